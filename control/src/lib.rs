//! Switch control (in progress).
