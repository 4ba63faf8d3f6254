//! `gradwire job worker` and `gradwire job run`: parse, call `gradwire_job`, print.
//!
//! - `job worker` is one rank, started by whatever launcher the cluster uses (torchrun,
//!   Slurm `srun`, Open MPI `mpirun`, a PMI launcher): `gradwire_job::worker`.
//! - `job run` plays the launcher on one machine: `gradwire_job::run`, the ranks started and
//!   supervised by `gradwire_launch` (the launcher `gradwire experiment wan` uses too).

use std::error::Error;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use gradwire_collective::aggregate::ReduceOp;
use gradwire_job::run::{JobPlan, RunEvent, RunSpec};
use gradwire_job::worker::{die_with_launcher, op_name, run_worker, WorkerReport, WorkerSpec};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{JobOp, JobOptions, JobRunArgs, JobWorkerArgs};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// What `job run` prints on stderr once every rank has finished its first iteration (the
/// job is under way: tests wait for it instead of guessing a time).
const ALL_ITERATING: &str = "every rank is iterating";

/// The library's options from the command line's.
fn job_options(o: &JobOptions) -> gradwire_job::JobOptions {
    gradwire_job::JobOptions {
        algorithm: o.algorithm,
        model: o.model.clone(),
        scale: o.scale,
        iterations: o.iterations,
        loss_bound: o.loss_bound,
        op: match o.op {
            JobOp::Sum => ReduceOp::Sum,
            JobOp::Average => ReduceOp::Average,
        },
        rate: o.rate,
        timeout: o.timeout,
    }
}

