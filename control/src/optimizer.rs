//! The threshold optimizer of DLCP Appendix B.
//!
//! # The model (Appendix B, with the notation of the paper)
//!
//! N = 7 data queues, Q_1 the highest priority (gradwire queue 6, front layers) down to
//! Q_7 (queue 0). Layer x of the M layers goes to the queue of `gradwire_qos::layer_queue`
//! (⌊x·N/M⌋, the same rule the data plane tags with), so queue i carries the layer sizes
//! S^m(i) of its layers, out of a model of S parameters.
//!
//! - Arrivals: total packet rate λ, split by size: λ_i = λ·S^m(i)/S; small gradients are a
//!   share θ of them (θλ_i), large ones (1-θ)λ_i.
//! - Service under strict priority: μ_1 = μ, μ_i = μ_{i-1}·(1 - ρ_{i-1}) with
//!   ρ_i = λ_i/μ_i. Small and large gradients of a queue share its service in the same
//!   proportion, so both see load ρ_i.
//! - Each queue is split into a small-only and a large-only M/M/1/m queue of capacities
//!   S'_i and L'_i packets. The ECN threshold of the real queue is S_i = S'_i/θ and its
//!   size L_i = S'_i + L'_i. Loss ratios: r^S_i = P(ρ_i, S'_i), r^L_i = P(ρ_i, L'_i) with
//!   the M/M/1/m blocking probability P(ρ, m) = (ρ^m - ρ^(m+1)) / (1 - ρ^(m+1)).
//! - Goal: minimise Σ_i f^S_i(r^S_i) + f^L_i(r^L_i).
//!
//! # What the appendix leaves open, and the choices made here
//!
//! - **Buffer constraint.** The appendix names the buffer B but no constraint. Queues
//!   partition it: Σ_i L_i ≤ B. (With each L_i ≤ B alone, more buffer always helps and
//!   every threshold would simply be B.)
//! - **Threshold inside the queue.** S_i ≤ L_i, i.e. L'_i ≥ S'_i·(1-θ)/θ: a threshold
//!   above the queue size never acts, and the split model would then misstate r^S.
//! - **At least one packet** of small-gradient capacity per queue (S'_i ≥ 1), so every
//!   threshold is > 0 as switches require.
//! - **Typos fixed.** The printed r^S has (θρ_i)^(S_i+1) in its numerator; consistent with
//!   the formula it cites it is P(ρ_i, θS_i) = P(ρ_i, S'_i). ρ_1 is printed as λ/μ; it is
//!   λ_1/μ_1.
//! - **Layer ranges.** The appendix writes queue i's layers as ⌊M·i/N⌋..⌊M(i+1)/N⌋-1,
//!   which is not exactly the inverse of the tagging rule x·P/L (and for M < N gives the
//!   front layer to a lower queue). The optimizer uses the tagging rule, since that is
//!   where packets actually go.
//! - **Saturation.** If a higher queue has ρ ≥ 1, the queues below it get no service:
//!   their loss ratio is 1 (when they carry traffic).
//! - **Cost functions.** "x% loss costs f(i) rounds" is read as per-queue functions of the
//!   loss ratio, f^S_i(r) = c^S_i·w_i·r^e and f^L_i(r) = c^L_i·w_i·r^e, where w_i is the
//!   queue's share of the model (so a lost fraction of a big queue costs more) unless
//!   turned off. Defaults: c^S = 1, c^L = 10 (losing large gradients is what hurts
//!   convergence; DLCP only lets switches drop small ones), e = 1.
//! - **Units.** M/M/1/m counts packets; thresholds are packets × the packet size. The
//!   buffer is cut into at most `max_units` units of whole packets so the exact search
//!   stays fast.
//!
//! # The search
//!
//! The cost is separable per queue and the only coupling is the shared budget, so an exact
//! dynamic programme finds the global optimum on the unit grid: for each queue and each
//! budget t, the best split t = a + b (a = S'_i, b = L'_i) subject to the constraints
//! above, then a knapsack over the 7 queues. No convexity is assumed. O(N·U²) for U units.
//!
//! The baseline it is compared with is the DLCP arithmetic sequence S = T·(1, ..., 1+6d):
//! for each d the best T, with the remaining buffer split among the L'_i optimally by the
//! same programme, so the comparison is against the best the arithmetic family can do.

use gradwire_qos::{layer_queue, NUM_DATA_QUEUES};
use serde::Serialize;

use crate::model::DnnModel;
use crate::policy::DATA_QUEUES;
use gradwire_units::Bytes;

/// Per-queue convergence-cost functions f(r) = coef·w·r^exponent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostModel {
    /// c^S per data queue, indexed by queue (0..=6).
    pub small: [f64; DATA_QUEUES],
    /// c^L per data queue, indexed by queue.
    pub large: [f64; DATA_QUEUES],
    /// e.
    pub exponent: f64,
    /// Multiply by the queue's share of the model's parameters.
    pub weight_by_share: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            small: [1.0; DATA_QUEUES],
            large: [10.0; DATA_QUEUES],
            exponent: 1.0,
            weight_by_share: true,
        }
    }
}

