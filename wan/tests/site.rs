//! One whole job through `run_node` on loopback: three sites of the three-site fixture, the
//! scheduler served by node 0 once the rendezvous has given every node's address, every
//! round verified on every node. The job's address is 127.0.0.3, not 127.0.0.1, which the
//! kernel would pick as the source of a connection to any loopback address: the nodes'
//! scheduler connections must come from the address they published. Each node runs under
//! a hang guard far beyond the run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::bounded;
use gradwire_netstorm::config::NetStormConfig;
use gradwire_proto::rate::RateMode;
use gradwire_wan::scheduler::Strategy;
use gradwire_wan::site::{run_node, NodeSpec, SchedulerRole};
use gradwire_wan::workload::Workload;

/// A master port whose next two (the scheduler's, the barrier's) are free too, as far as a
/// bind can tell.
fn free_master() -> SocketAddr {
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

#[test]
fn three_sites_on_loopback_run_verified_rounds_with_the_scheduler_served_by_node_0() {
    three_sites_plain();
}

/// The same job with a secret: every chunk sealed per pair of nodes, every scheduler
/// connection authenticated (node 0's member key is the scheduler's).
#[test]
fn an_authenticated_job_runs_the_same_rounds_sealed() {
    let secret = gradwire_proto::auth::JobSecret::new(b"a netstorm job secret".to_vec()).unwrap();
    let key = Some(Arc::new(gradwire_proto::auth::JobKey::new(&secret)));
    for (rank, out) in three_sites([key.clone(), key.clone(), key])
        .into_iter()
        .enumerate()
    {
        let out = out.unwrap_or_else(|e| panic!("node {rank}: {e}"));
        assert!(out.verified && out.rounds == 3, "node {rank}: {out:?}");
    }
}

/// A node without the secret in an authenticated job: the rendezvous refuses it as not
/// authenticated, rank 0 fails naming it as never joined and saying a join was refused for
/// want of the secret, and no node runs a round.
#[test]
fn a_node_without_the_secret_fails_every_nodes_set_up() {
    let secret = gradwire_proto::auth::JobSecret::new(b"a netstorm job secret".to_vec()).unwrap();
    let key = Some(Arc::new(gradwire_proto::auth::JobKey::new(&secret)));
    let outs: Vec<String> = three_sites([key.clone(), key, None])
        .into_iter()
        .map(|out| out.expect_err("a mixed job ran").to_string())
        .collect();
    assert!(outs[2].contains("not authenticated"), "node 2: {}", outs[2]);
    assert!(
        outs[0].contains("[2] never joined") && outs[0].contains("not authenticated"),
        "node 0: {}",
        outs[0]
    );
}

type Key = Option<Arc<gradwire_proto::auth::JobKey>>;

fn three_sites_plain() {
    for (rank, out) in three_sites([None, None, None]).into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("node {rank}: {e}"));
        assert!(out.verified && out.rounds == 3, "node {rank}: {out:?}");
        if rank == 0 {
            let s = out.scheduler.expect("node 0 served the scheduler");
            assert_eq!(s.requests, 9, "three rounds of three nodes' requests");
        }
    }
}

/// Every node's outcome.
fn three_sites(
    auth: [Key; 3],
) -> Vec<Result<gradwire_wan::site::NodeOutput, gradwire_wan::site::NodeError>> {
    let master = free_master();
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
                iterations: 3,
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
