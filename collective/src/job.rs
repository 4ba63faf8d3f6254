//! A collective job's description: which ranks exist, what each one does, where it runs and
//! in which rack, and where rank 0 (the rendezvous master) listens.
//!
//! Two sources, because jobs are started two ways:
//! - a job file ([`JobSpec`], TOML or JSON), when the whole job is described up front (the
//!   example files in `collective/jobs/`); the tree builders need its roles and racks;
//! - the launcher's environment ([`LaunchEnv`]), when torchrun, Slurm `srun`, Open MPI
//!   `mpirun` or a PMI launcher (MPICH/Intel MPI hydra) started the processes and only says
//!   "you are rank r of n, rank 0 is at MASTER_ADDR:MASTER_PORT". Everything else is then
//!   exchanged through the [`rendezvous`](crate::rendezvous).
//!
//! Both are validated on construction, so the rest of the crate can rely on ranks being
//! exactly `0..world`, with at least one worker.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

/// Largest number of ranks in a job (bounds every per-rank table, on the wire too): the
/// rendezvous's bound.
pub const MAX_RANKS: usize = gradwire_rendezvous::MAX_RANKS;
/// Largest job priority (the transport's priority classes are 0..=7).
pub const MAX_PRIORITY: u8 = 7;
/// Longest rack label, in characters.
pub const MAX_RACK_LABEL: usize = 64;

/// What a rank does in the job.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes gradients and takes part in the all-reduce (the default).
    #[default]
    Worker,
    /// A parameter server (holds the model, serves pulls under SSP).
    Server,
    /// An aggregation node of an MLNET tree (sums children's gradients, forwards them).
    Aggregator,
}

/// One rank of a job file (`[[rank]]` table).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankSpec {
    /// The rank number, `0..world`.
    pub rank: usize,
    /// What it does; `worker` when not given.
    #[serde(default)]
    pub role: Role,
    /// The host it runs on.
    pub host: IpAddr,
    /// Its rack label; ranks without one are grouped by their host's subnet (see
    /// [`JobSpec::rack_of`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rack: Option<String>,
}

/// A job file: the job id, its priority, rank 0's rendezvous address and every rank.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The job id (separates jobs sharing hosts; checked at the rendezvous).
    pub job: u32,
    /// Priority class, `0..=MAX_PRIORITY`; 0 when not given.
    #[serde(default)]
    pub priority: u8,
    /// Where rank 0 listens for the rendezvous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<SocketAddr>,
    /// The ranks (`[[rank]]` tables); sorted by rank after loading.
    #[serde(rename = "rank")]
    pub ranks: Vec<RankSpec>,
}

/// Why a job description or launcher environment was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The job file could not be read.
    #[error("cannot read job file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The job file is not valid TOML/JSON or does not have the expected fields.
    #[error("job description is not valid {format}: {message}")]
    Parse {
        /// `"TOML"` or `"JSON"`.
        format: &'static str,
        /// The parser's message (with line and column).
        message: String,
    },
    /// The description parses but is not a usable job.
    #[error("invalid job: {0}")]
    Invalid(String),
    /// The job file's name ends in neither `.toml` nor `.json`.
    #[error("job file {} has an unknown extension: name it *.toml or *.json", .0.display())]
    UnknownExtension(PathBuf),
    /// The launcher's environment variables are missing, malformed or contradict each other.
    #[error("launcher environment: {0}")]
    Env(String),
    /// MASTER_ADDR did not resolve.
    #[error(
        "cannot resolve MASTER_ADDR {addr:?}: {source}; set it to rank 0's IP address or a \
         host name this machine can resolve"
    )]
    Resolve {
        /// `MASTER_ADDR:MASTER_PORT` as given.
        addr: String,
        /// Why (no address is reported as `NotFound`).
        source: std::io::Error,
    },
}

impl JobSpec {
    /// Parses and validates a TOML job description.
    pub fn from_toml_str(s: &str) -> Result<JobSpec, JobError> {
        let spec: JobSpec = toml::from_str(s).map_err(|e| JobError::Parse {
            format: "TOML",
            message: e.to_string().trim_end().to_owned(),
        })?;
        spec.finish()
    }