/// Everything besides the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Params {
    /// θ: share of small (unimportant, non-ECT) gradients, 0 < θ < 1.
    pub theta: f64,
    /// λ: total arrival rate (any unit, the same as `service_rate`).
    pub arrival_rate: f64,
    /// μ: total service rate (the port's line rate).
    pub service_rate: f64,
    /// B: the port's buffer.
    pub buffer: Bytes,
    /// Bytes per packet.
    pub packet_size: Bytes,
    /// Cost functions.
    pub cost: CostModel,
    /// Most units the buffer is cut into.
    pub max_units: u32,
}

impl Default for Params {
    /// θ = 0.5 (the median split of DLCP §3.2.2), λ/μ = 95/100, B = 512 KiB (DLCP's
    /// simulations), 1500-byte packets, default costs, at most 1024 units.
    fn default() -> Self {
        Params {
            theta: 0.5,
            arrival_rate: 95.0,
            service_rate: 100.0,
            buffer: Bytes(512 * 1024),
            packet_size: Bytes(1500),
            cost: CostModel::default(),
            max_units: 1024,
        }
    }
}

/// Largest `max_units`: keeps the exact search to seconds.
pub const MAX_UNITS: u32 = 8192;

/// Unusable optimizer inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptError {
    /// A parameter out of its range.
    #[error("{name}: {message}")]
    BadParam {
        /// Parameter (flag) name.
        name: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The buffer cannot give every queue its minimum.
    #[error("buffer of {buffer} B holds {units} units of {unit} B; the {queues} queues need at least {need}")]
    BufferTooSmall {
        /// B.
        buffer: u64,
        /// Units it holds.
        units: u32,
        /// Bytes per unit.
        unit: u64,
        /// Queues.
        queues: usize,
        /// Units needed.
        need: u32,
    },
}

/// One queue's traffic in the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueLoad {
    /// gradwire queue index (6 = front layers).
    pub queue: u8,
    /// First and last layer index (front = 0), if any layer maps here.
    pub layers: Option<(usize, usize)>,
    /// Share of the model's parameters.
    pub share: f64,
    /// λ_i.
    pub arrival: f64,
    /// μ_i.
    pub service: f64,
    /// ρ_i (infinite when the queue gets no service but has traffic).
    pub rho: f64,
}

/// M/M/1/m blocking probability P(ρ, m) = (ρ^m - ρ^(m+1)) / (1 - ρ^(m+1)), for real m ≥ 0.
pub fn mm1m_loss(rho: f64, m: f64) -> f64 {
    if m <= 0.0 || rho.is_nan() {
        return 1.0;
    }
    if rho <= 0.0 {
        return 0.0;
    }
    if rho.is_infinite() {
        return 1.0;
    }
    if (rho - 1.0).abs() < 1e-9 {
        return 1.0 / (m + 1.0);
    }
    if rho < 1.0 {
        let pm = rho.powf(m);
        pm * (1.0 - rho) / (1.0 - pm * rho)
    } else {
        // Divide through by ρ^(m+1) so nothing overflows: (1 - s) / (1 - s^(m+1)), s = 1/ρ.
        let s = 1.0 / rho;
        (1.0 - s) / (1.0 - s.powf(m + 1.0))
    }
}

/// Per-queue loads, in priority order (index 0 = Q_1 = gradwire queue 6).
pub fn queue_loads(layer_sizes: &[u64], arrival: f64, service: f64) -> Vec<QueueLoad> {
    let n = usize::from(NUM_DATA_QUEUES);
    let total: f64 = layer_sizes.iter().map(|s| *s as f64).sum();
    let num_layers = u32::try_from(layer_sizes.len()).unwrap_or(u32::MAX);
    let mut size = vec![0f64; n];
    let mut range: Vec<Option<(usize, usize)>> = vec![None; n];
    for (x, s) in layer_sizes.iter().enumerate() {
        let q = layer_queue(u32::try_from(x).unwrap_or(u32::MAX), num_layers);
        let k = usize::from(NUM_DATA_QUEUES - 1 - q);
        size[k] += *s as f64;
        range[k] = Some(match range[k] {
            None => (x, x),
            Some((a, _)) => (a, x),
        });
    }
    let mut out = Vec::with_capacity(n);
    let mut mu = service;
    for k in 0..n {
        let share = if total > 0.0 { size[k] / total } else { 0.0 };
        let lambda = arrival * share;
        let rho = if lambda <= 0.0 {
            0.0
        } else if mu <= 0.0 {
            f64::INFINITY
        } else {
            lambda / mu
        };
        out.push(QueueLoad {
            queue: (n - 1 - k) as u8,
            layers: range[k],
            share,
            arrival: lambda,
            service: mu.max(0.0),
            rho,
        });
        // μ_{i+1} = μ_i·(1 - ρ_i) = μ_i - λ_i: what the lower queues get.
        mu = if rho.is_finite() {
            mu * (1.0 - rho)
        } else {
            0.0
        };
    }
    out
}

