//! The typed QoS policy every renderer works from, and its validation.
//!
//! A [`Policy`] says, for one switch (or host) role:
//! - how every DSCP (0..=63) maps to a traffic class, and every traffic class to one of the
//!   8 egress queues (so each DSCP lands in exactly one queue);
//! - that every queue is served by strict priority, queue 7 (the highest) reserved for the
//!   control DSCPs;
//! - one ECN/drop threshold (min = max) per data queue 0..=6, either the DLCP arithmetic
//!   sequence T·(1, 1+d, ..., 1+6d) with the front-layer queue 6 lowest, or explicit values
//!   (from the optimizer);
//! - the per-port buffer the thresholds must fit in, the ports to bind, and the ASIC whose
//!   cell size the thresholds are rounded to.
//!
//! The default traffic classes come from `gradwire-qos`, the definition the data plane tags
//! packets with. Validation is target-independent; renderers add their own checks (port
//! names legal for the target, units that keep thresholds distinct).

use gradwire_qos::{CONTROL_DSCP, CONTROL_QUEUE, DATA_DSCP, NUM_DATA_QUEUES, NUM_QUEUES};

use crate::asic::Asic;
use gradwire_units::Bytes;

/// Number of DSCP code points.
pub const NUM_DSCP: usize = 64;

/// Data queues as a `usize` for array sizes.
pub const DATA_QUEUES: usize = NUM_DATA_QUEUES as usize;

/// How the per-queue thresholds are given.
#[derive(Debug, Clone, PartialEq)]
pub enum ThresholdSpec {
    /// DLCP §4.2: queue 6 (front layers) gets `base`, queue 6-k gets `base·(1 + k·step)`.
    Arithmetic {
        /// T, the lowest threshold (queue 6).
        base: Bytes,
        /// d, the relative step.
        step: f64,
    },
    /// One threshold per data queue, indexed by queue (0..=6).
    Explicit([Bytes; DATA_QUEUES]),
}

/// The threshold of one data queue as requested and as the switch will apply it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueThreshold {
    /// Queue index, 0..=6.
    pub queue: u8,
    /// What the policy asks for.
    pub requested: Bytes,
    /// Rounded up to whole cells when the ASIC is known, else `requested`.
    pub effective: Bytes,
}

/// A QoS policy. Build one with [`Policy::gradwire`] or load one from a file
/// ([`crate::policy_file`]); call [`Policy::validate`] before use (renderers do).
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Name of the maps and prefix of the profiles on SONiC (`NAME`, `NAME_STRICT`,
    /// `NAME_Q0`..`NAME_Q6`).
    pub name: String,
    /// Traffic class of every DSCP, indexed by DSCP.
    pub dscp_to_tc: [u8; NUM_DSCP],
    /// Queue of every traffic class, indexed by traffic class.
    pub tc_to_queue: [u8; NUM_QUEUES as usize],
    /// The DSCPs of control traffic; exactly these may reach queue 7.
    pub control_dscp: Vec<u8>,
    /// The data-queue thresholds.
    pub thresholds: ThresholdSpec,
    /// Buffer available to one port's queues; every threshold must fit in it.
    pub port_buffer: Bytes,
    /// Ports (switch) or interfaces (host) to configure.
    pub ports: Vec<String>,
    /// The switch ASIC, for cell rounding. `None`: thresholds are rendered as given.
    pub asic: Option<Asic>,
}

/// Default name of the SONiC objects.
pub const DEFAULT_NAME: &str = "GRADWIRE";

/// Default per-port buffer: 512 KiB, the per-port buffer of DLCP's simulations.
pub const DEFAULT_PORT_BUFFER: Bytes = Bytes(512 * 1024);

/// Largest per-port buffer a policy may give: 1 GiB. Switch buffers are far smaller (the
/// reference lists 13945824 B as SONiC's SN2700 egress lossless pool, the largest pool it
/// names); the bound catches unit mistakes and keeps every threshold far from overflow.
pub const MAX_PORT_BUFFER: Bytes = Bytes(1 << 30);

