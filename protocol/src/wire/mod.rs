//! Wire formats: byte-exact, zero-copy views of everything gradwire puts on the wire.
//!
//! A gradwire data packet on the wire is
//!
//! ```text
//! +----------+---------------+-----------+------------------+------------------+
//! | Ethernet | IPv4 (20 B)   | UDP (8 B) | gradwire header  | payload          |
//! | (14 B)   | or IPv6 (40 B)|           | (32 B, header.rs)| (`length` bytes) |
//! +----------+---------------+-----------+------------------+------------------+
//! ```
//!
//! Each layer follows the smoltcp `wire` pattern so it can be used and tested on its own:
//!
//! - a view `Packet<T: AsRef<[u8]>>` over a borrowed or owned buffer, with
//!   `new_unchecked`, `check_len`, `new_checked` (= `new_unchecked` + `check_len`),
//!   `into_inner`, field getters (which never panic once `check_len` succeeded), setters for
//!   mutable buffers and `payload()`/`payload_mut()`;
//! - a `Repr`, the validated high-level contents of a header, with `parse` and `emit`.
//!
//! Field offsets are `mod field` range constants; all multi-byte fields are big-endian
//! (network byte order). Nothing here allocates or performs I/O, and no input, however
//! malformed, makes a parse function panic: they return [`Error`] instead.
//!
//! [`frame`] puts the layers together: [`frame::emit_headers`] writes Ethernet + IP + UDP in
//! front of a datagram that is already in place (so the AF_XDP path copies the payload once),
//! and [`frame::parse`] validates a whole received frame.

pub mod checksum;
pub mod ethernet;
pub mod frame;
pub mod header;
pub mod ipv4;
pub mod ipv6;
pub mod udp;

/// Why a buffer could not be parsed or a header could not be emitted.
///
/// Deliberately a field-less `Copy` enum: it is returned on the per-packet path, so it must not
/// allocate or carry anything that is expensive to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The buffer ends before a header or before the length a header announces.
    #[error("buffer truncated")]
    Truncated,
    /// The gradwire header's version is not [`header::VERSION`].
    #[error("unsupported gradwire header version")]
    BadVersion,
    /// The gradwire header's kind is not a known [`header::Kind`].
    #[error("unknown gradwire packet kind")]
    UnknownKind,
    /// A length field disagrees with the bytes actually present (e.g. trailing bytes after a
    /// gradwire payload, or a UDP length that differs from the IP payload length).
    #[error("length field does not match the buffer")]
    LengthMismatch,
    /// An IPv4 header checksum or a UDP checksum does not verify.
    #[error("checksum mismatch")]
    BadChecksum,
    /// The ethertype (after at most one 802.1Q tag) is neither IPv4 nor IPv6.
    #[error("ethertype is not IPv4 or IPv6")]
    NotIp,
    /// The IP protocol / next header is not UDP.
    #[error("IP payload is not UDP")]
    NotUdp,
    /// The IPv4 packet is a fragment (MF set or nonzero fragment offset).
    #[error("IP packet is a fragment")]
    Fragmented,
    /// Malformed IP header: wrong version, IHL < 5, total length < header length, or mixed
    /// IPv4/IPv6 source and destination addresses.
    #[error("malformed IP header")]
    BadIpHeader,
    /// When emitting: a value does not fit its field, or the buffer is too small.
    #[error("value does not fit its field or the buffer")]
    Oversize,
}

/// Result type of all wire operations.
pub type Result<T> = core::result::Result<T, Error>;

/// Explicit Congestion Notification codepoint (RFC 3168), the low two bits of the IPv4 TOS /
/// IPv6 traffic class byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Ecn {
    /// Not ECN-capable transport.
    #[default]
    NotEct = 0,
    /// ECN-capable transport, ECT(1).
    Ect1 = 1,
    /// ECN-capable transport, ECT(0).
    Ect0 = 2,
    /// Congestion experienced.
    Ce = 3,
}

impl Ecn {
    /// Decodes the low two bits of `bits` (higher bits are ignored, so a whole TOS byte may be
    /// passed).
    pub const fn from_bits(bits: u8) -> Ecn {
        match bits & 0b11 {
            0 => Ecn::NotEct,
            1 => Ecn::Ect1,
            2 => Ecn::Ect0,
            _ => Ecn::Ce,
        }
    }

    /// The two-bit codepoint.
    pub const fn bits(self) -> u8 {
        self as u8
    }

    /// Whether the packet was sent by an ECN-capable transport (ECT(0), ECT(1) or CE).
    pub const fn is_ect(self) -> bool {
        !matches!(self, Ecn::NotEct)
    }
}

pub use header::{Flags, Kind};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ecn_bits_round_trip() {
        for b in 0u8..4 {
            assert_eq!(Ecn::from_bits(b).bits(), b);
        }
        assert_eq!(Ecn::from_bits(0xfe), Ecn::Ect0);
        assert!(!Ecn::NotEct.is_ect());
        assert!(Ecn::Ce.is_ect());
    }

    #[test]
    fn error_is_small_and_displays() {
        assert_eq!(core::mem::size_of::<Error>(), 1);
        assert_eq!(Error::BadChecksum.to_string(), "checksum mismatch");
    }
}
