//! MLNET's parameter server over real network namespaces (root), kernel UDP and TCP:
//! - a server and four workers, one of them slow, with staleness 2 on a BINARY tree: some
//!   pull is served stale (the slow worker is held back until the others have pulled as far
//!   ahead as the bound allows), none staler than the bound, and the final model is exactly
//!   the sequential result;
//! - an aggregator process that dies mid-run is routed around (its children re-attach to
//!   their grandparent) and the final model is exactly what the applied contributions give.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use gradwire::tensor::{DType, Tensor};
use gradwire_collective::link::{tree_edges, Links, NetLinkConfig};
use gradwire_collective::ps::{fault_tolerant_edges, PsConfig, PsNode};
use gradwire_collective::tree::{Strategy, Tree};
use gradwire_netns::{require_root, FabricLock};

mod common;
use common::Pace;
use gradwire_netns::testbed::{host_ipv4, Testbed, TestbedConfig};

const WORLD: usize = 5;
const ITERATIONS: u64 = 6;
const STALENESS: u64 = 2;
const ELEMS: usize = 20_000;
const SLOW: usize = 4;

/// Worker `r`'s gradient of clock `c`: small integers, so every sum and the average over 4
/// workers are exact in f32.
fn grad(r: usize, c: u64, e: usize) -> f32 {
    ((r + c as usize * 3 + e) % 7) as f32 - 3.0
}

#[test]
fn a_slow_worker_never_makes_a_pull_staler_than_allowed() {
    if !require_root("a_slow_worker_never_makes_a_pull_staler_than_allowed") {
        return;
    }
    // Heartbeats and op timeouts run on the wall clock: no fabric of another test at once.
    let _fabric = FabricLock::acquire().unwrap();
    let tb = Testbed::up(&TestbedConfig::with_hosts(WORLD)).unwrap();
    let members: Vec<usize> = (0..WORLD).collect();
    let tree = Tree::build(Strategy::BINARY, 0, &members, &[0; WORLD]).unwrap();
    let master = SocketAddr::new(IpAddr::V4(host_ipv4(0)), 29_611);
    let lr = 0.5f32;
    let fast: Vec<usize> = (1..WORLD).filter(|&r| r != SLOW).collect();
    let pace = Arc::new(Pace::new(WORLD, fast, STALENESS, ITERATIONS));
    let handles: Vec<_> = (0..WORLD)
        .map(|r| {
            let (tree, pace) = (tree.clone(), pace.clone());
            tb.spawn_in(r, move || {
                let timeout = Duration::from_secs(20);
                let links = host_links(11, r, WORLD, master, &tree_edges(&tree), None, timeout);
                let cfg = PsConfig {
                    staleness: STALENESS,
                    learning_rate: lr,
                    op_timeout: timeout,
                    ..PsConfig::default()
                };
                let initial = Tensor::zeros(DType::F32, ELEMS);
                let mut node = PsNode::start(links, tree, 11, &initial, cfg).unwrap();
                let mut pulls = Vec::new();
                if r == 0 {
                    node.wait_clock(ITERATIONS, Duration::from_secs(60))
                        .unwrap();
                    let (clock, w) = node.weights();
                    node.shutdown().unwrap();
                    return (clock, w.as_f32().unwrap().to_vec(), pulls);
                }
                let mut w = Tensor::zeros(DType::F32, ELEMS);
                for c in 0..ITERATIONS {
                    let report = node.pull(&mut w, None).unwrap();
                    pulls.push((node.worker_clock(), report.weights_clock));
                    let mut g = Tensor::zeros(DType::F32, ELEMS);
                    for (e, x) in g.as_f32_mut().unwrap().iter_mut().enumerate() {
                        *x = grad(r, c, e);
                    }
                    if r == SLOW {
                        pace.hold(c);
                    } else {
                        pace.pulled(r, c);
                    }
                    node.push(&g).unwrap();
                    node.clock();
                }
                node.shutdown().unwrap();
                (0, Vec::new(), pulls)
            })
        })
        .collect();
    let results = join_all(handles, tb);

    let mut stalest = 0;
    for (r, (_, _, pulls)) in results.iter().enumerate().skip(1) {
        for &(c_worker, v) in pulls {
            assert!(
                v + STALENESS >= c_worker,
                "rank {r} at clock {c_worker} pulled version {v}: staler than s = {STALENESS}"
            );
            stalest = stalest.max(c_worker.saturating_sub(v));
        }
    }
    // Stale synchronous parallel, not synchronous, and to the full bound: the slow worker
    // holds its push of clock c until the fast ones have pulled at c + s, and such a pull is
    // served version c, stale by exactly s (less means a bound off by one, or pulls that
    // waited for the current version).
    assert_eq!(
        stalest, STALENESS,
        "no pull was served s = {STALENESS} clocks stale: the bound was never used in full"
    );
    // w_{c+1} = w_c - lr * mean over the 4 workers of their gradients of clock c.
    let (clock, w, _) = &results[0];
    assert!(*clock >= ITERATIONS);
    for (e, &got) in w.iter().enumerate() {
        let mut want = 0.0f32;
        for c in 0..ITERATIONS {
            let mean = (1..WORLD).map(|r| grad(r, c, e)).sum::<f32>() / (WORLD - 1) as f32;
            want -= lr * mean;
        }
        assert_eq!(got, want, "element {e}");
    }
}

