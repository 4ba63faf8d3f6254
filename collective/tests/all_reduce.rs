//! All-reduce, broadcast and barrier over in-memory links (every rank a thread), with and
//! without injected loss: with p = 0 every rank holds exactly the sum; with loss every block
//! is the average of exactly the contributions its report names, computed here
//! independently from the inputs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gradwire::datapath::fault::FaultConfig;
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire_collective::aggregate::ReduceOp;
use gradwire_collective::comm::{
    Algorithm, AllReduceOptions, AllReduceReport, CommConfig, Communicator,
};
use gradwire_collective::link::{ring_edges, tree_edges, Links, MemLinkConfig};
use gradwire_collective::tree::{Strategy, Tree};
use half::{bf16, f16};

/// Rank `r`'s input at element `e`: small integers, so f32 sums are exact in any order.
fn input(r: usize, e: usize) -> f32 {
    ((r * 7 + e * 3) % 23) as f32 - 11.0
}

fn tensor_for(dtype: DType, r: usize, elems: usize) -> Tensor {
    let mut t = Tensor::zeros(dtype, elems);
    match dtype {
        DType::F32 => t
            .as_f32_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
            .for_each(|(e, x)| *x = input(r, e)),
        DType::F16 => t
            .as_f16_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
            .for_each(|(e, x)| *x = f16::from_f32(input(r, e))),
        DType::Bf16 => t
            .as_bf16_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
            .for_each(|(e, x)| *x = bf16::from_f32(input(r, e))),
        DType::Raw => unreachable!(),
    }
    t
}

fn values(t: &Tensor) -> Vec<f32> {
    match t.dtype() {
        DType::F32 => t.as_f32().unwrap().to_vec(),
        DType::F16 => t.as_f16().unwrap().iter().map(|x| x.to_f32()).collect(),
        DType::Bf16 => t.as_bf16().unwrap().iter().map(|x| x.to_f32()).collect(),
        DType::Raw => unreachable!(),
    }
}

fn cfg() -> CommConfig {
    let mut c = CommConfig::default();
    c.transfer.sender = gradwire::flow::SenderConfig::new(2_000_000_000);
    c.op_timeout = std::time::Duration::from_secs(20);
    c.pipeline_blocks = 64;
    c
}

