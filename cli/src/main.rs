//! `gradwire`: send, receive and demo bounded-loss tensor transfers.

mod args;
mod report;
mod run;
mod stats;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Demo(a) => run::demo(&a),
        args::Command::Send(a) => run::send(&a),
        args::Command::Recv(a) => run::recv(&a),
        args::Command::Stats(a) => stats::run(&a),
        args::Command::Bench(a) => gradwire_bench::netbench::run(&a),
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
