//! `gradwire experiment incast`: see `gradwire_experiment`.

use std::error::Error;
use std::io::Write;

use gradwire_experiment::{print_table, run, IncastConfig, Variant};

use crate::args::IncastArgs;

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

pub fn incast(a: &IncastArgs) -> Res {
    if !gradwire::testbed::is_root() {
        return Err("gradwire experiment needs root (network namespaces, XDP, AF_XDP)".into());
    }
    if !(a.scale > 0.0 && a.scale <= 1.0) {
        return Err(format!("--scale {} must be within (0, 1]", a.scale).into());
    }
    let variants = match &a.variants {
        None => Variant::defaults(),
        Some(names) => names
            .iter()
            .map(|n| Variant::parse(n))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let cfg = IncastConfig {
        topology: a.topology.clone(),
        model: a.model.clone(),
        scale: a.scale,
        split_bytes: a
            .split_bytes
            .unwrap_or(((4u64 << 20) as f64 * a.scale) as u64),
        iterations: a.iterations,
        variants,
        seed: a.seed,
        spray_ports: a.spray_ports,
        period_ns: a.period_us * 1000,
    };
    let report = run(&cfg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("incast.json"), serde_json::to_vec_pretty(&report)?)?;
        let mut csv = std::fs::File::create(dir.join("incast-flows.csv"))?;
        writeln!(csv, "variant,iteration,phase,src,dst,tensor,layer,bytes,fct_us,delivered_fraction,wrong_bytes")?;
        for v in &report.results {
            for r in &v.records {
                writeln!(
                    csv,
                    "{},{},{},{},{},{},{},{},{:.1},{:.6},{}",
                    v.variant.name,
                    r.iteration,
                    if r.push { "push" } else { "pull" },
                    r.src,
                    r.dst,
                    r.tensor,
                    r.layer,
                    r.bytes,
                    r.fct_us,
                    r.delivered_fraction,
                    r.wrong_bytes
                )?;
            }
        }
        eprintln!("wrote {}/incast.json and incast-flows.csv", dir.display());
    }
    let wrong: u64 = report.results.iter().map(|v| v.wrong_bytes).sum();
    if wrong > 0 {
        return Err(format!("{wrong} delivered bytes differ from what was sent").into());
    }
    Ok(())
}
