//! gradwire: a bounded-loss-tolerant transport for distributed DNN training traffic.
//!
//! The protocol itself, with no I/O, is the `gradwire-proto` crate; its modules are
//! re-exported here ([`wire`], [`message`], [`datagram`], [`rate`], [`grant`], [`tensor`],
//! [`bitmap`], [`flow`], [`tagging`], [`auth`], [`handshake`]) so `gradwire::wire::...` is the one path users write. This crate
//! adds what touches the operating system:
//!
//! - [`datapath`]: the datapath trait and its in-memory, fault-injecting, multipath and
//!   kernel UDP implementations (with source-port spraying).
//! - [`afxdp`] (cargo feature `afxdp`, on by default): the kernel-bypass datapath behind
//!   gradwire's XDP classifier, the pinned-worker engine and a raw-frame port for the
//!   emulated switch. Without the feature the crate builds with no clang and no libbpf.
//! - [`grant_pool`]: one receiver downlink's grant allocator shared by its receiving
//!   threads (receiver-driven incast congestion control).
//! - [`ctrl_channel`]: the reliable control channel (kernel TCP, or in-memory for tests),
//!   opened by a handshake that authenticates both ends when the job has a secret;
//!   [`ctrl_listener`]: a control listener that runs handshakes in the background and holds
//!   nothing for clients that do not complete them.
//! - [`transport`]: the drivers that run one transfer, and the `Sender`/`Receiver` API
//!   (DLCP's `dlcp_send` / `dlcp_recv`).
//! - [`job_secret`]: an authenticated job's secret, from a key file or the environment.
//! - [`addr`]: `host:port` as users write it, resolved once through the system resolver.
#![doc(html_no_source)]

pub mod addr;
#[cfg(feature = "afxdp")]
pub mod afxdp;
pub mod ctrl_channel;
pub mod ctrl_listener;
pub mod datapath;
pub mod grant_pool;
pub mod job_secret;
pub mod transport;

pub use gradwire_proto::{
    auth, bitmap, datagram, flow, grant, handshake, message, rate, tagging, tensor, wire,
};
