//! `gradwire-fabric-bench`: packets per core the emulated switch forwards, against kernel
//! forwarding in the same namespaces. Needs root. See `gradwire_experiment::fabricbench`.

use clap::Parser;
use gradwire_experiment::fabricbench::{print, run, FabricBenchArgs};

fn main() -> std::process::ExitCode {
    let a = FabricBenchArgs::parse();
    match run(&a) {
        Ok(r) => {
            if a.json {
                match serde_json::to_string_pretty(&r) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("gradwire-fabric-bench: error: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            } else {
                print(&r);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gradwire-fabric-bench: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
