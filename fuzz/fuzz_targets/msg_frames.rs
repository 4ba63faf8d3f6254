//! Fuzzes the message layer's frames on raw bytes, as an endpoint's socket hands them over:
//! `wire::DataHeader::parse`, `wire::Ctrl::parse` and `wire::SealedHeader::parse`, and the
//! opening of sealed datagrams (`seal::Sealing::open`) under a fixed pair of keys.
//!
//! Properties checked:
//! - neither parser panics on any input;
//! - an accepted data segment is exactly its header and `length` payload bytes, lies inside
//!   its message (`offset + length <= total`), and re-emits to the same 40 header bytes;
//! - an accepted control frame's bitmap has exactly the bytes its bit count needs (NACK) or
//!   none, and re-emits to the same bytes;
//! - an accepted sealed header re-emits to the same 24 bytes; random bytes never open (a
//!   forgery would need the pair's key), and the replay window never panics.
#![no_main]

use std::sync::OnceLock;

use gradwire_msg::seal::Sealing;
use gradwire_msg::wire::{
    Ctrl, CtrlOp, DataHeader, SealedHeader, CTRL_HEADER_LEN, DATA_HEADER_LEN, SEALED_HEADER_LEN,
};
use libfuzzer_sys::fuzz_target;

static SEALING: OnceLock<std::sync::Mutex<Sealing>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    if let Ok((h, payload)) = DataHeader::parse(data) {
        assert_eq!(data.len(), DATA_HEADER_LEN + usize::from(h.length));
        assert_eq!(payload, &data[DATA_HEADER_LEN..]);
        assert!(h.offset + u64::from(h.length) <= u64::from(h.total));
        let mut out = [0u8; DATA_HEADER_LEN];
        h.emit(&mut out);
        assert_eq!(&out[..], &data[..DATA_HEADER_LEN], "re-emitted data header");
    }
    if let Ok((c, bitmap)) = Ctrl::parse(data) {
        let want = if c.op == CtrlOp::Nack {
            (c.b as usize).div_ceil(8)
        } else {
            0
        };
        assert_eq!(bitmap.len(), want);
        let mut out = vec![0u8; CTRL_HEADER_LEN + bitmap.len()];
        let n = c.emit(bitmap, &mut out).expect("a parsed frame re-emits");
        // The reserved bytes are written as zero: compare the rest.
        assert_eq!(&out[..30], &data[..30], "re-emitted control header");
        assert_eq!(&out[32..n], &data[32..], "re-emitted bitmap");
    }
    if let Ok((h, _)) = SealedHeader::parse(data) {
        let mut out = [0u8; SEALED_HEADER_LEN];
        h.emit(&mut out);
        assert_eq!(&out[..], &data[..SEALED_HEADER_LEN], "re-emitted sealed header");
    }
    let sealing = SEALING.get_or_init(|| std::sync::Mutex::new(Sealing::for_fuzzing()));
    let mut s = sealing.lock().expect("one thread");
    let mut scratch = Vec::new();
    assert!(
        s.open(1, data, &mut scratch).is_err(),
        "random bytes opened under a pair key"
    );
});