    /// Parses and validates a JSON job description (same field names as TOML; the ranks
    /// are the array `"rank"`).
    pub fn from_json_str(s: &str) -> Result<JobSpec, JobError> {
        let spec: JobSpec = serde_json::from_str(s).map_err(|e| JobError::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        spec.finish()
    }

    /// Reads, parses and validates a job file; the format follows the extension (`.toml` or
    /// `.json`, any case).
    pub fn load(path: &Path) -> Result<JobSpec, JobError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let parse: fn(&str) -> Result<JobSpec, JobError> = match ext.as_deref() {
            Some("toml") => JobSpec::from_toml_str,
            Some("json") => JobSpec::from_json_str,
            _ => return Err(JobError::UnknownExtension(path.to_owned())),
        };
        let text = std::fs::read_to_string(path).map_err(|source| JobError::Io {
            path: path.to_owned(),
            source,
        })?;
        parse(&text).map_err(|e| match e {
            // Name the file: the parser's line/column alone does not say which one.
            JobError::Parse { format, message } => JobError::Parse {
                format,
                message: format!("{}: {message}", path.display()),
            },
            JobError::Invalid(m) => JobError::Invalid(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    fn finish(mut self) -> Result<JobSpec, JobError> {
        self.validate()?;
        self.ranks.sort_by_key(|r| r.rank);
        Ok(self)
    }

    /// Checks that this is a usable job: 1..=[`MAX_RANKS`] ranks numbered exactly
    /// `0..world`, each once; priority at most [`MAX_PRIORITY`]; at least one worker; rack
    /// labels 1..=[`MAX_RACK_LABEL`] characters.
    pub fn validate(&self) -> Result<(), JobError> {
        let n = self.ranks.len();
        if n == 0 {
            return Err(invalid("no ranks: add at least one [[rank]] table"));
        }
        if n > MAX_RANKS {
            return Err(invalid(format!(
                "{n} ranks, more than the {MAX_RANKS} supported"
            )));
        }
        if self.priority > MAX_PRIORITY {
            return Err(invalid(format!(
                "priority {} is out of range: use 0..={MAX_PRIORITY}",
                self.priority
            )));
        }
        let mut seen = vec![false; n];
        let mut out_of_range = Vec::new();
        for r in &self.ranks {
            match seen.get_mut(r.rank) {
                Some(true) => {
                    return Err(invalid(format!(
                        "rank {} appears more than once: each of 0..{n} must appear exactly once",
                        r.rank
                    )))
                }
                Some(s) => *s = true,
                None => out_of_range.push(r.rank),
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            let extra = if out_of_range.is_empty() {
                String::new()
            } else {
                format!(" (found out-of-range rank(s) {out_of_range:?} instead)")
            };
            return Err(invalid(format!(
                "rank {missing} is missing: with {n} [[rank]] tables the ranks must be \
                 0..{n}, each once{extra}"
            )));
        }
        if !self.ranks.iter().any(|r| r.role == Role::Worker) {
            return Err(invalid(
                "no worker: at least one rank needs role = \"worker\" (the default)",
            ));
        }
        for r in &self.ranks {
            if let Some(rack) = &r.rack {
                let len = rack.chars().count();
                if len == 0 || len > MAX_RACK_LABEL {
                    return Err(invalid(format!(
                        "rank {}: rack label of {len} characters: use 1..={MAX_RACK_LABEL}, \
                         or leave it out to group by the host's subnet",
                        r.rank
                    )));
                }
            }
        }
        Ok(())
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s entry.
    pub fn rank(&self, r: usize) -> Option<&RankSpec> {
        // Loaded specs are sorted, so this is the direct index; the search covers specs
        // built by hand.
        self.ranks
            .get(r)
            .filter(|s| s.rank == r)
            .or_else(|| self.ranks.iter().find(|s| s.rank == r))
    }

    /// The workers' ranks, ascending.
    pub fn workers(&self) -> Vec<usize> {
        self.with_role(Role::Worker)
    }

    /// The parameter servers' ranks, ascending.
    pub fn servers(&self) -> Vec<usize> {
        self.with_role(Role::Server)
    }

    fn with_role(&self, role: Role) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .ranks
            .iter()
            .filter(|r| r.role == role)
            .map(|r| r.rank)
            .collect();
        v.sort_unstable();
        v
    }

    /// A dense rack index per rank (entry `r` is rank `r`'s rack, for a validated spec).
    ///
    /// Ranks with the same label share an index. A rank without a label is grouped by its
    /// host's subnet: the IPv4 /24 or the IPv6 /64 (IPv4-mapped IPv6 counts as IPv4); a
    /// label and a subnet never share a group. Indices are assigned in order of first
    /// appearance, walking the ranks in ascending order.
    pub fn rack_of(&self) -> Vec<usize> {
        #[derive(PartialEq, Eq, Hash)]
        enum Key<'a> {
            Label(&'a str),
            V4([u8; 3]),
            V6([u8; 8]),
        }
        let mut order: Vec<&RankSpec> = self.ranks.iter().collect();
        order.sort_by_key(|r| r.rank);
        let mut index: HashMap<Key<'_>, usize> = HashMap::new();
        order
            .iter()
            .map(|r| {
                let key = match (&r.rack, r.host.to_canonical()) {
                    (Some(label), _) => Key::Label(label),
                    (None, IpAddr::V4(a)) => {
                        let o = a.octets();
                        Key::V4([o[0], o[1], o[2]])
                    }
                    (None, IpAddr::V6(a)) => {
                        let mut p = [0u8; 8];
                        p.copy_from_slice(&a.octets()[..8]);
                        Key::V6(p)
                    }
                };
                let next = index.len();
                *index.entry(key).or_insert(next)
            })
            .collect()
    }
}

fn invalid(msg: impl Into<String>) -> JobError {
    JobError::Invalid(msg.into())
}

fn env_err(msg: impl Into<String>) -> JobError {
    JobError::Env(msg.into())
}

/// Which launcher's variables gave the rank and world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun / torch.distributed.run: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
    Torchrun,
    /// Slurm `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
    /// Open MPI `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// A PMI launcher (MPICH / Intel MPI hydra, Slurm's PMI plugins): `PMI_RANK`, `PMI_SIZE`.
    Pmi,
}

/// Each launcher's variables, in precedence order (the innermost launcher of the usual
/// nestings first: `srun torchrun`, `mpirun` inside a Slurm allocation).
struct LauncherVars {
    launcher: Launcher,
    name: &'static str,
    rank: &'static str,
    world: &'static str,
    local: Option<&'static str>,
}

const LAUNCHERS: [LauncherVars; 4] = [
    LauncherVars {
        launcher: Launcher::Torchrun,
        name: "torchrun",
        rank: "RANK",
        world: "WORLD_SIZE",
        local: Some("LOCAL_RANK"),
    },
    LauncherVars {
        launcher: Launcher::OpenMpi,
        name: "openmpi",
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
    },
    LauncherVars {
        launcher: Launcher::Slurm,
        name: "slurm",
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local: Some("SLURM_LOCALID"),
    },
    LauncherVars {
        launcher: Launcher::Pmi,
        name: "pmi",
        rank: "PMI_RANK",
        world: "PMI_SIZE",
        local: None,
    },
];

/// Names one launcher explicitly (`torchrun`, `openmpi`, `slurm`, `pmi`): only its variables
/// are read, and disagreeing variables of other launchers are ignored. For nested launches
/// whose outer launcher's variables are inherited (e.g. `srun torchrun`).
pub const LAUNCHER_VAR: &str = "GRADWIRE_LAUNCHER";

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = LAUNCHERS.iter().find(|v| v.launcher == *self);
        f.write_str(v.map_or("?", |v| v.name))
    }
}

/// Rank, world size and rendezvous address as the launcher gave them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `< world`.
    pub rank: usize,
    /// Number of ranks, `1..=MAX_RANKS`.
    pub world: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Rank 0's rendezvous address (`MASTER_ADDR:MASTER_PORT`), when set.
    pub master: Option<SocketAddr>,
    /// Whose variables these are.
    pub launcher: Launcher,
}

impl LaunchEnv {
    /// Reads the process environment (see [`LaunchEnv::from_vars`]).
    pub fn from_env() -> Result<LaunchEnv, JobError> {
        LaunchEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the launcher variables through `get`.
    ///
    /// Launchers are tried in the order torchrun, Open MPI, Slurm, PMI; the first whose rank
    /// and world variables are both set wins. Another launcher whose variables are also set
    /// must agree on rank and world, unless [`LAUNCHER_VAR`] names the launcher to use.
    /// `MASTER_ADDR` (IP or host name, resolved preferring IPv4) and `MASTER_PORT` go
    /// together.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, JobError> {
        let forced = match get(LAUNCHER_VAR) {
            None => None,
            Some(name) => {
                let v = LAUNCHERS
                    .iter()
                    .find(|v| v.name.eq_ignore_ascii_case(name.trim()));
                match v {
                    Some(v) => Some(v),
                    None => {
                        return Err(env_err(format!(
                            "{LAUNCHER_VAR}={name:?} is not a known launcher: use one of {}",
                            launcher_names()
                        )))
                    }
                }
            }
        };
        let candidates: Vec<&LauncherVars> = match forced {
            Some(v) => vec![v],
            None => LAUNCHERS.iter().collect(),
        };

        // (vars, rank, world) of every launcher with both variables set.
        let mut found: Vec<(&LauncherVars, usize, usize)> = Vec::new();
        let mut partial: Option<String> = None;
        for v in candidates {
            match (get(v.rank), get(v.world)) {
                (Some(r), Some(w)) => {
                    let rank = parse_var(v.rank, &r)?;
                    let world = parse_var(v.world, &w)?;
                    found.push((v, rank, world));
                }
                (None, None) => {}
                (Some(_), None) | (None, Some(_)) => {
                    let (set, unset) = match get(v.rank) {
                        Some(_) => (v.rank, v.world),
                        None => (v.world, v.rank),
                    };
                    partial.get_or_insert(format!(
                        "{set} is set but {unset} is not ({} sets both)",
                        v.name
                    ));
                }
            }
        }
        let Some(&(first, rank, world)) = found.first() else {
            return Err(env_err(match partial {
                Some(p) => p,
                None => format!(
                    "no rank/world size found: looked for {}; start the job under one of \
                     these launchers (or set RANK and WORLD_SIZE yourself)",
                    LAUNCHERS
                        .iter()
                        .map(|v| format!("{}/{} ({})", v.rank, v.world, v.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }));
        };
        for &(other, r, w) in &found[1..] {
            if (r, w) != (rank, world) {
                return Err(env_err(format!(
                    "{}/{} ({}) say rank {rank} of {world} but {}/{} ({}) say rank {r} of \
                     {w}; unset the stale variables, or set {LAUNCHER_VAR}={} if {} runs \
                     inside {}",
                    first.rank,
                    first.world,
                    first.name,
                    other.rank,
                    other.world,
                    other.name,
                    first.name,
                    first.name,
                    other.name
                )));
            }
        }
        if world == 0 || world > MAX_RANKS {
            return Err(env_err(format!(
                "{}={world}: the world size must be 1..={MAX_RANKS}",
                first.world
            )));
        }
        if rank >= world {
            return Err(env_err(format!(
                "{}={rank} is not below {}={world}",
                first.rank, first.world
            )));
        }
        let local_rank = match first.local.and_then(|k| get(k).map(|v| (k, v))) {
            Some((k, v)) => Some(parse_var(k, &v)?),
            None => None,
        };
        let master = master_from_vars(&get)?;
        Ok(LaunchEnv {
            rank,
            world,
            local_rank,
            master,
            launcher: first.launcher,
        })
    }
}

fn launcher_names() -> String {
    LAUNCHERS
        .iter()
        .map(|v| v.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn parse_var(name: &str, value: &str) -> Result<usize, JobError> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| env_err(format!("{name}={value:?} is not a non-negative integer")))
}

fn master_from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<Option<SocketAddr>, JobError> {
    let (addr, port) = match (get("MASTER_ADDR"), get("MASTER_PORT")) {
        (None, None) => return Ok(None),
        (Some(a), Some(p)) => (a, p),
        (Some(_), None) => {
            return Err(env_err(
                "MASTER_ADDR is set but MASTER_PORT is not: set both (rank 0's address and \
                 rendezvous port) or neither",
            ))
        }
        (None, Some(_)) => {
            return Err(env_err(
                "MASTER_PORT is set but MASTER_ADDR is not: set both (rank 0's address and \
                 rendezvous port) or neither",
            ))
        }
    };
    let port_num = match port.trim().parse::<u16>() {
        Ok(p) if p != 0 => p,
        _ => {
            return Err(env_err(format!(
                "MASTER_PORT={port:?} is not a port number (1..=65535)"
            )))
        }
    };
    let host = addr.trim();
    // "[::1]" as well as "::1".
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(env_err("MASTER_ADDR is empty: set it to rank 0's address"));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, port_num)));
    }
    let shown = format!("{addr}:{port_num}");
    let addrs: Vec<SocketAddr> = (host, port_num)
        .to_socket_addrs()
        .map_err(|source| JobError::Resolve {
            addr: shown.clone(),
            source,
        })?
        .collect();
    let pick = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied();
    match pick {
        Some(a) => Ok(Some(a)),
        None => Err(JobError::Resolve {
            addr: shown,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no addresses"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RING4: &str = include_str!("../jobs/ring4.toml");
    const RACKS8: &str = include_str!("../jobs/racks8.toml");

    fn spec(ranks: Vec<RankSpec>) -> JobSpec {
        JobSpec {
            job: 1,
            priority: 0,
            master: None,
            ranks,
        }
    }

    fn rs(rank: usize, host: &str, rack: Option<&str>) -> RankSpec {
        RankSpec {
            rank,
            role: Role::Worker,
            host: host.parse().unwrap(),
            rack: rack.map(str::to_owned),
        }
    }

    fn invalid_msg(r: Result<(), JobError>) -> String {
        match r {
            Err(JobError::Invalid(m)) => m,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn example_files_load_and_validate() {
        let ring = JobSpec::from_toml_str(RING4).unwrap();
        assert_eq!(ring.job, 4);
        assert_eq!(ring.world(), 4);
        assert_eq!(ring.master, Some("127.0.0.1:29500".parse().unwrap()));
        assert_eq!(ring.workers(), vec![0, 1, 2, 3]);
        assert!(ring.servers().is_empty());
        assert_eq!(ring.rack_of(), vec![0, 0, 0, 0]);

        let racks = JobSpec::from_toml_str(RACKS8).unwrap();
        assert_eq!(racks.world(), 8);
        assert_eq!(racks.workers(), (0..8).collect::<Vec<_>>());
        assert_eq!(racks.rack_of(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
        let m = racks.master.unwrap();
        assert_eq!(m.port(), 29500);
        assert_eq!(m.ip(), racks.rank(0).unwrap().host);

        // And through load(), by path.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs");
        assert_eq!(JobSpec::load(&dir.join("ring4.toml")).unwrap(), ring);
        assert_eq!(JobSpec::load(&dir.join("racks8.toml")).unwrap(), racks);
    }

    #[test]
    fn toml_fields_defaults_and_sorting() {
        let s = r#"
            job = 7
            priority = 2
            master = "198.18.0.1:29500"
            [[rank]]
            rank = 1
            role = "server"
            host = "198.18.1.2"
            [[rank]]
            rank = 0
            host = "198.18.1.1"
            rack = "r1"
            [[rank]]
            rank = 2
            role = "aggregator"
            host = "2001:db8::1"
        "#;
        let j = JobSpec::from_toml_str(s).unwrap();
        assert_eq!(j.job, 7);
        assert_eq!(j.priority, 2);
        assert_eq!(j.master, Some("198.18.0.1:29500".parse().unwrap()));
        let order: Vec<usize> = j.ranks.iter().map(|r| r.rank).collect();
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(j.rank(0).unwrap().role, Role::Worker);
        assert_eq!(j.rank(0).unwrap().rack.as_deref(), Some("r1"));
        assert_eq!(j.rank(1).unwrap().role, Role::Server);
        assert_eq!(j.rank(2).unwrap().role, Role::Aggregator);
        assert!(j.rank(3).is_none());
        assert_eq!(j.workers(), vec![0]);
        assert_eq!(j.servers(), vec![1]);

        let defaults =
            JobSpec::from_toml_str("job = 1\n[[rank]]\nrank = 0\nhost = \"10.0.0.1\"\n").unwrap();
        assert_eq!(defaults.priority, 0);
        assert_eq!(defaults.master, None);
    }

    #[test]
    fn json_same_fields_and_round_trip() {
        let j = JobSpec::from_toml_str(RACKS8).unwrap();
        let json = serde_json::to_string(&j).unwrap();
        assert!(json.contains("\"rank\":["), "{json}");
        assert_eq!(JobSpec::from_json_str(&json).unwrap(), j);
        let toml_text = toml::to_string(&j).unwrap();
        assert_eq!(JobSpec::from_toml_str(&toml_text).unwrap(), j);

        let s = r#"{"job": 3, "rank": [{"rank": 0, "host": "::1", "role": "worker"}]}"#;
        let j = JobSpec::from_json_str(s).unwrap();
        assert_eq!(j.job, 3);
        assert_eq!(j.rank(0).unwrap().host, "::1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn parse_errors_name_the_format() {
        match JobSpec::from_toml_str("job = 1\nbogus = 2\n[[rank]]\nrank = 0\nhost = \"::1\"") {
            Err(JobError::Parse { format, message }) => {
                assert_eq!(format, "TOML");
                assert!(message.contains("bogus"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match JobSpec::from_json_str(r#"{"job": 1, "rank": [{"rank": 0, "host": "nope"}]}"#) {
            Err(JobError::Parse { format, .. }) => assert_eq!(format, "JSON"),
            other => panic!("{other:?}"),
        }
        match JobSpec::from_toml_str(
            r#"job = 1
[[rank]]
rank = 0
host = "::1"
role = "boss""#,
        ) {
            Err(JobError::Parse { message, .. }) => assert!(message.contains("boss"), "{message}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn validate_rank_numbering() {
        let m = invalid_msg(spec(vec![]).validate());
        assert!(m.contains("no ranks"), "{m}");

        let m =
            invalid_msg(spec(vec![rs(0, "10.0.0.1", None), rs(0, "10.0.0.2", None)]).validate());
        assert!(m.contains("rank 0 appears more than once"), "{m}");

        let m =
            invalid_msg(spec(vec![rs(0, "10.0.0.1", None), rs(2, "10.0.0.2", None)]).validate());
        assert!(m.contains("rank 1 is missing"), "{m}");
        assert!(m.contains("[2]"), "{m}");

        let many: Vec<RankSpec> = (0..=MAX_RANKS).map(|r| rs(r, "10.0.0.1", None)).collect();
        let m = invalid_msg(spec(many).validate());
        assert!(m.contains("4097 ranks"), "{m}");
        let max: Vec<RankSpec> = (0..MAX_RANKS).map(|r| rs(r, "10.0.0.1", None)).collect();
        assert!(spec(max).validate().is_ok());
    }

    #[test]
    fn validate_priority_roles_racks() {
        let mut j = spec(vec![rs(0, "10.0.0.1", None)]);
        j.priority = MAX_PRIORITY;
        assert!(j.validate().is_ok());
        j.priority = MAX_PRIORITY + 1;
        assert!(invalid_msg(j.validate()).contains("priority 8"));

        let mut j = spec(vec![rs(0, "10.0.0.1", None)]);
        j.ranks[0].role = Role::Server;
        assert!(invalid_msg(j.validate()).contains("no worker"));

        let mut j = spec(vec![rs(0, "10.0.0.1", Some(""))]);
        assert!(invalid_msg(j.validate()).contains("rack label of 0"));
        j.ranks[0].rack = Some("é".repeat(MAX_RACK_LABEL));
        assert!(j.validate().is_ok());
        j.ranks[0].rack = Some("x".repeat(MAX_RACK_LABEL + 1));
        assert!(invalid_msg(j.validate()).contains("rack label of 65"));
    }

    #[test]
    fn rack_of_groups_labels_and_subnets() {
        let j = spec(vec![
            rs(0, "10.0.1.1", None),
            rs(1, "10.0.2.1", Some("a")),
            rs(2, "10.0.1.200", None),
            rs(3, "2001:db8:0:1::5", None),
            rs(4, "10.0.9.9", Some("a")),
            rs(5, "2001:db8:0:1:ffff::1", None),
            rs(6, "2001:db8:0:2::1", None),
            rs(7, "::ffff:10.0.1.7", None),
            rs(8, "10.0.3.1", None),
        ]);
        j.validate().unwrap();
        // 10.0.1/24 (with the mapped ::ffff:10.0.1.7), label a, 2001:db8:0:1::/64,
        // 2001:db8:0:2::/64, 10.0.3/24.
        assert_eq!(j.rack_of(), vec![0, 1, 0, 2, 1, 2, 3, 0, 4]);

        // Order of first appearance is by rank, not by position in the list.
        let mut shuffled = j.clone();
        shuffled.ranks.reverse();
        assert_eq!(shuffled.rack_of(), j.rack_of());
        assert_eq!(shuffled.rank(3), j.rank(3));
    }

    #[test]
    fn load_checks_extension_and_names_path() {
        let dir = std::env::temp_dir().join(format!("gw-job-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let yaml = dir.join("job.yaml");
        match JobSpec::load(&yaml) {
            Err(e @ JobError::UnknownExtension(_)) => {
                let m = e.to_string();
                assert!(
                    m.contains(".toml") && m.contains(".json") && m.contains("job.yaml"),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }

        let missing = dir.join("missing.toml");
        match JobSpec::load(&missing) {
            Err(JobError::Io { path, source }) => {
                assert_eq!(path, missing);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }

        let json = dir.join("Job.JSON");
        std::fs::write(
            &json,
            r#"{"job": 9, "rank": [{"rank": 0, "host": "10.0.0.1"}]}"#,
        )
        .unwrap();
        assert_eq!(JobSpec::load(&json).unwrap().job, 9);

        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "job = 1\n[[rank]]\nrank = 1\nhost = \"10.0.0.1\"\n").unwrap();
        match JobSpec::load(&bad) {
            Err(JobError::Invalid(m)) => {
                assert!(
                    m.contains("bad.toml") && m.contains("rank 0 is missing"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn env_msg(r: Result<LaunchEnv, JobError>) -> String {
        match r {
            Err(JobError::Env(m)) => m,
            other => panic!("expected Env error, got {other:?}"),
        }
    }

    #[test]
    fn each_launcher() {
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "198.18.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world: 8,
                local_rank: Some(1),
                master: Some("198.18.0.1:29500".parse().unwrap()),
                launcher: Launcher::Torchrun,
            }
        );

        let e = LaunchEnv::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (5, 6, Some(2)));
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!(e.master, None);

        let e =
            LaunchEnv::from_vars(vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (0, 1, None));
        assert_eq!(e.launcher, Launcher::Slurm);

        let e = LaunchEnv::from_vars(vars(&[("PMI_RANK", "2"), ("PMI_SIZE", "4")])).unwrap();
        assert_eq!((e.rank, e.world, e.launcher), (2, 4, Launcher::Pmi));
        assert_eq!(e.launcher.to_string(), "pmi");
    }

    #[test]
    fn agreeing_launchers_take_precedence_order() {
        let e = LaunchEnv::from_vars(vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.world), (1, 2));
    }

    #[test]
    fn disagreeing_launchers_name_both_unless_one_is_chosen() {
        let both = [
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
        ];
        let m = env_msg(LaunchEnv::from_vars(vars(&both)));
        assert!(
            m.contains("RANK/WORLD_SIZE") && m.contains("SLURM_PROCID/SLURM_NTASKS"),
            "{m}"
        );
        assert!(
            m.contains("rank 5 of 8") && m.contains("rank 1 of 2"),
            "{m}"
        );
        assert!(m.contains(LAUNCHER_VAR), "{m}");

        let mut chosen = both.to_vec();
        chosen.push((LAUNCHER_VAR, "torchrun"));
        let e = LaunchEnv::from_vars(vars(&chosen)).unwrap();
        assert_eq!((e.rank, e.world, e.launcher), (5, 8, Launcher::Torchrun));
        chosen.pop();
        chosen.push((LAUNCHER_VAR, "Slurm"));
        let e = LaunchEnv::from_vars(vars(&chosen)).unwrap();
        assert_eq!((e.rank, e.world, e.launcher), (1, 2, Launcher::Slurm));
        chosen.pop();
        chosen.push((LAUNCHER_VAR, "lsf"));
        let m = env_msg(LaunchEnv::from_vars(vars(&chosen)));
        assert!(
            m.contains("lsf") && m.contains("torchrun, openmpi, slurm, pmi"),
            "{m}"
        );
    }

    #[test]
    fn bad_numbers_and_ranges() {
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("RANK", "x1"),
            ("WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("RANK=\"x1\""), "{m}");
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("RANK", "-1"),
            ("WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("RANK=\"-1\""), "{m}");
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
        ])));
        assert!(m.contains("RANK=2 is not below WORLD_SIZE=2"), "{m}");
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "0"),
        ])));
        assert!(m.contains("PMI_SIZE=0"), "{m}");
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4097"),
        ])));
        assert!(m.contains("WORLD_SIZE=4097") && m.contains("4096"), "{m}");
        let m = env_msg(LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "zero"),
        ])));
        assert!(m.contains("LOCAL_RANK=\"zero\""), "{m}");
    }

