//! Kernel-TCP settings of a TCP variant's run: which congestion control the sockets use
//! (DCTCP is gradwire-ebpf's `gw_dctcp`, registered for the variant), `net.ipv4.tcp_ecn` and
//! the routes' `rto_min` in every host namespace (set for the run, read back, restored after),
//! and how many data segments a socket sent (`TCP_INFO`).
//!
//! `/proc/sys/net` and the routing table are per network namespace, so the settings touch
//! only the testbed's hosts, never the machine's own namespace.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

use gradwire_ebpf::tcp_cc::{self, Dctcp, TcpCcError, DCTCP_NAME};
use gradwire_netns::cmd::ip;
use gradwire_netns::link::set_route_rto_min;
use gradwire_netns::run_in_netns;

const TCP_ECN: &str = "/proc/sys/net/ipv4/tcp_ecn";

/// The kernel congestion control a variant's `congestion` name runs as: `dctcp` is
/// gradwire's BPF DCTCP ([`DCTCP_NAME`], registered while the returned [`Dctcp`] lives; the
/// kernel's own `dctcp` module if it has one), anything else must be listed in
/// `tcp_available_congestion_control`. `Err`: why the variant cannot run on this machine.
pub(crate) fn resolve_congestion(congestion: &str) -> Result<(String, Option<Dctcp>), String> {
    let available = tcp_cc::available().map_err(|e| e.to_string())?;
    if congestion != "dctcp" {
        return if available.iter().any(|n| n == congestion) {
            Ok((congestion.to_string(), None))
        } else {
            Err(format!(
                "this kernel offers no {congestion} (tcp_available_congestion_control: {})",
                available.join(" ")
            ))
        };
    }
    if available.iter().any(|n| n == "dctcp") {
        return Ok(("dctcp".into(), None));
    }
    match Dctcp::register() {
        Ok(d) => Ok((DCTCP_NAME.to_string(), Some(d))),
        // Registered by someone else (another gradwire process): usable while they hold it.
        Err(TcpCcError::AlreadyRegistered { .. }) => Ok((DCTCP_NAME.to_string(), None)),
        Err(e) => Err(format!(
            "this kernel has no dctcp module and gradwire's BPF DCTCP ({DCTCP_NAME}) could not \
             be registered: {e}"
        )),
    }
}

/// What one host namespace had before the run.
#[derive(Debug)]
struct Saved {
    ns: String,
    /// `tcp_ecn` before, if it was changed.
    tcp_ecn: Option<String>,
    /// Routes (as `ip route show` prints them) that were replaced.
    routes: Vec<String>,
}

/// The settings applied to every host namespace; [`HostTcp::restore`] puts back what was
/// there.
#[derive(Debug)]
pub(crate) struct HostTcp {
    saved: Vec<Saved>,
    /// `tcp_ecn` as read back after applying.
    pub tcp_ecn: u8,
}

fn read_tcp_ecn(ns: &str) -> Result<String, String> {
    run_in_netns(ns, || std::fs::read_to_string(TCP_ECN))
        .map_err(|e| e.to_string())?
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("{ns}: read {TCP_ECN}: {e}"))
}

fn write_tcp_ecn(ns: &str, value: &str) -> Result<(), String> {
    let v = value.to_string();
    run_in_netns(ns, move || std::fs::write(TCP_ECN, v))
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{ns}: write {value} to {TCP_ECN}: {e}"))
}

