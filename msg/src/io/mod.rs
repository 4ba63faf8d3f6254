//! Datagram I/O of an endpoint: one module per kernel mechanism.

pub mod udp;