    #[test]
    fn nothing_or_half_set() {
        let m = env_msg(LaunchEnv::from_vars(vars(&[])));
        for v in [
            "RANK",
            "OMPI_COMM_WORLD_RANK",
            "SLURM_PROCID",
            "PMI_RANK",
            "SLURM_NTASKS",
        ] {
            assert!(m.contains(v), "{m}");
        }
        let m = env_msg(LaunchEnv::from_vars(vars(&[("SLURM_PROCID", "0")])));
        assert!(
            m.contains("SLURM_PROCID is set but SLURM_NTASKS is not"),
            "{m}"
        );
        // A half-set lower-precedence launcher does not get in the way of a complete one.
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.launcher), (1, Launcher::Torchrun));
    }

    #[test]
    fn master_address() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            LaunchEnv::from_vars(vars(&v))
        };
        let m = env_msg(with(&[("MASTER_ADDR", "10.0.0.1")]));
        assert!(m.contains("MASTER_PORT is not"), "{m}");
        let m = env_msg(with(&[("MASTER_PORT", "29500")]));
        assert!(m.contains("MASTER_ADDR is not"), "{m}");
        let m = env_msg(with(&[
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "99999"),
        ]));
        assert!(m.contains("MASTER_PORT=\"99999\""), "{m}");
        let m = env_msg(with(&[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "0")]));
        assert!(m.contains("MASTER_PORT=\"0\""), "{m}");

        let e = with(&[("MASTER_ADDR", "[::1]"), ("MASTER_PORT", "29500")]).unwrap();
        assert_eq!(e.master, Some("[::1]:29500".parse().unwrap()));
        let e = with(&[("MASTER_ADDR", "fd00::2"), ("MASTER_PORT", "1")]).unwrap();
        assert_eq!(e.master, Some("[fd00::2]:1".parse().unwrap()));
        // A host name resolves (localhost is in every /etc/hosts; IPv4 preferred).
        let e = with(&[("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")]).unwrap();
        let a = e.master.unwrap();
        assert!(a.ip().is_loopback() && a.port() == 29500, "{a}");
        // .invalid never resolves (RFC 6761).
        match with(&[
            ("MASTER_ADDR", "no-such-host.invalid"),
            ("MASTER_PORT", "29500"),
        ]) {
            Err(e @ JobError::Resolve { .. }) => {
                assert!(e.to_string().contains("no-such-host.invalid"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }
}