/// The IPv4 routes of the main table, one per line as `ip -o route show` prints them (the
/// namespace kit's hosts have plain routes: no state flags that `ip route replace` refuses).
fn routes(ns: &str) -> Result<Vec<String>, String> {
    let out = ip(
        Some(ns),
        &["-n", ns, "-o", "-4", "route", "show", "table", "main"],
    )
    .map_err(|e| e.to_string())?;
    Ok(out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// `ip route replace <route>` in `ns`: puts back a route as it was printed before.
fn replace_route(ns: &str, route: &str) -> Result<(), String> {
    let mut args = vec!["-n", ns, "route", "replace"];
    args.extend(route.split_whitespace());
    ip(Some(ns), &args).map(drop).map_err(|e| e.to_string())
}

/// Applies the settings to `saved.ns`, recording in `saved` what it changes; returns
/// `tcp_ecn` as read back.
fn apply_to(saved: &mut Saved, ecn: bool, rto_min_ms: Option<u32>) -> Result<u8, String> {
    let ns = saved.ns.clone();
    let ns = ns.as_str();
    let before = read_tcp_ecn(ns)?;
    if ecn && before != "1" {
        write_tcp_ecn(ns, "1")?;
        saved.tcp_ecn = Some(before);
    }
    let now = read_tcp_ecn(ns)?;
    if ecn && now != "1" {
        return Err(format!("{ns}: {TCP_ECN} reads {now} after writing 1"));
    }
    if let Some(ms) = rto_min_ms {
        // What was there, for restore (the namespace kit sets rto_min, nothing unsets it).
        saved.routes = routes(ns)?;
        let after = set_route_rto_min(ns, Duration::from_millis(u64::from(ms)))
            .map_err(|e| e.to_string())?;
        let want = [format!("rto_min {ms}ms"), format!("rto_min lock {ms}ms")];
        if let Some(bad) = after
            .iter()
            .find(|r| !want.iter().any(|w| r.contains(w.as_str())))
        {
            return Err(format!(
                "{ns}: route {bad:?} has no rto_min {ms}ms after setting it"
            ));
        }
    }
    now.parse()
        .map_err(|_| format!("{ns}: {TCP_ECN} reads {now:?}, not a number"))
}

impl HostTcp {
    /// In every namespace of `hosts`: `tcp_ecn = 1` if `ecn`, and `rto_min` on every IPv4
    /// route if `rto_min_ms` is given; both read back. On an error, what was already changed
    /// is restored.
    pub(crate) fn apply(
        hosts: &[String],
        ecn: bool,
        rto_min_ms: Option<u32>,
    ) -> Result<HostTcp, String> {
        let mut h = HostTcp {
            saved: Vec::new(),
            tcp_ecn: 0,
        };
        for ns in hosts {
            if let Err(e) = h.apply_one(ns, ecn, rto_min_ms) {
                return Err(match h.restore() {
                    Ok(()) => e,
                    Err(r) => format!("{e} (and restoring: {r})"),
                });
            }
        }
        Ok(h)
    }

    fn apply_one(&mut self, ns: &str, ecn: bool, rto_min_ms: Option<u32>) -> Result<(), String> {
        let mut saved = Saved {
            ns: ns.to_string(),
            tcp_ecn: None,
            routes: Vec::new(),
        };
        // Whatever happens, what was changed is remembered for restore.
        let result = apply_to(&mut saved, ecn, rto_min_ms);
        self.saved.push(saved);
        self.tcp_ecn = result?;
        Ok(())
    }

    /// Puts back every changed `tcp_ecn` and route; reports every failure.
    pub(crate) fn restore(self) -> Result<(), String> {
        let mut errors = Vec::new();
        for s in self.saved {
            for r in &s.routes {
                if let Err(e) = replace_route(&s.ns, r) {
                    errors.push(e);
                }
            }
            if let Some(v) = &s.tcp_ecn {
                if let Err(e) = write_tcp_ecn(&s.ns, v) {
                    errors.push(e);
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

/// Data segments `s` has sent so far, retransmissions included, pure ACKs not
/// (`tcpi_data_segs_out` of `TCP_INFO`, Linux 4.6+; 0 on older kernels).
#[allow(unsafe_code)] // getsockopt(TCP_INFO): no safe wrapper in nix or std.
pub(crate) fn data_segs_out(s: &TcpStream) -> io::Result<u64> {
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a writable buffer of `len` bytes that lives across the call; the
    // kernel writes at most `len` bytes into it and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zero-initialised, then (partly) written by the kernel; `tcp_info` is integers
    // only, so every byte pattern is a valid value.
    let info = unsafe { info.assume_init() };
    Ok(u64::from(info.tcpi_data_segs_out))
}
