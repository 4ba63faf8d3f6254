//! Fuzzes the endpoint table a session gets from the caller's all-gather
//! (`gradwire_collective::link::parse_endpoint_table`): untrusted bytes from every rank.
//!
//! Properties checked:
//! - no panic, whatever the bytes (the input is cut into entries at 0xff bytes; the first
//!   byte picks the world size and job);
//! - an accepted table has exactly `world` entries, each from a JSON entry no longer than
//!   `MAX_ENDPOINT_LEN`, with at most `world` listeners.
#![no_main]

use gradwire_collective::link::{parse_endpoint_table, MAX_ENDPOINT_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let world = usize::from(pick % 8);
    let job = u32::from(pick >> 3);
    let table: Vec<Vec<u8>> = rest.split(|&b| b == 0xff).map(<[u8]>::to_vec).collect();
    if let Ok(endpoints) = parse_endpoint_table(&table, job, world) {
        assert_eq!(endpoints.len(), world);
        assert_eq!(table.len(), world);
        for (e, bytes) in endpoints.iter().zip(&table) {
            assert!(bytes.len() <= MAX_ENDPOINT_LEN);
            assert!(e.listeners.len() <= world);
        }
    }
});
