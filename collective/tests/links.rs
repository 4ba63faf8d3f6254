//! Network links on loopback addresses of this host (no root needed): a link's listener
//! refuses a connection from an address that is not its peer's in the endpoint table, and
//! in a plain job one without the link's token (another process at the peer's address, a
//! scan), and the link is still made with the real peer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire::ctrl_channel::{ChannelError, CtrlChannel, TcpCtrl};
use gradwire::tensor::Tensor;
use gradwire_collective::comm::{AllReduceOptions, CommConfig, Communicator};
use gradwire_collective::link::{
    parse_endpoint_table, ring_edges, EndpointInfo, Links, NetLinkConfig, PendingLinks,
};

const JOB: u32 = 21;

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 64, 0, last))
}

/// Two plain ranks of a ring on 127.64.0.1 and .2, bound: their pending links, the endpoint
/// table, the table checked, and rank 1's control port for rank 0's link.
fn two_ranks(
    connect_timeout: Duration,
) -> (Vec<PendingLinks>, Vec<Vec<u8>>, Vec<EndpointInfo>, u16) {
    let cfg = NetLinkConfig {
        connect_timeout,
        ..NetLinkConfig::default()
    };
    let pending: Vec<_> = (0..2)
        .map(|r| Links::bind(JOB, r, 2, ip(r as u8 + 1), &ring_edges(2), None, &cfg).unwrap())
        .collect();
    let table: Vec<Vec<u8>> = pending.iter().map(|p| p.endpoint().to_vec()).collect();
    let infos = parse_endpoint_table(&table, JOB, 2).unwrap();
    let port = infos[1]
        .listeners
        .iter()
        .find(|(from, _)| *from == 0)
        .unwrap()
        .1;
    (pending, table, infos, port)
}

#[test]
fn a_links_listener_refuses_an_address_not_in_the_table() {
    let (pending, table, infos, port) = two_ranks(Duration::from_secs(5));
    // A stranger (another address of this host) that holds the table, so the link's token,
    // completes the handshake on rank 1's listener for rank 0's link before rank 0
    // connects: it is first in line, and refused for its address.
    let token = infos[1]
        .tokens
        .iter()
        .find(|(from, _)| *from == 0)
        .unwrap()
        .1;
    let mut stranger = TcpCtrl::connect_link(
        Some(ip(3)),
        SocketAddr::new(ip(2), port),
        Duration::from_secs(5),
        None,
        None,
        Some(token),
    )
    .unwrap();
    // The stranger is checked while every rank's links (and whatever rank 1 accepted) are
    // alive: each rank reports its links made, then waits for the check before using them.
    // Dropping them would close a connection kept by mistake and hide it.
    let (made_tx, made_rx) = mpsc::channel::<usize>();
    let go: Vec<_> = (0..2).map(|_| mpsc::channel::<()>()).collect();
    let (go_tx, go_rx): (Vec<_>, Vec<_>) = go.into_iter().unzip();
    let sums: Vec<Option<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = pending
            .into_iter()
            .zip(go_rx)
            .map(|(p, go)| {
                let table = table.clone();
                let made = made_tx.clone();
                s.spawn(move || {
                    let links = p.finish(&table).unwrap();
                    let r = links.rank();
                    made.send(r).unwrap();
                    // The check failed (its sender is gone): stop here.
                    go.recv().ok()?;
                    let ccfg = CommConfig {
                        op_timeout: Duration::from_secs(5),
                        ..CommConfig::default()
                    };
                    let mut comm = Communicator::new(links, JOB, ccfg).unwrap();
                    let mut t = Tensor::from_f32(&[r as f32 + 1.0; 300]);
                    comm.all_reduce(&mut t, &AllReduceOptions::default())
                        .unwrap();
                    Some(t.as_f32().unwrap().to_vec())
                })
            })
            .collect();
        drop(made_tx);
        for _ in 0..2 {
            // A rank that failed panicked and dropped its sender: the join below reports it.
            if made_rx.recv_timeout(Duration::from_secs(10)).is_err() {
                break;
            }
        }
        // Rank 1 dropped the stranger's connection when it accepted it (a refused stranger is
        // closed, not kept as the link): end of stream or a reset while its links live.
        let deadline = Instant::now() + Duration::from_secs(5);
        let closed = loop {
            match stranger.recv(Duration::from_millis(200)) {
                Err(ChannelError::Closed { .. } | ChannelError::Io { .. }) => break Ok(()),
                Ok(None) if Instant::now() < deadline => continue,
                other => break Err(format!("{other:?}")),
            }
        };
        if closed.is_ok() {
            for g in &go_tx {
                let _ = g.send(());
            }
        }
        // On failure the ranks' go senders drop here, so they return without the all-reduce.
        drop(go_tx);
        let sums = hs.into_iter().map(|h| h.join().unwrap()).collect();
        if let Err(other) = closed {
            panic!("the stranger's connection is still open while rank 1's links live: {other}");
        }
        sums
    });
    assert!(
        sums.iter()
            .all(|v| v.as_ref().is_some_and(|v| v.iter().all(|&x| x == 3.0))),
        "{sums:?}"
    );
}

