//! `gradwire-perpacket`: per-packet CPU cost of the gradwire data path, and its ratio to a
//! bare 1440-byte memcpy measured in the same process on the same memory.
//!
//! Measures the five operations of `gradwire_bench` (`memcpy_1440`, `recv_place`,
//! `recv_frame_place`, `send_build`, `send_build_frame`; see that crate's docs for what each
//! includes) with its own loop: every fixture is built and warmed up over one whole lap of the
//! 64 MiB tensor, then `--runs` rounds each time `--packets` packets of every operation in
//! turn (interleaved, so a noisy neighbour hits all of them alike), and the best round of
//! each operation is reported. Flow resets between laps are not timed.
//!
//! ```text
//! cargo run --release -p gradwire-bench --bin gradwire-perpacket [-- --json] [--packets N] [--runs N]
//! ```

use std::process::ExitCode;

use gradwire_bench::{
    threshold_estimate_time, time_packets, warm_up, MemcpyFixture, PerPacket, RecvFixture,
    SendFixture, NS_PER_PACKET_100G, OPS, PAYLOAD, SEGMENTS,
};

struct Args {
    json: bool,
    packets: u64,
    runs: usize,
}

const USAGE: &str = "usage: gradwire-perpacket [--json] [--packets N (200000)] [--runs N (5)]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        json: false,
        packets: 200_000,
        runs: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |what: &str| {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{what} needs a positive integer\n{USAGE}"))
        };
        match a.as_str() {
            "--json" => args.json = true,
            "--packets" => args.packets = value("--packets")?,
            "--runs" => args.runs = value("--runs")? as usize,
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(args)
}

/// Nanoseconds per packet of one timed round.
fn round<P: PerPacket>(p: &mut P, packets: u64) -> f64 {
    time_packets(p, packets).as_nanos() as f64 / packets as f64
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };

    let mut memcpy = MemcpyFixture::new(SEGMENTS);
    let mut recv = RecvFixture::new(false, SEGMENTS);
    let mut recv_frame = RecvFixture::new(true, SEGMENTS);
    let mut send = SendFixture::new(false, SEGMENTS);
    let mut send_frame = SendFixture::new(true, SEGMENTS);
    let mut send_tagged = SendFixture::with_tagging(false, true, SEGMENTS);
    warm_up(&mut send_tagged);
    warm_up(&mut memcpy);
    warm_up(&mut recv);
    warm_up(&mut recv_frame);
    warm_up(&mut send);
    warm_up(&mut send_frame);

    let mut best = [f64::INFINITY; OPS.len()];
    for _ in 0..args.runs {
        let ns = [
            round(&mut memcpy, args.packets),
            round(&mut recv, args.packets),
            round(&mut recv_frame, args.packets),
            round(&mut send, args.packets),
            round(&mut send_frame, args.packets),
            round(&mut send_tagged, args.packets),
        ];
        for (b, n) in best.iter_mut().zip(ns) {
            *b = b.min(n);
        }
    }
    let base = best[0];
    // The per-tensor part of tagging against sending the whole tensor with tagging.
    let estimate_ns = threshold_estimate_time(
        send_tagged.tensor(),
        u32::try_from(args.runs).unwrap_or(u32::MAX),
    )
    .as_nanos() as f64;
    let tensor_send_ns = best[OPS.len() - 1] * f64::from(SEGMENTS);
    let estimate_share = estimate_ns / tensor_send_ns;

    if args.json {
        let mut o = serde_json::Map::new();
        o.insert("memcpy_ns".into(), base.into());
        for (name, ns) in OPS.iter().zip(best).skip(1) {
            o.insert(format!("{name}_ns"), ns.into());
            o.insert(format!("{name}_ratio"), (ns / base).into());
        }
        o.insert("packets".into(), args.packets.into());
        o.insert("runs".into(), args.runs.into());
        o.insert("payload_bytes".into(), PAYLOAD.into());
        o.insert("segments".into(), SEGMENTS.into());
        o.insert("budget_100g_ns".into(), NS_PER_PACKET_100G.into());
        o.insert("threshold_estimate_ns".into(), estimate_ns.into());
        o.insert(
            "threshold_estimate_share_of_send".into(),
            estimate_share.into(),
        );
        println!("{}", serde_json::Value::Object(o));
    } else {
        println!(
            "gradwire per-packet cost: {} B payload, {} segments (64 MiB tensor), best of {} x {} packets",
            PAYLOAD, SEGMENTS, args.runs, args.packets
        );
        println!(
            "{:<18} {:>10} {:>10} {:>12}",
            "op", "ns/packet", "x memcpy", "Gbit/s/core"
        );
        for (name, ns) in OPS.iter().zip(best) {
            let gbps = PAYLOAD as f64 * 8.0 / ns;
            println!("{name:<18} {ns:>10.1} {:>10.2} {gbps:>12.1}", ns / base);
        }
        println!(
            "(100 Gbit/s line rate with 1500-byte packets leaves {NS_PER_PACKET_100G:.0} ns per packet)"
        );
        println!(
            "magnitude threshold (0.1 % sample median) of the 64 MiB tensor: {:.1} us = {:.2} % of \
             sending it with tagging",
            estimate_ns / 1e3,
            estimate_share * 100.0
        );
    }
    ExitCode::SUCCESS
}