/// One queue of the optimisation problem in model units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueModel {
    /// ρ_i.
    pub rho: f64,
    /// Cost coefficient of small-gradient loss (c^S·w).
    pub small: f64,
    /// Cost coefficient of large-gradient loss (c^L·w).
    pub large: f64,
}

/// The core problem: queues, a budget of `units`, `packets_per_unit` packets in each.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Queues in any order.
    pub queues: Vec<QueueModel>,
    /// Budget.
    pub units: u32,
    /// Packets per unit (M/M/1/m capacity per unit).
    pub packets_per_unit: f64,
    /// θ.
    pub theta: f64,
    /// Cost exponent e.
    pub exponent: f64,
}

impl Problem {
    /// Cost of a queue's small-gradient part with `a` units (real, for baselines).
    pub fn small_cost(&self, q: &QueueModel, a: f64) -> f64 {
        q.small * mm1m_loss(q.rho, a * self.packets_per_unit).powf(self.exponent)
    }

    /// Cost of a queue's large-gradient part with `b` units.
    pub fn large_cost(&self, q: &QueueModel, b: f64) -> f64 {
        q.large * mm1m_loss(q.rho, b * self.packets_per_unit).powf(self.exponent)
    }

    /// Smallest L' (units) that keeps S = S'/θ within L = S' + L'.
    pub fn min_large(&self, a: f64) -> u32 {
        let x = a * (1.0 - self.theta) / self.theta;
        // A hair of tolerance so exact products (a = 3, θ = 0.5 -> 3) are not pushed up.
        let c = (x - 1e-9).ceil().max(0.0);
        if c >= f64::from(u32::MAX) {
            u32::MAX
        } else {
            c as u32
        }
    }

    /// Total cost of an allocation (a_i, b_i) in units; real values allowed.
    pub fn cost(&self, alloc: &[(f64, f64)]) -> f64 {
        self.queues
            .iter()
            .zip(alloc)
            .map(|(q, (a, b))| self.small_cost(q, *a) + self.large_cost(q, *b))
            .sum()
    }

    /// Knapsack over per-queue tables: `best[k][t]` = cost of queue k with exactly t units.
    /// Returns units per queue and the total, or `None` if infeasible.
    fn knapsack(&self, best: &[Vec<f64>]) -> Option<(Vec<usize>, f64)> {
        let u = self.units as usize;
        let n = best.len();
        // f[k][t]: best cost of queues 0..=k using exactly t units; choice[k][t]: units of k.
        let mut f = vec![vec![f64::INFINITY; u + 1]; n];
        let mut choice = vec![vec![0usize; u + 1]; n];
        for t in 0..=u {
            f[0][t] = best[0][t];
            choice[0][t] = t;
        }
        for k in 1..n {
            for t in 0..=u {
                let mut bv = f64::INFINITY;
                let mut bc = 0;
                for x in 0..=t {
                    let v = f[k - 1][t - x] + best[k][x];
                    if v < bv {
                        bv = v;
                        bc = x;
                    }
                }
                f[k][t] = bv;
                choice[k][t] = bc;
            }
        }
        let mut t_best = 0;
        for t in 0..=u {
            if f[n - 1][t] < f[n - 1][t_best] {
                t_best = t;
            }
        }
        if !f[n - 1][t_best].is_finite() {
            return None;
        }
        let total = f[n - 1][t_best];
        let mut units = vec![0; n];
        let mut t = t_best;
        for k in (0..n).rev() {
            units[k] = choice[k][t];
            t -= units[k];
        }
        Some((units, total))
    }

