//! Helpers shared by the wan crate's integration tests.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use gradwire_netstorm::config::NetStormConfig;
use gradwire_proto::rate::RateMode;
use gradwire_wan::scheduler::Strategy;
use gradwire_wan::site::{run_node, NodeSpec, SchedulerRole};
use gradwire_wan::workload::Workload;

/// `f` on its own thread, failing the test if it has not returned within `limit`: a hang
/// guard set far beyond what the run takes (at least 5x its longest configured wait), so a
/// loaded machine cannot trip it; never a timing.
pub fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(t) => t,
        // The thread panicked: its message is on stderr already.
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the thread under test panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the thread under test hung for {limit:?}"),
    }
}

/// `n` message-layer endpoints of job `job` on loopback, started with each other's
/// addresses: the nodes of an in-process test. A peer silent for `peer_timeout` fails the
/// links with it.
pub fn endpoints(
    n: usize,
    job: u32,
    peer_timeout: Duration,
) -> Vec<gradwire_msg::endpoint::Endpoint> {
    use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
    let bound: Vec<_> = (0..n)
        .map(|r| {
            let mut cfg =
                EndpointConfig::new(job, r as u16, n as u16, "127.0.0.1:0".parse().unwrap());
            cfg.core.peer_timeout = peer_timeout;
            Endpoint::bind(cfg).expect("bind a loopback endpoint")
        })
        .collect();
    let table: Vec<_> = bound.iter().map(|b| b.local_addr()).collect();
    bound
        .into_iter()
        .map(|b| b.start(table.clone()).expect("start an endpoint"))
        .collect()
}

/// A master port whose next two (the scheduler's, the barrier's) are free too, as far as a
/// bind can tell.
pub fn free_master() -> SocketAddr {
    loop {
        let l = TcpListener::bind("127.0.0.3:0").unwrap();
        let a = l.local_addr().unwrap();
        let (Some(p1), Some(p2)) = (a.port().checked_add(1), a.port().checked_add(2)) else {
            continue;
        };
        let next = [p1, p2].map(|p| TcpListener::bind(("127.0.0.3", p)));
        if next.iter().all(Result::is_ok) {
            return a;
        }
    }
}

/// A node's job key (`None`: a plain node).
pub type Key = Option<std::sync::Arc<gradwire_proto::auth::JobKey>>;

/// Three sites of the three-site fixture on 127.0.0.3 running `iterations` verified
/// rounds, node 0 serving the scheduler at master port + 1, each with its key (`None`:
/// plain): every node's outcome.
pub fn three_sites(
    auth: [Key; 3],
    iterations: u32,
) -> Vec<Result<gradwire_wan::site::NodeOutput, gradwire_wan::site::NodeError>> {
    three_sites_at(free_master(), auth, iterations)
}

/// [`three_sites`] with the rendezvous at `master`.
pub fn three_sites_at(
    master: SocketAddr,
    auth: [Key; 3],
    iterations: u32,
) -> Vec<Result<gradwire_wan::site::NodeOutput, gradwire_wan::site::NodeError>> {
    let world = 3;
    let workload = Workload {
        model: "synthetic".into(),
        scale: 1.0,
        layers: vec![("a".into(), 3000), ("b".into(), 1000)],
        elems: 4000,
    };
    let topology =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/three_sites.toml");
    let nodes: Vec<_> = (0..world)
        .map(|rank| {
            let spec = NodeSpec {
                rank,
                world,
                job: 77,
                ip: "127.0.0.3".parse().unwrap(),
                master,
                scheduler: if rank == 0 {
                    SchedulerRole::Serve(SocketAddr::new(master.ip(), master.port() + 1))
                } else {
                    SchedulerRole::At(SocketAddr::new(master.ip(), master.port() + 1))
                },
                strategy: Strategy::MrFaptAware,
                topology: (rank == 0).then(|| topology.clone()),
                workload: workload.clone(),
                iterations,
                duration: None,
                timeout: Duration::from_secs(10),
                rate_bps: 1_000_000_000,
                rate_mode: RateMode::default(),
                period_ns: 1_000_000,
                netstorm: NetStormConfig {
                    chunk_size: 500,
                    ..NetStormConfig::default()
                },
                auth: auth[rank].clone(),
            };
            std::thread::spawn(move || run_node(&spec, |_, _| {}))
        })
        .collect();
    nodes
        .into_iter()
        .map(|h| bounded(Duration::from_secs(120), move || h.join().unwrap()))
        .collect()
}
