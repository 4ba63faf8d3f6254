//! The incast workload on the message layer (`msg-p<pct>` variants): one
//! [`Endpoint`] per host for the whole variant, every pair's tensors messages between two
//! ranks, no connection or handshake per pair.
//!
//! The workload and the records are the flow variants' ([`super::flows`]): per pair, the
//! sender sends its tensors one after the other (a tensor's FCT is from its send to the
//! receiver's DONE), and the receiver posts all of them ahead and checks every delivered
//! byte. Incast is the receivers' to schedule with the layer's grants (`-nogrants`: each
//! sender's own window only); DLCP's tags go per segment as with flows (`-notag`: one data
//! DSCP, everything ECN-capable).
//!
//! Nothing here hangs: every wait is bounded by the phase's deadline, and a pair that fails
//! becomes records with its error (the layer names a silent or dead peer within its peer
//! timeout). The layer numbers a pair's messages in the order both sides post them, so a
//! pair whose sender stopped early leaves the two sides' numbers apart, and that pair's
//! later iterations fail too (their records say so); the flow variants reconnect instead.

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire::flow::{fixed_priority, tos_per_segment, PriorityFn, Tag};
use gradwire::tagging::{DlcpTagger, MagnitudeConfig};
use gradwire::tensor::Tensor;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::topology::Topology;
use gradwire_msg::core::{CoreConfig, RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_msg::mem::Region;
use gradwire_msg::op::Handle;
use gradwire_msg::p2p::{Recv, Send, SendDone};
use gradwire_netns::spawn_in_netns;

use crate::flows::{
    merge, phase_deadline, tensor_done, Outcome, Pair, Phase, Received, Sent, Stop,
};
use crate::report::FlowRecord;
use crate::workload::tensor_values;

/// The layer's job id of the experiment's endpoints.
const JOB: u32 = 0x1ca5;
/// Path MTU of the fabric's host links.
const MTU: usize = 1500;

/// What a `msg-p<pct>` variant runs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MsgSettings {
    /// Loss bound p of every tensor (the receiver's).
    pub loss_bound: f64,
    /// DLCP tagging (layer DSCP, magnitude ECT); off: one DSCP, everything ECT.
    pub tagging: bool,
    /// The receivers' grants; off: each sender's own window only.
    pub grants: bool,
}

/// Every host's endpoint, by host index (a host's rank is its index).
pub(crate) struct Hosts {
    eps: Vec<Endpoint>,
    seg_payload: usize,
    settings: MsgSettings,
}