/// Run one all-reduce on every rank; results and reports in rank order.
fn run(
    world: usize,
    elems: usize,
    dtype: DType,
    algorithm: Algorithm,
    opts: AllReduceOptions,
    fault: Option<FaultConfig>,
) -> Vec<(Tensor, AllReduceReport)> {
    let edges = match &algorithm {
        Algorithm::Ring => ring_edges(world),
        Algorithm::Tree(t) => tree_edges(t),
    };
    let links = Links::in_memory(
        world,
        &edges,
        &MemLinkConfig {
            fault,
            ..MemLinkConfig::default()
        },
    )
    .unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .map(|l| {
                let opts = AllReduceOptions {
                    algorithm: algorithm.clone(),
                    ..opts.clone()
                };
                s.spawn(move || {
                    let r = l.rank();
                    let mut comm = Communicator::new(l, 9, cfg()).unwrap();
                    let mut t = tensor_for(dtype, r, elems);
                    let report = comm.all_reduce(&mut t, &opts).unwrap();
                    (t, report)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn binary(world: usize) -> Algorithm {
    let members: Vec<usize> = (0..world).collect();
    let racks = vec![0; world];
    Algorithm::Tree(Tree::build(Strategy::BINARY, 0, &members, &racks).unwrap())
}

fn assert_exact_sum(world: usize, elems: usize, out: &[(Tensor, AllReduceReport)]) {
    let want: Vec<f32> = (0..elems)
        .map(|e| (0..world).map(|r| input(r, e)).sum())
        .collect();
    for (r, (t, report)) in out.iter().enumerate() {
        assert_eq!(values(t), want, "rank {r}");
        assert_eq!(report.complete_blocks, report.blocks, "rank {r}");
        assert_eq!(report.delivered_fraction, 1.0);
    }
}

#[test]
fn ring_p0_is_the_exact_sum_on_4_and_8_ranks() {
    for world in [4, 8] {
        let elems = 20_011; // not a multiple of anything
        let out = run(
            world,
            elems,
            DType::F32,
            Algorithm::Ring,
            AllReduceOptions::default(),
            None,
        );
        assert_exact_sum(world, elems, &out);
    }
}

#[test]
fn tree_p0_is_the_exact_sum_on_4_and_8_ranks() {
    for world in [4, 8] {
        let elems = 30_001;
        let out = run(
            world,
            elems,
            DType::F32,
            binary(world),
            AllReduceOptions::default(),
            None,
        );
        assert_exact_sum(world, elems, &out);
    }
    // A star (MLNET's baseline) and a chain (d = 1) too.
    let members: Vec<usize> = (0..5).collect();
    for strategy in [Strategy::Star, Strategy::Degree(1)] {
        let tree = Tree::build(strategy, 2, &members, &[0; 5]).unwrap();
        let out = run(
            5,
            4_000,
            DType::F32,
            Algorithm::Tree(tree),
            AllReduceOptions::default(),
            None,
        );
        assert_exact_sum(5, 4_000, &out);
    }
}

#[test]
fn half_precision_types_reduce_too() {
    for dtype in [DType::F16, DType::Bf16] {
        // Sums of four values in -11..=11 are exact in f16 and bf16.
        let out = run(
            4,
            5_000,
            dtype,
            Algorithm::Ring,
            AllReduceOptions::default(),
            None,
        );
        assert_exact_sum(4, 5_000, &out);
    }
}

#[test]
fn tiny_tensors_and_a_single_rank_work() {
    // Fewer blocks than ranks: some ring chunks are empty.
    let out = run(
        8,
        3,
        DType::F32,
        Algorithm::Ring,
        AllReduceOptions::default(),
        None,
    );
    assert_exact_sum(8, 3, &out);
    let out = run(
        1,
        10,
        DType::F32,
        Algorithm::Ring,
        AllReduceOptions::default(),
        None,
    );
    assert_exact_sum(1, 10, &out);
}

/// Every block of every rank's result is the average of exactly the ranks its report names.
fn assert_named_average(
    world: usize,
    elems: usize,
    op: ReduceOp,
    out: &[(Tensor, AllReduceReport)],
) -> usize {
    let mut incomplete = 0;
    for (r, (t, report)) in out.iter().enumerate() {
        let v = values(t);
        let be = report.block_elems;
        for b in 0..report.blocks {
            let ranks = report.contributors.ranks(b);
            assert!(!ranks.is_empty(), "rank {r} block {b}: no contributor");
            if ranks.len() < world {
                incomplete += 1;
            }
            for (e, &got) in v.iter().enumerate().take(elems).skip(b * be).take(be) {
                let mean = ranks.iter().map(|&q| input(q, e)).sum::<f32>() / ranks.len() as f32;
                let want = match op {
                    ReduceOp::Average => mean,
                    // The unbiased estimate of the sum (exact when complete).
                    ReduceOp::Sum => mean * world as f32,
                    other => panic!("{other:?} is not run lossy"),
                };
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "rank {r} block {b} element {e}: {got} != {want} (contributors {ranks:?})"
                );
            }
        }
        let named = (0..report.blocks)
            .map(|b| report.contributors.count(b))
            .sum::<usize>() as f64
            / (report.blocks * world) as f64;
        assert!((named - report.delivered_fraction).abs() < 1e-12);
    }
    incomplete
}

#[test]
fn with_loss_each_block_is_the_average_of_the_contributions_that_arrived() {
    let elems = 60_000;
    // 4 % random loss against a 5 % bound: the first pass usually meets the bound, so
    // some segments stay missing for good.
    let fault = FaultConfig::loss(0.04);
    for (world, algorithm, op) in [
        (4, Algorithm::Ring, ReduceOp::Average),
        (4, binary(4), ReduceOp::Average),
        (4, Algorithm::Ring, ReduceOp::Sum),
        (8, Algorithm::Ring, ReduceOp::Average),
        (8, binary(8), ReduceOp::Sum),
    ] {
        let opts = AllReduceOptions {
            op,
            loss_bound: Some(LossBound::from_fraction(0.05).unwrap()),
            ..AllReduceOptions::default()
        };
        let out = run(
            world,
            elems,
            DType::F32,
            algorithm.clone(),
            opts,
            Some(fault.clone()),
        );
        let incomplete = assert_named_average(world, elems, op, &out);
        assert!(
            incomplete > 0,
            "{algorithm:?}: the injected loss reached no block"
        );
        for (_, report) in &out {
            assert!(report.delivered_fraction < 1.0 || report.complete_blocks == report.blocks);
            assert!(
                report.delivered_fraction > 0.8,
                "{}",
                report.delivered_fraction
            );
        }
    }
}

#[test]
fn broadcast_and_barrier() {
    let world = 4;
    let links = Links::in_memory(world, &ring_edges(world), &MemLinkConfig::default()).unwrap();
    let out: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                s.spawn(move || {
                    let r = l.rank();
                    let mut comm = Communicator::new(l, 3, cfg()).unwrap();
                    comm.barrier().unwrap();
                    let mut t = tensor_for(DType::F32, r, 10_000);
                    let rep = comm.broadcast(&mut t, 2, None).unwrap();
                    assert_eq!(rep.received_blocks, rep.blocks);
                    comm.barrier().unwrap();
                    values(&t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..10_000).map(|e| input(2, e)).collect();
    for v in out {
        assert_eq!(v, want);
    }
}

#[test]
fn a_dead_rank_is_an_error_naming_it_not_a_hang() {
    let world = 3;
    let links = Links::in_memory(world, &ring_edges(world), &MemLinkConfig::default()).unwrap();
    let mut c = cfg();
    c.op_timeout = std::time::Duration::from_secs(2);
    c.transfer.idle_timeout = std::time::Duration::from_secs(2);
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .filter(|l| l.rank() != 1) // rank 1 never shows up
            .map(|l| {
                let c = c.clone();
                s.spawn(move || {
                    let r = l.rank();
                    let mut comm = Communicator::new(l, 3, c).unwrap();
                    let mut t = tensor_for(DType::F32, r, 1_000);
                    let e = comm
                        .all_reduce(&mut t, &AllReduceOptions::default())
                        .unwrap_err()
                        .to_string();
                    // The links are mid-flow now: the communicator refuses further work.
                    let again = comm.barrier().unwrap_err();
                    assert!(
                        matches!(
                            again,
                            gradwire_collective::error::CollectiveError::Unusable(_)
                        ),
                        "{again}"
                    );
                    e
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert!(e.contains("rank"), "{e}");
    }
    assert!(errors.iter().any(|e| e.contains("rank 1")), "{errors:?}");
}
