//! Fuzzes the gradwire data header on raw bytes, as the UDP datapath sees them:
//! `header::Packet::new_checked` then `header::Repr::parse`.
//!
//! Properties checked:
//! - neither function panics on any input;
//! - an accepted datagram is exactly `HEADER_LEN + length` bytes (+ `TAG_LEN` for AuthData),
//!   `payload()` is the `length` bytes after the header and `tag()` the rest;
//! - the header is canonical: emitting the parsed `Repr` reproduces the 32 header bytes
//!   exactly (unknown flag bits included).
#![no_main]

use gradwire_proto::wire::header::{Packet, Repr, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(pkt) = Packet::new_checked(data) else {
        return;
    };
    let Ok(repr) = Repr::parse(&pkt) else {
        return;
    };
    assert_eq!(repr.buffer_len(), data.len(), "accepted length");
    assert_eq!(repr.header_len(), HEADER_LEN);
    let end = HEADER_LEN + usize::from(repr.length);
    assert_eq!(pkt.payload(), &data[HEADER_LEN..end], "payload view");
    assert_eq!(pkt.tag(), &data[end..], "tag view");
    assert_eq!(pkt.tag().len(), repr.kind.tag_len(), "tag length");

    let mut out = vec![0u8; repr.buffer_len()];
    assert!(
        repr.emit(&mut Packet::new_unchecked(&mut out[..])).is_ok(),
        "emit of a parsed header failed: {repr:?}"
    );
    assert_eq!(&out[..HEADER_LEN], &data[..HEADER_LEN], "re-emitted header");
});