/// Longest policy name: SONiC names are at most 32 characters and the longest suffix is
/// `_STRICT`.
pub const MAX_NAME_LEN: usize = 32 - "_STRICT".len();

/// Why a policy is not usable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// The name is not a legal SONiC object name.
    #[error("field `name`: {name:?} is not a legal name ({reason})")]
    BadName {
        /// The name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// T = 0.
    #[error("field `thresholds.base`: the base threshold T must be > 0")]
    ZeroBase,
    /// d < 0 or not a number.
    #[error("field `thresholds.step`: the step d must be a finite number >= 0, got {step}")]
    BadStep {
        /// The step.
        step: f64,
    },
    /// d > 0 but T·d is below one byte, so neighbouring thresholds come out equal.
    #[error("field `thresholds.step`: T*d = {base}*{step} is below one byte, so neighbouring queues would get equal thresholds; use d = 0 for equal thresholds or a larger d")]
    StepTooSmall {
        /// T.
        base: Bytes,
        /// d.
        step: f64,
    },
    /// An explicit threshold of 0.
    #[error("field `thresholds.queues[{queue}]`: threshold of queue {queue} must be > 0")]
    ZeroThreshold {
        /// The queue.
        queue: u8,
    },
    /// T·(1+6d) does not fit in 64 bits.
    #[error("field `thresholds`: T*(1+6d) = {base}*(1+6*{step}) overflows")]
    ThresholdOverflow {
        /// T.
        base: Bytes,
        /// d.
        step: f64,
    },
    /// Port buffer of 0.
    #[error("field `port_buffer`: must be > 0")]
    ZeroBuffer,
    /// Port buffer above [`MAX_PORT_BUFFER`].
    #[error("field `port_buffer`: {buffer} B is above the limit of {} B (1 GiB); switch port buffers are megabytes, so this is most likely a unit mistake", MAX_PORT_BUFFER.0)]
    BufferTooLarge {
        /// The buffer asked for.
        buffer: u64,
    },
    /// Rounding a threshold up to whole cells does not fit in 64 bits.
    #[error("field `thresholds`: queue {queue} threshold {requested} B cannot be rounded up to {cell}-byte cells without overflowing; it is far above any port buffer")]
    CellOverflow {
        /// The queue.
        queue: u8,
        /// The requested bytes.
        requested: u64,
        /// The cell size.
        cell: u64,
    },
    /// A threshold above the port buffer: it could never be reached.
    #[error("field `thresholds`: queue {queue} threshold {effective} B (requested {requested} B) exceeds the port buffer of {buffer} B; lower T or d, or raise the buffer (--buffer / port_buffer)")]
    ExceedsBuffer {
        /// The queue.
        queue: u8,
        /// Requested bytes.
        requested: u64,
        /// After cell rounding.
        effective: u64,
        /// The port buffer.
        buffer: u64,
    },
    /// Cell rounding made two different thresholds equal.
    #[error("field `thresholds`: queues {a} and {b} ask for different thresholds ({ra} B, {rb} B) but both round to {effective} B in {cell}-byte cells of {asic}; use a larger step or base")]
    Collapsed {
        /// One queue.
        a: u8,
        /// The other.
        b: u8,
        /// Its request.
        ra: u64,
        /// The other's request.
        rb: u64,
        /// The common rounded value.
        effective: u64,
        /// Cell size.
        cell: u64,
        /// The ASIC.
        asic: Asic,
    },
    /// A traffic class above 7.
    #[error("field `dscp.map`: DSCP {dscp} maps to traffic class {tc}; traffic classes are 0..=7")]
    TcOutOfRange {
        /// DSCP.
        dscp: u8,
        /// Its traffic class.
        tc: u8,
    },
    /// A queue index above 7.
    #[error("field `tc_to_queue[{tc}]`: queue {queue} is out of range; queues are 0..=7")]
    QueueOutOfRange {
        /// Traffic class.
        tc: u8,
        /// Its queue.
        queue: u8,
    },
    /// A DSCP above 63.
    #[error("field `{field}`: DSCP {dscp} is out of range; DSCP is 0..=63")]
    DscpOutOfRange {
        /// The field.
        field: String,
        /// The value.
        dscp: u8,
    },
    /// The same control DSCP twice.
    #[error("field `dscp.control`: DSCP {dscp} is listed twice")]
    DuplicateControlDscp {
        /// The DSCP.
        dscp: u8,
    },
    /// No control DSCP.
    #[error(
        "field `dscp.control`: at least one control DSCP is needed (gradwire uses {CONTROL_DSCP})"
    )]
    NoControlDscp,
    /// A control DSCP that does not reach queue 7.
    #[error("field `dscp.map`: control DSCP {dscp} maps to queue {queue}; control must use queue {CONTROL_QUEUE}")]
    ControlNotInControlQueue {
        /// The DSCP.
        dscp: u8,
        /// Where it goes.
        queue: u8,
    },
    /// A data DSCP in the control queue.
    #[error("field `dscp.map`: DSCP {dscp} is not a control DSCP but maps to the control queue {CONTROL_QUEUE} (via traffic class {tc})")]
    DataInControlQueue {
        /// The DSCP.
        dscp: u8,
        /// Its traffic class.
        tc: u8,
    },
    /// The same port twice.
    #[error("field `ports`: {port:?} is listed twice")]
    DuplicatePort {
        /// The port.
        port: String,
    },
}

