//! All-reduce on the message layer over 127.0.0.1, one thread per rank, for profiling:
//!
//! ```text
//! cargo run --release -p gradwire-collective --example group_allreduce -- [ranks] [MiB] [iters] [ring|direct] [verify] [sealed]
//! ```
//!
//! `verify`: the ring checks every chunk against its owner's digest
//! (`GroupReduceOptions::verify_results`). `sealed`: an authenticated job, every datagram
//! sealed with its pair of ranks' key (`EndpointConfig::auth`).
//!
//! Prints the median time per operation and the endpoint counters of rank 0.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire::auth::MemberEntry;
use gradwire::tensor::DType;
use gradwire_collective::comm::TensorMut;
use gradwire_collective::group::{AllReduceAlgo, GroupConfig, GroupReduceOptions, PendingGroup};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let world: usize = arg(0, "4").parse().expect("ranks");
    let mib: usize = arg(1, "64").parse().expect("MiB");
    let iters: usize = arg(2, "5").parse().expect("iterations");
    let algo = AllReduceAlgo::parse(&arg(3, "ring")).expect("ring or direct");
    let flags = &args[args.len().min(4)..];
    let verify_results = flags.iter().any(|f| f == "verify");
    let key = flags.iter().any(|f| f == "sealed").then(|| {
        let secret = gradwire::auth::JobSecret::new(vec![7; 32]).expect("secret");
        std::sync::Arc::new(gradwire::auth::JobKey::new(&secret))
    });
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (atx, arx) = mpsc::channel();
    let mut ttx = Vec::new();
    let mut threads = Vec::new();
    for rank in 0..world {
        let (tx, rx) = mpsc::channel::<(Vec<SocketAddr>, Vec<Option<MemberEntry>>)>();
        ttx.push(tx);
        let (atx, key) = (atx.clone(), key.clone());
        threads.push(std::thread::spawn(move || {
            let mut cfg = GroupConfig::new(1, rank, world, lo, Duration::from_secs(10));
            cfg.endpoint.auth = key;
            let p = PendingGroup::bind(cfg).expect("bind");
            atx.send((rank, p.address(), p.member())).expect("address");
            let (table, members) = rx.recv().expect("table");
            let g = match members.into_iter().collect::<Option<Vec<_>>>() {
                Some(m) => p.start_sealed(table, &m),
                None => p.start(table),
            }
            .expect("start");
            let n = mib * (1 << 20) / 4;
            let mut buf: Vec<u8> = vec![0; n * 4];
            let o = GroupReduceOptions {
                algorithm: algo,
                verify_results,
                ..GroupReduceOptions::default()
            };
            let mut times = Vec::new();
            for _ in 0..iters {
                for c in buf.chunks_exact_mut(4) {
                    c.copy_from_slice(&1.0f32.to_le_bytes());
                }
                g.barrier().expect("barrier");
                let t = Instant::now();
                g.all_reduce(TensorMut::new(DType::F32, &mut buf).expect("t"), &o)
                    .expect("all-reduce");
                times.push(t.elapsed());
                assert_eq!(&buf[..4], &(world as f32).to_le_bytes());
            }
            times.sort();
            (times[times.len() / 2], g.stats())
        }));
    }
    let mut table = vec![SocketAddr::new(lo, 0); world];
    let mut members = vec![None; world];
    for _ in 0..world {
        let (r, a, m) = arx.recv().expect("address");
        table[r] = a;
        members[r] = m;
    }
    for t in &ttx {
        t.send((table.clone(), members.clone())).expect("table");
    }
    let out: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("rank"))
        .collect();
    println!(
        "median {:?} per all-reduce of {mib} MiB over {world} ranks",
        out[0].0
    );
    println!("rank 0: {:#?}", out[0].1);
}
