//! The algorithms over real endpoints on 127.0.0.1, one thread per rank.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::time::Duration;

use gradwire::tensor::DType;

use crate::aggregate::ReduceOp;
use crate::comm::TensorMut;
use crate::deadline::{StepDeadline, MIN_SAMPLES};
use crate::group::{AllReduceAlgo, Group, GroupConfig, GroupReduceOptions, PendingGroup};
use gradwire_msg::mem::Region;

const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Runs `f(group)` on `world` ranks; returns each rank's result in rank order.
pub(crate) fn with_groups<T: Send + 'static>(
    world: usize,
    tweak: impl Fn(&mut GroupConfig) + Send + Sync + Clone + 'static,
    f: impl Fn(Group) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let (addr_tx, addr_rx) = mpsc::channel();
    let mut table_txs = Vec::new();
    let mut threads = Vec::new();
    for rank in 0..world {
        let (ttx, trx) = mpsc::channel::<Vec<SocketAddr>>();
        table_txs.push(ttx);
        let addr_tx = addr_tx.clone();
        let (f, tweak) = (f.clone(), tweak.clone());
        threads.push(std::thread::spawn(move || {
            let mut cfg = GroupConfig::new(7, rank, world, LO, Duration::from_secs(5));
            tweak(&mut cfg);
            let pending = PendingGroup::bind(cfg).expect("bind");
            addr_tx.send((rank, pending.address())).expect("address");
            let table = trx.recv().expect("table");
            f(pending.start(table).expect("start"))
        }));
    }
    let mut table = vec![SocketAddr::new(LO, 0); world];
    for _ in 0..world {
        let (r, a) = addr_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("addresses");
        table[r] = a;
    }
    for t in &table_txs {
        t.send(table.clone()).expect("send table");
    }
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn vals(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Rank r's element i: (r + 1) * (i mod 7 + 1), so sums are exact.
fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((rank + 1) * (i % 7 + 1)) as f32).collect()
}

fn expected_sum(world: usize, n: usize) -> Vec<f32> {
    let s = (world * (world + 1) / 2) as f32;
    (0..n).map(|i| s * (i % 7 + 1) as f32).collect()
}

#[test]
fn every_algorithm_sums_and_averages_exactly_for_every_world_and_size() {
    for world in [1usize, 2, 3, 5] {
        for n in [0usize, 1, 357, 358, 1000, 100_003] {
            for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Direct] {
                for op in [ReduceOp::Sum, ReduceOp::Average] {
                    let out = with_groups(
                        world,
                        |_| {},
                        move |g| {
                            let mut b = f32s(&input(g.rank(), n));
                            let o = GroupReduceOptions {
                                op,
                                algorithm: algo,
                                ..GroupReduceOptions::default()
                            };
                            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                            let r = g.all_reduce(t, &o).expect("all-reduce");
                            assert_eq!(r.complete_blocks, r.blocks);
                            vals(&b)
                        },
                    );
                    let mut want = expected_sum(world, n);
                    if op == ReduceOp::Average {
                        want.iter_mut().for_each(|x| *x /= world as f32);
                    }
                    for (r, got) in out.iter().enumerate() {
                        assert_eq!(got, &want, "world {world} n {n} {algo:?} {op:?} rank {r}");
                    }
                }
            }
        }
    }
}

/// What one rank of [`lossy_sum`] ended with.
struct Lossy {
    vals: Vec<f32>,
    sets: Vec<Vec<usize>>,
    complete: usize,
    blocks: usize,
    per_block: usize,
    stats: gradwire_msg::endpoint::EndpointStats,
}

/// Sums each rank's `input` of `n` elements over `world` ranks on loopback under `o`, with
/// `loss` of the data packets dropped at the receivers (seed `seed`).
fn lossy_sum(world: usize, n: usize, loss: f64, seed: u64, o: GroupReduceOptions) -> Vec<Lossy> {
    with_groups(
        world,
        move |c| {
            c.endpoint.inject_loss = loss;
            c.endpoint.seed = seed;
        },
        move |g| {
            let mut b = f32s(&input(g.rank(), n));
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let r = g.all_reduce(t, &o).expect("all-reduce");
            let c = r
                .contributors
                .expect("a lossy reduction reports contributors");
            Lossy {
                sets: (0..c.blocks()).map(|b| c.ranks(b)).collect(),
                complete: r.complete_blocks,
                blocks: r.blocks,
                per_block: g.block_bytes() / 4,
                stats: g.stats(),
                vals: vals(&b),
            }
        },
    )
}

