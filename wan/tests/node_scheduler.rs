//! A node's side of the scheduler connection: a node whose scheduler closes the connection,
//! goes silent, or stops between rounds fails with an error that names the scheduler (its
//! address), never a hang; a silent scheduler fails it by the round timeout, which the error
//! names and the node waited in full (by its own clock). The scheduler is a bare TCP
//! listener that reads the node's topology request and then misbehaves, or the real one
//! stopped between two rounds. Each node runs under a hang guard of 60 s, 30 times the
//! round timeout: only a node that never gives up trips it, however loaded the machine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::time::Duration;

use common::{bounded, endpoints};

use gradwire_msg::endpoint::Endpoint;
use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::Message;
use gradwire_wan::control::read_frame;
use gradwire_wan::node::{Node, NodeConfig};
use gradwire_wan::scheduler::{self, SchedulerConfig, Strategy};
use gradwire_wan::WanError;

const ELEMS: usize = 2_000;

/// The nodes' round timeout: it bounds the wait for the scheduler's answer.
const ROUND_TIMEOUT: Duration = Duration::from_secs(2);

fn config(rank: usize) -> NodeConfig {
    NodeConfig {
        rank,
        netstorm: Strategy::MrFapt.netstorm(&NetStormConfig {
            chunk_size: 500,
            ..NetStormConfig::default()
        }),
        dscp: 10,
        round_timeout: ROUND_TIMEOUT,
        peer_budget: gradwire_wan::channel::DEFAULT_PEER_BUDGET,
        control_auth: None,
    }
}

/// Two nodes' endpoints on loopback.
fn links() -> Vec<Endpoint> {
    endpoints(2, 9, ROUND_TIMEOUT)
}

/// The error names the scheduler at `addr`, as a scheduler error.
fn assert_names_scheduler(e: &WanError, addr: SocketAddr, what: &str) {
    assert!(
        matches!(e, WanError::Scheduler { addr: a, .. } if *a == addr),
        "{what}: the node failed without naming the scheduler at {addr}: {e:?}"
    );
    assert!(
        e.to_string().contains(&format!("scheduler at {addr}")),
        "{what}: {e}"
    );
}

/// A scheduler that accepts one node, reads its topology request, and then does `then`
/// with the connection (called with the stream; it returns when the test is done with it).
fn fake_scheduler(
    then: impl FnOnce(std::net::TcpStream) + Send + 'static,
) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        match read_frame(&mut s).unwrap() {
            Message::TopologyRequest(r) => assert_eq!((r.node, r.round), (0, 0)),
            m => panic!("a {:?} before the topology request", m.kind()),
        }
        then(s);
    });
    (addr, h)
}

/// Node 0 of two runs one round against the scheduler at `addr`; its error.
fn one_round(addr: SocketAddr) -> WanError {
    let mut ls = links();
    // Node 1's endpoint stays open (it answers node 0's liveness checks): only the scheduler
    // can fail the round.
    let peer = ls.pop().unwrap();
    let l0 = ls.pop().unwrap();
    let e = bounded(Duration::from_secs(60), move || {
        let mut node = Node::start(l0, addr, config(0)).unwrap();
        let e = node
            .synchronize(&vec![1.0; ELEMS])
            .expect_err("a round without the scheduler's answer succeeded");
        node.shutdown();
        e
    });
    drop(peer);
    e
}

#[test]
fn a_node_whose_scheduler_closes_the_connection_fails_naming_it() {
    // The scheduler reads the request and closes the connection without answering.
    let (addr, h) = fake_scheduler(drop);
    let e = one_round(addr);
    assert_names_scheduler(&e, addr, "the scheduler closed the connection");
    // A closed connection is no timeout: the node did not wait for one.
    assert_eq!(e.timed_out(), None, "{e}");
    h.join().unwrap();
}

#[test]
fn a_node_whose_scheduler_goes_silent_fails_naming_it_within_the_round_timeout() {
    // The scheduler reads the request and keeps the connection open without answering,
    // until the test has the node's error.
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (addr, h) = fake_scheduler(move |s| {
        let _ = done_rx.recv();
        drop(s);
    });
    let e = one_round(addr);
    assert_names_scheduler(&e, addr, "the scheduler went silent");
    assert!(
        e.to_string().contains("round 0"),
        "the error does not say which round's policy it waited for: {e}"
    );
    // The configured round timeout is what fired, the message says so, and the node waited
    // it in full by its own clock (a lower bound: no load makes a wait shorter).
    let t = e
        .timed_out()
        .unwrap_or_else(|| panic!("the node did not report a timeout: {e}"));
    assert_eq!(t.timeout, ROUND_TIMEOUT, "{e}");
    assert!(
        t.waited >= ROUND_TIMEOUT,
        "it gave up after {:?}: {e}",
        t.waited
    );
    assert!(
        e.to_string().contains(&format!(
            "no answer within {ROUND_TIMEOUT:?}, the round timeout"
        )),
        "the error does not say which timeout fired: {e}"
    );
    done_tx.send(()).unwrap();
    h.join().unwrap();
}

#[test]
fn a_scheduler_that_stops_between_rounds_fails_every_node_naming_it() {
    let mut o = Overlay::new(2);
    o.add_link(0, 1, 10e6).unwrap();
    let sched = scheduler::spawn(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        SchedulerConfig {
            world: 2,
            strategy: Strategy::MrFapt,
            netstorm: config(0).netstorm,
            overlay: o,
            round_bytes: ELEMS as u64 * 4,
            node_ips: None,
            auth: None,
        },
    )
    .unwrap();
    let addr = sched.addr();
    // Both nodes finish round 0, then the scheduler stops, then both try round 1.
    let (stopped_tx, stopped_rx) = mpsc::channel::<()>();
    let (round0_tx, round0_rx) = mpsc::channel::<()>();
    let stopped_rx = std::sync::Arc::new(std::sync::Mutex::new(stopped_rx));
    let nodes: Vec<_> = links()
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let round0 = round0_tx.clone();
            let stopped = std::sync::Arc::clone(&stopped_rx);
            std::thread::spawn(move || {
                let mut node = Node::start(l, addr, config(rank)).unwrap();
                let input = vec![rank as f32; ELEMS];
                let out = node.synchronize(&input).unwrap();
                assert!(out.iter().all(|&v| v == 0.5), "round 0 is wrong");
                round0.send(()).unwrap();
                stopped.lock().unwrap().recv().unwrap();
                let e = node
                    .synchronize(&input)
                    .expect_err("a round without the scheduler succeeded");
                node.shutdown();
                e
            })
        })
        .collect();
    for _ in 0..2 {
        round0_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("round 0 did not finish");
    }
    sched.stop().unwrap();
    for _ in 0..2 {
        stopped_tx.send(()).unwrap();
    }
    for (rank, h) in nodes.into_iter().enumerate() {
        let e = bounded(Duration::from_secs(60), move || h.join().unwrap());
        assert_names_scheduler(&e, addr, &format!("node {rank}, its scheduler stopped"));
    }
}
