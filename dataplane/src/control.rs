//! Control messages (in progress).
