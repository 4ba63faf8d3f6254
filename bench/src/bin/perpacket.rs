//! `gradwire-perpacket`: per-packet CPU cost of the gradwire data path, and its ratio to a
//! bare 1440-byte memcpy measured in the same process on the same memory.
//!
//! Measures the eleven operations of `gradwire_bench::OPS` (`memcpy_1440`, the plain receive
//! and send paths, `send_build_tagged`, the authenticated receive and send paths `*_auth`, and
//! the plain receive path without peer binding; see that crate's docs for what each includes) with its own loop: every fixture is
//! built and warmed up over one whole lap of the 64 MiB tensor, then `--runs` rounds each time
//! `--packets` packets of every operation in turn (interleaved, so a noisy neighbour hits all
//! of them alike), and the best round of each operation is reported. Flow resets between laps
//! are not timed.
//!
//! Also printed: each authenticated operation's ratio to its plain one, and the cores that
//! 25 and 100 Gbit/s line rate of 1500-byte packets (2.03 and 8.13 Mpps, Ethernet overheads
//! included) would need on the authenticated paths: ns/packet x packets/s / 1e9.
//!
//! ```text
//! cargo run --release -p gradwire-bench --bin gradwire-perpacket [-- --json] [--packets N] [--runs N]
//! ```

use std::process::ExitCode;

use gradwire_bench::{
    cores_needed, threshold_estimate_time, time_packets, warm_up, MemcpyFixture, PerPacket,
    RecvFixture, SendFixture, AUTH_PAIRS, NS_PER_PACKET_100G, OPS, PAYLOAD, PEER_BINDING_PAIR,
    PPS_100G, PPS_25G, SEGMENTS,
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

/// The best time of operation `name`.
fn best_of(best: &[f64; OPS.len()], name: &str) -> f64 {
    OPS.iter()
        .position(|o| *o == name)
        .map_or(f64::NAN, |i| best[i])
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
    let mut recv_auth = RecvFixture::authenticated(false, SEGMENTS);
    let mut recv_frame_auth = RecvFixture::authenticated(true, SEGMENTS);
    let mut send_auth = SendFixture::authenticated(false, SEGMENTS);
    let mut send_frame_auth = SendFixture::authenticated(true, SEGMENTS);
    let mut recv_unbound = RecvFixture::unbound(SEGMENTS);
    let names = [
        memcpy.name(),
        recv.name(),
        recv_frame.name(),
        send.name(),
        send_frame.name(),
        send_tagged.name(),
        recv_auth.name(),
        recv_frame_auth.name(),
        send_auth.name(),
        send_frame_auth.name(),
        recv_unbound.name(),
    ];
    assert_eq!(names, OPS, "fixtures in OPS order");
    warm_up(&mut send_tagged);
    warm_up(&mut memcpy);
    warm_up(&mut recv);
    warm_up(&mut recv_frame);
    warm_up(&mut send);
    warm_up(&mut send_frame);
    warm_up(&mut recv_auth);
    warm_up(&mut recv_frame_auth);
    warm_up(&mut send_auth);
    warm_up(&mut send_frame_auth);
    warm_up(&mut recv_unbound);

    let mut best = [f64::INFINITY; OPS.len()];
    for _ in 0..args.runs {
        // Each call monomorphised, as before: no dynamic dispatch inside the timed loops.
        let ns = [
            round(&mut memcpy, args.packets),
            round(&mut recv, args.packets),
            round(&mut recv_frame, args.packets),
            round(&mut send, args.packets),
            round(&mut send_frame, args.packets),
            round(&mut send_tagged, args.packets),
            round(&mut recv_auth, args.packets),
            round(&mut recv_frame_auth, args.packets),
            round(&mut send_auth, args.packets),
            round(&mut send_frame_auth, args.packets),
            round(&mut recv_unbound, args.packets),
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
    let tensor_send_ns = best_of(&best, "send_build_tagged") * f64::from(SEGMENTS);
    let estimate_share = estimate_ns / tensor_send_ns;
    let (bound, unbound) = PEER_BINDING_PAIR;
    let binding_ratio = best_of(&best, bound) / best_of(&best, unbound);
    // (auth op, plain op, auth ns, auth / plain, cores at 25G, cores at 100G)
    let auth: Vec<(&str, &str, f64, f64, f64, f64)> = AUTH_PAIRS
        .iter()
        .map(|&(a, p)| {
            let ns = best_of(&best, a);
            (
                a,
                p,
                ns,
                ns / best_of(&best, p),
                cores_needed(ns, PPS_25G),
                cores_needed(ns, PPS_100G),
            )
        })
        .collect();

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
        for &(a, _, _, ratio, c25, c100) in &auth {
            o.insert(format!("{a}_vs_plain"), ratio.into());
            o.insert(format!("{a}_cores_25g"), c25.into());
            o.insert(format!("{a}_cores_100g"), c100.into());
        }
        o.insert("peer_binding_ratio".into(), binding_ratio.into());
        o.insert("pps_25g".into(), PPS_25G.into());
        o.insert("pps_100g".into(), PPS_100G.into());
        println!("{}", serde_json::Value::Object(o));
    } else {
        println!(
            "gradwire per-packet cost: {} B payload, {} segments (64 MiB tensor), best of {} x {} packets",
            PAYLOAD, SEGMENTS, args.runs, args.packets
        );
        println!(
            "{:<22} {:>10} {:>10} {:>12}",
            "op", "ns/packet", "x memcpy", "Gbit/s/core"
        );
        for (name, ns) in OPS.iter().zip(best) {
            let gbps = PAYLOAD as f64 * 8.0 / ns;
            println!("{name:<22} {ns:>10.1} {:>10.2} {gbps:>12.1}", ns / base);
        }
        println!();
        println!(
            "authenticated (AES-128-GCM) vs plain; cores = ns/packet x packets/s / 1e9 at \
             1500-byte packets (25G {:.2} Mpps, 100G {:.2} Mpps)",
            PPS_25G / 1e6,
            PPS_100G / 1e6
        );
        println!(
            "{:<22} {:>10} {:>10} {:>10} {:>10}",
            "op", "ns/packet", "x plain", "cores 25G", "cores 100G"
        );
        for &(a, _, ns, ratio, c25, c100) in &auth {
            println!("{a:<22} {ns:>10.1} {ratio:>10.2} {c25:>10.2} {c100:>10.2}");
        }
        println!(
            "(100 Gbit/s line rate with 1500-byte packets leaves {NS_PER_PACKET_100G:.0} ns per packet)"
        );
        println!(
            "peer binding: {bound} / {unbound} = {binding_ratio:.3} (the plain receive path with \
             and without the source check)"
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