/// Rank `r`'s links of job `job` from testbed host `r`, through the rendezvous at `master`.
fn host_links(
    job: u32,
    r: usize,
    world: usize,
    master: SocketAddr,
    edges: &[(usize, usize)],
    secret: Option<&gradwire::auth::JobSecret>,
    timeout: Duration,
) -> Links {
    let link_cfg = NetLinkConfig {
        connect_timeout: timeout,
        ..NetLinkConfig::default()
    };
    let ip = IpAddr::V4(host_ipv4(r));
    Links::connect(job, r, world, ip, master, edges, secret, &link_cfg).unwrap()
}

/// Joins every rank's thread, takes the testbed down, and only then reports the first
/// failure: no thread is left running in a namespace that is being deleted.
fn join_all<T>(
    handles: Vec<gradwire_netns::Result<std::thread::JoinHandle<T>>>,
    tb: Testbed,
) -> Vec<T> {
    let joined: Vec<Result<T, String>> = handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| match h {
            Ok(h) => h.join().map_err(|p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("rank {r} panicked: {msg}")
            }),
            Err(e) => Err(format!("rank {r} did not start: {e}")),
        })
        .collect();
    let down = tb.down();
    let failures: Vec<&String> = joined.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failures.is_empty(), "{failures:#?}");
    down.unwrap();
    joined.into_iter().map(|r| r.unwrap()).collect()
}

/// An aggregator process dies (its node is dropped without a word) mid-run, over kernel
/// UDP/TCP between namespaces: the server declares it dead, its children re-attach to their
/// grandparent, every survivor finishes every clock, and the final model is exactly what the
/// applied contributions give.
#[test]
fn a_killed_aggregator_is_routed_around_over_namespaces() {
    if !require_root("a_killed_aggregator_is_routed_around_over_namespaces") {
        return;
    }
    const N: usize = 7;
    const CLOCKS: u64 = 6;
    const KILL_AFTER: u64 = 2;
    let elems = 4_000;
    // The failure detector times silence on the wall clock: no fabric of another test at once.
    let _fabric = FabricLock::acquire().unwrap();
    let tb = Testbed::up(&TestbedConfig::with_hosts(N)).unwrap();
    let members: Vec<usize> = (0..N).collect();
    let tree = Tree::build(Strategy::BINARY, 0, &members, &[0; N]).unwrap();
    let victim = (1..N).find(|&r| !tree.children(r).is_empty()).unwrap();
    let master = SocketAddr::new(IpAddr::V4(host_ipv4(0)), 29_612);
    let edges = fault_tolerant_edges(&tree);
    let handles: Vec<_> = (0..N)
        .map(|r| {
            let (tree, edges) = (tree.clone(), edges.clone());
            tb.spawn_in(r, move || {
                let timeout = Duration::from_secs(20);
                let links = host_links(12, r, N, master, &edges, None, timeout);
                let cfg = PsConfig {
                    learning_rate: common::LR,
                    op_timeout: timeout,
                    keep_updates: 64,
                    ..PsConfig::default()
                };
                let initial = Tensor::from_f32(&common::initial(elems));
                let mut node = PsNode::start(links, tree, 12, &initial, cfg).unwrap();
                if r == 0 {
                    node.wait_clock(CLOCKS, Duration::from_secs(60)).unwrap();
                    let block_elems = node.block_elems();
                    let w = node.weights().1.as_f32().unwrap().to_vec();
                    let stats = node.shutdown().unwrap();
                    return Some((w, block_elems, stats));
                }
                let mut w = Tensor::zeros(DType::F32, elems);
                for c in 0..CLOCKS {
                    node.pull(&mut w, None).unwrap();
                    let g: Vec<f32> = (0..elems).map(|e| common::grad(r, c, e)).collect();
                    node.push(&Tensor::from_f32(&g)).unwrap();
                    node.clock();
                    if r == victim && c == KILL_AFTER {
                        drop(node); // the process dies
                        return None;
                    }
                }
                let stats = node.shutdown().unwrap();
                assert_eq!(stats.dead, vec![victim], "rank {r}");
                None
            })
        })
        .collect();
    let results = join_all(handles, tb);

    let (w, block_elems, stats) = results[0].clone().expect("the server's result");
    assert_eq!(stats.dead, vec![victim]);
    assert_eq!(stats.tree_version, 1);
    assert!(!stats.fell_back_to_star);
    assert_eq!(stats.updates.len(), CLOCKS as usize);
    let want = common::replay(&stats.updates, block_elems, elems)
        .pop()
        .unwrap();
    assert_eq!(w, want);
    // Every survivor is in every update; the dead rank only in the first ones.
    for u in &stats.updates {
        for r in (1..N).filter(|&r| r != victim) {
            assert!(u.contributors.contains(0, r), "clock {}: rank {r}", u.clock);
        }
    }
    assert!(stats.updates[KILL_AFTER as usize + 1..]
        .iter()
        .all(|u| !u.contributors.contains(0, victim)));
}

