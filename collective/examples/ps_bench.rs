//! Times MLNET's parameter server (`PsNode`) over network namespaces (root): one server and
//! `world - 1` synchronous workers, each in its own namespace on a bridge, kernel UDP; every
//! worker pulls, pushes and clocks `clocks` times. Prints one JSON line: the time per clock
//! at the server (median and mean of the clocks after the first), the bytes the nodes
//! counted as sent, and whether the final model is the exact result.
//!
//! ```text
//! cargo run --release -p gradwire-collective --example ps_bench -- [world] [star|binary] [elems] [clocks]
//! ```

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use gradwire::tensor::{DType, Tensor};
use gradwire_collective::link::{tree_edges, Links, NetLinkConfig};
use gradwire_collective::ps::{PsConfig, PsNode};
use gradwire_collective::tree::{Strategy, Tree};
use gradwire_netns::testbed::{host_ipv4, Testbed, TestbedConfig};
use gradwire_netns::FabricLock;

const LR: f32 = 0.5;

/// Worker `r`'s gradient of clock `c` at element `e`: small integers, so sums and means over
/// up to 8 workers are exact in f32.
fn grad(r: usize, c: u64, e: usize) -> f32 {
    ((r + c as usize * 3 + e) % 7) as f32 - 3.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let world: usize = arg(0, "5").parse().expect("world: a number of ranks");
    let strategy = match arg(1, "binary").as_str() {
        "star" => Strategy::Star,
        "binary" => Strategy::BINARY,
        s => panic!("strategy {s}: star or binary"),
    };
    let elems: usize = arg(2, "262144")
        .parse()
        .expect("elems: f32 elements of the model");
    let clocks: u64 = arg(3, "20").parse().expect("clocks");
    let _fabric = FabricLock::acquire().expect("the fabric lock");
    let tb = Testbed::up(&TestbedConfig::with_hosts(world)).expect("namespaces (run as root)");
    let members: Vec<usize> = (0..world).collect();
    let tree = Tree::build(strategy, 0, &members, &vec![0; world]).expect("tree");
    let master = SocketAddr::new(IpAddr::V4(host_ipv4(0)), 29_671);
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let tree = tree.clone();
            tb.spawn_in(r, move || {
                let timeout = Duration::from_secs(30);
                let link_cfg = NetLinkConfig {
                    connect_timeout: timeout,
                    ..NetLinkConfig::default()
                };
                let ip = IpAddr::V4(host_ipv4(r));
                let edges = tree_edges(&tree);
                let links = Links::connect(21, r, world, ip, master, &edges, None, &link_cfg)
                    .expect("links");
                let cfg = PsConfig {
                    learning_rate: LR,
                    op_timeout: timeout,
                    reroute: false,
                    ..PsConfig::default()
                };
                let initial = Tensor::zeros(DType::F32, elems);
                let mut node = PsNode::start(links, tree, 21, &initial, cfg).expect("start");
                if r == 0 {
                    let mut at = Vec::new();
                    for c in 1..=clocks {
                        node.wait_clock(c, timeout).expect("clock");
                        at.push(Instant::now());
                    }
                    let (_, w) = node.weights();
                    let stats = node.shutdown().expect("shutdown");
                    return (at, w.as_f32().map(<[f32]>::to_vec), stats.bytes_sent);
                }
                let mut w = Tensor::zeros(DType::F32, elems);
                let mut g = Tensor::zeros(DType::F32, elems);
                for c in 0..clocks {
                    node.pull(&mut w, None).expect("pull");
                    if let Some(v) = g.as_f32_mut() {
                        for (e, x) in v.iter_mut().enumerate() {
                            *x = grad(r, c, e);
                        }
                    }
                    node.push(&g).expect("push");
                    node.clock();
                }
                let stats = node.shutdown().expect("shutdown");
                (Vec::new(), None, stats.bytes_sent)
            })
        })
        .collect();
    // Every rank joined before the namespaces go (they also go on unwinding: their drop).
    let joined: Vec<_> = handles.into_iter().map(|h| h.map(|h| h.join())).collect();
    if let Err(e) = tb.down() {
        eprintln!("tearing the namespaces down: {e}");
    }
    let results: Vec<_> = joined
        .into_iter()
        .enumerate()
        .map(|(r, j)| match j {
            Ok(Ok(x)) => x,
            Ok(Err(_)) => panic!("rank {r} panicked"),
            Err(e) => panic!("rank {r} did not start: {e}"),
        })
        .collect();
    let (at, w, _) = &results[0];
    let bytes: u64 = results.iter().map(|r| r.2).sum();
    let mut exact = true;
    if let Some(w) = w {
        for (e, &got) in w.iter().enumerate() {
            let mut want = 0.0f32;
            for c in 0..clocks {
                let mean = (1..world).map(|r| grad(r, c, e)).sum::<f32>() / (world - 1) as f32;
                want -= LR * mean;
            }
            exact &= got == want;
        }
    }
    // Clock 1's time includes the set-up; the others are the steady state.
    let mut per: Vec<f64> = at
        .windows(2)
        .map(|p| (p[1] - p[0]).as_secs_f64() * 1e3)
        .collect();
    let mean = per.iter().sum::<f64>() / per.len().max(1) as f64;
    per.sort_by(f64::total_cmp);
    let median = per.get(per.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "{{\"world\":{world},\"strategy\":\"{}\",\"elems\":{elems},\"clocks\":{clocks},\"ms_per_clock_median\":{median:.3},\"ms_per_clock_mean\":{mean:.3},\"bytes_sent\":{bytes},\"exact\":{exact}}}",
        arg(1, "binary")
    );
}