impl Hosts {
    /// Binds one endpoint in every host's namespace and starts them all.
    pub(crate) fn up(topo: &Topology, net: &FabricNet, s: &MsgSettings) -> Result<Hosts, String> {
        let world = u16::try_from(topo.hosts.len())
            .map_err(|_| format!("{} hosts: the layer holds at most 65535", topo.hosts.len()))?;
        let mut bound = Vec::with_capacity(topo.hosts.len());
        for (h, host) in topo.hosts.iter().enumerate() {
            let ns = net
                .host_ns(h)
                .ok_or_else(|| format!("no namespace for host {h}"))?;
            let mut cfg = EndpointConfig::new(
                JOB,
                h as u16,
                world,
                SocketAddr::new(IpAddr::V4(host.ip), 0),
            );
            cfg.mtu = MTU;
            cfg.core.grants = s.grants;
            // The socket belongs to the namespace it was opened in; its progress threads can
            // run anywhere.
            let b = spawn_in_netns(ns, move || Endpoint::bind(cfg))
                .map_err(|e| format!("host {h}: entering its namespace: {e}"))?
                .join()
                .map_err(|_| format!("host {h}: the binding thread panicked"))?
                .map_err(|e| format!("host {h}: binding its endpoint: {e}"))?;
            bound.push(b);
        }
        let addrs: Vec<SocketAddr> = bound.iter().map(|b| b.local_addr()).collect();
        let eps = bound
            .into_iter()
            .enumerate()
            .map(|(h, b)| {
                b.start(addrs.clone())
                    .map_err(|e| format!("host {h}: starting its endpoint: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Hosts {
            eps,
            seg_payload: CoreConfig::seg_payload_for_mtu(MTU, false),
            settings: *s,
        })
    }

    /// The layer's counters summed over every host: what a reader of the run needs to see
    /// where its time went (resends, polls, gap NACKs, grants, duplicates).
    pub(crate) fn counters(&self) -> String {
        let mut t = gradwire_msg::core::Stats::default();
        for ep in &self.eps {
            t += &ep.stats().core;
        }
        format!(
            "data sent {} resent {} ({} on gap NACKs) duplicates {}; control {} (NACKs {}, gap \
             NACKs {}, POLLs {}, GRANTs {}); kept before posted {}",
            t.data_sent,
            t.data_resent,
            t.gap_resent,
            t.data_duplicate,
            t.ctrl_sent,
            t.nacks,
            t.gap_nacks,
            t.polls,
            t.grants,
            t.unexpected_kept
        )
    }
}

/// Runs one phase's pairs on the hosts' endpoints: every receiver posts its receives, then
/// every sender sends; returns the phase's duration (first send to last sender result) and
/// one record per tensor of every pair.
pub(crate) fn run_phase(
    hosts: &Hosts,
    topo: &Topology,
    layers: u32,
    phase: Phase,
    it: u32,
    pairs: &[Pair],
) -> (Duration, Vec<FlowRecord>) {
    let deadline = phase_deadline(topo, pairs);
    let mut posted = Vec::with_capacity(pairs.len());
    for p in pairs {
        posted.push(post_receives(hosts, p));
    }
    let start = Instant::now();
    let by = start + deadline;
    let (sent_tx, sent_rx) = mpsc::channel::<(usize, Outcome<Sent>)>();
    let (out, took) = std::thread::scope(|scope| {
        for (i, p) in pairs.iter().enumerate() {
            let tx = sent_tx.clone();
            scope.spawn(move || {
                let mut done = Vec::with_capacity(p.tensors.len());
                let res = send_pair(hosts, layers, p, it, by, &mut done);
                let _ = tx.send((i, Outcome::of(done, res)));
            });
        }
        drop(sent_tx);
        let mut sent: Vec<Option<Outcome<Sent>>> = vec![None; pairs.len()];
        for (i, o) in sent_rx.iter() {
            sent[i] = Some(o);
        }
        let took = start.elapsed();
        // Receivers end with their senders (or on the deadline and the peer timeout).
        let got: Vec<Outcome<Received>> = pairs
            .iter()
            .zip(posted)
            .map(|(p, handles)| check_pair(hosts, p, it, handles, by))
            .collect();
        let mut out = Vec::new();
        for ((p, sn), g) in pairs.iter().zip(sent).zip(got) {
            let sn =
                sn.unwrap_or_else(|| Outcome::failed("the sender thread gave no result".into()));
            out.extend(merge(p, phase == Phase::Push, it, sn, g));
        }
        (out, took)
    });
    (took, out)
}

type Posted = Result<Vec<Handle<(Option<Region>, RecvReport)>>, Stop>;

/// Posts a receive for every tensor of `p`, in order, at its destination.
fn post_receives(hosts: &Hosts, p: &Pair) -> Posted {
    let ep = hosts
        .eps
        .get(p.dst)
        .ok_or_else(|| Stop::new(format!("no host {}", p.dst)))?;
    let src = u16::try_from(p.src).map_err(|_| Stop::new(format!("no host {}", p.src)))?;
    Ok(p.tensors
        .iter()
        .map(|t| {
            let opts = RecvOpts {
                loss_bound: hosts.settings.loss_bound,
                ..RecvOpts::default()
            };
            ep.submit(Recv::new(Region::owned(vec![0; t.elems * 4]), src, opts))
        })
        .collect())
}

/// Sends every tensor of `p` one after the other, recording the FCT and data segments of
/// each; stops at the first error.
fn send_pair(
    hosts: &Hosts,
    layers: u32,
    p: &Pair,
    it: u32,
    by: Instant,
    out: &mut Vec<Sent>,
) -> Result<(), Stop> {
    let e = |what: &str, err: &dyn std::fmt::Display| p.sender_stop(what, err);
    let ep = hosts
        .eps
        .get(p.src)
        .ok_or_else(|| Stop::new(format!("no host {}", p.src)))?;
    let dst = u16::try_from(p.dst).map_err(|_| Stop::new(format!("no host {}", p.dst)))?;
    for t in &p.tensors {
        let tensor = tensor_values(t, p.sender_id, it);
        let prio = priority(hosts.settings.tagging, layers, t.layer, &tensor)
            .map_err(|err| e("tagging", &err))?;
        let layer = u16::try_from(t.layer).unwrap_or(u16::MAX);
        let tos = tos_per_segment(
            tensor.as_bytes(),
            hosts.seg_payload,
            layer,
            tensor.dtype(),
            &*prio,
        );
        let opts = SendOpts {
            tos: tos.first().copied().unwrap_or(0b10),
            layer,
            tos_per_segment: tos,
            ..SendOpts::default()
        };
        let t0 = Instant::now();
        let h = ep.submit(Send::new(
            Region::owned(tensor.as_bytes().to_vec()),
            dst,
            opts,
        ));
        let res = wait(h, by);
        let sent = Sent {
            fct_us: t0.elapsed().as_secs_f64() * 1e6,
            data_packets: res.as_ref().map_or(0, |d| u64::from(d.segments)),
        };
        let res = res
            .map(|_: SendDone| ())
            .map_err(|err| e(&format!("tensor {}", t.id), &err));
        tensor_done(out, sent, res)?;
    }
    Ok(())
}

/// The priority function of a tensor: DLCP's default (its layer's DSCP, ECN-capable where
/// its gradients are large), or with tagging off one data DSCP, everything ECN-capable (as
/// the flow variants' `-notag`).
fn priority(
    tagging: bool,
    layers: u32,
    layer: u32,
    tensor: &Tensor,
) -> Result<Box<PriorityFn<'static>>, gradwire::tagging::TaggingError> {
    if !tagging {
        return Ok(Box::new(fixed_priority(Tag {
            dscp: gradwire_qos::DATA_DSCP[3],
            ect: true,
        })));
    }
    let tagger = DlcpTagger::for_tensor(tensor, layer, layers, &MagnitudeConfig::default())?;
    Ok(Box::new(tagger.priority_fn()))
}

/// Waits for `h` until `by`; past it the operation is cancelled and is an error.
fn wait<T>(h: Handle<T>, by: Instant) -> Result<T, String> {
    match h.wait_timeout(by.saturating_duration_since(Instant::now())) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(h) => {
            h.cancel();
            Err("timeout: not done by the phase's deadline".into())
        }
    }
}

