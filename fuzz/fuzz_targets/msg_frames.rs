//! Fuzzes the message layer's frames on raw bytes, as an endpoint's socket hands them over:
//! `wire::DataHeader::parse` and `wire::Ctrl::parse`.
//!
//! Properties checked:
//! - neither parser panics on any input;
//! - an accepted data segment is exactly its header and `length` payload bytes, lies inside
//!   its message (`offset + length <= total`), and re-emits to the same 40 header bytes;
//! - an accepted control frame's bitmap has exactly the bytes its bit count needs (NACK) or
//!   none, and re-emits to the same bytes.
#![no_main]

use gradwire_msg::wire::{Ctrl, CtrlOp, DataHeader, CTRL_HEADER_LEN, DATA_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

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
});
