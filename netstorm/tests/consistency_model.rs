#![allow(clippy::unwrap_used, clippy::expect_used)]
//! An explicit-state model checker for NetStorm's policy consistency protocol (§VII) as
//! gradwire implements it (`gradwire_netstorm::consistency`).
//!
//! The model: 3 nodes running 2 rounds of an all-reduce (push up each root's tree, pull
//! down), a scheduler holding policy version 1, and a refresh to version 2 that may happen at
//! any point. The versions' trees differ for both roots (root 0: chain `1 -> 2 -> 0` vs
//! `2 -> 1 -> 0`; root 1: a star vs `0 -> 2 -> 1`), and each version has a source-routed
//! auxiliary path through a third node (`1 -> 0 -> 2` for the edge `1 -> 2`, `2 -> 0 -> 1` for
//! `2 -> 1`). A PUSH whose edge has an auxiliary path may take either path (the runtime's
//! choice by queue occupancy, explored both ways).
//!
//! Network model: every message in flight (TRPs, answers, chunks) is in one **multiset**, and
//! any of them may be delivered next: no FIFO order even between the same two nodes. That
//! allows every behaviour of per-connection FIFO channels and more, so what holds here holds
//! over TCP connections and over gradwire's flows, whose chunks may overtake each other.
//! Messages are not lost or duplicated by the network (the transport is reliable).
//!
//! The checker visits every reachable global state (node states + scheduler state + the
//! multiset in flight) by breadth-first search, with the real state machines as the
//! transition function, and checks:
//! - no deadlock: every state with no move left has every node idle after both rounds, no
//!   chunk cached and nothing in flight;
//! - no loss or duplication: every result any node gets is the sum of each node's
//!   contribution exactly once (contributions are unit vectors, the sum must be all ones),
//!   every node gets each root's result of each round exactly once, and every message sent is
//!   delivered and accepted;
//! - no message to a node that cannot handle it: no state machine returns an error.
//!
//! Then it shows the protocol is needed: with the scheduler answering every TRP with the
//! newest policy (the paper read literally, no pinning), or with nodes dropping early data
//! instead of caching it (no Case 2), it finds a counterexample and prints its trace.

use std::cell::Cell;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::rc::Rc;
use std::time::Instant;

use gradwire_netstorm::consistency::{NodeState, Output, Payload, Reply, SchedulerState, Stage};
use gradwire_netstorm::wire::{
    AuxPaths, ChunkHeader, Phase, Policy, PolicyConfirm, PolicyUpdate, RootTree, TopologyRequest,
};

const N: usize = 3;
const ROUNDS: u32 = 2;
/// Chunks per round, assigned to the roots by the round's policy's shares.
const CHUNKS: u32 = 3;

/// How many times each node's contribution is in a sum: the aggregate must be all ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Counts([u8; N]);

impl Payload for Counts {
    fn accumulate(&mut self, other: &Self) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a = a.saturating_add(b);
        }
    }
}

