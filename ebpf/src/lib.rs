//! XDP classifier and loader (in progress).