    /// The optimum on the unit grid: (S'_i, L'_i) per queue and the total cost. `None` if
    /// the budget cannot give every queue S' ≥ 1 and S ≤ L.
    pub fn solve(&self) -> Option<(Vec<(u32, u32)>, f64)> {
        if self.queues.is_empty() {
            return Some((Vec::new(), 0.0));
        }
        let u = self.units as usize;
        let mut best = Vec::with_capacity(self.queues.len());
        let mut split = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            let g: Vec<f64> = (0..=u).map(|a| self.small_cost(q, a as f64)).collect();
            let h: Vec<f64> = (0..=u).map(|b| self.large_cost(q, b as f64)).collect();
            let mut row = vec![f64::INFINITY; u + 1];
            let mut arg = vec![0usize; u + 1];
            for a in 1..=u {
                let min_b = self.min_large(a as f64) as usize;
                let Some(start) = a.checked_add(min_b) else {
                    continue;
                };
                for t in start..=u {
                    let v = g[a] + h[t - a];
                    if v < row[t] {
                        row[t] = v;
                        arg[t] = a;
                    }
                }
            }
            best.push(row);
            split.push(arg);
        }
        let (units, total) = self.knapsack(&best)?;
        let alloc = units
            .iter()
            .zip(&split)
            .map(|(t, arg)| {
                let a = arg[*t];
                (a as u32, (*t - a) as u32)
            })
            .collect();
        Some((alloc, total))
    }

    /// The best L'_i for fixed (real) S'_i: `None` if they leave too little buffer.
    ///
    /// With e ≥ 1 every per-queue cost is convex and non-increasing in L'_i (the M/M/1/m
    /// blocking probability is convex in m, and r^e is convex and increasing), so giving
    /// each next unit to the queue whose cost falls most is exact; otherwise the exact
    /// dynamic programme runs. (Only the baselines need this, many times over.)
    pub fn solve_large_for(&self, small: &[f64]) -> Option<(Vec<u32>, f64)> {
        if self.exponent >= 1.0 {
            self.solve_large_greedy(small)
        } else {
            self.solve_large_dp(small)
        }
    }

    fn solve_large_greedy(&self, small: &[f64]) -> Option<(Vec<u32>, f64)> {
        let used: f64 = small.iter().sum();
        let left = f64::from(self.units) - used;
        if left < 0.0 {
            return None;
        }
        let mut b: Vec<u32> = small.iter().map(|a| self.min_large(*a)).collect();
        let need: u64 = b.iter().map(|x| u64::from(*x)).sum();
        let mut spare = (left.floor() as u64).checked_sub(need)?;
        let large = |k: usize, b: u32| self.large_cost(&self.queues[k], f64::from(b));
        while spare > 0 {
            let mut best: Option<(usize, f64)> = None;
            for (k, bk) in b.iter().enumerate() {
                let gain = large(k, *bk) - large(k, bk.saturating_add(1));
                if gain > 0.0 && best.is_none_or(|(_, g)| gain > g) {
                    best = Some((k, gain));
                }
            }
            let Some((k, _)) = best else { break };
            b[k] = b[k].saturating_add(1);
            spare -= 1;
        }
        let alloc: Vec<(f64, f64)> = small
            .iter()
            .zip(&b)
            .map(|(a, x)| (*a, f64::from(*x)))
            .collect();
        Some((b, self.cost(&alloc)))
    }

    /// The exact dynamic programme for [`Problem::solve_large_for`].
    pub fn solve_large_dp(&self, small: &[f64]) -> Option<(Vec<u32>, f64)> {
        let used: f64 = small.iter().sum();
        let left = f64::from(self.units) - used;
        if left < 0.0 {
            return None;
        }
        let u = left.floor() as usize;
        let mut best = Vec::with_capacity(self.queues.len());
        for (q, a) in self.queues.iter().zip(small) {
            let min_b = self.min_large(*a) as usize;
            let g = self.small_cost(q, *a);
            let row: Vec<f64> = (0..=u)
                .map(|b| {
                    if b < min_b {
                        f64::INFINITY
                    } else {
                        g + self.large_cost(q, b as f64)
                    }
                })
                .collect();
            best.push(row);
        }
        let sub = Problem {
            units: u32::try_from(u).unwrap_or(u32::MAX),
            ..self.clone()
        };
        let (units, total) = sub.knapsack(&best)?;
        Some((units.iter().map(|b| *b as u32).collect(), total))
    }
}

/// One queue of a solution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueResult {
    /// Traffic.
    #[serde(flatten)]
    pub load: QueueLoad,
    /// S'_i in packets.
    pub small_packets: f64,
    /// L'_i in packets.
    pub large_packets: f64,
    /// S_i: the ECN/drop threshold to configure.
    pub threshold: Bytes,
    /// L_i: the queue's share of the buffer in the model (not configured on switches).
    pub queue_size: Bytes,
    /// r^S_i.
    pub loss_small: f64,
    /// r^L_i.
    pub loss_large: f64,
    /// f^S_i(r^S_i) + f^L_i(r^L_i).
    pub cost: f64,
}

/// An evaluated set of thresholds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Solution {
    /// Queues in priority order (queue 6 first).
    pub queues: Vec<QueueResult>,
    /// Σ cost.
    pub total_cost: f64,
}

impl Solution {
    /// Thresholds indexed by queue (0..=6).
    pub fn thresholds(&self) -> [Bytes; DATA_QUEUES] {
        let mut t = [Bytes(0); DATA_QUEUES];
        for q in &self.queues {
            if let Some(slot) = t.get_mut(usize::from(q.load.queue)) {
                *slot = q.threshold;
            }
        }
        t
    }
}

/// A model and parameters turned into a [`Problem`], with what is needed to report.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// Loads in priority order.
    pub loads: Vec<QueueLoad>,
    /// The problem.
    pub problem: Problem,
    /// Bytes per unit.
    pub unit_bytes: u64,
}

