//! Collectives over AF_XDP (root; cargo feature `afxdp`): three ranks in three network
//! namespaces on a bridge, each group's endpoint on an AF_XDP socket of its host's veth
//! (copy mode), the XDP allowlist holding the other two ranks. A ring all-reduce, a
//! two-phase all-reduce and a broadcast give exact results, and nothing was refused.
//!
//! Holds [`FabricLock`] (it times traffic through namespaces); the testbed goes down on every
//! exit (drop, unwinding, or the namespaces' reaper if the process dies), and the sockets and
//! XDP programs close with their groups. Without root: reported as skipped, unless
//! `GRADWIRE_REQUIRE_PRIV=1`, which makes it fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::Duration;

use gradwire::tensor::DType;
use gradwire_collective::comm::TensorMut;
use gradwire_collective::group::{AllReduceAlgo, GroupConfig, GroupReduceOptions, PendingGroup};
use gradwire_netns::testbed::{host_ipv4, Testbed, TestbedConfig};
use gradwire_netns::{require_root, FabricLock, HOST_IFNAME};

const WORLD: usize = 3;
const PORT: u16 = 7410;

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) % 101) as f32).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn collectives_over_af_xdp_are_exact_and_use_only_the_af_xdp_sockets() {
    if !require_root("collectives_over_af_xdp_are_exact_and_use_only_the_af_xdp_sockets") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let tb = Testbed::up(&TestbedConfig::with_hosts(WORLD)).unwrap();
    let (addr_tx, addr_rx) = mpsc::channel();
    let mut tables = Vec::new();
    let mut handles = Vec::new();
    for r in 0..WORLD {
        let (table_tx, table_rx) = mpsc::channel::<Vec<SocketAddr>>();
        tables.push(table_tx);
        let addr_tx = addr_tx.clone();
        handles.push(
            tb.spawn_in(r, move || {
                let ip = IpAddr::V4(host_ipv4(r));
                let mut cfg = GroupConfig::new(21, r, WORLD, ip, Duration::from_secs(10));
                // A port per rank: the XDP classifier matches the destination port, not the
                // address, so a frame the bridge floods to every host (before it learned where
                // a MAC is) would reach another rank's socket on a shared port (refused there
                // by the core, counted, but a cost).
                cfg.endpoint.bind = SocketAddr::new(ip, PORT + r as u16);
                cfg.afxdp_ifname = Some(HOST_IFNAME.to_string());
                let pending = PendingGroup::bind(cfg).expect("AF_XDP group");
                addr_tx.send((r, pending.address())).unwrap();
                let table = table_rx
                    .recv_timeout(Duration::from_secs(30))
                    .expect("the table");
                let g = pending.start(table).expect("start");
                let mut results = Vec::new();
                for (algo, n) in [
                    (AllReduceAlgo::Ring, 300_000),
                    (AllReduceAlgo::Direct, 3_000),
                ] {
                    let mut b = bytes(&input(r, n));
                    let o = GroupReduceOptions {
                        algorithm: algo,
                        ..GroupReduceOptions::default()
                    };
                    let t = TensorMut::new(DType::F32, &mut b).unwrap();
                    g.all_reduce(t, &o).expect("all-reduce");
                    results.push(floats(&b));
                }
                let mut root_data = if r == 1 {
                    bytes(&input(9, 50_000))
                } else {
                    vec![0; 200_000]
                };
                g.broadcast(&mut root_data, 1, 0.0).expect("broadcast");
                results.push(floats(&root_data));
                (r, results, g.stats())
            })
            .unwrap(),
        );
    }
    let mut addrs = vec![None; WORLD];
    for _ in 0..WORLD {
        let (r, a) = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("an address");
        addrs[r] = Some(a);
    }
    let table: Vec<SocketAddr> = addrs.into_iter().map(Option::unwrap).collect();
    for t in &tables {
        t.send(table.clone()).unwrap();
    }
    for h in handles {
        let (r, results, stats) = h.join().expect("rank thread");
        for (k, n) in [300_000usize, 3_000].into_iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..WORLD).map(|q| input(q, n)).collect();
            let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
            assert!(
                results[k] == want,
                "rank {r}: all-reduce {k} is not the exact sum"
            );
        }
        assert!(
            results[2] == input(9, 50_000),
            "rank {r}: the broadcast differs"
        );
        assert!(
            stats.datagrams_in > 0 && stats.datagrams_out > 0,
            "rank {r}: {stats:?}"
        );
        assert_eq!(stats.core.refused, 0, "rank {r}: {stats:?}");
        assert_eq!(stats.unknown_source, 0, "rank {r}: {stats:?}");
    }
}
