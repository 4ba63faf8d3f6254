//! Rate control (in progress).
