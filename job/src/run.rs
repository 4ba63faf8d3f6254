//! A job file's ranks on one machine (`gradwire job run`): one network namespace per host
//! address of the job file on a private bridge (or the hosts of a testbed topology, with its
//! emulated fabric running), every rank its own `gradwire job worker` process in its host's
//! namespace with torchrun's variables, started and supervised by the one launcher
//! ([`gradwire_launch`]: dies with this process, an overall deadline, the first failure
//! stops the others), and teardown on every path.
//!
//! In three steps, so the caller can speak in between: [`JobPlan::new`] checks everything
//! that can be checked without building anything, [`JobPlan::up`] builds the namespaces
//! (and starts the fabric), [`JobRun::run`] runs the ranks and tears down.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gradwire::job_secret::load_secret;
use gradwire_collective::job::{JobError, JobSpec, LAUNCHER_VAR};
use gradwire_launch::{Ended, RankCommand, Ranks, Supervision};
use gradwire_netns::testbed::host_mac;
use gradwire_netns::{IpBatch, NamespaceSet, Veth, VethEnd};

use crate::error::Error;
use crate::worker::{
    op_name, seconds, JobOptions, WorkerReport, DEFAULT_MASTER_PORT, ITERATION_MARK,
};
use crate::workload::model_layers;

/// Hosts of a `job run`: one veth port each on the bridge, MACs from the netns kit.
pub const MAX_RUN_HOSTS: usize = gradwire_netns::testbed::MAX_HOSTS;
/// The host interface and the bridge of `job run`'s namespaces.
const HOST_IF: &str = "gw0";
const BRIDGE: &str = "br0";
/// Prefix length of `job run`'s addresses: all of 198.18.0.0/15 is on the one bridge.
const RUN_PREFIX_LEN: u8 = 15;

/// What `gradwire job run` was asked.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Job file; its hosts become namespaces on one bridge, or the hosts of `topology`.
    pub file: PathBuf,
    /// A testbed topology whose hosts (and emulated fabric) the ranks run on.
    pub topology: Option<PathBuf>,
    /// What every rank does.
    pub opts: JobOptions,
    /// The job secret's key file, handed to every rank.
    pub secret_file: Option<PathBuf>,
    /// Seconds the whole job may take before every rank is stopped.
    pub deadline: f64,
    /// The `gradwire` executable (its `job worker` runs each rank).
    pub exe: PathBuf,
}

/// What a run tells its caller while it runs (from the ranks' reader threads too).
#[derive(Debug, Clone, Copy)]
pub enum RunEvent<'a> {
    /// Rank `rank` finished an iteration.
    Iteration {
        /// The rank.
        rank: usize,
    },
    /// Every rank has finished its first iteration: the job is under way.
    AllIterating,
    /// Every rank has ended or was stopped; what follows is about their reports.
    RanksEnded,
    /// A line a successful rank logged on stderr (a warning).
    RankLog {
        /// The rank.
        rank: usize,
        /// The line.
        line: &'a str,
    },
    /// The emulated fabric fell behind its clock: the run's timings are not valid.
    FabricFellBehind,
}

/// A checked `job run`, nothing built yet.
#[derive(Debug)]
pub struct JobPlan {
    /// The job file.
    pub spec: JobSpec,
    /// Its distinct hosts, in rank order of first appearance.
    pub hosts: Vec<Ipv4Addr>,
    /// Each rank's host index.
    pub host_of: Vec<usize>,
    /// Rank 0's rendezvous address.
    pub master: SocketAddr,
    /// The model's name.
    pub model: String,
    /// Its layers at the scale (name, elements).
    pub layers: Vec<(String, usize)>,
    deadline: Duration,
    deadline_secs: f64,
    topology: Option<PathBuf>,
    exe: PathBuf,
    args: Vec<String>,
}

impl JobPlan {
    /// Check the job file, the hosts and master, the times, the model and the secret (here,
    /// once, rather than in every rank).
    pub fn new(r: &RunSpec) -> Result<JobPlan, Error> {
        let file_shown = r.file.display().to_string();
        let spec = JobSpec::load(&r.file)?;
        let (hosts, host_of, master) = plan(&spec, &file_shown)?;
        let deadline = seconds("deadline", r.deadline)?;
        seconds("timeout", r.opts.timeout)?;
        let (model, layers) = model_layers(&r.opts.model, r.opts.scale)?;
        // The workers read the same file (or GRADWIRE_JOB_SECRET, which they inherit).
        load_secret(r.secret_file.as_deref())?;
        let args = worker_args(
            &r.opts,
            r.secret_file.as_deref(),
            &absolute(&r.file),
            &absolute(&r.opts.model),
        );
        Ok(JobPlan {
            spec,
            hosts,
            host_of,
            master,
            model,
            layers,
            deadline,
            deadline_secs: r.deadline,
            topology: r.topology.clone(),
            exe: r.exe.clone(),
            args,
        })
    }

