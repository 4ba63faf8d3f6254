//! What a running fabric counts ([`FabricStats`]), and its stats file: the fabric process
//! replaces it atomically every stats interval ([`write_stats`]) and `gradwire fabric stats`
//! reads it back as the same type ([`read_stats`]). A missing or mistyped field is an error
//! naming the file, never a zero.

use std::path::{Path, PathBuf};

use gradwire::afxdp::port::RawPortStats;
use gradwire::afxdp::KernelStats;
use serde::{Deserialize, Serialize};

use crate::forward::ForwardCounters;
pub use crate::lag::LagStats;
use crate::sched::{PortCounters, NUM_QUEUES};
use crate::topology::Ecmp;

/// Counters of one switch port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PortStats {
    /// Interface in the switch namespace.
    pub ifname: String,
    /// What is at the other end (`host NAME` or `switch NAME port`).
    pub peer: String,
    /// Link rate.
    pub rate_bps: u64,
    /// Link delay.
    pub delay_ns: u64,
    /// Link loss probability.
    pub loss: f64,
    /// Egress queueing counters.
    pub egress: PortCounters,
    /// Bytes queued now, per queue.
    pub depth_bytes: [u64; NUM_QUEUES],
    /// Socket counters (rx = frames received on this port, tx = frames sent).
    pub socket: RawPortStats,
    /// The kernel's socket counters (drops before the fabric saw a frame).
    pub kernel: KernelStats,
}

/// Counters of one switch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchStats {
    /// Name.
    pub name: String,
    /// ECMP mode.
    pub ecmp: Ecmp,
    /// Forwarding counters.
    pub forward: ForwardCounters,
    /// Ports.
    pub ports: Vec<PortStats>,
}

/// Everything the fabric counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FabricStats {
    /// Topology name.
    pub topology: String,
    /// Still forwarding (`false` in the last snapshot, written as the fabric stops).
    pub running: bool,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Wall-clock time of this snapshot, seconds since the epoch.
    pub updated_unix: u64,
    /// Lag of departures against the emulated clock.
    pub lag: LagStats,
    /// Loop iterations and how many ended in a sleep.
    pub iterations: u64,
    /// Sleeps in `ppoll()`.
    pub sleeps: u64,
    /// CPU time (user + system) of the fabric's thread so far, seconds: the cost of the switch
    /// itself. Kernel work on veth that runs in other contexts (the senders' softirqs running
    /// the XDP program and copying into the UMEM) is not in it.
    pub loop_cpu_s: f64,
    /// Per switch.
    pub switches: Vec<SwitchStats>,
}

/// Frame counts of a whole fabric, summed over switches and ports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FabricTotals {
    /// Frames handed to an egress port.
    pub forwarded: u64,
    /// Frames put on a link and not lost.
    pub delivered: u64,
    /// Frames lost on links (random loss).
    pub lost: u64,
    /// Frames marked CE.
    pub marked: u64,
    /// Frames dropped by a threshold or a full buffer.
    pub dropped: u64,
}

impl FabricStats {
    /// Frames queued or in flight anywhere in the fabric.
    pub fn in_fabric(&self) -> u64 {
        self.switches
            .iter()
            .flat_map(|s| &s.ports)
            .map(|p| {
                let c = &p.egress;
                let arrived: u64 = c.queues.iter().map(|q| q.enqueued_pkts).sum();
                arrived.saturating_sub(c.delivered_pkts + c.lost_pkts)
            })
            .sum()
    }

    /// The stats of switch `name`.
    pub fn switch(&self, name: &str) -> Option<&SwitchStats> {
        self.switches.iter().find(|s| s.name == name)
    }

    /// Frame counts summed over every switch and port.
    pub fn totals(&self) -> FabricTotals {
        let mut t = FabricTotals::default();
        for sw in &self.switches {
            t.forwarded += sw.forward.forwarded;
            for p in &sw.ports {
                t.delivered += p.egress.delivered_pkts;
                t.lost += p.egress.lost_pkts;
                for q in &p.egress.queues {
                    t.marked += q.marked;
                    t.dropped += q.dropped_threshold + q.dropped_buffer;
                }
            }
        }
        t
    }
}

