//! gradwire's bounded-loss protocol (DLCP §3.2), with no I/O: no sockets, no threads, no
//! clocks (time is an argument), no `unsafe`. Everything that must be exactly right lives
//! here so it can be tested, fuzzed and benchmarked on its own; the `gradwire` crate drives it
//! over real datapaths and re-exports every module.
//!
//! - [`wire`]: byte-exact packet views and `Repr` parse/emit for Ethernet, IPv4, IPv6, UDP
//!   and the gradwire data header.
//! - [`message`]: the control-channel messages (flow start/stop/finish, retransmission
//!   requests, rate and per-queue ECN reports), their length-prefixed framing and an
//!   incremental decoder.
//! - [`datagram`]: a datagram's peer address and TOS byte, as datapaths pass them.
//! - [`rate`]: the sender's rate modes (receiver grants, a DCTCP-style CE reaction, DLCP's
//!   Figure 7), a pacer and a rate meter; [`grant`]: the receiver's side, a downlink's
//!   aggregate target shared out as per-flow grants.
//! - [`tensor`] (aligned tensors, segment layout and placement by offset), [`bitmap`] (which
//!   segments arrived).
//! - [`flow`]: the sender and receiver state machines of one transfer.
//! - [`tagging`]: DLCP's default priority function (layer -> DSCP, gradient magnitude ->
//!   ECN-capable).
//! - [`auth`]: authenticated jobs' crypto (from `ring`): the key schedule from a job secret,
//!   handshake proofs, control-frame tags, per-flow AES-128-GCM of data datagrams.
//! - [`handshake`]: the control connection's opening handshake (plain or authenticated) as
//!   client and server state machines.
#![forbid(unsafe_code)]

pub mod auth;
pub mod bitmap;
pub mod datagram;
pub mod flow;
pub mod grant;
pub mod handshake;
pub mod message;
pub mod rate;
pub mod tagging;
pub mod tensor;
pub mod wire;
