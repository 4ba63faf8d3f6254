//! gradwire: a bounded-loss-tolerant transport for distributed DNN training traffic.
//!
//! The crate is layered so that every layer can be tested without the one below it:
//!
//! - [`wire`]: byte-exact packet views and `Repr` parse/emit for Ethernet, IPv4, IPv6, UDP and
//!   the gradwire data header. No I/O.
//! - [`control`]: the control-channel messages (flow start/stop/finish, retransmission
//!   requests, rate and per-queue ECN reports) and their length-prefixed framing. No I/O.
//! - [`rate`]: the DLCP rate-control state machine (Figure 7), a pacer and a rate meter, all
//!   pure functions of their inputs (time is an argument).
//! - [`tagging`]: DLCP's default priority function (layer -> DSCP, gradient magnitude ->
//!   ECN-capable). No I/O.
//! - [`proto`] (deterministic sender/receiver state machines), [`datapath`] (the datapath
//!   trait, in-memory, fault-injecting and kernel UDP implementations, with source-port
//!   spraying), [`afxdp`] (the kernel-bypass datapath and a raw-frame port for the emulated
//!   switch), [`transport`] (the drivers and the `Sender`/`Receiver` API), [`testbed`].
#![doc(html_no_source)]

pub mod afxdp;
pub mod bitmap;
pub mod channel;
pub mod control;
pub mod datapath;
pub mod proto;
pub mod rate;
pub mod tagging;
pub mod tensor;
pub mod testbed;
pub mod transport;
pub mod wire;
