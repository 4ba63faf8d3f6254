//! Fuzzes the parameter server's message header (`gradwire_collective::ps`, the 16-byte
//! `[magic, kind, flags, 0, len u32, clock u64]` that starts every message on a PS link) on
//! raw bytes, as a node reads it from a peer.
//!
//! Properties checked:
//! - the decoder never panics;
//! - it accepts exactly `LEN` bytes, never fewer or more;
//! - an accepted header is canonical: re-encoding gives the input bytes exactly (the reserved
//!   byte is zero, the kind is known, no unknown flag bit is set);
//! - changing the magic or the reserved byte of an accepted header is refused.
#![no_main]

use gradwire_collective::ps::header_codec::{decode_encode, LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(again) = decode_encode(data) else {
        return;
    };
    assert_eq!(data.len(), LEN, "accepted a header of {} bytes", data.len());
    assert_eq!(&again[..], data, "encode(decode(h)) != h");
    assert!(
        matches!(data[1], 1..=7),
        "unknown kind {} accepted",
        data[1]
    );
    assert_eq!(data[2] & !3, 0, "unknown flags {:#x} accepted", data[2]);
    for (i, flip) in [(0usize, 0xffu8), (3, 1)] {
        let mut bad = again;
        bad[i] ^= flip;
        assert!(
            decode_encode(&bad).is_err(),
            "byte {i} changed and still accepted"
        );
    }
    let mut longer = again.to_vec();
    longer.push(0);
    assert!(decode_encode(&longer).is_err());
    assert!(decode_encode(&again[..LEN - 1]).is_err());
});
