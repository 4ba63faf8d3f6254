//! An operation that is one link's own stream (`Op::isolated` true: the
//! parameter server's links) fails alone when its peer fails: the rank goes on with its other
//! peers. A collective's operation (the default) makes every peer give up everything with the
//! rank, naming the culprit.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use gradwire_msg::core::{RecvOpts, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Op, OpCx, OpEvent, Step};
use gradwire_msg::p2p::{Recv, Send};

/// Three ranks on loopback whose peers count as silent after `peer_timeout`.
fn three(peer_timeout: Duration) -> Vec<Endpoint> {
    let bound: Vec<_> = (0..3u16)
        .map(|r| {
            let mut c =
                EndpointConfig::new(5, r, 3, SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
            c.core.peer_timeout = peer_timeout;
            Endpoint::bind(c).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = bound.iter().map(|b| b.local_addr()).collect();
    bound
        .into_iter()
        .map(|b| b.start(addrs.clone()).unwrap())
        .collect()
}

/// A receive whose failure is its own.
struct Alone(Recv);

impl Op for Alone {
    type Output = ();

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        Ok(self.0.start(cx)?.map(|_| ()))
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<()> {
        Ok(self.0.on_event(ev, cx)?.map(|_| ()))
    }

    fn isolated(&self) -> bool {
        true
    }
}

#[test]
fn a_link_operation_fails_alone_a_collective_one_breaks_the_group() {
    let wait = Duration::from_secs(5);
    for alone in [true, false] {
        let eps = three(Duration::from_millis(300));
        // Rank 1 never sends: rank 0's receive from it fails, naming it.
        let from_1 = Recv::new(Region::owned(vec![0; 8]), 1, RecvOpts::default());
        let err = if alone {
            eps[0].run(Alone(from_1), wait).unwrap_err()
        } else {
            eps[0].run(from_1, wait).map(|_| ()).unwrap_err()
        };
        assert_eq!(err.peer(), Some(1), "{err}");
        // Then rank 2 sends to rank 0.
        let send = eps[2].submit(Send::new(Region::owned(vec![7; 8]), 0, SendOpts::default()));
        if alone {
            let (region, report) = eps[0]
                .run(
                    Recv::new(Region::owned(vec![0; 8]), 2, RecvOpts::default()),
                    wait,
                )
                .unwrap();
            assert_eq!(report.missing, 0);
            assert_eq!(region.unwrap().as_slice(), &[7; 8]);
            send.wait_timeout(wait).unwrap().unwrap();
        } else {
            // Rank 0 told rank 2 to give up everything with it, naming rank 1.
            let e = send.wait_timeout(wait).unwrap().unwrap_err();
            assert_eq!(e.peer(), Some(1), "{e}");
        }
    }
}

/// A lossy send ends with how many segments its receiver did without (the same count the
/// receiver's report gives: what `gradwire send` prints as delivered) and how many data
/// segments it sent, resends included.
#[test]
fn a_lossy_send_reports_what_its_receiver_did_without() {
    let wait = Duration::from_secs(20);
    let bound: Vec<_> = (0..2u16)
        .map(|r| {
            let mut c =
                EndpointConfig::new(6, r, 2, SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
            // The receiver drops a fifth of what arrives; the bound lets it keep a tenth short.
            if r == 0 {
                c.inject_loss = 0.2;
                c.seed = 3;
            }
            Endpoint::bind(c).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = bound.iter().map(|b| b.local_addr()).collect();
    let eps: Vec<Endpoint> = bound
        .into_iter()
        .map(|b| b.start(addrs.clone()).unwrap())
        .collect();
    let data: Vec<u8> = (0..400_000u32).map(|i| i as u8).collect();
    let send = eps[1].submit(Send::new(
        Region::owned(data.clone()),
        0,
        SendOpts::default(),
    ));
    let opts = RecvOpts {
        loss_bound: 0.1,
        ..RecvOpts::default()
    };
    let (_, report) = eps[0]
        .run(Recv::new(Region::owned(vec![0; data.len()]), 1, opts), wait)
        .unwrap();
    let done = send.wait_timeout(wait).unwrap().unwrap();
    assert!(
        report.missing > 0,
        "20 % loss under a 10 % bound left nothing short"
    );
    assert_eq!(done.missing, report.missing);
    // Every segment once, and resends for some of the fifth the receiver dropped.
    assert!(
        done.segments > report.segments,
        "{} segments sent for {} with 20 % dropped: no resends counted",
        done.segments,
        report.segments
    );
    assert_eq!(done.region.map(Region::into_vec), Some(Some(data)));
}