/// `gradwire job worker`.
pub fn worker(a: &JobWorkerArgs) -> Res {
    die_with_launcher()?;
    let spec = WorkerSpec {
        job_file: a.job_file.clone(),
        host: a.host,
        job: a.job,
        secret_file: a.secret_file.clone(),
        opts: job_options(&a.opts),
    };
    let report = run_worker(&spec, |line| {
        if a.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_worker_table(&report);
    }
    Ok(())
}

fn print_worker_table(r: &WorkerReport) {
    println!(
        "rank {} of {} ({}), job {}, host {} (master {}): {} all-reduce ({}) of {} x {}: {} \
         layers, {} f32 elements per iteration, loss bound {}",
        r.rank,
        r.world,
        r.launcher,
        r.job,
        r.host,
        r.master,
        r.algorithm,
        r.op,
        r.model,
        r.scale,
        r.layers,
        r.elements,
        r.loss_bound
    );
    println!(
        "{:>9} {:>10} {:>14} {:>10}",
        "iteration", "ms", "delivered min", "sent MB"
    );
    for it in &r.iterations {
        println!(
            "{:>9} {:>10.1} {:>13.3}% {:>10.3}",
            it.iteration,
            it.ms,
            100.0 * it.delivered_fraction_min,
            it.bytes_sent as f64 / 1e6
        );
    }
    let exact = r.loss_bound == 0.0;
    println!(
        "verified: every element of every result {}",
        if exact {
            format!("is the exact {} over the {} ranks", r.op, r.world)
        } else {
            "is the average of the contributions its report names".to_owned()
        }
    );
}

/// `gradwire job run`.
pub fn run(a: &JobRunArgs) -> Res {
    let opts = job_options(&a.opts);
    let plan = JobPlan::new(&RunSpec {
        file: a.file.clone(),
        topology: a.topology.clone(),
        opts: opts.clone(),
        secret_file: a.secret_file.clone(),
        deadline: a.deadline,
        exe: std::env::current_exe()?,
    })?;
    // Ctrl-C and SIGTERM end the run in order: stop the ranks, remove the namespaces.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let job = plan.up()?;
    let p = &job.plan;
    let world = p.spec.world();
    if !a.json {
        let elements: usize = p.layers.iter().map(|l| l.1).sum();
        println!(
            "job {}: {} ranks on {} hosts (namespaces {}...), master {}, {} all-reduce ({}) \
             of {} x {}: {} layers, {elements} f32 elements, {} iterations, loss bound {}",
            p.spec.job,
            world,
            p.hosts.len(),
            job.namespaces.first().map_or("", String::as_str),
            p.master,
            a.opts.algorithm,
            op_name(opts.op),
            p.model,
            a.opts.scale,
            p.layers.len(),
            a.opts.iterations,
            a.opts.loss_bound
        );
    }
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::new(world as u64 * u64::from(a.opts.iterations));
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {pos}/{len} rank-iterations {elapsed}")
        {
            pb.set_style(style);
        }
        pb
    };
    let reports = job.run(&stop, move |event| match event {
        RunEvent::Iteration { .. } => pb.inc(1),
        RunEvent::AllIterating => pb.suspend(|| eprintln!("gradwire job run: {ALL_ITERATING}")),
        RunEvent::RanksEnded => pb.finish_and_clear(),
        RunEvent::RankLog { rank, line } => eprintln!("rank {rank}: {line}"),
        RunEvent::FabricFellBehind => eprintln!(
            "gradwire job run: the emulated fabric fell behind its clock: timings of this run are not valid"
        ),
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print_run_table(&reports);
    }
    Ok(())
}

fn print_run_table(reports: &[WorkerReport]) {
    println!(
        "{:>5} {:<16} {:>10} {:>10} {:>10} {:>14} {:>10} {:>9}",
        "rank", "host", "iterations", "mean ms", "max ms", "delivered min", "sent MB", "verified"
    );
    for r in reports {
        let n = r.iterations.len().max(1) as f64;
        let mean = r.iterations.iter().map(|i| i.ms).sum::<f64>() / n;
        let max = r.iterations.iter().map(|i| i.ms).fold(0.0, f64::max);
        let dmin = r
            .iterations
            .iter()
            .map(|i| i.delivered_fraction_min)
            .fold(1.0, f64::min);
        let sent: u64 = r.iterations.iter().map(|i| i.bytes_sent).sum();
        println!(
            "{:>5} {:<16} {:>10} {:>10.1} {:>10.1} {:>13.3}% {:>10.3} {:>9}",
            r.rank,
            r.host.to_string(),
            r.iterations.len(),
            mean,
            max,
            100.0 * dmin,
            sent as f64 / 1e6,
            if r.verified { "yes" } else { "NO" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::JobAlgorithm;
    use gradwire_job::run::worker_args;
    use std::path::Path;

    #[test]
    fn algorithms_and_the_job_commands_parse() {
        use crate::args::{parse_algorithm, Cli, Command, JobCommand};
        use clap::Parser;
        use gradwire_collective::tree::Strategy;
        assert_eq!(parse_algorithm("Ring"), Ok(JobAlgorithm::Ring));
        assert_eq!(
            parse_algorithm("binary"),
            Ok(JobAlgorithm::Tree(Strategy::BINARY))
        );
        assert_eq!(
            parse_algorithm("d=3"),
            Ok(JobAlgorithm::Tree(Strategy::Degree(3)))
        );
        let e = parse_algorithm("quad").unwrap_err();
        assert!(e.contains("\"ring\"") && e.contains("d=N"), "{e}");
        // What `job run` hands its workers parses back to the same options.
        for alg in ["ring", "star", "rack", "binary", "d=5"] {
            assert_eq!(
                parse_algorithm(&parse_algorithm(alg).unwrap().to_string()),
                parse_algorithm(alg)
            );
        }
        let c = Cli::try_parse_from([
            "gradwire",
            "job",
            "run",
            "j.toml",
            "--algorithm",
            "rack",
            "--op",
            "average",
            "--rate",
            "200M",
            "--deadline",
            "9",
        ])
        .unwrap();
        let Command::Job(j) = c.command else {
            panic!("not job")
        };
        let JobCommand::Run(r) = j.command else {
            panic!("not run")
        };
        assert_eq!(r.opts.op, JobOp::Average);
        assert_eq!(r.opts.rate, 200_000_000);
        let args = worker_args(
            &job_options(&r.opts),
            r.secret_file.as_deref(),
            Path::new("/j.toml"),
            Path::new("/m.toml"),
        );
        let mut full = vec!["gradwire".to_owned()];
        full.extend(args);
        let c = Cli::try_parse_from(full).unwrap();
        let Command::Job(j) = c.command else {
            panic!("not job")
        };
        let JobCommand::Worker(w) = j.command else {
            panic!("not worker")
        };
        assert!(w.json);
        assert_eq!(w.job_file.as_deref(), Some(Path::new("/j.toml")));
        assert_eq!(w.opts.algorithm, r.opts.algorithm);
        assert_eq!(w.opts.rate, r.opts.rate);
        assert_eq!(w.opts.op, r.opts.op);
        assert_eq!(w.opts.scale, r.opts.scale);
        assert_eq!(w.opts.timeout, r.opts.timeout);
        assert!(Cli::try_parse_from(["gradwire", "job", "worker", "--scale", "x"]).is_err());
    }
}