/// Ranks whose transfers use different MTUs cut tensors into different blocks: the
/// all-reduce fails at every rank with an error naming the peer (the transport refuses a
/// flow whose size does not match), reliable or lossy, never a silent mix of layouts.
#[test]
fn ranks_with_different_mtus_get_an_error_not_a_silent_mix() {
    use gradwire::message::LossBound;
    use gradwire_collective::error::CollectiveError;
    use gradwire_collective::link::MemLinkConfig;
    let mem = MemLinkConfig {
        max_datagram: 9000,
        ..MemLinkConfig::default()
    };
    for (elems, bound) in [(100_000, 0.0), (100_000, 0.05), (5_000, 0.05), (300, 0.05)] {
        let links = Links::in_memory(2, &ring_edges(2), &mem).unwrap();
        let results: Vec<Result<Vec<f32>, CollectiveError>> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .map(|l| {
                    s.spawn(move || {
                        let r = l.rank();
                        let mut ccfg = CommConfig {
                            op_timeout: Duration::from_secs(3),
                            ..CommConfig::default()
                        };
                        ccfg.transfer.mtu = if r == 0 { 1500 } else { 4000 };
                        ccfg.transfer.idle_timeout = Duration::from_secs(3);
                        let mut comm = Communicator::new(l, JOB, ccfg).unwrap();
                        let mut t = Tensor::from_f32(&vec![r as f32 + 1.0; elems]);
                        let o = AllReduceOptions {
                            loss_bound: Some(LossBound::from_fraction(bound).unwrap()),
                            ..AllReduceOptions::default()
                        };
                        comm.all_reduce(&mut t, &o)?;
                        Ok(t.as_f32().unwrap().to_vec())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut why = false;
        for (r, res) in results.iter().enumerate() {
            match res {
                Err(e @ CollectiveError::Link { peer, .. }) => {
                    assert_eq!(*peer, 1 - r, "{elems} elems, p {bound}: rank {r}: {e}");
                    let m = e.to_string();
                    why |= m.contains("SizeMismatch") || m.contains("BadSegmentLayout");
                }
                other => panic!(
                    "{elems} elems, p {bound}: rank {r}: {:?}",
                    other.as_ref().map(|v| v.len())
                ),
            }
        }
        assert!(
            why,
            "{elems} elems, p {bound}: no rank says the layouts differ: {results:?}"
        );
    }
}

/// Two ranks (on 127.64.0.1 and .2) set up their ring links and all-reduce, after `before`
/// ran with rank 1's control port for rank 0's link; what each rank got (or its error).
fn ring_of_two_after(before: impl FnOnce(SocketAddr)) -> Vec<Result<Vec<f32>, String>> {
    let (pending, table, _, port) = two_ranks(Duration::from_secs(4));
    before(SocketAddr::new(ip(2), port));
    std::thread::scope(|s| {
        let hs: Vec<_> = pending
            .into_iter()
            .map(|p| {
                let table = table.clone();
                s.spawn(move || -> Result<Vec<f32>, String> {
                    let links = p.finish(&table).map_err(|e| e.to_string())?;
                    let r = links.rank();
                    let ccfg = CommConfig {
                        op_timeout: Duration::from_secs(4),
                        ..CommConfig::default()
                    };
                    let mut comm =
                        Communicator::new(links, JOB, ccfg).map_err(|e| e.to_string())?;
                    let mut t = Tensor::from_f32(&[r as f32 + 1.0; 300]);
                    comm.all_reduce(&mut t, &AllReduceOptions::default())
                        .map_err(|e| e.to_string())?;
                    Ok(t.as_f32().unwrap().to_vec())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn all_three(sums: &[Result<Vec<f32>, String>]) -> bool {
    sums.iter()
        .all(|v| v.as_ref().is_ok_and(|v| v.iter().all(|&x| x == 3.0)))
}

/// A process on rank 0's own host (its address) that completes a plain handshake on rank
/// 1's listener for rank 0's link before rank 0 does is not taken for rank 0: the listener
/// wants the link's token, which only the job's endpoint table holds.
#[test]
fn a_process_on_a_ranks_own_address_cannot_become_that_rank() {
    let mut stranger = None;
    let sums = ring_of_two_after(|to| {
        stranger = Some(TcpCtrl::connect_from(
            Some(ip(1)),
            to,
            Duration::from_secs(2),
            None,
            None,
        ));
    });
    let stranger = stranger.unwrap();
    assert!(
        matches!(stranger, Err(ChannelError::Refused { .. })),
        "the stranger's plain handshake completed: {:?}",
        stranger.map(|_| ())
    );
    assert!(all_three(&sums), "{sums:?}");
}

/// A scan that keeps completing plain handshakes on a link's listener while the ranks set up
/// (filling its queue of completed connections) does not crowd out the real peer: without
/// the link's token none completes.
#[test]
fn a_scan_of_plain_hellos_does_not_crowd_out_the_real_peer() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let (stop, completed) = (AtomicBool::new(false), AtomicUsize::new(0));
    let mut first = Vec::new(); // the first scan's connections, open until the end
    let sums = std::thread::scope(|s| {
        let sums = ring_of_two_after(|to| {
            let (stop, completed) = (&stop, &completed);
            // Saturate the queue before the ranks start, then keep it full.
            let scan = move || {
                let mut held = Vec::new();
                while !stop.load(Ordering::Relaxed) && held.len() < 200 {
                    match TcpCtrl::connect_from(Some(ip(3)), to, Duration::from_secs(1), None, None)
                    {
                        Ok(c) => {
                            completed.fetch_add(1, Ordering::Relaxed);
                            held.push(c);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            };
            for _ in 0..20 {
                if let Ok(c) =
                    TcpCtrl::connect_from(Some(ip(3)), to, Duration::from_secs(1), None, None)
                {
                    completed.fetch_add(1, Ordering::Relaxed);
                    first.push(c);
                }
            }
            s.spawn(scan);
        });
        stop.store(true, Ordering::Relaxed);
        sums
    });
    let completed = completed.load(Ordering::Relaxed);
    assert!(
        all_three(&sums),
        "{completed} scan handshakes completed: {sums:?}"
    );
    assert_eq!(
        completed, 0,
        "{completed} scan connections completed the handshake"
    );
    drop(first);
}