/// Waits for every receive of `p` in order and checks each delivered byte.
fn check_pair(hosts: &Hosts, p: &Pair, it: u32, posted: Posted, by: Instant) -> Outcome<Received> {
    let e = |what: &str, err: &dyn std::fmt::Display| p.receiver_stop(what, err);
    let handles = match posted {
        Ok(h) => h,
        Err(stop) => return Outcome::of(Vec::new(), Err(stop)),
    };
    let mut done = Vec::with_capacity(handles.len());
    let mut handles = handles.into_iter();
    for (t, h) in p.tensors.iter().zip(&mut handles) {
        let (region, report) = match wait(h, by) {
            Ok(r) => r,
            Err(err) => {
                for rest in handles {
                    rest.cancel();
                }
                return Outcome::of(done, Err(e(&format!("tensor {}", t.id), &err)));
            }
        };
        let got = region.and_then(Region::into_vec).unwrap_or_default();
        let want = tensor_values(t, p.sender_id, it);
        // Bytes outside the missing segments must be the sender's: the missing ones are
        // taken from what was sent, so only the delivered ones can differ.
        let mut checked = got.clone();
        for r in report.missing_ranges(hosts.seg_payload) {
            checked[r.clone()].copy_from_slice(&want.as_bytes()[r]);
        }
        let wrong = checked
            .iter()
            .zip(want.as_bytes())
            .filter(|(x, y)| x != y)
            .count() as u64
            + (want.as_bytes().len().abs_diff(got.len())) as u64;
        let delivered =
            f64::from(report.segments - report.missing) / f64::from(report.segments.max(1));
        done.push((delivered, wrong));
    }
    Outcome::of(done, Ok(()))
}