/// An authenticated job (a job secret on the links): every node's message-layer datagrams
/// are sealed with its pair of ranks' keys, exchanged over the authenticated links. The
/// server's version digests go to every worker below its children (`verify_versions`),
/// sealed too; the final model is exactly the sequential result.
#[test]
fn an_authenticated_parameter_server_runs_sealed_and_exact() {
    if !require_root("an_authenticated_parameter_server_runs_sealed_and_exact") {
        return;
    }
    const CLOCKS: u64 = 4;
    let _fabric = FabricLock::acquire().unwrap();
    let tb = Testbed::up(&TestbedConfig::with_hosts(WORLD)).unwrap();
    let members: Vec<usize> = (0..WORLD).collect();
    let tree = Tree::build(Strategy::BINARY, 0, &members, &[0; WORLD]).unwrap();
    let master = SocketAddr::new(IpAddr::V4(host_ipv4(0)), 29_613);
    let edges = fault_tolerant_edges(&tree);
    let lr = 0.5f32;
    let handles: Vec<_> = (0..WORLD)
        .map(|r| {
            let (tree, edges) = (tree.clone(), edges.clone());
            tb.spawn_in(r, move || {
                let timeout = Duration::from_secs(20);
                let secret =
                    gradwire::auth::JobSecret::new(b"0123456789abcdef-ps".to_vec()).unwrap();
                let links = host_links(13, r, WORLD, master, &edges, Some(&secret), timeout);
                let cfg = PsConfig {
                    learning_rate: lr,
                    op_timeout: timeout,
                    verify_versions: true,
                    ..PsConfig::default()
                };
                let initial = Tensor::zeros(DType::F32, ELEMS);
                let mut node = PsNode::start(links, tree, 13, &initial, cfg).unwrap();
                if r == 0 {
                    node.wait_clock(CLOCKS, Duration::from_secs(60)).unwrap();
                    let w = node.weights().1.as_f32().unwrap().to_vec();
                    return (w, node.shutdown().unwrap());
                }
                let mut w = Tensor::zeros(DType::F32, ELEMS);
                for c in 0..CLOCKS {
                    node.pull(&mut w, None).unwrap();
                    let mut g = Tensor::zeros(DType::F32, ELEMS);
                    for (e, x) in g.as_f32_mut().unwrap().iter_mut().enumerate() {
                        *x = grad(r, c, e);
                    }
                    node.push(&g).unwrap();
                    node.clock();
                }
                (Vec::new(), node.shutdown().unwrap())
            })
        })
        .collect();
    let results = join_all(handles, tb);
    for (r, (_, st)) in results.iter().enumerate() {
        assert!(st.sealed, "rank {r} ran plain: {st:?}");
        assert_eq!(st.claims_refused, 0, "rank {r}: {st:?}");
    }
    // Ranks 3..: below the server's children, every version checked against its digest.
    assert!(
        results[3].1.versions_verified >= CLOCKS,
        "{:?}",
        results[3].1
    );
    let w = &results[0].0;
    for (e, &got) in w.iter().enumerate() {
        let mut want = 0.0f32;
        for c in 0..CLOCKS {
            let mean = (1..WORLD).map(|r| grad(r, c, e)).sum::<f32>() / (WORLD - 1) as f32;
            want -= lr * mean;
        }
        assert_eq!(got, want, "element {e}");
    }
}
