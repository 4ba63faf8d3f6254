//! A forged rank 1 of a 2-rank job as a program (`tests/common/forge.rs`), for tests of a
//! binding that cannot run Rust in-process (the Python package's `DataError` test).
//!
//! ```text
//! forged_peer --mask 0x1 [--job 1] [--ip 127.0.0.1] [--elems 8] [--value 1.0] [--bound 0.1]
//!             [--timeout-ms 10000]
//! ```
//!
//! Protocol on stdio, one line each: it prints `endpoint <hex>` (rank 1's address bytes),
//! reads rank 0's address as hex, connects, sends rank 0's first all-reduce its contribution
//! with contributor set `--mask` (on the message layer), prints `forged`, and keeps its links up until stdin ends
//! (the test closes it once it has checked rank 0's error), then exits 0. Any failure
//! panics (non-zero exit, the reason on stderr).

#[path = "../tests/common/forge.rs"]
mod forge;

use std::io::{BufRead, Read, Write};
use std::net::IpAddr;
use std::time::Duration;

#[derive(Debug)]
struct Args {
    mask: u64,
    job: u32,
    ip: IpAddr,
    elems: usize,
    value: f32,
    bound: f64,
    timeout: Duration,
}

fn parse_args() -> Args {
    let mut a = Args {
        mask: 0,
        job: 1,
        ip: IpAddr::from([127, 0, 0, 1]),
        elems: 8,
        value: 1.0,
        bound: 0.1,
        timeout: Duration::from_secs(10),
    };
    let mut mask = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| panic!("forged_peer: {flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| -> ! { panic!("forged_peer: {flag} {value:?}: {e}") };
        match flag.as_str() {
            "--mask" => {
                let digits = value.trim_start_matches("0x");
                mask = Some(u64::from_str_radix(digits, 16).unwrap_or_else(|e| bad(&e)));
            }
            "--job" => a.job = value.parse().unwrap_or_else(|e| bad(&e)),
            "--ip" => a.ip = value.parse().unwrap_or_else(|e| bad(&e)),
            "--elems" => a.elems = value.parse().unwrap_or_else(|e| bad(&e)),
            "--value" => a.value = value.parse().unwrap_or_else(|e| bad(&e)),
            "--bound" => a.bound = value.parse().unwrap_or_else(|e| bad(&e)),
            "--timeout-ms" => {
                a.timeout = Duration::from_millis(value.parse().unwrap_or_else(|e| bad(&e)))
            }
            _ => panic!("forged_peer: unknown option {flag}"),
        }
    }
    a.mask = mask.expect("forged_peer: --mask (hex) is required");
    a
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    assert!(s.len() % 2 == 0, "forged_peer: odd-length hex {s:?}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("forged_peer: hex digits"))
        .collect()
}

fn main() {
    let a = parse_args();
    let forged = forge::ForgedRank::bind(a.job, a.ip, a.timeout);
    let mut out = std::io::stdout().lock();
    writeln!(out, "endpoint {}", hex(&forged.endpoint())).expect("forged_peer: stdout");
    out.flush().expect("forged_peer: stdout");

    let mut input = std::io::stdin().lock();
    let mut line = String::new();
    input
        .read_line(&mut line)
        .expect("forged_peer: rank 0's endpoint on stdin");
    let table = [unhex(&line), forged.endpoint()];
    // `--bound` is rank 0's business (sets travel only under a bound); accepted for the
    // caller's convenience.
    let _ = a.bound;
    let links = forged.connect_and_forge(&table, a.elems, a.value, a.mask);
    writeln!(out, "forged").expect("forged_peer: stdout");
    out.flush().expect("forged_peer: stdout");

    // Links up until the test is done with rank 0 (it closes stdin; killing us also works).
    let mut rest = Vec::new();
    let _ = input.read_to_end(&mut rest);
    drop(links);
}