fn check_params(p: &Params) -> Result<(), OptError> {
    let bad = |name, message: &str| {
        Err(OptError::BadParam {
            name,
            message: message.into(),
        })
    };
    if !(p.theta > 0.0 && p.theta < 1.0) {
        return bad("theta", "the small-gradient share θ must be in (0, 1)");
    }
    if !(p.arrival_rate.is_finite() && p.arrival_rate > 0.0) {
        return bad("arrival-rate", "must be a finite number > 0");
    }
    if !(p.service_rate.is_finite() && p.service_rate > 0.0) {
        return bad("service-rate", "must be a finite number > 0");
    }
    if p.packet_size.0 == 0 {
        return bad("packet-size", "must be > 0");
    }
    if p.buffer.0 < p.packet_size.0 {
        return bad("buffer", "must hold at least one packet");
    }
    if !(2..=MAX_UNITS).contains(&p.max_units) {
        // The search is O(N·U²) in time and O(N·U) in memory.
        return bad("max-units", &format!("must be 2..={MAX_UNITS}"));
    }
    if !(p.cost.exponent.is_finite() && p.cost.exponent > 0.0) {
        return bad("cost-exponent", "must be a finite number > 0");
    }
    let ok = |v: &[f64; DATA_QUEUES]| v.iter().all(|c| c.is_finite() && *c >= 0.0);
    if !ok(&p.cost.small) {
        return bad("cost-small", "coefficients must be finite and >= 0");
    }
    if !ok(&p.cost.large) {
        return bad("cost-large", "coefficients must be finite and >= 0");
    }
    Ok(())
}

/// Build the problem for a model.
pub fn setup(model: &DnnModel, p: &Params) -> Result<Setup, OptError> {
    check_params(p)?;
    let loads = queue_loads(&model.sizes(), p.arrival_rate, p.service_rate);
    let packets = p.buffer.0 / p.packet_size.0;
    let quantum = packets.div_ceil(u64::from(p.max_units)).max(1);
    let units = u32::try_from(packets / quantum).unwrap_or(u32::MAX);
    let unit_bytes = quantum * p.packet_size.0;
    let queues = loads
        .iter()
        .map(|l| {
            let q = usize::from(l.queue);
            let w = if p.cost.weight_by_share { l.share } else { 1.0 };
            QueueModel {
                rho: l.rho,
                small: p.cost.small[q] * w,
                large: p.cost.large[q] * w,
            }
        })
        .collect();
    Ok(Setup {
        loads,
        problem: Problem {
            queues,
            units,
            packets_per_unit: quantum as f64,
            theta: p.theta,
            exponent: p.cost.exponent,
        },
        unit_bytes,
    })
}

fn result(s: &Setup, alloc: &[(f64, f64)]) -> Solution {
    let pr = &s.problem;
    let ub = s.unit_bytes as f64;
    let queues: Vec<QueueResult> = s
        .loads
        .iter()
        .zip(pr.queues.iter())
        .zip(alloc)
        .map(|((l, q), (a, b))| {
            let small_cost = pr.small_cost(q, *a);
            let large_cost = pr.large_cost(q, *b);
            QueueResult {
                load: l.clone(),
                small_packets: a * pr.packets_per_unit,
                large_packets: b * pr.packets_per_unit,
                threshold: Bytes((a * ub / pr.theta).ceil() as u64),
                queue_size: Bytes(((a + b) * ub).ceil() as u64),
                loss_small: mm1m_loss(q.rho, a * pr.packets_per_unit),
                loss_large: mm1m_loss(q.rho, b * pr.packets_per_unit),
                cost: small_cost + large_cost,
            }
        })
        .collect();
    let total_cost = queues.iter().map(|q| q.cost).sum();
    Solution { queues, total_cost }
}

/// The optimal thresholds for a model.
pub fn optimize(model: &DnnModel, p: &Params) -> Result<Solution, OptError> {
    let s = setup(model, p)?;
    let need: u32 = (0..s.problem.queues.len())
        .map(|_| 1 + s.problem.min_large(1.0))
        .sum();
    let Some((alloc, _)) = s.problem.solve() else {
        return Err(OptError::BufferTooSmall {
            buffer: p.buffer.0,
            units: s.problem.units,
            unit: s.unit_bytes,
            queues: s.problem.queues.len(),
            need,
        });
    };
    let alloc: Vec<(f64, f64)> = alloc
        .iter()
        .map(|(a, b)| (f64::from(*a), f64::from(*b)))
        .collect();
    Ok(result(&s, &alloc))
}

/// The arithmetic sequence T·(1, ..., 1+6d) evaluated in the model, with the rest of the
/// buffer split among the L'_i optimally. `None` when it does not fit the buffer.
pub fn evaluate_arithmetic(
    model: &DnnModel,
    p: &Params,
    base: Bytes,
    step: f64,
) -> Result<Option<Solution>, OptError> {
    let s = setup(model, p)?;
    let Ok(th) = crate::policy::arithmetic(base, step) else {
        return Ok(None);
    };
    evaluate_thresholds(&s, &th)
}