/// A stats file could not be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum StatsFileError {
    /// Reading the file.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its contents are not fabric stats (a field missing or of the wrong type, or no JSON).
    #[error("{}: not fabric stats: {source} (written by another gradwire version? restart the fabric)", path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// What is wrong, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// Writing or renaming the file.
    #[error("{}: cannot write the fabric stats: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl StatsFileError {
    /// Whether the file does not exist (not yet written, or removed).
    pub fn is_not_found(&self) -> bool {
        matches!(self, StatsFileError::Read { source, .. }
            if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Writes `stats` to `path` atomically (a temporary file `<path>.tmp`, then a rename), so a
/// reader sees either the previous snapshot or this one.
pub fn write_stats(path: &Path, stats: &FabricStats) -> Result<(), StatsFileError> {
    let write = |source| StatsFileError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec_pretty(stats).map_err(|e| write(std::io::Error::other(e)))?;
    std::fs::write(&tmp, text).map_err(write)?;
    std::fs::rename(&tmp, path).map_err(write)
}

/// Publishes the snapshots of one fabric to its stats file. A failed write only costs
/// visibility, so the first failure is reported on stderr and the fabric carries on.
#[derive(Debug)]
pub struct StatsPublisher {
    path: PathBuf,
    warned: bool,
}

impl StatsPublisher {
    /// Publishes to `path`.
    pub fn new(path: PathBuf) -> StatsPublisher {
        StatsPublisher {
            path,
            warned: false,
        }
    }

    /// The stats file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file with `stats`.
    pub fn publish(&mut self, stats: &FabricStats) {
        if let Err(e) = write_stats(&self.path, stats) {
            if !self.warned {
                eprintln!("gradwire fabric: {e}");
                self.warned = true;
            }
        }
    }
}

/// Reads a stats file written by [`write_stats`].
pub fn read_stats(path: &Path) -> Result<FabricStats, StatsFileError> {
    read_stats_with_text(path).map(|(stats, _)| stats)
}

/// Reads a stats file written by [`write_stats`], with its text as it is on disk.
pub fn read_stats_with_text(path: &Path) -> Result<(FabricStats, String), StatsFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| StatsFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let stats = serde_json::from_str(&text).map_err(|source| StatsFileError::Decode {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((stats, text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::QueueCounters;

    fn sample() -> FabricStats {
        let mut egress = PortCounters::default();
        egress.queues[1] = QueueCounters {
            enqueued_pkts: 900,
            dequeued_pkts: 899,
            marked: 12,
            dropped_threshold: 3,
            max_depth_bytes: 45_100,
            first_drop_ns: Some(5_000),
            ..QueueCounters::default()
        };
        egress.delivered_pkts = 899;
        FabricStats {
            topology: "incast".into(),
            running: true,
            uptime_s: 12.34,
            updated_unix: 1000,
            lag: LagStats {
                departures: 899,
                late: 2,
                max_lag_ns: 1_000_000,
                worst_ns: 2_500_000,
                mean_ns: 9000,
                p99_ns: 65_535,
                behind: false,
            },
            iterations: 5,
            sleeps: 4,
            loop_cpu_s: 0.5,
            switches: vec![SwitchStats {
                name: "s0".into(),
                ecmp: Ecmp::Flow,
                forward: ForwardCounters {
                    rx: 1810,
                    forwarded: 1800,
                    not_ipv4: 10,
                    ..ForwardCounters::default()
                },
                ports: vec![PortStats {
                    ifname: "p0".into(),
                    peer: "host h0".into(),
                    rate_bps: 200_000_000,
                    delay_ns: 20_000,
                    loss: 0.0,
                    egress,
                    depth_bytes: [0, 1538, 0, 0, 0, 0, 0, 0],
                    socket: RawPortStats::default(),
                    kernel: KernelStats::default(),
                }],
            }],
        }
    }

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "gradwire-fabric-stats-{}-{tag}",
            std::process::id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    #[test]
    fn stats_read_back_as_written() {
        let d = dir("roundtrip");
        let path = d.0.join("fabric-incast.json");
        let s = sample();
        write_stats(&path, &s).unwrap();
        assert!(!path.with_extension("tmp").exists());
        let (back, text) = read_stats_with_text(&path).unwrap();
        assert_eq!(back, s);
        assert!(text.contains("\"behind\": false"), "{text}");
        assert_eq!(s.in_fabric(), 1);
        assert_eq!(
            s.totals(),
            FabricTotals {
                forwarded: 1800,
                delivered: 899,
                lost: 0,
                marked: 12,
                dropped: 3
            }
        );
    }

    #[test]
    fn a_missing_or_mistyped_field_is_an_error_naming_the_file() {
        let d = dir("strict");
        let path = d.0.join("fabric-x.json");
        let good = serde_json::to_value(sample()).unwrap();

        let mut v = good.clone();
        v["lag"].as_object_mut().unwrap().remove("late");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = read_stats(&path).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(e.contains("missing field `late`"), "{e}");

        // An optional counter must be present too (as null), not silently absent.
        let mut v = good.clone();
        v["switches"][0]["ports"][0]["egress"]["queues"][1]
            .as_object_mut()
            .unwrap()
            .remove("first_mark_ns");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = read_stats(&path).unwrap_err().to_string();
        assert!(e.contains("missing field `first_mark_ns`"), "{e}");

        let mut v = good;
        v["switches"][0]["forward"]["forwarded"] = serde_json::json!("many");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = read_stats(&path).unwrap_err();
        assert!(matches!(e, StatsFileError::Decode { .. }), "{e}");
        assert!(e.to_string().contains("invalid type"), "{e}");

        let missing = d.0.join("nothing.json");
        let e = read_stats(&missing).unwrap_err();
        assert!(e.is_not_found(), "{e}");
        assert!(e.to_string().contains("nothing.json"), "{e}");
    }
}
