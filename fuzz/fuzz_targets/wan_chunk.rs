//! Fuzzes the WAN chunk message's header (`gradwire_wan::channel::decode_chunk`): the
//! `[data_len u32, dtype u8, sent_ns u64, meta_len u16]` (big-endian) before the caller's
//! metadata and the values, as a node reads each chunk message from a peer.
//!
//! Properties checked:
//! - the decoder never panics;
//! - lengths are bounded: values at most `MAX_CHUNK_BYTES`, metadata at most `MAX_META`, and
//!   the message is exactly header + metadata + values long;
//! - an accepted message is canonical: re-encoding what was decoded, by the documented layout,
//!   gives the input bytes exactly;
//! - one byte more or less is refused.
#![no_main]

use gradwire_wan::channel::{decode_chunk, MAX_CHUNK_BYTES, MAX_META};
use libfuzzer_sys::fuzz_target;

const HEAD: usize = 4 + 1 + 8 + 2;

fuzz_target!(|data: &[u8]| {
    let Ok((values, sent_ns, meta)) = decode_chunk(data) else {
        return;
    };
    let bytes = values.as_bytes();
    assert!(bytes.len() <= MAX_CHUNK_BYTES);
    assert!(meta.len() <= MAX_META);
    assert_eq!(
        data.len(),
        HEAD + meta.len() + bytes.len(),
        "accepted length"
    );
    assert_eq!(bytes.len() % values.dtype().elem_size(), 0);
    let mut again = Vec::with_capacity(data.len());
    again.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    again.push(values.dtype().code());
    again.extend_from_slice(&sent_ns.to_be_bytes());
    again.extend_from_slice(&(meta.len() as u16).to_be_bytes());
    again.extend_from_slice(&meta);
    again.extend_from_slice(bytes);
    assert_eq!(again, data, "encode(decode(c)) != c");
    assert!(decode_chunk(&data[..data.len() - 1]).is_err());
    let mut longer = data.to_vec();
    longer.push(0);
    assert!(decode_chunk(&longer).is_err());
});