/// Fixed thresholds (indexed by queue) evaluated in the model with the best L'_i.
pub fn evaluate_thresholds(
    s: &Setup,
    th: &[Bytes; DATA_QUEUES],
) -> Result<Option<Solution>, OptError> {
    let pr = &s.problem;
    let small: Vec<f64> = s
        .loads
        .iter()
        .map(|l| th[usize::from(l.queue)].0 as f64 * pr.theta / s.unit_bytes as f64)
        .collect();
    let Some((large, _)) = pr.solve_large_for(&small) else {
        return Ok(None);
    };
    let alloc: Vec<(f64, f64)> = small
        .iter()
        .zip(&large)
        .map(|(a, b)| (*a, f64::from(*b)))
        .collect();
    let mut sol = result(s, &alloc);
    // Report the thresholds as given, not as recomputed from the units.
    for q in &mut sol.queues {
        q.threshold = th[usize::from(q.load.queue)];
    }
    Ok(Some(sol))
}

/// The best arithmetic sequence for one step d.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArithmeticBaseline {
    /// d.
    pub step: f64,
    /// The best T found.
    pub base: Bytes,
    /// Its evaluation.
    pub solution: Solution,
}

/// Steps the baseline tries by default.
pub const BASELINE_STEPS: [f64; 7] = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// For each d in `steps`, the T (searched on a grid of `grid` values up to the largest that
/// fits the buffer, then refined around the best) that gives the lowest modelled cost.
pub fn best_arithmetic(
    model: &DnnModel,
    p: &Params,
    steps: &[f64],
    grid: u32,
) -> Result<Vec<ArithmeticBaseline>, OptError> {
    let s = setup(model, p)?;
    let mut out = Vec::new();
    for &d in steps {
        if !d.is_finite() || d < 0.0 {
            continue;
        }
        // Σ S_i = 7·T·(1 + 3d) must fit in B (S_i ≤ L_i, Σ L_i ≤ B).
        let t_max = p.buffer.0 as f64 / (f64::from(NUM_DATA_QUEUES) * (1.0 + 3.0 * d));
        let mut best: Option<(Bytes, Solution)> = None;
        let try_t = |t: f64, best: &mut Option<(Bytes, Solution)>| -> Result<(), OptError> {
            if t.is_nan() || t < 1.0 {
                return Ok(());
            }
            let base = Bytes(t as u64);
            let Ok(th) = crate::policy::arithmetic(base, d) else {
                return Ok(());
            };
            if let Some(sol) = evaluate_thresholds(&s, &th)? {
                let better = best
                    .as_ref()
                    .is_none_or(|(_, b)| sol.total_cost < b.total_cost);
                if better {
                    *best = Some((base, sol));
                }
            }
            Ok(())
        };
        let g = grid.max(2);
        for i in 1..=g {
            try_t(t_max * f64::from(i) / f64::from(g), &mut best)?;
        }
        // Refine between the grid neighbours of the best.
        if let Some((b, _)) = &best {
            let centre = b.0 as f64;
            let h = t_max / f64::from(g);
            for i in 0..=2 * g {
                try_t(centre - h + h * f64::from(i) / f64::from(g), &mut best)?;
            }
        }
        if let Some((base, solution)) = best {
            out.push(ArithmeticBaseline {
                step: d,
                base,
                solution,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Layer;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn mm1m_by_hand() {
        // P(ρ, m) = ρ^m (1-ρ) / (1-ρ^(m+1))
        assert!(close(mm1m_loss(0.5, 1.0), 1.0 / 3.0));
        assert!(close(mm1m_loss(0.5, 2.0), 1.0 / 7.0));
        assert!(close(mm1m_loss(2.0, 1.0), 2.0 / 3.0));
        assert!(close(mm1m_loss(1.0, 4.0), 0.2));
        assert!(close(mm1m_loss(0.3, 0.0), 1.0), "no room: everything lost");
        assert!(close(mm1m_loss(0.0, 3.0), 0.0));
        assert!(close(mm1m_loss(f64::INFINITY, 3.0), 1.0));
        // ρ > 1: tends to 1 - 1/ρ, never above 1, no overflow for huge m
        assert!(close(mm1m_loss(2.0, 5000.0), 0.5));
        assert!(mm1m_loss(1e300, 1e6) <= 1.0);
        // continuous near ρ = 1
        assert!((mm1m_loss(1.0 + 1e-7, 4.0) - 0.2).abs() < 1e-6);
        // decreasing in m
        for rho in [0.1, 0.9, 1.0, 1.5, 10.0] {
            for m in 0..50 {
                assert!(mm1m_loss(rho, f64::from(m + 1)) <= mm1m_loss(rho, f64::from(m)));
            }
        }
    }

    #[test]
    fn strict_priority_service_by_hand() {
        // Layers 0..7 -> one per queue (L = P = 7); sizes 2,3,5,0.. of 10 (λ = 0.9, μ = 1).
        let l = queue_loads(&[2, 3, 5], 0.9, 1.0);
        // L = 3 < P: layers go to priorities 0, 2, 4 = queues 6, 4, 2.
        assert_eq!(l[0].queue, 6);
        assert!(close(l[0].rho, 0.18));
        assert!(
            close(l[1].service, 0.82) && l[1].rho == 0.0,
            "queue 5 is empty"
        );
        assert!(close(l[2].service, 0.82));
        assert!(close(l[2].rho, 0.27 / 0.82));
        assert!(close(l[4].service, 0.55));
        assert!(close(l[4].rho, 0.45 / 0.55));
        assert_eq!(l[4].queue, 2);
        assert_eq!(l[4].layers, Some((2, 2)));
        // overload: the lower queues starve
        let l = queue_loads(&[1; 7], 14.0, 1.0);
        assert!(close(l[0].rho, 2.0));
        assert!(l[1].rho.is_infinite());
        assert!(close(mm1m_loss(l[1].rho, 10.0), 1.0));
    }

    #[test]
    fn single_queue_by_hand() {
        // ρ = 0.5, θ = 0.5, c^S = 1, c^L = 10, 3 units of 1 packet.
        // Feasible (S', L') with S' ≥ 1 and L' ≥ S': (1,1), (1,2). P(.5,1) = 1/3, P(.5,2) = 1/7:
        // (1,1) costs 1/3 + 10/3, (1,2) costs 1/3 + 10/7: the optimum is S' = 1, L' = 2,
        // i.e. threshold S = S'/θ = 2 packets, queue size L = 3.
        let pr = Problem {
            queues: vec![QueueModel {
                rho: 0.5,
                small: 1.0,
                large: 10.0,
            }],
            units: 3,
            packets_per_unit: 1.0,
            theta: 0.5,
            exponent: 1.0,
        };
        let (alloc, cost) = pr.solve().unwrap();
        assert_eq!(alloc, [(1, 2)]);
        assert!(close(cost, 1.0 / 3.0 + 10.0 / 7.0));
        // 1 unit cannot hold S' = 1 and L' ≥ 1
        let tiny = Problem {
            units: 1,
            ..pr.clone()
        };
        assert!(tiny.solve().is_none());
    }

    /// Every allocation of a small budget, enumerated.
    fn brute(pr: &Problem) -> Option<f64> {
        let n = pr.queues.len();
        let u = pr.units;
        let mut best: Option<f64> = None;
        let mut alloc = vec![(0u32, 0u32); n];
        fn rec(
            pr: &Problem,
            k: usize,
            left: u32,
            alloc: &mut Vec<(u32, u32)>,
            best: &mut Option<f64>,
        ) {
            if k == alloc.len() {
                let a: Vec<(f64, f64)> = alloc
                    .iter()
                    .map(|(a, b)| (f64::from(*a), f64::from(*b)))
                    .collect();
                let c = pr.cost(&a);
                if best.is_none_or(|b| c < b) {
                    *best = Some(c);
                }
                return;
            }
            for a in 1..=left {
                for b in pr.min_large(f64::from(a))..=left - a {
                    alloc[k] = (a, b);
                    rec(pr, k + 1, left - a - b, alloc, best);
                }
            }
        }
        rec(pr, 0, u, &mut alloc, &mut best);
        best
    }

    #[test]
    fn dp_matches_brute_force() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..60 {
            let n = 1 + case % 3;
            let queues = (0..n)
                .map(|_| QueueModel {
                    rho: rnd() * 1.6,
                    small: rnd() * 3.0,
                    large: rnd() * 30.0,
                })
                .collect();
            let theta = [0.5, 0.3, 0.7, 0.9][case % 4];
            let pr = Problem {
                queues,
                units: 4 + (case % 6) as u32,
                packets_per_unit: 1.0 + (case % 2) as f64,
                theta,
                exponent: [1.0, 2.0, 0.5][case % 3],
            };
            let dp = pr.solve();
            let bf = brute(&pr);
            match (dp, bf) {
                (None, None) => {}
                (Some((alloc, c)), Some(b)) => {
                    assert!(close(c, b), "case {case}: dp {c} brute {b}");
                    let a: Vec<(f64, f64)> = alloc
                        .iter()
                        .map(|(a, b)| (f64::from(*a), f64::from(*b)))
                        .collect();
                    assert!(
                        close(pr.cost(&a), c),
                        "reported allocation has the reported cost"
                    );
                    let used: u32 = alloc.iter().map(|(a, b)| a + b).sum();
                    assert!(used <= pr.units);
                    for (a, b) in &alloc {
                        assert!(*a >= 1 && f64::from(*a) / theta <= f64::from(a + b) + 1e-9);
                    }
                }
                (d, b) => panic!("case {case}: dp {d:?} brute {b:?}"),
            }
        }
    }

    #[test]
    fn large_only_dp_matches_brute_force() {
        let pr = Problem {
            queues: vec![
                QueueModel {
                    rho: 0.2,
                    small: 1.0,
                    large: 5.0,
                },
                QueueModel {
                    rho: 0.9,
                    small: 2.0,
                    large: 20.0,
                },
            ],
            units: 9,
            packets_per_unit: 1.0,
            theta: 0.5,
            exponent: 1.0,
        };
        let small = [1.5, 2.0];
        let (large, cost) = pr.solve_large_dp(&small).unwrap();
        assert!(close(pr.solve_large_greedy(&small).unwrap().1, cost));
        let mut best = f64::INFINITY;
        for b0 in 2..=5u32 {
            for b1 in 2..=5u32 {
                if f64::from(b0 + b1) <= 9.0 - 3.5 {
                    best = best.min(pr.cost(&[(1.5, f64::from(b0)), (2.0, f64::from(b1))]));
                }
            }
        }
        assert!(close(cost, best), "{cost} vs {best}");
        assert!(close(
            pr.cost(&[(1.5, f64::from(large[0])), (2.0, f64::from(large[1]))]),
            cost
        ));
        assert!(pr.solve_large_for(&[5.0, 5.0]).is_none());
        assert!(pr.solve_large_dp(&[5.0, 5.0]).is_none());
    }

    #[test]
    fn greedy_large_split_is_exact_for_convex_costs() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..300 {
            let n = 1 + case % 7;
            let pr = Problem {
                queues: (0..n)
                    .map(|_| QueueModel {
                        rho: [rnd() * 1.2, rnd() * 5.0, 0.0, f64::INFINITY, 1.0][case % 5],
                        small: rnd(),
                        large: rnd() * 20.0,
                    })
                    .collect(),
                units: 10 + (case % 40) as u32,
                packets_per_unit: 1.0 + (case % 3) as f64,
                theta: [0.5, 0.2, 0.8][case % 3],
                exponent: [1.0, 1.5, 3.0][case % 3],
            };
            let small: Vec<f64> = (0..n).map(|_| 0.5 + rnd() * 2.0).collect();
            let g = pr.solve_large_greedy(&small);
            let d = pr.solve_large_dp(&small);
            match (g, d) {
                (None, None) => {}
                (Some((_, a)), Some((_, b))) => {
                    assert!(close(a, b), "case {case}: greedy {a} dp {b}")
                }
                (g, d) => panic!("case {case}: greedy {g:?} dp {d:?}"),
            }
        }
    }

    fn toy_model() -> DnnModel {
        DnnModel {
            name: "toy".into(),
            total_params: None,
            bytes_per_param: 4,
            layers: [1u64, 2, 4, 8, 16, 32, 64]
                .iter()
                .enumerate()
                .map(|(i, p)| Layer {
                    name: format!("l{i}"),
                    params: *p * 1000,
                })
                .collect(),
        }
    }

    #[test]
    fn optimizer_beats_every_arithmetic_sequence_on_a_toy_model() {
        let m = toy_model();
        let p = Params {
            buffer: Bytes(64 * 1500),
            ..Params::default()
        };
        let opt = optimize(&m, &p).unwrap();
        let base = best_arithmetic(&m, &p, &BASELINE_STEPS, 16).unwrap();
        assert!(!base.is_empty());
        for b in &base {
            assert!(
                opt.total_cost < b.solution.total_cost,
                "d = {}: optimizer {} vs arithmetic {}",
                b.step,
                opt.total_cost,
                b.solution.total_cost
            );
        }
        // thresholds fit: Σ L = B at most, S ≤ L
        let used: u64 = opt.queues.iter().map(|q| q.queue_size.0).sum();
        assert!(used <= p.buffer.0);
        for q in &opt.queues {
            assert!(q.threshold <= q.queue_size && q.threshold.0 > 0);
        }
    }

    #[test]
    fn bad_params_are_errors() {
        let m = toy_model();
        for p in [
            Params {
                theta: 0.0,
                ..Params::default()
            },
            Params {
                theta: 1.0,
                ..Params::default()
            },
            Params {
                arrival_rate: f64::NAN,
                ..Params::default()
            },
            Params {
                service_rate: 0.0,
                ..Params::default()
            },
            Params {
                packet_size: Bytes(0),
                ..Params::default()
            },
            Params {
                buffer: Bytes(10),
                ..Params::default()
            },
            Params {
                max_units: 1,
                ..Params::default()
            },
        ] {
            assert!(
                matches!(optimize(&m, &p), Err(OptError::BadParam { .. })),
                "{p:?}"
            );
        }
        let p = Params {
            buffer: Bytes(3 * 1500),
            ..Params::default()
        };
        assert!(matches!(
            optimize(&m, &p),
            Err(OptError::BufferTooSmall { .. })
        ));
        let mut p = Params::default();
        p.cost.large[3] = -1.0;
        assert!(optimize(&m, &p).is_err());
    }

    #[test]
    fn arithmetic_that_does_not_fit_is_none() {
        let m = toy_model();
        let p = Params::default();
        // 7 · 64 KiB · 2.5 = 1120 KiB > 512 KiB
        assert!(evaluate_arithmetic(&m, &p, Bytes(65536), 0.5)
            .unwrap()
            .is_none());
        assert!(evaluate_arithmetic(&m, &p, Bytes(16384), 0.5)
            .unwrap()
            .is_some());
    }
}
