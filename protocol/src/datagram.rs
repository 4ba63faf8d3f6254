//! What a datapath knows about one datagram besides its bytes: the peer address and the IP
//! TOS byte (DSCP and ECN). Shared by the protocol cores, which choose the TOS of what they
//! send and read the ECN of what arrives, and by every datapath.

use std::net::SocketAddr;

/// Metadata of a datagram to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxMeta {
    /// Destination.
    pub dst: SocketAddr,
    /// IP TOS / traffic class byte: DSCP in the top six bits, ECN in the low two.
    pub tos: u8,
}

/// Metadata of a received datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta {
    /// Source.
    pub src: SocketAddr,
    /// IP TOS / traffic class byte as received (0 where the datapath cannot see it).
    pub tos: u8,
}

impl RxMeta {
    /// True when the packet arrived marked Congestion Experienced.
    pub fn is_ce(&self) -> bool {
        self.tos & 0b11 == 0b11
    }
}

/// Build a TOS byte from a DSCP (0..=63) and an ECN codepoint (0..=3).
pub const fn tos(dscp: u8, ecn: u8) -> u8 {
    (dscp << 2) | (ecn & 0b11)
}
