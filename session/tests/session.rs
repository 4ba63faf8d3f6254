//! Sessions of several ranks as threads on 127.0.0.1: both set-up paths, every operation,
//! loss within a bound, and the errors a caller can cause.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire_session::{
    DType, Endpoint, ErrorKind, P2pOptions, ReduceOp, ReduceOptions, SegmentInfo, Session,
    SessionConfig, SessionError, Tag,
};

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn config(rank: usize, world: usize) -> SessionConfig {
    SessionConfig {
        timeout: Duration::from_secs(10),
        ..SessionConfig::new(rank, world, LOCAL)
    }
}

/// Run `f` on every rank of a `world`-rank job set up in two phases, the table exchanged
/// through channels (a stand-in for the caller's all-gather).
fn with_sessions<T: Send + 'static>(
    world: usize,
    tweak: impl Fn(&mut SessionConfig) + Sync,
    f: impl Fn(&mut Session) -> T + Sync,
) -> Vec<T> {
    let endpoints: Vec<Endpoint> = (0..world)
        .map(|r| {
            let mut c = config(r, world);
            tweak(&mut c);
            Endpoint::bind(c).unwrap()
        })
        .collect();
    let table: Vec<Vec<u8>> = endpoints.iter().map(|e| e.address().to_vec()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = endpoints
            .into_iter()
            .map(|e| {
                let table = table.clone();
                let f = &f;
                s.spawn(move || {
                    let mut session = e.connect(&table).unwrap();
                    f(&mut session)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn input(rank: usize, e: usize) -> f32 {
    ((rank * 7 + e * 3) % 11) as f32
}

#[test]
fn all_reduce_broadcast_barrier_and_p2p_are_exact_when_reliable() {
    let n = 3;
    let elems = 10_000;
    let out = with_sessions(
        n,
        |_| {},
        |s| {
            let r = s.rank();
            let mut buf = f32_bytes(&(0..elems).map(|e| input(r, e)).collect::<Vec<_>>());
            let rep = s
                .all_reduce(DType::F32, &mut buf, &ReduceOptions::default())
                .unwrap();
            assert_eq!(rep.elems, elems);
            assert_eq!(rep.complete_blocks, rep.blocks);
            assert_eq!(rep.block_delivered.len(), rep.blocks);
            assert!(rep.block_delivered.iter().all(|&d| d == 1.0));
            let sum = f32s(&buf);

            let mut avg = f32_bytes(&(0..elems).map(|e| input(r, e)).collect::<Vec<_>>());
            let o = ReduceOptions {
                op: ReduceOp::Average,
                layer: 1,
                num_layers: 4,
                ..ReduceOptions::default()
            };
            s.all_reduce(DType::F32, &mut avg, &o).unwrap();

            let mut b = if r == 1 {
                f32_bytes(&[4.5; 333])
            } else {
                f32_bytes(&[0.0; 333])
            };
            let br = s.broadcast(1, DType::F32, &mut b, &o).unwrap();
            assert_eq!(br.received_blocks, br.blocks);
            s.barrier().unwrap();

            // Rank 0 sends rank 2 one tensor with a caller's priority function.
            let opts = P2pOptions {
                tensor: 9,
                ..P2pOptions::default()
            };
            let got = match r {
                0 => {
                    let prio = |seg: &SegmentInfo<'_>| Tag {
                        dscp: if seg.index == 0 { 46 } else { 10 },
                        ect: true,
                    };
                    let t = f32_bytes(&(0..5000).map(|e| e as f32).collect::<Vec<_>>());
                    let sent = s.send(2, DType::F32, &t, &opts, Some(&prio)).unwrap();
                    assert_eq!(sent.bytes, 20_000);
                    None
                }
                2 => {
                    let mut t = vec![0u8; 20_000];
                    let rep = s.recv(0, DType::F32, &mut t, &opts).unwrap();
                    assert_eq!(rep.received_segments, rep.segments);
                    Some(f32s(&t))
                }
                _ => None,
            };
            (sum, f32s(&avg), f32s(&b), got)
        },
    );
    let want: Vec<f32> = (0..elems)
        .map(|e| (0..n).map(|r| input(r, e)).sum())
        .collect();
    for (sum, avg, b, got) in &out {
        assert_eq!(sum, &want);
        for (a, w) in avg.iter().zip(&want) {
            assert!((a - w / n as f32).abs() <= 1e-6 * w.abs().max(1.0));
        }
        assert!(b.iter().all(|&x| x == 4.5));
        if let Some(got) = got {
            assert_eq!(got, &(0..5000).map(|e| e as f32).collect::<Vec<_>>());
        }
    }
    assert!(out[2].3.is_some());
}

#[test]
fn gradwires_own_rendezvous_sets_up_a_session() {
    let port = TcpListener::bind((LOCAL, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = SocketAddr::new(LOCAL, port);
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let mut c = config(r, 2);
                    c.point_to_point = false;
                    let mut sess = Session::rendezvous(c, master).unwrap();
                    let mut b = f32_bytes(&[r as f32 + 1.0; 100]);
                    sess.all_reduce(DType::F32, &mut b, &ReduceOptions::default())
                        .unwrap();
                    f32s(&b)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(sums.iter().all(|v| v.iter().all(|&x| x == 3.0)));
}

#[test]
fn loss_within_the_bound_is_reported_per_block() {
    let bound = 0.05;
    let reports = with_sessions(
        4,
        |c| {
            c.inject_loss = 0.03;
            c.seed = 7;
        },
        |s| {
            let mut b = f32_bytes(&vec![1.0; 200_000]);
            let o = ReduceOptions {
                op: ReduceOp::Average,
                loss_bound: Some(bound),
                ..ReduceOptions::default()
            };
            let rep = s.all_reduce(DType::F32, &mut b, &o).unwrap();
            // An average over whoever contributed to a block of all-ones is one.
            assert!(f32s(&b).iter().all(|&x| x == 1.0));
            rep
        },
    );
    for rep in &reports {
        assert!(
            rep.delivered_fraction >= 1.0 - 2.0 * bound - 1e-9,
            "{rep:?}"
        );
        let mean = rep.block_delivered.iter().sum::<f64>() / rep.blocks as f64;
        assert!((mean - rep.delivered_fraction).abs() < 1e-9);
        assert!(rep.rank_delivered.iter().all(|&d| d > 0.8));
    }
    assert!(
        reports.iter().any(|r| r.complete_blocks < r.blocks),
        "3 % injected loss with a 5 % bound should leave some blocks short: {reports:?}"
    );
}

#[test]
fn bad_configuration_and_buffers_are_invalid_arguments() {
    let kind = |c: SessionConfig| Endpoint::bind(c).unwrap_err().kind();
    assert_eq!(kind(config(2, 2)), ErrorKind::InvalidArgument);
    // A world beyond any job (an uninitialised field) is refused before anything is built.
    assert_eq!(kind(config(0, usize::MAX)), ErrorKind::InvalidArgument);
    assert_eq!(
        kind(SessionConfig {
            loss_bound: 1.0,
            ..config(0, 2)
        }),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        kind(SessionConfig {
            secret: Some(b"short".to_vec()),
            ..config(0, 2)
        }),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        kind(SessionConfig {
            ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            ..config(0, 2)
        }),
        ErrorKind::InvalidArgument
    );
    // An address that is not this host's.
    let e = Endpoint::bind(SessionConfig {
        ip: "198.19.255.1".parse().unwrap(),
        ..config(0, 2)
    })
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Setup, "{e}");

    // A table whose other entry is another job's.
    let a = Endpoint::bind(config(0, 2)).unwrap();
    let other = Endpoint::bind(SessionConfig {
        job: 2,
        ..config(1, 2)
    })
    .unwrap();
    let table = vec![a.address().to_vec(), other.address().to_vec()];
    let e = a.connect(&table).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Setup);
    assert!(e.to_string().contains("same job id"), "{e}");

    // A table out of rank order.
    let a = Endpoint::bind(config(0, 2)).unwrap();
    let b = Endpoint::bind(config(1, 2)).unwrap();
    let table = vec![b.address().to_vec(), a.address().to_vec()];
    let e = a.connect(&table).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Setup);
    assert!(e.to_string().contains("order the table by rank"), "{e}");

    let errs = with_sessions(
        1,
        |_| {},
        |s| {
            let mut odd = vec![0u8; 7];
            let e1 = s
                .all_reduce(DType::F32, &mut odd, &ReduceOptions::default())
                .unwrap_err();
            let e2 = s
                .all_reduce(DType::Raw, &mut odd, &ReduceOptions::default())
                .unwrap_err();
            let mut ok = vec![0u8; 8];
            let e3 = s
                .all_reduce(
                    DType::F32,
                    &mut ok,
                    &ReduceOptions {
                        layer: 5,
                        num_layers: 2,
                        ..ReduceOptions::default()
                    },
                )
                .unwrap_err();
            let e4 = s
                .send(0, DType::F32, &ok, &P2pOptions::default(), None)
                .unwrap_err();
            [e1, e2, e3, e4].map(|e| (e.kind(), e.to_string()))
        },
    );
    for (k, m) in &errs[0] {
        assert_eq!(*k, ErrorKind::InvalidArgument, "{m}");
    }
}

#[test]
fn a_peer_that_never_comes_is_an_error_within_the_timeout() {
    let c = SessionConfig {
        timeout: Duration::from_secs(2),
        ..config(0, 2)
    };
    let a = Endpoint::bind(c).unwrap();
    let b = Endpoint::bind(config(1, 2)).unwrap();
    let table = vec![a.address().to_vec(), b.address().to_vec()];
    drop(b); // rank 1 dies before connecting
    let started = Instant::now();
    let e = a.connect(&table).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(
        matches!(e.kind(), ErrorKind::Peer | ErrorKind::Setup),
        "{e}"
    );
}

#[test]
fn a_rank_that_dies_mid_job_fails_the_others_with_its_name() {
    let endpoints: Vec<Endpoint> = (0..3)
        .map(|r| {
            Endpoint::bind(SessionConfig {
                timeout: Duration::from_secs(3),
                ..config(r, 3)
            })
            .unwrap()
        })
        .collect();
    let table: Vec<Vec<u8>> = endpoints.iter().map(|e| e.address().to_vec()).collect();
    let (tx, rx) = mpsc::channel::<(usize, Result<(), SessionError>, Duration)>();
    std::thread::scope(|s| {
        for e in endpoints {
            let table = table.clone();
            let tx = tx.clone();
            s.spawn(move || {
                let mut sess = e.connect(&table).unwrap();
                let r = sess.rank();
                let mut b = f32_bytes(&[1.0; 50_000]);
                sess.all_reduce(DType::F32, &mut b, &ReduceOptions::default())
                    .unwrap();
                if r == 2 {
                    return; // dies: its session is dropped, links closed
                }
                let started = Instant::now();
                let res = sess
                    .all_reduce(DType::F32, &mut b, &ReduceOptions::default())
                    .map(|_| ());
                tx.send((r, res, started.elapsed())).unwrap();
                // Unusable after a failure.
                let again = sess.barrier().unwrap_err();
                assert_eq!(again.kind(), ErrorKind::Unusable, "{again}");
            });
        }
    });
    drop(tx);
    let results: Vec<_> = rx.iter().collect();
    assert_eq!(results.len(), 2);
    for (r, res, took) in results {
        let e = res.expect_err("a dead peer must fail the operation");
        assert!(took < Duration::from_secs(10), "rank {r} took {took:?}");
        assert_eq!(e.kind(), ErrorKind::Peer, "rank {r}: {e}");
        assert!(e.peer().is_some());
        if r == 0 {
            // Rank 0 receives from rank 2 in the ring: the dead rank is named.
            assert_eq!(e.peer(), Some(2), "{e}");
        }
    }
}

#[test]
fn ranks_on_different_addresses_of_one_host_connect_from_their_own() {
    // Two loopback addresses of this host: each rank's connections must come from its own
    // address, or the peer refuses them as a stranger's.
    let cfg = |r: usize| SessionConfig {
        timeout: Duration::from_secs(5),
        ..SessionConfig::new(r, 2, IpAddr::V4(Ipv4Addr::new(127, 61, 0, r as u8 + 1)))
    };
    let endpoints: Vec<Endpoint> = (0..2).map(|r| Endpoint::bind(cfg(r)).unwrap()).collect();
    let table: Vec<Vec<u8>> = endpoints.iter().map(|e| e.address().to_vec()).collect();
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = endpoints
            .into_iter()
            .map(|e| {
                let table = table.clone();
                s.spawn(move || {
                    let mut sess = e.connect(&table).unwrap();
                    let mut b = f32_bytes(&[sess.rank() as f32 + 1.0; 64]);
                    sess.all_reduce(DType::F32, &mut b, &ReduceOptions::default())
                        .unwrap();
                    f32s(&b)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(sums.iter().all(|v| v.iter().all(|&x| x == 3.0)));
}
