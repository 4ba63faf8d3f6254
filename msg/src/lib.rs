//! gradwire's message layer (see docs/design.md, "The message layer").
//!
//! - [`wire`]: the layer's frames (data segments and control), codecs with no I/O.
//! - [`mem`]: registered buffers, the memory messages are sent from and placed into.
//! - [`core`]: the state machines of one endpoint (every peer, every message), driven by
//!   datagrams and timers, with no I/O and no clock of their own (tested on a virtual clock).
//! - [`io`]: the datagram sockets (kernel UDP with GSO/GRO and `sendmmsg`/`recvmmsg`; AF_XDP
//!   with the `afxdp` feature).
//! - [`op`]: operations (state machines on the progress thread) and their handles.
//! - [`seal`]: authenticated jobs' sealing of every datagram with its pair of ranks' key,
//!   and the replay windows.
//! - [`endpoint`]: one endpoint per rank: the socket, the core and the progress thread.
//! - [`p2p`]: the simplest operations: one message to or from one peer (fixed or variable
//!   length), for anything built on the layer that is not a collective.
#![deny(unsafe_code)]

pub mod core;
pub mod endpoint;
pub mod io;
pub mod mem;
pub mod op;
pub mod p2p;
pub mod reduce;
pub mod seal;
pub mod wire;