    /// Build the namespaces: one per host on a bridge, or the topology's (with its fabric
    /// running).
    pub fn up(self) -> Result<JobRun, Error> {
        let (place, namespaces) = match &self.topology {
            Some(t) => on_topology(t, &self.hosts)?,
            None => {
                let (set, ns) = build_namespaces(&self.hosts)?;
                (Place::Bridge(set), ns)
            }
        };
        Ok(JobRun {
            plan: self,
            namespaces,
            place,
        })
    }
}

/// A `job run` whose namespaces are up; dropping it removes them.
#[derive(Debug)]
pub struct JobRun {
    /// What runs.
    pub plan: JobPlan,
    /// Each host's namespace.
    pub namespaces: Vec<String>,
    place: Place,
}

impl JobRun {
    /// Run every rank until all have finished (their reports, in rank order), one fails
    /// (the others are stopped), the deadline passes or `stop` is set (Ctrl-C); then stop
    /// the fabric and remove the namespaces, on every path.
    pub fn run(
        self,
        stop: &AtomicBool,
        events: impl Fn(RunEvent<'_>) + Send + Sync + 'static,
    ) -> Result<Vec<WorkerReport>, Error> {
        let events: Arc<dyn Fn(RunEvent<'_>) + Send + Sync> = Arc::new(events);
        let outcome = run_ranks(&self.plan, &self.namespaces, stop, &events);
        let down = self.place.down(&*events);
        let reports = outcome?;
        down?;
        Ok(reports)
    }
}

fn run_ranks(
    plan: &JobPlan,
    host_ns: &[String],
    stop: &AtomicBool,
    events: &Arc<dyn Fn(RunEvent<'_>) + Send + Sync>,
) -> Result<Vec<WorkerReport>, Error> {
    let world = plan.spec.world();
    let master = plan.master;
    let mut ranks = Ranks::new();
    let mut local_rank: BTreeMap<usize, usize> = BTreeMap::new();
    // Ranks that have finished their first iteration.
    let iterating = Arc::new(AtomicUsize::new(0));
    for (r, &h) in plan.host_of.iter().enumerate() {
        let lr = local_rank.entry(h).or_insert(0);
        let cmd = RankCommand {
            netns: Some(host_ns[h].clone()),
            program: plan.exe.clone(),
            args: plan.args.clone(),
            env: vec![
                ("RANK".into(), r.to_string()),
                ("WORLD_SIZE".into(), world.to_string()),
                ("LOCAL_RANK".into(), lr.to_string()),
                ("MASTER_ADDR".into(), master.ip().to_string()),
                ("MASTER_PORT".into(), master.port().to_string()),
                // Launcher variables this process may have inherited (a Slurm allocation)
                // must not contradict ours.
                (LAUNCHER_VAR.into(), "torchrun".into()),
            ],
            // The worker dies with this process, however it ends (`die_with_launcher`).
            die_with_launcher: true,
        };
        *lr += 1;
        let mark = format!("rank {r}{ITERATION_MARK}");
        let mut first = true;
        let (events, iterating) = (Arc::clone(events), Arc::clone(&iterating));
        ranks
            .start(&cmd, move |line| {
                if !line.starts_with(&mark) {
                    return false;
                }
                events(RunEvent::Iteration { rank: r });
                if std::mem::take(&mut first)
                    && iterating.fetch_add(1, Ordering::SeqCst) + 1 == world
                {
                    events(RunEvent::AllIterating);
                }
                true
            })
            .map_err(|source| Error::Spawn { rank: r, source })?;
    }
    let how = Supervision {
        deadline: plan.deadline,
        stop,
        end_on_failure: true,
    };
    let ended = ranks.supervise(&how, |_| {});
    let stopped = ranks.kill_running();
    events(RunEvent::RanksEnded);
    let outputs = ranks.finish();
    match ended {
        Ended::Interrupted => Err(Error::Interrupted),
        Ended::Deadline { running } => Err(Error::Deadline {
            secs: plan.deadline_secs,
            running,
        }),
        Ended::Failed(failed) => {
            let failed = failed
                .into_iter()
                .map(|r| {
                    let how = outputs[r]
                        .ended
                        .map_or_else(|| "?".to_owned(), |(s, _)| s.to_string());
                    (r, how, outputs[r].stderr.trim().replace('\n', " | "))
                })
                .collect();
            Err(Error::RankFailed { failed, stopped })
        }
        Ended::AllExited => {
            let mut reports = Vec::with_capacity(world);
            for o in outputs {
                // Warnings a successful rank logged.
                for line in o.stderr.lines() {
                    events(RunEvent::RankLog { rank: o.rank, line });
                }
                let rep: WorkerReport =
                    serde_json::from_str(&o.stdout).map_err(|source| Error::BadReport {
                        rank: o.rank,
                        source,
                        stdout: o.stdout.clone(),
                    })?;
                reports.push(rep);
            }
            Ok(reports)
        }
    }
}

/// A host address `job run` may use: inside 198.18.0.0/15, neither its network nor its
/// broadcast address.
pub fn in_bench_range(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            let o = a.octets();
            let inside = o[0] == 198 && (o[1] & 0xfe) == 18;
            let edge = a == Ipv4Addr::new(198, 18, 0, 0) || a == Ipv4Addr::new(198, 19, 255, 255);
            (inside && !edge).then_some(a)
        }
        IpAddr::V6(_) => None,
    }
}

/// The job's distinct hosts (in rank order of first appearance), each rank's host index, and
/// the master; checked for a namespace run.
pub fn plan(spec: &JobSpec, file: &str) -> Result<(Vec<Ipv4Addr>, Vec<usize>, SocketAddr), Error> {
    let mut hosts: Vec<Ipv4Addr> = Vec::new();
    let mut host_of = Vec::with_capacity(spec.world());
    // A loaded spec holds ranks 0..world in order, at least one.
    for (r, entry) in spec.ranks.iter().enumerate() {
        let a = in_bench_range(entry.host).ok_or(Error::NotBenchmarkRange {
            file: file.to_owned(),
            rank: r,
            host: entry.host,
        })?;
        let i = match hosts.iter().position(|&h| h == a) {
            Some(i) => i,
            None => {
                hosts.push(a);
                hosts.len() - 1
            }
        };
        host_of.push(i);
    }
    if hosts.len() > MAX_RUN_HOSTS {
        return Err(Error::TooManyHosts {
            file: file.to_owned(),
            hosts: hosts.len(),
        });
    }
    let host0 = match host_of.first() {
        Some(&h) => IpAddr::V4(hosts[h]),
        None => return Err(JobError::Invalid(format!("{file}: no ranks")).into()),
    };
    let master = spec
        .master
        .unwrap_or_else(|| SocketAddr::new(host0, DEFAULT_MASTER_PORT));
    if master.ip().to_canonical() != host0 {
        return Err(Error::MasterNotRank0 {
            file: file.to_owned(),
            master,
            host: host0,
        });
    }
    Ok((hosts, host_of, master))
}

/// Where the ranks run.
#[derive(Debug)]
enum Place {
    /// Namespaces on one bridge.
    Bridge(NamespaceSet),
    /// A testbed topology's namespaces with its emulated fabric running.
    Fabric {
        net: gradwire_fabric::netns::FabricNet,
        fabric: gradwire_fabric::run::FabricHandle,
    },
}

impl Place {
    /// Stop the fabric (if any; [`RunEvent::FabricFellBehind`] if it fell behind its clock)
    /// and remove the namespaces.
    fn down(self, events: &dyn Fn(RunEvent<'_>)) -> Result<(), Error> {
        match self {
            Place::Bridge(set) => set.down()?,
            Place::Fabric { net, fabric } => {
                let stats = fabric.stop();
                if stats.as_ref().is_some_and(|s| s.lag.behind) {
                    events(RunEvent::FabricFellBehind);
                }
                net.down()?;
            }
        }
        Ok(())
    }
}

/// The namespaces of `topology`'s hosts (with its fabric running) for the job's `hosts`, each
/// of which must be one of the topology's host addresses.
fn on_topology(topology: &Path, hosts: &[Ipv4Addr]) -> Result<(Place, Vec<String>), Error> {
    let topo = gradwire_fabric::supervise::load_topology(topology)
        .map_err(|e| Error::Topology(Box::new(e)))?;
    let mut index = Vec::with_capacity(hosts.len());
    for h in hosts {
        let i = topo.hosts.iter().position(|t| t.ip == *h).ok_or_else(|| {
            let known: Vec<String> = topo
                .hosts
                .iter()
                .map(|t| format!("{} = {}", t.name, t.ip))
                .collect();
            Error::NotTopologyHost {
                host: *h,
                topology: topology.display().to_string(),
                known: known.join(", "),
            }
        })?;
        index.push(i);
    }
    let net = gradwire_fabric::netns::FabricNet::up(&topo)?;
    let fabric = match gradwire_fabric::run::spawn(
        &topo,
        net.switch_namespaces(),
        gradwire_fabric::run::FabricConfig::default(),
    ) {
        Ok(f) => f,
        Err(e) => {
            let _ = net.down();
            return Err(Error::FabricStart(e));
        }
    };
    let host_ns = index
        .iter()
        .map(|&i| net.host_ns(i).map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or(Error::FewerNamespaces)?;
    Ok((Place::Fabric { net, fabric }, host_ns))
}

/// One namespace per host, each with `gw0` on one bridge in a switch namespace; removed when
/// the returned set is dropped or torn down (and by the kit's reaper if this process dies).
fn build_namespaces(hosts: &[Ipv4Addr]) -> gradwire_netns::Result<(NamespaceSet, Vec<String>)> {
    let prefix = gradwire_netns::new_netns_prefix();
    let host_ns: Vec<String> = (0..hosts.len()).map(|i| format!("{prefix}h{i}")).collect();
    let sw = format!("{prefix}sw");
    let mut all = host_ns.clone();
    all.push(sw.clone());
    let set = NamespaceSet::temporary("gradwire job run", &all)?;
    gradwire_netns::link::add_bridge(&sw, BRIDGE)?;
    let mut ports = IpBatch::new();
    for (i, ns) in host_ns.iter().enumerate() {
        let port = format!("h{i}");
        Veth {
            a: VethEnd {
                netns: ns,
                ifname: HOST_IF,
                mac: Some(host_mac(i)),
            },
            b: VethEnd {
                netns: &sw,
                ifname: &port,
                mac: None,
            },
            mtu: Some(1500),
            queues: None,
        }
        .create()?;
        ports.master(&port, BRIDGE).up(&port);
    }
    ports.up(BRIDGE).apply(&sw)?;
    for (i, ns) in host_ns.iter().enumerate() {
        let mut b = IpBatch::new();
        b.addr(HOST_IF, hosts[i].into(), RUN_PREFIX_LEN).up(HOST_IF);
        for (j, h) in hosts.iter().enumerate().filter(|&(j, _)| j != i) {
            b.neighbour(HOST_IF, (*h).into(), &host_mac(j));
        }
        b.apply(ns)?;
    }
    Ok((set, host_ns))
}

/// The arguments every worker of `job run` gets.
pub fn worker_args(
    o: &JobOptions,
    secret_file: Option<&Path>,
    file: &Path,
    model: &Path,
) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "job".into(),
        "worker".into(),
        "--json".into(),
        "--job-file".into(),
        file.display().to_string(),
        "--algorithm".into(),
        o.algorithm.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--scale".into(),
        o.scale.to_string(),
        "--iterations".into(),
        o.iterations.to_string(),
        "--loss-bound".into(),
        o.loss_bound.to_string(),
        "--op".into(),
        op_name(o.op).into(),
        "--rate".into(),
        format!("{}bit", o.rate),
        "--timeout".into(),
        o.timeout.to_string(),
    ];
    if let Some(s) = secret_file {
        v.push("--secret-file".into());
        v.push(s.display().to_string());
    }
    v
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bench_range() {
        for ok in [
            "198.18.0.1",
            "198.19.255.254",
            "198.18.50.4",
            "::ffff:198.18.1.1",
        ] {
            assert!(in_bench_range(ok.parse().unwrap()).is_some(), "{ok}");
        }
        for bad in [
            "198.18.0.0",
            "198.19.255.255",
            "198.20.0.1",
            "10.0.0.1",
            "fd00::1",
        ] {
            assert!(in_bench_range(bad.parse().unwrap()).is_none(), "{bad}");
        }
    }

