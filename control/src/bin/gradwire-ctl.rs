//! `gradwire-ctl`: render switch and NIC QoS configurations, optimise thresholds, validate
//! policy files. See `gradwire-ctl --help` and `docs/switch-control.md`.

use std::process::ExitCode;

use gradwire_control::cli::{run_with_warnings, CliError};

fn main() -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    match run_with_warnings(std::env::args_os(), &mut stdout, &mut stderr) {
        Ok(()) => ExitCode::SUCCESS,
        // clap prints help/version to stdout (exit 0) and usage errors to stderr (exit 2).
        Err(CliError::Clap(e)) => e.exit(),
        Err(e) => {
            eprintln!("gradwire-ctl: {e}");
            ExitCode::FAILURE
        }
    }
}