const ALL_ONCE: Counts = Counts([1; N]);

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Msg {
    /// Node to scheduler.
    Trp(TopologyRequest),
    /// Scheduler to node (the policy itself is looked up by version on delivery).
    Reply {
        to: u16,
        update: bool,
        version: u32,
        round: u32,
    },
    /// Node to node.
    Chunk {
        from: u16,
        to: u16,
        header: ChunkHeader,
        payload: Counts,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Scheduler {
    /// gradwire's: rounds pinned to a version.
    Pinned(SchedulerState),
    /// Every TRP answered with the newest version.
    Newest { version: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// gradwire's protocol.
    Protocol,
    /// The scheduler answers with the newest policy: no per-round pinning.
    NoPinning,
    /// Nodes drop a chunk they cannot process yet instead of caching it.
    NoCache,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Global {
    nodes: Vec<NodeState<Counts>>,
    sched: Scheduler,
    switched: bool,
    /// The multiset in flight: message -> copies.
    net: BTreeMap<Msg, u8>,
    /// (node, round, chunk) results received.
    results: BTreeSet<(u16, u32, u32)>,
}

impl Global {
    fn send(&mut self, m: Msg) {
        *self.net.entry(m).or_insert(0) += 1;
    }
    fn take(&mut self, m: &Msg) {
        let c = self.net.get_mut(m).expect("delivered message is in flight");
        *c -= 1;
        if *c == 0 {
            self.net.remove(m);
        }
    }
}

/// One transition: the refresh, or the delivery of a message (with the route chosen for
/// each PUSH that had an auxiliary path: 0 primary, i > 0 the i-th auxiliary path).
#[derive(Debug, Clone)]
enum Step {
    Init,
    Switch,
    Deliver(Msg, Vec<u8>),
}

struct Model {
    policies: [Policy; 2],
    variant: Variant,
    seen: Coverage,
}

/// The situations the protocol exists for, each seen in some explored state (so the
/// exhaustive run is known to cover them, not just to pass).
#[derive(Debug, Default)]
struct Coverage {
    /// Case 2: a chunk of a node's round arrived before the node knew the round's policy.
    early_before_policy: Cell<bool>,
    /// A chunk of the next round arrived at a node still in its round.
    next_round_cached: Cell<bool>,
    /// An auxiliary chunk passed through a node that was not running the chunk's round.
    aux_through_other_state: Cell<bool>,
    /// Two nodes held different policy versions at the same time.
    mixed_versions: Cell<bool>,
}

fn tree(root: u16, share: u32, parent: [Option<u16>; N]) -> RootTree {
    RootTree {
        root,
        share,
        parent: parent.to_vec(),
    }
}

/// The root of each chunk by the policy's shares (each root takes `share` consecutive slots
/// of a cycle): the same on every node that holds the same policy.
fn assign(policy: &Policy) -> Vec<u16> {
    let slots: Vec<u16> = policy
        .trees()
        .iter()
        .flat_map(|t| std::iter::repeat_n(t.root, t.share as usize))
        .collect();
    (0..CHUNKS as usize)
        .map(|c| slots[c % slots.len()])
        .collect()
}

fn policies() -> [Policy; 2] {
    let v1 = Policy::new(
        N as u16,
        vec![
            // 1 -> 2 -> 0, two chunks of three
            tree(0, 2, [None, Some(2), Some(0)]),
            // 0 -> 1 <- 2, one chunk
            tree(1, 1, [Some(1), None, Some(1)]),
        ],
        vec![AuxPaths {
            from: 1,
            to: 2,
            paths: vec![vec![1, 0, 2]],
        }],
    )
    .unwrap();
    let v2 = Policy::new(
        N as u16,
        vec![
            // 2 -> 1 -> 0, one chunk of three
            tree(0, 1, [None, Some(0), Some(1)]),
            // 0 -> 2 -> 1, two chunks
            tree(1, 2, [Some(2), None, Some(1)]),
        ],
        vec![AuxPaths {
            from: 2,
            to: 1,
            paths: vec![vec![2, 0, 1]],
        }],
    )
    .unwrap();
    [v1, v2]
}

type Violation = String;

impl Model {
    fn new(variant: Variant) -> Model {
        Model {
            policies: policies(),
            variant,
            seen: Coverage::default(),
        }
    }

    fn policy(&self, version: u32) -> &Policy {
        &self.policies[version as usize - 1]
    }

    fn initial(&self) -> Result<Global, Violation> {
        let sched = match self.variant {
            Variant::NoPinning => Scheduler::Newest { version: 1 },
            _ => Scheduler::Pinned(SchedulerState::new(self.policies[0].clone())),
        };
        let mut g = Global {
            nodes: (0..N as u16).map(|n| NodeState::new(n, 0)).collect(),
            sched,
            switched: false,
            net: BTreeMap::new(),
            results: BTreeSet::new(),
        };
        let mut pending = VecDeque::new();
        for n in 0..N {
            let outs = g.nodes[n].begin_round(0).map_err(|e| e.to_string())?;
            pending.extend(outs.into_iter().map(|o| (n as u16, o)));
        }
        let mut next = Vec::new();
        self.run(g, pending, Vec::new(), &mut next)?;
        Ok(next.pop().expect("no route choice before any chunk").1)
    }

    /// Applies node outputs (sends, and the runtime's immediate reactions: contributing once
    /// the policy is adopted, beginning the next round), branching on route choices.
    fn run(
        &self,
        mut g: Global,
        mut pending: VecDeque<(u16, Output<Counts>)>,
        mut choices: Vec<u8>,
        acc: &mut Vec<(Vec<u8>, Global)>,
    ) -> Result<(), Violation> {
        while let Some((n, out)) = pending.pop_front() {
            let node = usize::from(n);
            match out {
                Output::Request(r) => g.send(Msg::Trp(r)),
                Output::Send {
                    to,
                    header,
                    payload,
                } => {
                    let aux: Vec<Vec<u16>> = if header.phase == Phase::Push && !header.is_aux {
                        let (_, p) = g.nodes[node].policy().expect("sending with a policy");
                        p.aux_paths(n, to).to_vec()
                    } else {
                        Vec::new()
                    };
                    for (i, path) in aux.iter().enumerate() {
                        let mut g2 = g.clone();
                        let h = header.via(path).map_err(|e| e.to_string())?;
                        g2.send(Msg::Chunk {
                            from: n,
                            to: path[1],
                            header: h,
                            payload,
                        });
                        let mut c = choices.clone();
                        c.push(i as u8 + 1);
                        self.run(g2, pending.clone(), c, acc)?;
                    }
                    if !aux.is_empty() {
                        choices.push(0);
                    }
                    g.send(Msg::Chunk {
                        from: n,
                        to,
                        header,
                        payload,
                    });
                }
                Output::Adopted { version, .. } => {
                    let (v, policy) = g.nodes[node].policy().expect("adopted a policy");
                    assert_eq!(v, version);
                    // Node n contributes the unit vector e_n to every chunk.
                    let mut mine = Counts([0; N]);
                    mine.0[node] = 1;
                    let plan: Vec<(u16, u32, Counts)> = assign(policy)
                        .into_iter()
                        .zip(0..)
                        .map(|(root, chunk)| (root, chunk, mine))
                        .collect();
                    let outs = g.nodes[node]
                        .contribute(plan)
                        .map_err(|e| format!("node {n} cannot contribute: {e}"))?;
                    pending.extend(outs.into_iter().map(|o| (n, o)));
                }
                Output::Result {
                    round,
                    root,
                    chunk,
                    payload,
                } => {
                    if payload != ALL_ONCE {
                        return Err(format!(
                            "LOSS/DUPLICATION: node {n} got result {:?} for round {round}, root \
                             {root}, chunk {chunk} (each node's contribution must count once)",
                            payload.0
                        ));
                    }
                    if !g.results.insert((n, round, chunk)) {
                        return Err(format!(
                            "DUPLICATION: node {n} got a second result for round {round}, \
                             chunk {chunk}"
                        ));
                    }
                }
                Output::RoundDone { round } => {
                    if round + 1 < ROUNDS {
                        let outs = g.nodes[node]
                            .begin_round(round + 1)
                            .map_err(|e| format!("node {n}: {e}"))?;
                        pending.extend(outs.into_iter().map(|o| (n, o)));
                    }
                }
            }
        }
        acc.push((choices, g));
        Ok(())
    }

    /// Every successor of `g`, or the first violation a move runs into.
    fn successors(&self, g: &Global) -> Result<Vec<(Step, Global)>, (Step, Violation)> {
        let mut out = Vec::new();
        if !g.switched {
            let mut g2 = g.clone();
            g2.switched = true;
            match &mut g2.sched {
                Scheduler::Pinned(s) => {
                    s.install(self.policies[1].clone())
                        .map_err(|e| (Step::Switch, e.to_string()))?;
                }
                Scheduler::Newest { version } => *version = 2,
            }
            out.push((Step::Switch, g2));
        }
        for m in g.net.keys() {
            let mut g2 = g.clone();
            g2.take(m);
            let fail = |e: Violation| (Step::Deliver(m.clone(), Vec::new()), e);
            let (node, outs) = match m {
                Msg::Trp(req) => {
                    let (update, version) = match &mut g2.sched {
                        Scheduler::Pinned(s) => {
                            let r = s.on_request(req).map_err(|e| fail(e.to_string()))?;
                            (matches!(r, Reply::Update(_)), r.version())
                        }
                        Scheduler::Newest { version } => (req.version != *version, *version),
                    };
                    g2.send(Msg::Reply {
                        to: req.node,
                        update,
                        version,
                        round: req.round,
                    });
                    (req.node, Vec::new())
                }
                Msg::Reply {
                    to,
                    update,
                    version,
                    round,
                } => {
                    let (version, round) = (*version, *round);
                    let reply = if *update {
                        Reply::Update(PolicyUpdate {
                            version,
                            round,
                            policy: self.policy(version).clone(),
                        })
                    } else {
                        Reply::Confirm(PolicyConfirm { version, round })
                    };
                    let outs = g2.nodes[usize::from(*to)]
                        .on_reply(reply)
                        .map_err(|e| fail(format!("UNHANDLED MESSAGE (its data is lost): {e}")))?;
                    (*to, outs)
                }
                Msg::Chunk {
                    from,
                    to,
                    header,
                    payload,
                } => {
                    let n = &mut g2.nodes[usize::from(*to)];
                    let can_process = n.stage() == Stage::Running && header.round == n.round();
                    let passing_through = header.is_aux && header.forwarded().is_some();
                    if passing_through && !can_process {
                        self.seen.aux_through_other_state.set(true);
                    } else if !passing_through && header.round == n.round() && !can_process {
                        self.seen.early_before_policy.set(true);
                    } else if !passing_through && header.round > n.round() {
                        self.seen.next_round_cached.set(true);
                    }
                    if self.variant == Variant::NoCache && !can_process && !passing_through {
                        // Dropped: this variant has no Case 2.
                        (*to, Vec::new())
                    } else {
                        let outs = n.on_chunk(*from, header.clone(), *payload).map_err(|e| {
                            fail(format!("UNHANDLED MESSAGE (its data is lost): {e}"))
                        })?;
                        (*to, outs)
                    }
                }
            };
            let mut next = Vec::new();
            let pending = outs.into_iter().map(|o| (node, o)).collect();
            self.run(g2, pending, Vec::new(), &mut next)
                .map_err(|e| (Step::Deliver(m.clone(), Vec::new()), e))?;
            for (choices, g3) in next {
                let versions: BTreeSet<u32> = g3
                    .nodes
                    .iter()
                    .filter_map(|n| n.policy().map(|(v, _)| v))
                    .collect();
                if versions.len() > 1 {
                    self.seen.mixed_versions.set(true);
                }
                let step = Step::Deliver(m.clone(), choices);
                if let Some(why) = self.check_invariants(&g3) {
                    return Err((step, why));
                }
                out.push((step, g3));
            }
        }
        Ok(out)
    }

    /// What pinning guarantees in every state: the nodes that know their round's policy
    /// agree on it per round, and the scheduler has at most one round pinned.
    /// (Not checked without pinning, where it fails by design: that variant must show the
    /// harm itself, a deadlock or lost data.)
    fn check_invariants(&self, g: &Global) -> Option<Violation> {
        if self.variant == Variant::NoPinning {
            return None;
        }
        let mut by_round: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for n in &g.nodes {
            if matches!(n.stage(), Stage::Adopted | Stage::Running) {
                let (v, _) = n.policy().expect("a node past its TRP holds a policy");
                by_round.entry(n.round()).or_default().insert(v);
            }
        }
        if let Some((round, vs)) = by_round.iter().find(|(_, vs)| vs.len() > 1) {
            return Some(format!(
                "SPLIT ROUND: nodes run round {round} on policy versions {vs:?}"
            ));
        }
        if let Scheduler::Pinned(s) = &g.sched {
            let pinned = (0..ROUNDS).filter(|&r| s.pinned(r).is_some()).count();
            if pinned > 1 {
                return Some(format!("{pinned} rounds pinned at once"));
            }
        }
        None
    }

    /// What is wrong with a state that has no move left, if anything.
    fn check_terminal(&self, g: &Global) -> Option<Violation> {
        let expected = N * ROUNDS as usize * CHUNKS as usize;
        let done = g
            .nodes
            .iter()
            .all(|n| n.stage() == Stage::Idle && n.round() == ROUNDS && n.cached() == 0);
        if done && g.net.is_empty() && g.results.len() == expected {
            return None;
        }
        let mut s = String::from("DEADLOCK: no move left, but");
        for n in &g.nodes {
            let _ = write!(
                s,
                " node {} {:?} in round {} ({} cached);",
                n.me(),
                n.stage(),
                n.round(),
                n.cached()
            );
        }
        let _ = write!(
            s,
            " {} results of {}; in flight: {:?}",
            g.results.len(),
            expected,
            g.net
        );
        Some(s)
    }
}

struct Report {
    seen: Coverage,
    states: usize,
    transitions: usize,
    terminals: usize,
    /// The trace to the violation (one line per step) and the violation.
    violation: Option<(Vec<String>, Violation)>,
}

fn describe(step: &Step) -> String {
    match step {
        Step::Init => "every node sends its TRP for round 0".into(),
        Step::Switch => "the scheduler installs policy version 2 (refresh)".into(),
        Step::Deliver(Msg::Trp(r), _) => format!(
            "scheduler receives TRP from node {} (holds v{}, round {})",
            r.node, r.version, r.round
        ),
        Step::Deliver(
            Msg::Reply {
                to,
                update,
                version,
                round,
            },
            _,
        ) => format!(
            "node {to} receives {} v{version} for round {round}",
            if *update {
                "PolicyUpdate"
            } else {
                "PolicyConfirm"
            }
        ),
        Step::Deliver(
            Msg::Chunk {
                from, to, header, ..
            },
            choices,
        ) => {
            let mut s = format!(
                "node {to} receives from node {from}: {:?} v{} round {} root {} chunk {}{}",
                header.phase,
                header.version,
                header.round,
                header.root,
                header.chunk,
                if header.is_aux {
                    format!(" AUX path {:?} hop {}", header.path, header.hop)
                } else {
                    String::new()
                }
            );
            if choices.contains(&1) {
                s.push_str(" (its next PUSH goes on the auxiliary path)");
            }
            s
        }
    }
}

fn check(variant: Variant) -> Report {
    let model = Model::new(variant);
    let init = Rc::new(model.initial().expect("initial state"));
    let mut states: Vec<Rc<Global>> = vec![init.clone()];
    let mut parent: Vec<(usize, Step)> = vec![(usize::MAX, Step::Init)];
    let mut index: HashMap<Rc<Global>, usize> = HashMap::from([(init, 0)]);
    let mut queue = VecDeque::from([0usize]);
    let (mut transitions, mut terminals) = (0, 0);
    let trace = |parent: &[(usize, Step)], mut i: usize| {
        let mut t = Vec::new();
        while i != usize::MAX {
            t.push(describe(&parent[i].1));
            i = parent[i].0;
        }
        t.reverse();
        t
    };
    while let Some(i) = queue.pop_front() {
        let g = states[i].clone();
        let succ = match model.successors(&g) {
            Ok(s) => s,
            Err((step, why)) => {
                let mut t = trace(&parent, i);
                t.push(describe(&step));
                return Report {
                    seen: model.seen,
                    states: states.len(),
                    transitions,
                    terminals,
                    violation: Some((t, why)),
                };
            }
        };
        if succ.is_empty() {
            terminals += 1;
            if let Some(why) = model.check_terminal(&g) {
                return Report {
                    seen: model.seen,
                    states: states.len(),
                    transitions,
                    terminals,
                    violation: Some((trace(&parent, i), why)),
                };
            }
        }
        for (step, g2) in succ {
            transitions += 1;
            let g2 = Rc::new(g2);
            if let Entry::Vacant(e) = index.entry(g2.clone()) {
                let j = states.len();
                e.insert(j);
                states.push(g2);
                parent.push((i, step));
                queue.push_back(j);
            }
        }
    }
    Report {
        seen: model.seen,
        states: states.len(),
        transitions,
        terminals,
        violation: None,
    }
}

fn print_counterexample(name: &str, r: &Report) {
    let (trace, why) = r.violation.as_ref().expect("a counterexample");
    println!(
        "{name}: counterexample after {} states ({} transitions):",
        r.states, r.transitions
    );
    for (k, line) in trace.iter().enumerate() {
        println!("  {:>2}. {line}", k + 1);
    }
    println!("  => {why}");
}

#[test]
fn protocol_has_no_deadlock_or_loss_in_any_interleaving() {
    let t = Instant::now();
    let r = check(Variant::Protocol);
    println!(
        "pinned rounds + TRP + cache: {} states, {} transitions, {} terminal states, {:?}",
        r.states,
        r.transitions,
        r.terminals,
        t.elapsed()
    );
    if let Some((trace, why)) = &r.violation {
        panic!("{why}\ntrace:\n  {}", trace.join("\n  "));
    }
    println!("covered: {:?}", r.seen);
    assert!(r.seen.early_before_policy.get(), "Case 2 never exercised");
    assert!(
        r.seen.next_round_cached.get(),
        "no next-round chunk ever cached"
    );
    assert!(
        r.seen.aux_through_other_state.get(),
        "no auxiliary forward by a busy node"
    );
    assert!(
        r.seen.mixed_versions.get(),
        "the refresh never split the nodes' versions"
    );
    // Terminal states: all on v1 (refresh after the last pin) or all on v2.
    assert!(r.terminals >= 1);
}

#[test]
fn without_pinning_the_checker_finds_a_counterexample() {
    let r = check(Variant::NoPinning);
    print_counterexample("newest policy per TRP (no pinning)", &r);
    let (trace, why) = r.violation.as_ref().unwrap();
    assert!(
        ["DEADLOCK", "LOSS", "UNHANDLED"]
            .iter()
            .any(|harm| why.contains(harm)),
        "{why}"
    );
    // The counterexample needs the refresh in the middle of a round.
    assert!(trace.iter().any(|l| l.contains("refresh")));
}

#[test]
fn without_the_cache_the_checker_finds_a_counterexample() {
    let r = check(Variant::NoCache);
    print_counterexample("early chunks dropped (no Case 2)", &r);
    let (_, why) = r.violation.as_ref().unwrap();
    assert!(why.starts_with("DEADLOCK"), "{why}");
}