impl Policy {
    /// The gradwire policy: the `gradwire-qos` code points (each data DSCP to the traffic
    /// class equal to its queue, control DSCP 48 to 7, every other DSCP to 0), identity
    /// traffic class -> queue, default name and buffer, no ports, no ASIC.
    pub fn gradwire(thresholds: ThresholdSpec) -> Policy {
        let mut dscp_to_tc = [0u8; NUM_DSCP];
        for (q, d) in DATA_DSCP.iter().enumerate() {
            dscp_to_tc[usize::from(*d)] = q as u8;
        }
        dscp_to_tc[usize::from(CONTROL_DSCP)] = CONTROL_QUEUE;
        Policy {
            name: DEFAULT_NAME.into(),
            dscp_to_tc,
            tc_to_queue: [0, 1, 2, 3, 4, 5, 6, 7],
            control_dscp: vec![CONTROL_DSCP],
            thresholds,
            port_buffer: DEFAULT_PORT_BUFFER,
            ports: Vec::new(),
            asic: None,
        }
    }

    /// The queue a DSCP lands in (values above 63 use their low 6 bits, as on the wire).
    pub fn dscp_queue(&self, dscp: u8) -> u8 {
        let tc = self.dscp_to_tc[usize::from(dscp & 0x3f)];
        self.tc_to_queue
            .get(usize::from(tc))
            .copied()
            .unwrap_or(u8::MAX)
    }

    /// The requested threshold of every data queue, indexed by queue.
    pub fn requested_thresholds(&self) -> Result<[Bytes; DATA_QUEUES], PolicyError> {
        match &self.thresholds {
            ThresholdSpec::Explicit(t) => Ok(*t),
            ThresholdSpec::Arithmetic { base, step } => arithmetic(*base, *step),
        }
    }

    /// Requested and effective (cell-rounded) thresholds of every data queue, checked
    /// against the buffer and for collapse. Validates the policy first.
    pub fn thresholds(&self) -> Result<[QueueThreshold; DATA_QUEUES], PolicyError> {
        self.validate()?;
        self.thresholds_unchecked()
    }

    fn thresholds_unchecked(&self) -> Result<[QueueThreshold; DATA_QUEUES], PolicyError> {
        let req = self.requested_thresholds()?;
        let mut out = [QueueThreshold {
            queue: 0,
            requested: Bytes(0),
            effective: Bytes(0),
        }; DATA_QUEUES];
        for (q, r) in req.iter().enumerate() {
            let effective = match self.asic {
                Some(a) => r
                    .round_up_to_cells(a.cell_size())
                    .ok_or(PolicyError::CellOverflow {
                        queue: q as u8,
                        requested: r.0,
                        cell: a.cell_size().0,
                    })?,
                None => *r,
            };
            out[q] = QueueThreshold {
                queue: q as u8,
                requested: *r,
                effective,
            };
        }
        Ok(out)
    }