#[test]
fn under_loss_every_rank_ends_with_the_same_values_and_sets() {
    for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Direct] {
        let world = 4;
        let n = 200_000;
        let o = GroupReduceOptions {
            op: ReduceOp::Sum,
            loss_bound: 0.1,
            algorithm: algo,
            ..GroupReduceOptions::default()
        };
        let out: Vec<_> = lossy_sum(world, n, 0.05, 11, o)
            .into_iter()
            .map(|l| (l.vals, l.sets, l.complete, l.blocks, l.stats))
            .collect();
        let want = expected_sum(world, n);
        for (rank, (v, sets, complete, blocks, stats)) in out.iter().enumerate() {
            assert_eq!(
                v, &out[0].0,
                "{algo:?}: rank {rank} holds other values than rank 0"
            );
            assert_eq!(sets, &out[0].1, "{algo:?}: rank {rank} holds other sets");
            assert!(stats.injected_drops > 0, "no loss was injected");
            assert!(
                complete < blocks,
                "{algo:?}: 5 % loss under a 10 % bound left no block short"
            );
            // A short block is the sum over its contributors scaled to the world.
            let per_block = 1432 / 4;
            for (b, set) in sets.iter().enumerate() {
                assert!(!set.is_empty(), "block {b} has no contributor");
                let scale = world as f32 / set.len() as f32;
                let sub: f32 = set.iter().map(|r| (r + 1) as f32).sum();
                for i in b * per_block..((b + 1) * per_block).min(n) {
                    let exact = sub * (i % 7 + 1) as f32 * scale;
                    assert!(
                        (v[i] - exact).abs() <= 1e-3 * exact.abs(),
                        "{algo:?} element {i}: {} not {} (block {b}, set {set:?})",
                        v[i],
                        exact
                    );
                    if set.len() == world {
                        assert_eq!(v[i], want[i]);
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_barrier_and_point_to_point() {
    let world = 5;
    let out = with_groups(
        world,
        |_| {},
        move |g| {
            let r = g.rank();
            let mut b = if r == 2 {
                vec![7u8; 100_000]
            } else {
                vec![0u8; 100_000]
            };
            let got = g.broadcast(&mut b, 2, 0.0).expect("broadcast");
            assert!(got.iter().all(|&x| x), "a reliable broadcast missed blocks");
            for _ in 0..3 {
                g.barrier().expect("barrier");
            }
            // A ring of point-to-point transfers: even ranks send first.
            let next = (r + 1) % world;
            let prev = (r + world - 1) % world;
            let mine = vec![r as u8; 5000];
            let mut got = vec![0u8; 5000];
            if r % 2 == 0 {
                g.send(next, &mine, 9, 0, Vec::new()).expect("send");
                g.recv(prev, &mut got, 9, 0.0).expect("recv");
            } else {
                g.recv(prev, &mut got, 9, 0.0).expect("recv");
                g.send(next, &mine, 9, 0, Vec::new()).expect("send");
            }
            (b, got)
        },
    );
    for (r, (b, got)) in out.iter().enumerate() {
        assert!(
            b.iter().all(|&x| x == 7),
            "rank {r} did not get the broadcast"
        );
        assert!(got
            .iter()
            .all(|&x| usize::from(x) == (r + world - 1) % world));
    }
}

#[test]
fn reduce_scatter_then_all_gather_is_an_all_reduce() {
    let world = 3;
    let n = 50_000;
    let out = with_groups(
        world,
        |_| {},
        move |g| {
            let mut b = f32s(&input(g.rank(), n));
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            g.reduce_scatter(t, &GroupReduceOptions::default())
                .expect("reduce-scatter");
            let mine = g.chunk(b.len(), g.rank());
            let want = f32s(&expected_sum(world, n));
            assert_eq!(b[mine.clone()], want[mine], "rank {}'s chunk", g.rank());
            g.all_gather(&mut b).expect("all-gather");
            vals(&b)
        },
    );
    for v in out {
        assert_eq!(v, expected_sum(world, n));
    }
}

#[test]
fn operations_in_flight_together_complete_with_their_own_results() {
    let world = 3;
    let out = with_groups(
        world,
        |_| {},
        move |g| {
            let handles: Vec<_> = (0..6)
                .map(|k| {
                    let v: Vec<f32> = vec![(g.rank() * 10 + k) as f32; 10_000 * (k + 1)];
                    g.start_all_reduce(
                        DType::F32,
                        Region::owned(f32s(&v)),
                        &GroupReduceOptions::default(),
                    )
                    .expect("submit")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    let o = h.wait().expect("all-reduce");
                    vals(
                        &o.region
                            .and_then(|r| r.into_vec())
                            .expect("owned buffer back"),
                    )
                })
                .collect::<Vec<_>>()
        },
    );
    for per_rank in out {
        for (k, v) in per_rank.iter().enumerate() {
            let want = (0..world).map(|r| (r * 10 + k) as f32).sum::<f32>();
            assert_eq!(v.len(), 10_000 * (k + 1));
            assert!(v.iter().all(|&x| x == want), "operation {k}");
        }
    }
}

#[test]
fn min_max_and_product_are_exact_and_refuse_a_loss_bound() {
    let world = 3;
    let out = with_groups(
        world,
        |_| {},
        move |g| {
            let r = g.rank() as f32;
            let v: Vec<f32> = (0..5000).map(|i| (i % 7) as f32 - r).collect();
            let mut got = Vec::new();
            for (op, algo) in [
                (ReduceOp::Min, AllReduceAlgo::Ring),
                (ReduceOp::Max, AllReduceAlgo::Direct),
                (ReduceOp::Product, AllReduceAlgo::Ring),
            ] {
                let mut b = f32s(&v);
                let o = GroupReduceOptions {
                    op,
                    algorithm: algo,
                    ..GroupReduceOptions::default()
                };
                g.all_reduce(TensorMut::new(DType::F32, &mut b).unwrap(), &o)
                    .expect("reduce");
                got.push(vals(&b));
            }
            let lossy = GroupReduceOptions {
                op: ReduceOp::Max,
                loss_bound: 0.1,
                ..GroupReduceOptions::default()
            };
            let mut b = f32s(&v);
            let refused = g
                .all_reduce(TensorMut::new(DType::F32, &mut b).unwrap(), &lossy)
                .unwrap_err()
                .to_string();
            (got, refused)
        },
    );
    for (got, refused) in out {
        for (i, ((mn, mx), pr)) in got[0].iter().zip(&got[1]).zip(&got[2]).enumerate() {
            let x = (i % 7) as f32;
            assert_eq!(*mn, x - 2.0);
            assert_eq!(*mx, x);
            assert_eq!(*pr, x * (x - 1.0) * (x - 2.0));
        }
        assert!(refused.contains("reliable only"), "{refused}");
    }
}

#[test]
fn started_operations_of_every_kind_run_together_and_drop_cancels() {
    let world = 3;
    let out = with_groups(
        world,
        |_| {},
        move |g| {
            let (rank, n) = (g.rank(), 3000usize);
            let bb = g.block_bytes();
            let reduce = g
                .start_all_reduce(
                    DType::F32,
                    Region::owned(f32s(&input(rank, n))),
                    &GroupReduceOptions::default(),
                )
                .unwrap();
            let mut gather = vec![0u8; world * 2 * bb];
            let mine = g.chunk(gather.len(), rank);
            gather[mine].fill(rank as u8 + 1);
            let gather = g.start_all_gather(Region::owned(gather)).unwrap();
            let bcast = vec![if rank == 1 { 9u8 } else { 0 }; 5000];
            let bcast = g.start_broadcast(Region::owned(bcast), 1, 0.0).unwrap();
            let next = (rank + 1) % world;
            let prev = (rank + world - 1) % world;
            let send = g
                .start_send(next, Region::owned(vec![rank as u8; 7000]), 4, Vec::new())
                .unwrap();
            let recv = g
                .start_recv(prev, Region::owned(vec![0; 7000]), 0.0)
                .unwrap();
            let barrier = g.start_barrier().unwrap();
            let refused = g
                .start_recv(rank, Region::owned(vec![0; 8]), 0.0)
                .unwrap_err();
            // A receive nobody sends to, dropped: cancelled and waited for, not hung.
            let orphan = g
                .start_recv(prev, Region::owned(vec![0; 100]), 0.0)
                .unwrap();
            let back = |o: crate::algo::ReduceOutcome| o.region.and_then(|r| r.into_vec()).unwrap();
            let reduced = vals(&back(reduce.wait().unwrap()));
            let gathered = back(gather.wait().unwrap());
            let b = bcast.wait().unwrap();
            send.wait().unwrap();
            let (region, _) = recv.wait_tensor(prev, 4).unwrap();
            barrier.wait().unwrap();
            let t = std::time::Instant::now();
            drop(orphan);
            assert!(t.elapsed() < Duration::from_secs(4));
            (
                reduced,
                gathered,
                b.received.iter().all(|&x| x),
                region.and_then(|r| r.into_vec()).unwrap(),
                refused.to_string(),
                bb,
                prev,
            )
        },
    );
    for (reduced, gathered, got_bcast, received, refused, bb, prev) in out {
        assert_eq!(reduced, expected_sum(world, 3000));
        for r in 0..world {
            assert!(gathered[r * 2 * bb..(r + 1) * 2 * bb]
                .iter()
                .all(|&x| x == r as u8 + 1));
        }
        assert!(got_bcast);
        assert!(received.iter().all(|&x| x == prev as u8));
        assert!(refused.contains("not another rank"), "{refused}");
    }
}

#[test]
fn a_started_operation_outliving_its_group_fails_and_the_group_closes() {
    let out = with_groups(
        2,
        |_| {},
        move |g| {
            let peer = 1 - g.rank();
            let pending = g
                .start_recv(peer, Region::owned(vec![0; 100]), 0.0)
                .unwrap();
            let t = std::time::Instant::now();
            drop(g); // the progress thread stops although the handle holds a sender
            let err = pending.wait().unwrap_err().to_string();
            (t.elapsed(), err)
        },
    );
    for (took, err) in out {
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(err.contains("shut down"), "{err}");
    }
}

#[test]
fn a_dead_rank_is_named_within_the_timeout_not_waited_for() {
    let world = 3;
    let out = with_groups(
        world,
        |c| c.endpoint.core.peer_timeout = Duration::from_millis(500),
        move |g| {
            if g.rank() == 1 {
                drop(g); // dies before the operation
                return None;
            }
            let started = std::time::Instant::now();
            let mut b = f32s(&input(g.rank(), 10_000));
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let e = g
                .all_reduce(t, &GroupReduceOptions::default())
                .expect_err("rank 1 is dead");
            Some((e.to_string(), started.elapsed()))
        },
    );
    for (rank, r) in out.into_iter().enumerate() {
        if let Some((e, took)) = r {
            assert!(e.contains("rank 1"), "rank {rank}: {e}");
            assert!(took < Duration::from_secs(5), "rank {rank} waited {took:?}");
        }
    }
}

/// Rank 1 of a two-rank two-phase all-reduce that sends its finished chunk with a forged
/// contributor set.
struct ForgedDirect {
    forged: u64,
    left: usize,
}

impl gradwire_msg::op::Op for ForgedDirect {
    type Output = ();

    fn start(&mut self, cx: &mut gradwire_msg::op::OpCx<'_>) -> gradwire_msg::op::Step<()> {
        use gradwire_msg::core::{Place, RecvOpts, SendOpts};
        let n = 20_000 * 4;
        let chunks = super::Chunks::new(n, cx.seg_payload(), 2);
        let buf = cx.register(gradwire_msg::mem::Region::owned(f32s(&vec![1.0; 20_000])));
        let sb = cx.reserve_sends(0, 2)?;
        let rb = cx.reserve_recvs(0, 2)?;
        let sum = RecvOpts {
            place: Place::Reduce(gradwire_msg::reduce::Combine::Sum, DType::F32),
            loss_bound: 0.1,
            ..RecvOpts::default()
        };
        cx.recv(0, rb, buf, chunks.bytes(1), sum)?;
        cx.recv(0, rb + 1, buf, chunks.bytes(0), RecvOpts::default())?;
        // Phase 1 is genuine (its set is exactly {1}); phase 2, rank 1's finished chunk, is not.
        let genuine = SendOpts {
            meta: vec![0b10; chunks.block_range(0).len()],
            ..SendOpts::default()
        };
        cx.send(0, sb, buf, chunks.bytes(0), genuine)?;
        let forged = SendOpts {
            meta: vec![self.forged; chunks.block_range(1).len()],
            ..SendOpts::default()
        };
        cx.send(0, sb + 1, buf, chunks.bytes(1), forged)?;
        self.left = 4;
        Ok(None)
    }

    fn on_event(
        &mut self,
        _ev: gradwire_msg::op::OpEvent,
        _cx: &mut gradwire_msg::op::OpCx<'_>,
    ) -> gradwire_msg::op::Step<()> {
        self.left -= 1;
        Ok((self.left == 0).then_some(()))
    }
}

#[test]
fn forged_contributor_sets_fail_the_reduction_naming_the_sender() {
    // Beyond the world; leaving out the sender itself.
    for forged in [0b110u64, 0b01] {
        let quick = |c: &mut GroupConfig| c.endpoint.core.peer_timeout = Duration::from_secs(1);
        let out = with_groups(2, quick, move |g| {
            if g.rank() == 1 {
                // Rank 0 gives up on the forged sets, so this rank may not hear its DONE.
                let _ = g.run_op_for_tests(ForgedDirect { forged, left: 0 });
                return None;
            }
            let mut b = f32s(&vec![1.0; 20_000]);
            let o = GroupReduceOptions {
                loss_bound: 0.1,
                algorithm: AllReduceAlgo::Direct,
                ..GroupReduceOptions::default()
            };
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let e = g
                .all_reduce(t, &o)
                .expect_err("forged sets must be refused");
            let again = g.barrier().expect_err("unusable after a failure");
            Some((e.to_string(), again.to_string()))
        });
        let (e, again) = out[0].clone().expect("rank 0's result");
        assert!(
            e.contains("rank 1 sent invalid aggregation data"),
            "{forged:#b}: {e}"
        );
        assert!(again.contains("failed earlier"), "{again}");
    }
}

#[test]
fn a_step_deadline_ends_lossy_steps_and_the_ranks_still_agree() {
    // 30 % of data lost, a 1 % bound: only the 5 ms time bound can end the lossy steps early.
    for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Direct] {
        let world = 3;
        let n = 100_000;
        let out = with_groups(
            world,
            |c| {
                c.endpoint.inject_loss = 0.3;
                c.endpoint.seed = 5;
            },
            move |g| {
                let mut b = f32s(&input(g.rank(), n));
                let o = GroupReduceOptions {
                    loss_bound: 0.01,
                    algorithm: algo,
                    step_deadline: StepDeadline::Fixed(Duration::from_millis(5)),
                    ..GroupReduceOptions::default()
                };
                let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                let r = g.all_reduce(t, &o).expect("all-reduce");
                let c = r.contributors.expect("sets");
                let sets: Vec<Vec<usize>> = (0..c.blocks()).map(|b| c.ranks(b)).collect();
                (vals(&b), sets, r.steps)
            },
        );
        for (rank, (v, sets, steps)) in out.iter().enumerate() {
            assert_eq!(v, &out[0].0, "{algo:?}: rank {rank}'s values differ");
            assert_eq!(sets, &out[0].1, "{algo:?}: rank {rank}'s sets differ");
            assert_eq!(
                steps.len(),
                world - 1,
                "{algo:?}: one report per lossy receive"
            );
        }
        let by_deadline = out
            .iter()
            .flat_map(|o| &o.2)
            .filter(|s| s.ended == gradwire_msg::core::Ended::Deadline)
            .count();
        assert!(by_deadline > 0, "{algo:?}: no step ended by its deadline");
    }
}

#[test]
fn trees_sum_exactly_and_agree_under_loss() {
    use crate::tree::{Strategy, Tree};
    let world = 5;
    let racks = vec![0, 0, 0, 1, 1];
    for strategy in [Strategy::Star, Strategy::BINARY, Strategy::Rack] {
        for (loss, bound) in [(0.0, 0.0), (0.05, 0.1)] {
            let racks = racks.clone();
            let n = 150_000;
            let out = with_groups(
                world,
                move |c| {
                    c.endpoint.inject_loss = loss;
                    c.endpoint.seed = 3;
                },
                move |g| {
                    let members: Vec<usize> = (0..world).collect();
                    let tree = Tree::build(strategy, 0, &members, &racks).expect("tree");
                    let mut b = f32s(&input(g.rank(), n));
                    let o = GroupReduceOptions {
                        loss_bound: bound,
                        // Under loss, with the root's digest checked too.
                        verify_results: loss > 0.0,
                        ..GroupReduceOptions::default()
                    };
                    let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                    let r = g.all_reduce_tree(t, &tree, &o).expect("tree all-reduce");
                    let sets = r
                        .contributors
                        .map(|c| (0..c.blocks()).map(|b| c.ranks(b)).collect::<Vec<_>>());
                    (vals(&b), sets, r.complete_blocks, r.blocks)
                },
            );
            for (rank, (v, sets, complete, blocks)) in out.iter().enumerate() {
                assert_eq!(
                    v, &out[0].0,
                    "{strategy:?} loss {loss}: rank {rank} differs"
                );
                assert_eq!(sets, &out[0].1, "{strategy:?}: rank {rank}'s sets differ");
                if bound == 0.0 {
                    assert_eq!(
                        v,
                        &expected_sum(world, n),
                        "{strategy:?}: not the exact sum"
                    );
                    assert_eq!(complete, blocks);
                }
            }
        }
    }
}

#[test]
fn a_tensor_received_for_another_is_an_error_naming_both() {
    let out = with_groups(
        2,
        |_| {},
        move |g| {
            let mut b = vec![0u8; 3000];
            if g.rank() == 0 {
                g.send(1, &b, 4, 0, Vec::new())
                    .map(|_| String::new())
                    .unwrap_or_else(|e| e.to_string())
            } else {
                g.recv(0, &mut b, 5, 0.0)
                    .map(|_| String::new())
                    .unwrap_or_else(|e| e.to_string())
            }
        },
    );
    assert!(out[1].contains("rank 0 sent invalid aggregation data: it sent tensor 4 where this rank receives tensor 5"), "{}", out[1]);
}

#[test]
fn a_rank_whose_socket_closed_is_named_at_once_not_after_the_timeout() {
    let world = 3;
    let out = with_groups(
        world,
        |c| c.endpoint.core.peer_timeout = Duration::from_secs(20),
        move |g| {
            if g.rank() == 1 {
                drop(g); // its process "exits": the socket closes
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
            let started = std::time::Instant::now();
            let mut b = f32s(&input(g.rank(), 10_000));
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let e = g
                .all_reduce(t, &GroupReduceOptions::default())
                .expect_err("rank 1 is gone");
            Some((e.to_string(), started.elapsed()))
        },
    );
    for (rank, r) in out.into_iter().enumerate() {
        if let Some((e, took)) = r {
            // Named directly (its socket is closed) or through a survivor that gave up on it.
            assert!(
                e.starts_with("rank 1: ")
                    && (e.contains("rank 1's socket is closed") || e.contains("failed on rank 1")),
                "rank {rank}: {e}"
            );
            // At once when the kernel's ICMP answer comes; the kernel rate-limits ICMP
            // globally, so on a busy machine it may take a PING (a quarter of the timeout).
            // Either way well before the 20 s timeout, which is all the fallback would give.
            assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
        }
    }
}

#[test]
fn a_lossy_broadcast_says_which_blocks_hold_the_roots_values() {
    let world = 5;
    let out = with_groups(
        world,
        |c| {
            c.endpoint.inject_loss = 0.1;
            c.endpoint.seed = 8;
        },
        move |g| {
            let n = 200_000;
            let mine = g.rank() as u8 + 1;
            let mut b = if g.rank() == 0 {
                vec![9u8; n]
            } else {
                vec![mine; n]
            };
            let got = g.broadcast(&mut b, 0, 0.3).expect("broadcast");
            let seg = g.block_bytes();
            for (k, &held) in got.iter().enumerate() {
                let blk = &b[k * seg..((k + 1) * seg).min(n)];
                let want = if held { 9 } else { mine };
                assert!(
                    blk.iter().all(|&x| x == want),
                    "rank {} block {k}: held={held} but the bytes say otherwise",
                    g.rank()
                );
            }
            got.iter().filter(|&&h| !h).count()
        },
    );
    assert_eq!(out[0], 0, "the root holds everything");
    assert!(
        out.iter().skip(1).any(|&m| m > 0),
        "10 % loss under a 30 % bound lost nothing"
    );
    // A rank two hops down never has more than its relay plus its own loss: at least
    // consistent (checked per block above), and nothing beyond the bound per hop.
}

#[test]
fn lossy_reductions_of_tensors_smaller_than_the_world_agree_exactly() {
    // Fewer blocks than ranks: some chunks are empty. Nothing is lost here, so every block
    // must name every rank and hold the exact sum, whatever the bound.
    for world in [3usize, 4, 5] {
        for n in [1usize, 2, 357, 358, 1000] {
            for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Direct] {
                let out = with_groups(
                    world,
                    |_| {},
                    move |g| {
                        let mut b = f32s(&input(g.rank(), n));
                        let o = GroupReduceOptions {
                            loss_bound: 0.01,
                            algorithm: algo,
                            ..GroupReduceOptions::default()
                        };
                        let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                        let r = g.all_reduce(t, &o).expect("all-reduce");
                        (vals(&b), r.complete_blocks, r.blocks)
                    },
                );
                for (rank, (v, complete, blocks)) in out.iter().enumerate() {
                    let at = format!("world {world}, {n} elements, {algo:?}, rank {rank}");
                    assert_eq!(v, &expected_sum(world, n), "{at}");
                    assert_eq!(complete, blocks, "{at}");
                }
            }
        }
    }
}

#[test]
fn chunks_of_a_small_tensor_own_no_block_twice() {
    let c = super::Chunks::new(4, 1432, 4);
    assert_eq!(c.blocks(), 1);
    assert_eq!(c.block_range(0), 0..1);
    for k in 1..4 {
        assert!(
            c.bytes(k).is_empty() && c.block_range(k).is_empty(),
            "chunk {k}"
        );
    }
    let c = super::Chunks::new(1432 * 5 + 8, 1432, 4);
    let all: Vec<usize> = (0..4).flat_map(|k| c.block_range(k)).collect();
    assert_eq!(
        all,
        (0..6).collect::<Vec<_>>(),
        "each block in exactly one chunk"
    );
}

#[test]
fn a_time_bound_without_a_loss_bound_keeps_contributor_sets() {
    // Loss bound 0 but a 2 ms time bound under 30 % loss: steps end short, so the ranks must
    // track who is in each block, or they would silently average over missing data.
    let world = 3;
    let n = 60_000;
    let out = with_groups(
        world,
        |c| {
            c.endpoint.inject_loss = 0.3;
            c.endpoint.seed = 11;
        },
        move |g| {
            let mut b = f32s(&input(g.rank(), n));
            let o = GroupReduceOptions {
                algorithm: AllReduceAlgo::Ring,
                step_deadline: StepDeadline::Fixed(Duration::from_millis(2)),
                ..GroupReduceOptions::default()
            };
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let r = g.all_reduce(t, &o).expect("all-reduce");
            let c = r
                .contributors
                .expect("a time-bounded reduction reports its sets");
            let sets: Vec<Vec<usize>> = (0..c.blocks()).map(|b| c.ranks(b)).collect();
            (vals(&b), sets)
        },
    );
    for (rank, (v, sets)) in out.iter().enumerate() {
        assert_eq!(v, &out[0].0, "rank {rank}'s values differ");
        assert_eq!(sets, &out[0].1, "rank {rank}'s sets differ");
    }
}

#[test]
fn adaptive_time_bounds_learn_from_the_steps_and_the_ranks_still_agree() {
    // 20 % loss, a 1 % bound: every step needs passes. After MIN_SAMPLES steps the group
    // bounds each step by what it has seen; every operation's result still agrees.
    let world = 3;
    let n = 40_000;
    let ops = 8;
    let out = with_groups(
        world,
        |c| {
            c.endpoint.inject_loss = 0.2;
            c.endpoint.seed = 3;
        },
        move |g| {
            let o = GroupReduceOptions {
                loss_bound: 0.01,
                algorithm: AllReduceAlgo::Ring,
                step_deadline: StepDeadline::ADAPTIVE,
                ..GroupReduceOptions::default()
            };
            assert_eq!(g.step_bound(&o.step_deadline), None, "nothing learned yet");
            let results = (0..ops)
                .map(|_| {
                    let mut b = f32s(&input(g.rank(), n));
                    let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                    let r = g.all_reduce(t, &o).expect("all-reduce");
                    // One report per reduce-scatter step (a step whose data arrived before
                    // it started reports a zero wait, so the waits themselves may be 0).
                    assert_eq!(r.steps.len(), world - 1);
                    let c = r.contributors.expect("sets");
                    let sets: Vec<Vec<usize>> = (0..c.blocks()).map(|b| c.ranks(b)).collect();
                    (vals(&b), sets)
                })
                .collect::<Vec<_>>();
            // 2 reduce-scatter steps per operation: learned after MIN_SAMPLES / 2 of them.
            assert!(ops * (world - 1) >= MIN_SAMPLES);
            let bound = g.step_bound(&o.step_deadline).expect("a learned bound");
            assert!(bound >= Duration::from_millis(1), "{bound:?}");
            results
        },
    );
    for (rank, results) in out.iter().enumerate() {
        assert_eq!(results.len(), ops);
        for (k, (v, sets)) in results.iter().enumerate() {
            assert_eq!(v, &out[0][k].0, "op {k}: rank {rank}'s values differ");
            assert_eq!(sets, &out[0][k].1, "op {k}: rank {rank}'s sets differ");
        }
    }
}

#[test]
fn under_loss_every_range_delivers_its_bound_however_small() {
    // Parameters of very different sizes coalesced in one tensor, 8 % of packets lost,
    // a 10 % bound: every range is summed over at least 90 % of the ranks on average over
    // its elements, however few segments it spans, and so is the whole tensor.
    let sizes: Vec<usize> = (0..60)
        .map(|i| [3, 1000, 17, 20_000, 358, 5, 4_000][i % 7])
        .collect();
    let mut ranges = Vec::new();
    let mut at = 0;
    for s in &sizes {
        ranges.push(at..at + s);
        at += s;
    }
    let n = at;
    for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Direct] {
        let world = 4;
        let o = GroupReduceOptions {
            op: ReduceOp::Sum,
            loss_bound: 0.1,
            algorithm: algo,
            ranges: ranges.clone(),
            ..GroupReduceOptions::default()
        };
        let out: Vec<_> = lossy_sum(world, n, 0.08, 5, o)
            .into_iter()
            .map(|l| {
                let counts: Vec<usize> = l.sets.iter().map(Vec::len).collect();
                (counts, l.per_block, l.complete, l.blocks)
            })
            .collect();
        let (counts, per_block, complete, blocks) = &out[0];
        assert!(complete < blocks, "{algo:?}: 8 % loss left no block short");
        let delivered = |r: &std::ops::Range<usize>| {
            let sum: usize = r.clone().map(|i| counts[i / per_block]).sum();
            sum as f64 / (r.len() * world) as f64
        };
        for r in ranges.iter().chain(std::iter::once(&(0..n))) {
            let d = delivered(r);
            assert!(d >= 0.9, "{algo:?}: elements {r:?} delivered {d:.3} < 0.9");
        }
        for (rank, o) in out.iter().enumerate() {
            assert_eq!(o.0, out[0].0, "{algo:?}: rank {rank} holds other sets");
        }
    }
}

#[test]
fn loss_ranges_outside_the_tensor_are_refused() {
    let out = with_groups(
        2,
        |_| {},
        |g| {
            let mut b = f32s(&input(g.rank(), 100));
            let o = GroupReduceOptions {
                loss_bound: 0.1,
                ranges: vec![0..10, 5..20],
                ..GroupReduceOptions::default()
            };
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let overlap = g.all_reduce(t, &o).map(|_| ()).map_err(|e| e.to_string());
            let o = GroupReduceOptions {
                loss_bound: 0.1,
                ranges: std::iter::once(90..101).collect(),
                ..GroupReduceOptions::default()
            };
            let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
            let outside = g.all_reduce(t, &o).map(|_| ()).map_err(|e| e.to_string());
            (overlap, outside)
        },
    );
    for (overlap, outside) in out {
        assert!(
            overlap.is_err_and(|e| e.contains("loss range")),
            "overlap accepted"
        );
        assert!(
            outside.is_err_and(|e| e.contains("loss range")),
            "outside accepted"
        );
    }
}

#[test]
fn verified_ring_results_are_exact_reliable_or_lossy() {
    for world in [2usize, 3, 5] {
        for n in [0usize, 1, 1000, 100_003] {
            for loss_bound in [0.0, 0.1] {
                let out = with_groups(
                    world,
                    |_| {},
                    move |g| {
                        let mut b = f32s(&input(g.rank(), n));
                        let o = GroupReduceOptions {
                            algorithm: AllReduceAlgo::Ring,
                            loss_bound,
                            verify_results: true,
                            ..GroupReduceOptions::default()
                        };
                        let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                        g.all_reduce(t, &o).expect("all-reduce");
                        vals(&b)
                    },
                );
                let want = expected_sum(world, n);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(got, &want, "world {world} n {n} p {loss_bound} rank {r}");
                }
            }
        }
    }
}

#[test]
fn a_rank_that_changes_the_chunks_it_forwards_is_caught_by_the_owners_digests() {
    // 4 ranks; rank 1 flips a byte of every chunk it forwards in the all-gather (chunks 0
    // and 3): they reach ranks 2 and 3 changed.
    let run = |verify_results: bool| {
        with_groups(
            4,
            |_| {},
            move |g| {
                let mut b = f32s(&input(g.rank(), 4000));
                let o = GroupReduceOptions {
                    algorithm: AllReduceAlgo::Ring,
                    verify_results,
                    tamper: Some(1),
                    ..GroupReduceOptions::default()
                };
                let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                g.all_reduce(t, &o)
                    .map(|_| vals(&b))
                    .map_err(|e| e.to_string())
            },
        )
    };
    let want = expected_sum(4, 4000);
    // Unchecked, it goes through: ranks 2 and 3 end with another result, silently.
    let out = run(false);
    for r in [2, 3] {
        let got = out[r].as_ref().expect("unchecked all-reduce");
        assert!(
            got != &want,
            "rank {r}: the unchecked result was not changed"
        );
    }
    assert!(out[0].as_ref().expect("rank 0") == &want);
    // Checked: no honest rank ends with a changed result; ranks 2 and 3 name the path
    // through rank 1 (which changed its own copy too: it is the attacker).
    let out = run(true);
    for (r, res) in out.iter().enumerate().filter(|(r, _)| *r != 1) {
        if let Ok(v) = res {
            assert!(v == &want, "rank {r} ended with a changed result");
        }
    }
    let e2 = out[2].as_ref().expect_err("rank 2 took a changed chunk");
    assert!(
        e2.contains("chunk 0 changed") && e2.contains("([1])"),
        "{e2}"
    );
    // Rank 3 finds it too, or hears first that rank 2 gave up because of rank 1.
    let e3 = out[3].as_ref().expect_err("rank 3 took a changed chunk");
    assert!(
        e3.contains("changed") || e3.contains("failed on rank 1"),
        "{e3}"
    );
}

#[test]
fn an_aggregator_that_changes_the_result_it_passes_down_is_caught_by_the_roots_digest() {
    use crate::tree::{Strategy, Tree};
    // BINARY over 7 ranks: the root's first child aggregates for two ranks, and flips a byte
    // of every result chunk it passes down to them.
    let world = 7;
    let members: Vec<usize> = (0..world).collect();
    let tree = Tree::build(Strategy::BINARY, 0, &members, &[0; 7]).expect("tree");
    let agg = tree.children(0)[0];
    let victims = tree.children(agg).to_vec();
    assert_eq!(victims.len(), 2, "{tree:?}");
    let run = |verify_results: bool, tamper: Option<usize>| {
        let tree = tree.clone();
        with_groups(
            world,
            |_| {},
            move |g| {
                let mut b = f32s(&input(g.rank(), 50_000));
                let o = GroupReduceOptions {
                    verify_results,
                    tamper,
                    ..GroupReduceOptions::default()
                };
                let t = TensorMut::new(DType::F32, &mut b).expect("tensor");
                g.all_reduce_tree(t, &tree, &o)
                    .map(|_| vals(&b))
                    .map_err(|e| e.to_string())
            },
        )
    };
    let want = expected_sum(world, 50_000);
    // Honest and checked: exact everywhere.
    for (r, res) in run(true, None).iter().enumerate() {
        assert!(
            res.as_ref().expect("verified tree all-reduce") == &want,
            "rank {r}"
        );
    }
    // Unchecked, the change goes through: the victims end with another result, silently.
    let out = run(false, Some(agg));
    for &r in &victims {
        assert!(
            out[r].as_ref().expect("unchecked") != &want,
            "rank {r} was not changed"
        );
    }
    // Checked: the victims fail naming the path [agg]; no honest rank ends changed.
    let out = run(true, Some(agg));
    for (r, res) in out.iter().enumerate().filter(|(r, _)| *r != agg) {
        if let Ok(v) = res {
            assert!(v == &want, "rank {r} ended with a changed result");
        }
    }
    for &r in &victims {
        let e = out[r].as_ref().expect_err("a changed result was taken");
        let path = format!("([{agg}])");
        assert!(
            e.contains("changed on its way down") && e.contains(&path),
            "rank {r}: {e}"
        );
    }
}
