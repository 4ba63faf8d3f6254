//! `gradwire`: send, receive and demo bounded-loss tensor transfers (and their `stats`);
//! build topology testbeds and run their emulated switch fabric; benchmark AF_XDP against
//! kernel UDP; run the experiments (incast, mlnet, priority, wan); run collective jobs (`job
//! worker`, `job run`: `gradwire-job`) and NetStorm sites (`wan node`: `gradwire-wan`). It
//! parses arguments and prints: everything it runs is a library call.

mod args;
mod experiment;
mod fabric_cmd;
mod job_cmd;
mod loopio;
mod mlnet_cmd;
mod p2p;
mod prometheus;
mod report;
mod run;
mod stats;
mod wan_cmd;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

/// Log records to stderr as `gradwire: <level>: <message>`: gradwire's own crates at level
/// warn (or `GRADWIRE_LOG`: off, error, warn, info, debug, trace), other crates at error. A
/// few lines of our own rather than env_logger: one format, one variable, no dependencies.
struct StderrLog {
    ours: log::LevelFilter,
}

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        let limit = if m.target().starts_with("gradwire") {
            self.ours
        } else {
            log::LevelFilter::Error
        };
        m.level() <= limit
    }

    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let level = r.level().as_str().to_ascii_lowercase();
            // Nothing sensible to do if stderr is gone.
            let _ = writeln!(std::io::stderr().lock(), "gradwire: {level}: {}", r.args());
        }
    }

    fn flush(&self) {}
}

fn init_logging() {
    let ours = std::env::var("GRADWIRE_LOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(log::LevelFilter::Warn);
    // Installed once, for the life of the process.
    let logger: &'static StderrLog = Box::leak(Box::new(StderrLog { ours }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(ours.max(log::LevelFilter::Error));
    }
}

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    init_logging();
    let result = match cli.command {
        args::Command::Demo(a) => run::demo(&a),
        args::Command::Send(a) => run::send(&a),
        args::Command::Recv(a) => run::recv(&a),
        args::Command::Stats(a) => stats::run(&a),
        args::Command::Bench(a) => gradwire_experiment::netbench::run(&a),
        args::Command::Testbed(t) => match t.command {
            args::TestbedCommand::Up(a) => fabric_cmd::testbed_up(&a),
            args::TestbedCommand::Down(a) => fabric_cmd::testbed_down(&a),
            args::TestbedCommand::Status(a) => fabric_cmd::testbed_status(&a),
        },
        args::Command::Fabric(f) => match f.command {
            args::FabricCommand::Run(a) => fabric_cmd::fabric_run(&a),
            args::FabricCommand::Stats(a) => fabric_cmd::fabric_stats(&a),
        },
        args::Command::Experiment(x) => match x.command {
            args::ExperimentCommand::Incast(a) => experiment::incast(&a),
            args::ExperimentCommand::Mlnet(a) => mlnet_cmd::mlnet(&a),
            args::ExperimentCommand::Priority(a) => mlnet_cmd::priority(&a),
            args::ExperimentCommand::Wan(a) => wan_cmd::experiment(&a),
        },
        args::Command::Job(j) => match j.command {
            args::JobCommand::Worker(a) => job_cmd::worker(&a),
            args::JobCommand::Run(a) => job_cmd::run(&a),
        },
        args::Command::Wan(w) => match w.command {
            args::WanCommand::Node(a) => wan_cmd::node(&a),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut shown = e.to_string();
            eprintln!("gradwire: error: {shown}");
            let mut src = std::error::Error::source(&*e);
            while let Some(s) = src {
                // Most of our errors already quote their source; say each thing once.
                let text = s.to_string();
                if !shown.contains(&text) {
                    eprintln!("  caused by: {text}");
                    shown = text;
                }
                src = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
