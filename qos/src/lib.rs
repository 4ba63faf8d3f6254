//! Traffic classes shared by the data plane and the switch control (in progress).
