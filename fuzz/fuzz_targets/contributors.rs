//! Fuzzes the contributor-set decoder (`gradwire_collective::aggregate::Contributors::decode`),
//! which parses the sets a peer sends after each chunk of a lossy all-reduce or push.
//!
//! The first four input bytes pick the block count (0..=255), the world (1..=4096, the
//! little-endian u16 of bytes 1-2, wrapped) and `allow_empty` (bit 0 of byte 3); the rest
//! is the sets. Properties checked:
//! - the decoder never panics;
//! - it accepts only exactly `blocks * encoded_block_len` bytes;
//! - every accepted set names ranks below the world only, is not empty unless allowed, and
//!   its count agrees with its ranks;
//! - an accepted input is canonical: re-encoding gives the input bytes exactly.
#![no_main]

use gradwire_collective::aggregate::Contributors;
use gradwire_collective::job::MAX_RANKS;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, sets)) = data.split_first_chunk::<4>() else {
        return;
    };
    let blocks = usize::from(head[0]);
    let world = usize::from(u16::from_le_bytes([head[1], head[2]])) % MAX_RANKS + 1;
    let allow_empty = head[3] & 1 == 1;
    let Ok(c) = Contributors::decode(sets, blocks, world, allow_empty) else {
        return;
    };
    assert_eq!(c.blocks(), blocks);
    assert_eq!(c.world(), world);
    assert_eq!(
        sets.len(),
        blocks * c.encoded_block_len(),
        "accepted length"
    );
    for b in 0..blocks {
        let ranks = c.ranks(b);
        assert_eq!(ranks.len(), c.count(b));
        assert!(ranks.len() <= world);
        assert!(ranks.iter().all(|&r| r < world), "block {b}: {ranks:?}");
        assert!(allow_empty || !ranks.is_empty(), "block {b} empty");
    }
    assert_eq!(c.encode(0..blocks), sets, "encode(decode(s)) != s");
    if !sets.is_empty() {
        assert!(Contributors::decode(&sets[..sets.len() - 1], blocks, world, allow_empty).is_err());
    }
});
