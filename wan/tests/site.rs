//! One whole job through `run_node` on loopback: three sites of the three-site fixture, the
//! scheduler served by node 0 once the rendezvous has given every node's address, every
//! round verified on every node. The job's address is 127.0.0.3, not 127.0.0.1, which the
//! kernel would pick as the source of a connection to any loopback address: the nodes'
//! scheduler connections must come from the address they published. Each node runs under
//! a hang guard far beyond the run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

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
    for (rank, out) in common::three_sites([key.clone(), key.clone(), key], 3)
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
    let outs: Vec<String> = common::three_sites([key.clone(), key, None], 3)
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

fn three_sites_plain() {
    for (rank, out) in common::three_sites([None, None, None], 3)
        .into_iter()
        .enumerate()
    {
        let out = out.unwrap_or_else(|e| panic!("node {rank}: {e}"));
        assert!(out.verified && out.rounds == 3, "node {rank}: {out:?}");
        if rank == 0 {
            let s = out.scheduler.expect("node 0 served the scheduler");
            assert_eq!(s.requests, 9, "three rounds of three nodes' requests");
        }
    }
}
