//! An isolated operation's failure ends its own messages only: a rank whose receive from a
//! peer that left fails keeps its messages with every other rank, where an ordinary
//! operation's failure makes every peer give up everything with it (the group's rule). Three
//! endpoints on loopback; rank 1 leaves (its socket closes) and rank 0 learns it from the
//! port-unreachable answer to its liveness check. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use gradwire_msg::core::{MsgError, RecvOpts, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};
use gradwire_msg::p2p::{Recv, Send};

/// Longest wait for any operation (the peer timeout is 2 s: rank 0 checks on a silent rank
/// 1 after 0.5 s).
const WAIT: Duration = Duration::from_secs(20);

/// A receive whose isolation the test chooses.
struct Wrapped {
    inner: Recv,
    isolated: bool,
}

impl Op for Wrapped {
    type Output = <Recv as Op>::Output;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        self.inner.start(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        self.inner.on_event(ev, cx)
    }

    fn isolated(&self) -> bool {
        self.isolated
    }
}

fn endpoints(n: u16) -> Vec<Endpoint> {
    let bound: Vec<_> = (0..n)
        .map(|r| {
            let mut cfg = EndpointConfig::new(5, r, n, "127.0.0.1:0".parse().unwrap());
            cfg.core.peer_timeout = Duration::from_secs(2);
            Endpoint::bind(cfg).unwrap()
        })
        .collect();
    let table: Vec<_> = bound.iter().map(|b| b.local_addr()).collect();
    bound
        .into_iter()
        .map(|b| b.start(table.clone()).unwrap())
        .collect()
}

/// Rank 0 waits on rank 1 (isolated or not) and on rank 2; rank 1 leaves; once rank 0's
/// receive from rank 1 failed, rank 2 sends. Returns rank 2's send and rank 0's receive
/// from rank 2.
fn leave(isolated: bool) -> (Result<(), OpError>, Result<usize, OpError>) {
    let mut eps = endpoints(3);
    let r2 = eps.pop().unwrap();
    let r1 = eps.pop().unwrap();
    let r0 = eps.pop().unwrap();
    let opts = RecvOpts {
        patient: true,
        ..RecvOpts::default()
    };
    let from1 = r0.submit(Wrapped {
        inner: Recv::new(Region::owned(vec![0; 64]), 1, opts.clone()),
        isolated,
    });
    let from2 = r0.submit(Recv::new(Region::owned(vec![0; 64]), 2, opts));
    drop(r1);
    let e = from1
        .wait_timeout(WAIT)
        .expect("rank 0 never learned that rank 1 left")
        .expect_err("a receive from a rank that left succeeded");
    assert!(
        matches!(e, OpError::Peer(MsgError::Unreachable { peer: 1, .. })),
        "{e}"
    );
    let sent = r2
        .run(
            Send::new(Region::owned(vec![7; 64]), 0, SendOpts::default()),
            WAIT,
        )
        .map(|_| ());
    let got = from2
        .wait_timeout(WAIT)
        .expect("rank 0's receive from rank 2 hung")
        .map(|(_, report)| report.len as usize);
    (sent, got)
}

#[test]
fn an_isolated_failure_leaves_the_other_peers_alone() {
    let (sent, got) = leave(true);
    assert!(sent.is_ok(), "{sent:?}");
    assert_eq!(got, Ok(64));
}

#[test]
fn an_ordinary_failure_makes_every_peer_give_up_naming_the_culprit() {
    let (sent, got) = leave(false);
    match sent {
        Err(OpError::Peer(MsgError::Aborted {
            peer: 0,
            culprit: Some(1),
            ..
        })) => {}
        other => panic!("rank 2's send: {other:?}"),
    }
    assert!(got.is_err(), "{got:?}");
}