    /// Check everything that does not depend on the target.
    pub fn validate(&self) -> Result<(), PolicyError> {
        validate_name(&self.name)?;
        match &self.thresholds {
            ThresholdSpec::Arithmetic { base, step } => {
                if base.0 == 0 {
                    return Err(PolicyError::ZeroBase);
                }
                if !step.is_finite() || *step < 0.0 {
                    return Err(PolicyError::BadStep { step: *step });
                }
            }
            ThresholdSpec::Explicit(t) => {
                if let Some(q) = t.iter().position(|b| b.0 == 0) {
                    return Err(PolicyError::ZeroThreshold { queue: q as u8 });
                }
            }
        }
        if self.port_buffer.0 == 0 {
            return Err(PolicyError::ZeroBuffer);
        }
        if self.port_buffer > MAX_PORT_BUFFER {
            return Err(PolicyError::BufferTooLarge {
                buffer: self.port_buffer.0,
            });
        }
        for (tc, q) in self.tc_to_queue.iter().enumerate() {
            if *q >= NUM_QUEUES {
                return Err(PolicyError::QueueOutOfRange {
                    tc: tc as u8,
                    queue: *q,
                });
            }
        }
        for (dscp, tc) in self.dscp_to_tc.iter().enumerate() {
            if *tc >= NUM_QUEUES {
                return Err(PolicyError::TcOutOfRange {
                    dscp: dscp as u8,
                    tc: *tc,
                });
            }
        }
        if self.control_dscp.is_empty() {
            return Err(PolicyError::NoControlDscp);
        }
        for (i, d) in self.control_dscp.iter().enumerate() {
            if usize::from(*d) >= NUM_DSCP {
                return Err(PolicyError::DscpOutOfRange {
                    field: "dscp.control".into(),
                    dscp: *d,
                });
            }
            if self.control_dscp[..i].contains(d) {
                return Err(PolicyError::DuplicateControlDscp { dscp: *d });
            }
            let q = self.dscp_queue(*d);
            if q != CONTROL_QUEUE {
                return Err(PolicyError::ControlNotInControlQueue { dscp: *d, queue: q });
            }
        }
        for dscp in 0..NUM_DSCP as u8 {
            if self.dscp_queue(dscp) == CONTROL_QUEUE && !self.control_dscp.contains(&dscp) {
                return Err(PolicyError::DataInControlQueue {
                    dscp,
                    tc: self.dscp_to_tc[usize::from(dscp)],
                });
            }
        }
        for (i, p) in self.ports.iter().enumerate() {
            if self.ports[..i].contains(p) {
                return Err(PolicyError::DuplicatePort { port: p.clone() });
            }
        }
        let th = self.thresholds_unchecked()?;
        if let ThresholdSpec::Arithmetic { base, step } = &self.thresholds {
            if *step > 0.0 && th.windows(2).any(|w| w[0].requested <= w[1].requested) {
                return Err(PolicyError::StepTooSmall {
                    base: *base,
                    step: *step,
                });
            }
        }
        for t in &th {
            if t.effective > self.port_buffer {
                return Err(PolicyError::ExceedsBuffer {
                    queue: t.queue,
                    requested: t.requested.0,
                    effective: t.effective.0,
                    buffer: self.port_buffer.0,
                });
            }
        }
        if let Some(asic) = self.asic {
            for a in &th {
                for b in &th[usize::from(a.queue) + 1..] {
                    if a.requested != b.requested && a.effective == b.effective {
                        return Err(PolicyError::Collapsed {
                            a: a.queue,
                            b: b.queue,
                            ra: a.requested.0,
                            rb: b.requested.0,
                            effective: a.effective.0,
                            cell: asic.cell_size().0,
                            asic,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The DSCPs that land in `queue`, ascending.
    pub fn dscps_of_queue(&self, queue: u8) -> Vec<u8> {
        (0..NUM_DSCP as u8)
            .filter(|d| self.dscp_queue(*d) == queue)
            .collect()
    }

    /// The object names derived from [`Policy::name`].
    pub fn scheduler_name(&self) -> String {
        format!("{}_STRICT", self.name)
    }

    /// Name of the WRED profile of a data queue.
    pub fn wred_name(&self, queue: u8) -> String {
        format!("{}_Q{queue}", self.name)
    }
}

/// The DLCP sequence: queue 6 (front layers) = T, queue 6-k = T·(1 + k·d), rounded up to
/// whole bytes. Strictly decreasing with the queue index when d > 0 (before any cell
/// rounding, which [`Policy::validate`] checks separately), all equal when d = 0.
pub fn arithmetic(base: Bytes, step: f64) -> Result<[Bytes; DATA_QUEUES], PolicyError> {
    if !step.is_finite() || step < 0.0 {
        return Err(PolicyError::BadStep { step });
    }
    let mut out = [Bytes(0); DATA_QUEUES];
    for (q, slot) in out.iter_mut().enumerate() {
        let k = (DATA_QUEUES - 1 - q) as f64;
        // base + base·k·d: computing the increment separately keeps base exact for k = 0.
        let inc = (base.0 as f64 * k * step).ceil();
        // 2^64 as f64; anything at or above does not fit.
        if inc.is_nan() || inc >= 18_446_744_073_709_551_616.0 {
            return Err(PolicyError::ThresholdOverflow { base, step });
        }
        *slot = Bytes(
            base.0
                .checked_add(inc as u64)
                .ok_or(PolicyError::ThresholdOverflow { base, step })?,
        );
    }
    Ok(out)
}

/// Check a SONiC-style object name: `[a-zA-Z0-9][-a-zA-Z0-9_]*`, short enough for every
/// derived name to stay within 32 characters.
pub fn validate_name(name: &str) -> Result<(), PolicyError> {
    let bad = |reason: &str| PolicyError::BadName {
        name: name.into(),
        reason: reason.into(),
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return Err(bad("empty")),
        Some(c) if !c.is_ascii_alphanumeric() => {
            return Err(bad("must start with a letter or digit"))
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(bad("only letters, digits, '-' and '_' are allowed"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad(&format!(
            "at most {MAX_NAME_LEN} characters, so that NAME_STRICT fits SONiC's 32"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy(base: u64, step: f64) -> Policy {
        Policy::gradwire(ThresholdSpec::Arithmetic {
            base: Bytes(base),
            step,
        })
    }

    #[test]
    fn default_policy_is_valid_and_follows_gradwire_qos() {
        let p = policy(65536, 0.5);
        p.validate().unwrap();
        for q in 0..7u8 {
            assert_eq!(p.dscp_queue(DATA_DSCP[usize::from(q)]), q);
        }
        assert_eq!(p.dscp_queue(CONTROL_DSCP), CONTROL_QUEUE);
        assert_eq!(p.dscp_queue(63), 0, "unused code points go to queue 0");
        assert_eq!(p.dscps_of_queue(CONTROL_QUEUE), vec![CONTROL_DSCP]);
    }

    #[test]
    fn arithmetic_sequence_by_hand() {
        let t = arithmetic(Bytes(65536), 0.5).unwrap();
        let kib: Vec<u64> = t.iter().map(|b| b.0 / 1024).collect();
        // queue 0 (back layers) = T(1+6d) = 4T, queue 6 (front layers) = T
        assert_eq!(kib, [256, 224, 192, 160, 128, 96, 64]);
        let t = arithmetic(Bytes(1000), 0.0).unwrap();
        assert!(t.iter().all(|b| *b == Bytes(1000)));
        assert!(arithmetic(Bytes(1), -0.1).is_err());
        assert!(arithmetic(Bytes(1), f64::NAN).is_err());
        assert!(matches!(
            arithmetic(Bytes(u64::MAX / 2), 1.0),
            Err(PolicyError::ThresholdOverflow { .. })
        ));
    }

    #[test]
    fn rejects_bad_policies() {
        assert_eq!(policy(0, 0.5).validate(), Err(PolicyError::ZeroBase));
        assert!(matches!(
            policy(1024, -1.0).validate(),
            Err(PolicyError::BadStep { .. })
        ));
        assert!(matches!(
            policy(1024, f64::INFINITY).validate(),
            Err(PolicyError::BadStep { .. })
        ));
        // 128 KiB * 4 = 512 KiB fits exactly; one more byte of base does not.
        policy(131072, 0.5).validate().unwrap();
        assert!(matches!(
            policy(131073, 0.5).validate(),
            Err(PolicyError::ExceedsBuffer { queue: 0, .. })
        ));
        let mut p = policy(1024, 0.5);
        p.port_buffer = Bytes(0);
        assert_eq!(p.validate(), Err(PolicyError::ZeroBuffer));

        let mut p = policy(1024, 0.5);
        p.dscp_to_tc[5] = 8;
        assert_eq!(
            p.validate(),
            Err(PolicyError::TcOutOfRange { dscp: 5, tc: 8 })
        );
        let mut p = policy(1024, 0.5);
        p.tc_to_queue[3] = 9;
        assert_eq!(
            p.validate(),
            Err(PolicyError::QueueOutOfRange { tc: 3, queue: 9 })
        );
        let mut p = policy(1024, 0.5);
        p.dscp_to_tc[56] = 7;
        assert_eq!(
            p.validate(),
            Err(PolicyError::DataInControlQueue { dscp: 56, tc: 7 })
        );
        let mut p = policy(1024, 0.5);
        p.control_dscp = vec![48, 48];
        assert_eq!(
            p.validate(),
            Err(PolicyError::DuplicateControlDscp { dscp: 48 })
        );
        let mut p = policy(1024, 0.5);
        p.control_dscp = vec![];
        assert_eq!(p.validate(), Err(PolicyError::NoControlDscp));
        let mut p = policy(1024, 0.5);
        p.control_dscp = vec![64];
        assert!(matches!(
            p.validate(),
            Err(PolicyError::DscpOutOfRange { .. })
        ));
        let mut p = policy(1024, 0.5);
        p.dscp_to_tc[48] = 6;
        assert_eq!(
            p.validate(),
            Err(PolicyError::ControlNotInControlQueue { dscp: 48, queue: 6 })
        );
        let mut p = policy(1024, 0.5);
        p.ports = vec!["Ethernet0".into(), "Ethernet0".into()];
        assert!(matches!(
            p.validate(),
            Err(PolicyError::DuplicatePort { .. })
        ));
        let mut p = Policy::gradwire(ThresholdSpec::Explicit([Bytes(5); 7]));
        p.validate().unwrap();
        p.thresholds = ThresholdSpec::Explicit([
            Bytes(5),
            Bytes(0),
            Bytes(5),
            Bytes(5),
            Bytes(5),
            Bytes(5),
            Bytes(5),
        ]);
        assert_eq!(p.validate(), Err(PolicyError::ZeroThreshold { queue: 1 }));
    }

    #[test]
    fn names() {
        validate_name("GRADWIRE").unwrap();
        validate_name("a-b_c9").unwrap();
        validate_name(&"x".repeat(MAX_NAME_LEN)).unwrap();
        assert!(validate_name(&"x".repeat(MAX_NAME_LEN + 1)).is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name("_x").is_err());
        assert!(validate_name("a b").is_err());
        assert!(validate_name("a|b").is_err());
    }

    #[test]
    fn cell_rounding_and_collapse() {
        let mut p = policy(65536, 0.5);
        p.asic = Some(Asic::Spectrum1);
        let th = p.thresholds().unwrap();
        assert_eq!(th[6].requested, Bytes(65536));
        assert_eq!(th[6].effective, Bytes(65568), "683 cells of 96 B");
        // d so small that neighbours fall into the same 96-byte cell
        let mut p = policy(1000, 0.01);
        p.asic = Some(Asic::Spectrum1);
        assert!(matches!(p.validate(), Err(PolicyError::Collapsed { .. })));
        p.asic = None;
        p.validate().unwrap();
        // T·d below a byte: equal neighbours even without an ASIC
        let p = policy(10, 0.01);
        assert!(matches!(
            p.validate(),
            Err(PolicyError::StepTooSmall { .. })
        ));
        // rounding up may push the top threshold over the buffer
        let mut p = policy(131072, 0.5);
        p.port_buffer = Bytes(524288);
        p.asic = Some(Asic::Spectrum2);
        assert!(matches!(
            p.validate(),
            Err(PolicyError::ExceedsBuffer { .. })
        ));
    }

    #[test]
    fn cell_rounding_overflow_is_an_error() {
        // Before: rounding u64::MAX up to cells silently became u64::MAX and the error
        // blamed the buffer with a meaningless 18446744073709551615 B.
        let mut p = Policy::gradwire(ThresholdSpec::Explicit([Bytes(u64::MAX); 7]));
        p.asic = Some(Asic::Spectrum1);
        assert_eq!(
            p.validate(),
            Err(PolicyError::CellOverflow {
                queue: 0,
                requested: u64::MAX,
                cell: 96
            })
        );
        assert!(p.validate().unwrap_err().to_string().contains("overflow"));
    }

    #[test]
    fn port_buffer_has_an_upper_bound() {
        let mut p = policy(65536, 0.5);
        p.port_buffer = MAX_PORT_BUFFER;
        p.validate().unwrap();
        p.port_buffer = Bytes(MAX_PORT_BUFFER.0 + 1);
        assert_eq!(
            p.validate(),
            Err(PolicyError::BufferTooLarge {
                buffer: MAX_PORT_BUFFER.0 + 1
            })
        );
        let m = p.validate().unwrap_err().to_string();
        assert!(m.contains("port_buffer") && m.contains("1 GiB"), "{m}");
    }

    proptest! {
        /// The issue asks for thresholds "strictly increasing with queue index for d > 0".
        /// With queue 6 = front layers = lowest threshold (DLCP §3.2.2, §4.2) they strictly
        /// *decrease* as the queue index rises, i.e. increase as the priority falls.
        #[test]
        fn thresholds_fall_with_queue_index(base in 1u64..1 << 24, step in 0.0f64..8.0,
                                            ai in 0usize..6) {
            // T(1+6d) < 2^24 * 49 stays below the 1 GiB buffer limit after cell rounding.
            let mut p = policy(base, step);
            p.port_buffer = MAX_PORT_BUFFER;
            p.asic = if ai == 5 { None } else { Some(Asic::ALL[ai]) };
            match p.thresholds() {
                Ok(th) => {
                    for q in 1..DATA_QUEUES {
                        if step > 0.0 {
                            prop_assert!(th[q].effective < th[q - 1].effective);
                            prop_assert!(th[q].requested < th[q - 1].requested);
                        }
                    }
                    prop_assert_eq!(th[6].requested, Bytes(base));
                }
                // Only rounding (to bytes or cells) may refuse, and only for d > 0.
                Err(e) => prop_assert!(
                    step > 0.0
                        && matches!(e, PolicyError::Collapsed { .. } | PolicyError::StepTooSmall { .. }),
                    "{e}"
                ),
            }
        }

        #[test]
        fn zero_step_gives_equal_thresholds(base in 1u64..(1 << 30) - 192, ai in 0usize..6) {
            let mut p = policy(base, 0.0);
            p.port_buffer = MAX_PORT_BUFFER;
            p.asic = if ai == 5 { None } else { Some(Asic::ALL[ai]) };
            let th = p.thresholds().unwrap();
            for t in &th {
                prop_assert_eq!(t.effective, th[0].effective);
                prop_assert_eq!(t.requested, Bytes(base));
            }
        }

        #[test]
        fn every_dscp_maps_to_exactly_one_queue(map in proptest::array::uniform32(0u8..7),
                                               map2 in proptest::array::uniform32(0u8..7)) {
            let mut p = policy(1024, 0.5);
            p.dscp_to_tc[..32].copy_from_slice(&map);
            p.dscp_to_tc[32..].copy_from_slice(&map2);
            p.dscp_to_tc[usize::from(CONTROL_DSCP)] = 7;
            p.validate().unwrap();
            let mut count = [0usize; NUM_DSCP];
            for q in 0..8u8 {
                for d in p.dscps_of_queue(q) { count[usize::from(d)] += 1; }
            }
            prop_assert!(count.iter().all(|c| *c == 1));
        }
    }
}