    fn spec_of(text: &str) -> JobSpec {
        JobSpec::from_toml_str(text).unwrap()
    }

    #[test]
    fn plan_checks_hosts_and_master() {
        let s = spec_of(
            r#"job = 1
master = "198.18.0.1:29600"
[[rank]]
rank = 0
host = "198.18.0.1"
[[rank]]
rank = 1
host = "198.18.0.2"
[[rank]]
rank = 2
host = "198.18.0.1"
"#,
        );
        let (hosts, host_of, master) = plan(&s, "f").unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(host_of, vec![0, 1, 0]);
        assert_eq!(master.port(), 29600);

        let s = spec_of("job = 1\n[[rank]]\nrank = 0\nhost = \"10.0.0.1\"\n");
        let e = plan(&s, "f").unwrap_err().to_string();
        assert!(e.contains("198.18.0.0/15") && e.contains("10.0.0.1"), "{e}");

        let s = spec_of(
            "job = 1\nmaster = \"198.18.0.9:1\"\n[[rank]]\nrank = 0\nhost = \"198.18.0.1\"\n",
        );
        let e = plan(&s, "f").unwrap_err().to_string();
        assert!(e.contains("not rank 0's host"), "{e}");

        let s = spec_of("job = 1\n[[rank]]\nrank = 0\nhost = \"198.18.0.7\"\n");
        assert_eq!(
            plan(&s, "f").unwrap().2,
            "198.18.0.7:29500".parse().unwrap()
        );
    }
}
