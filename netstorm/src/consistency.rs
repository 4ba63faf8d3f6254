//! Policy consistency (NetStorm §VII) as pure state machines: the scheduler's side
//! ([`SchedulerState`]) and one node's rounds ([`NodeState`]). They take messages and
//! return the messages to send; the runtime does the I/O.
//!
//! # The protocol
//!
//! - **Versioned policies.** Every refresh ([`SchedulerState::install`]) makes a new policy
//!   version (1, 2, ...).
//! - **Topology request (TRP, §VII-A).** Before each PUSH a node sends
//!   [`TopologyRequest`]`{node, version it holds, round}` and blocks. The scheduler answers
//!   [`PolicyUpdate`] (the round's policy) when the node holds another version, else
//!   [`PolicyConfirm`]. Case 1: a node sends nothing of a round before it knows the round's
//!   policy.
//! - **Early data is cached (Case 2).** A chunk of the current round that arrives before the
//!   node knows the round's policy, or a chunk of the next round, is kept and processed once
//!   the node has the policy and its own contribution; nothing is dropped.
//! - **Source-routed auxiliary chunks (§VII-B).** A chunk with IS_AUX travels along the PATH
//!   its source chose: every node on the path forwards it at once, whatever its own policy,
//!   round or state (forward-only), and the last node consumes it as if it had come from
//!   `path[0]` directly, but only as a push on a path the round's policy gives from
//!   `path[0]` to it (so a node cannot pass its own chunk off as another's by writing a
//!   path). A path of another policy version fails the round's version check anyway.
//! - **Aggregate-forward per root.** For each chunk, a node waits for the chunk from each of
//!   its children in the chunk's root's tree, adds its own, and sends the sum to its parent
//!   (PUSH). The root then has the total and multicasts it down the same tree (PULL); every
//!   node forwards the result to its children. A round is done at a node when it has the
//!   result of every chunk.
//!
//! # gradwire's choice: a round is pinned to one policy version
//!
//! The paper answers each TRP with the newest policy. If a refresh lands between two nodes'
//! TRPs of the same round, the round runs on two trees at once: with `1 -> 2 -> 0` on one
//! node and `2 -> 1 -> 0` on another, node 2 waits for 1 while 1 waits for 2 (deadlock, the
//! paper's Figure 8), or a chunk reaches a node that does not expect it from that sender
//! (loss). Caching cannot help: the lagging node will not ask again before its next PUSH.
//!
//! gradwire therefore **pins** each round: the scheduler answers every TRP of round `k` with
//! the policy it gave the first TRP of round `k`. A new version takes effect from the next
//! round nobody has started. All nodes of a round then aggregate on the same trees, which is
//! an ordinary (deadlock-free) tree all-reduce, and data of a node already in round `k + 1`
//! is cached by the others until they get there. In an all-reduce every node contributes to
//! every round, so when the first TRP of round `k + 1` arrives every node has asked for
//! round `k`: at most one round is pinned at a time, and the scheduler forgets a pin as soon
//! as every node has asked. `tests/consistency_model.rs` checks this exhaustively over every
//! interleaving, and shows that answering with the newest policy instead deadlocks or loses
//! data.
//!
//! The state machines reject whatever a correct run cannot produce (a chunk from a node that
//! is not a child in the chunk's tree, a second copy, a chunk of a finished round or two
//! rounds ahead, a version other than the round's) with a [`ConsistencyError`], so a bug or
//! a stray peer is reported instead of corrupting an aggregate. The bound on rounds also
//! bounds the cache to the chunks of two rounds; the runtime caps its bytes.

use std::collections::BTreeMap;
use std::sync::Arc;

use thiserror::Error;

use crate::wire::{
    ChunkHeader, Message, Phase, Policy, PolicyConfirm, PolicyUpdate, TopologyRequest, MAX_NODES,
    NO_VERSION,
};

/// What the protocol refuses.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConsistencyError {
    /// A node id outside the policy.
    #[error("node {node} is not one of the policy's {nodes} nodes")]
    UnknownNode {
        /// The node.
        node: u16,
        /// Nodes in the policy.
        nodes: u16,
    },
    /// A refresh changed the number of nodes.
    #[error(
        "a new policy has {got} nodes, the job has {had}: nodes cannot join or leave a running job"
    )]
    NodeCountChanged {
        /// Nodes of the job.
        had: u16,
        /// Nodes of the new policy.
        got: u16,
    },
    /// The version counter is exhausted.
    #[error("policy version counter exhausted: restart the scheduler")]
    VersionOverflow,
    /// A node asked for a round before one it asked for already.
    #[error("node {node} asked for the policy of round {round} after round {last}")]
    RoundWentBack {
        /// The node.
        node: u16,
        /// The round asked for.
        round: u32,
        /// The last round it asked for.
        last: u32,
    },
    /// A node asked for a round more than one past the slowest node's last request: no
    /// correct node can be there (a round needs every node), and believing it would refuse
    /// the node's real requests for every round before it.
    #[error(
        "node {node} asked for the policy of round {round}, but the slowest node asked for \
         round {slowest:?} last: at most the round after it can be asked for"
    )]
    RoundAhead {
        /// The node.
        node: u16,
        /// The round asked for.
        round: u32,
        /// The slowest node's last round (`None`: some node has asked nothing yet, so only
        /// round 0 can be asked for).
        slowest: Option<u32>,
    },
    /// A node asked again for a round every node has its policy for.
    #[error("node {node} asked again for round {round}, which every node has the policy of")]
    RoundClosed {
        /// The node.
        node: u16,
        /// The round.
        round: u32,
    },
    /// A call or message the node's stage does not allow.
    #[error("node {node}: {what} while {stage}")]
    WrongStage {
        /// The node.
        node: u16,
        /// What happened.
        what: &'static str,
        /// The stage it was in.
        stage: String,
    },
    /// A round other than the next one.
    #[error("node {node}: round {got} begun, but round {expected} is next")]
    WrongRound {
        /// The node.
        node: u16,
        /// The next round.
        expected: u32,
        /// The round asked for.
        got: u32,
    },
    /// The scheduler's answer is for another round than the node asked for.
    #[error("node {node}: policy answer for round {got}, but it asked for round {expected}")]
    ReplyForOtherRound {
        /// The node.
        node: u16,
        /// The round asked for.
        expected: u32,
        /// The round answered.
        got: u32,
    },
    /// A confirmation of a version the node does not hold.
    #[error("node {node}: confirmation of policy version {version}, but it holds version {held}")]
    ConfirmMismatch {
        /// The node.
        node: u16,
        /// The confirmed version.
        version: u32,
        /// The held version (0 = none).
        held: u32,
    },
    /// The node's own contribution names a root that is not in the policy, or a chunk twice.
    #[error("node {node}: own chunk ({root}, {chunk}) {why}")]
    BadContribution {
        /// The node.
        node: u16,
        /// The chunk's root.
        root: u16,
        /// The chunk id.
        chunk: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// An auxiliary chunk that is not addressed to this node, or did not come from the
    /// previous node of its path.
    #[error("node {node}: auxiliary chunk from {from} misrouted (path {path:?}, hop {hop})")]
    Misrouted {
        /// The node.
        node: u16,
        /// The peer it came from.
        from: u16,
        /// Its path.
        path: Vec<u16>,
        /// Its hop.
        hop: u8,
    },
    /// A chunk of a round this node has finished.
    #[error("node {node}: chunk of round {round} from {from} arrived in round {current}, after its round")]
    LateChunk {
        /// The node.
        node: u16,
        /// The sender (the path's source for an auxiliary chunk).
        from: u16,
        /// The chunk's round.
        round: u32,
        /// The node's round.
        current: u32,
    },
    /// A chunk of a round more than one ahead of this node's.
    #[error("node {node}: chunk of round {round} from {from} arrived in round {current}, too early for any correct peer")]
    EarlyChunk {
        /// The node.
        node: u16,
        /// The sender.
        from: u16,
        /// The chunk's round.
        round: u32,
        /// The node's round.
        current: u32,
    },
    /// A chunk of the node's round under another policy version.
    #[error("node {node}: chunk from {from} of round {round} uses policy version {got}, the round's is {expected}")]
    VersionMismatch {
        /// The node.
        node: u16,
        /// The sender.
        from: u16,
        /// The round.
        round: u32,
        /// The round's version at this node.
        expected: u32,
        /// The chunk's version.
        got: u32,
    },
    /// A chunk this node does not have (an unknown root or chunk id).
    #[error("node {node}: chunk ({root}, {chunk}) from {from} is not one of this round's chunks")]
    UnknownChunk {
        /// The node.
        node: u16,
        /// The sender.
        from: u16,
        /// Its root.
        root: u16,
        /// Its id.
        chunk: u32,
    },
    /// A chunk from a node with the wrong place in the chunk's tree, or a second copy.
    #[error("node {node}: {phase:?} chunk ({root}, {chunk}) from {from}: {why}")]
    Unexpected {
        /// The node.
        node: u16,
        /// The sender.
        from: u16,
        /// Push or pull.
        phase: Phase,
        /// Its root.
        root: u16,
        /// Its id.
        chunk: u32,
        /// What is wrong.
        why: &'static str,
    },
}

/// The scheduler's answer to a [`TopologyRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reply {
    /// The node holds another version: here is the round's policy.
    Update(PolicyUpdate),
    /// The node holds the round's policy.
    Confirm(PolicyConfirm),
}

impl Reply {
    /// The round's policy version.
    pub fn version(&self) -> u32 {
        match self {
            Reply::Update(u) => u.version,
            Reply::Confirm(c) => c.version,
        }
    }

    /// The round answered.
    pub fn round(&self) -> u32 {
        match self {
            Reply::Update(u) => u.round,
            Reply::Confirm(c) => c.round,
        }
    }
}

impl From<Reply> for Message {
    fn from(r: Reply) -> Message {
        match r {
            Reply::Update(u) => Message::PolicyUpdate(u),
            Reply::Confirm(c) => Message::PolicyConfirm(c),
        }
    }
}

/// The version a round is pinned to and the nodes that have asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Pin {
    version: u32,
    asked: u64,
}

/// The scheduler's policy consistency module: versions, and the round pins (see the module
/// docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchedulerState {
    nodes: u16,
    version: u32,
    /// The current policy and those a pinned round still uses.
    policies: BTreeMap<u32, Policy>,
    pins: BTreeMap<u32, Pin>,
    last_round: Vec<Option<u32>>,
}

impl SchedulerState {
    /// Starts with `policy` as version 1, for `policy.nodes()` nodes.
    pub fn new(policy: Policy) -> SchedulerState {
        let nodes = policy.nodes();
        SchedulerState {
            nodes,
            version: 1,
            policies: BTreeMap::from([(1, policy)]),
            pins: BTreeMap::new(),
            last_round: vec![None; usize::from(nodes)],
        }
    }

    /// Installs a refreshed policy as the next version and returns it. It applies from the
    /// next round no node has asked for yet; a round already started keeps its version.
    pub fn install(&mut self, policy: Policy) -> Result<u32, ConsistencyError> {
        if policy.nodes() != self.nodes {
            return Err(ConsistencyError::NodeCountChanged {
                had: self.nodes,
                got: policy.nodes(),
            });
        }
        let version = self
            .version
            .checked_add(1)
            .ok_or(ConsistencyError::VersionOverflow)?;
        self.version = version;
        self.policies.insert(version, policy);
        self.forget_unused();
        Ok(version)
    }

    /// The newest version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The newest policy.
    pub fn policy(&self) -> &Policy {
        // The current version is never forgotten.
        &self.policies[&self.version]
    }

    /// Number of nodes.
    pub fn nodes(&self) -> u16 {
        self.nodes
    }

    /// The version round `round` is pinned to, while some node has not asked for it yet.
    pub fn pinned(&self, round: u32) -> Option<u32> {
        self.pins.get(&round).map(|p| p.version)
    }

    /// Answers a TRP: the version of the request's round (pinned by the round's first
    /// request to the newest version then), as a confirmation when the node holds it and as
    /// an update otherwise. A node may repeat a request while its round is pinned (the same
    /// answer again).
    pub fn on_request(&mut self, req: &TopologyRequest) -> Result<Reply, ConsistencyError> {
        let node = usize::from(req.node);
        if node >= usize::from(self.nodes) {
            return Err(ConsistencyError::UnknownNode {
                node: req.node,
                nodes: self.nodes,
            });
        }
        let bit = 1u64 << node;
        // Round k + 1 is asked for only once every node has asked for round k: a round runs
        // on every node. Anything further ahead is refused and changes nothing.
        let slowest = self.last_round.iter().copied().min().flatten();
        let limit = slowest.map_or(0, |r| r.saturating_add(1));
        if req.round > limit {
            return Err(ConsistencyError::RoundAhead {
                node: req.node,
                round: req.round,
                slowest,
            });
        }
        match self.last_round[node] {
            Some(last) if req.round < last => {
                return Err(ConsistencyError::RoundWentBack {
                    node: req.node,
                    round: req.round,
                    last,
                })
            }
            Some(last) if req.round == last && !self.pins.contains_key(&req.round) => {
                return Err(ConsistencyError::RoundClosed {
                    node: req.node,
                    round: req.round,
                })
            }
            _ => {}
        }
        let current = self.version;
        let pin = self.pins.entry(req.round).or_insert(Pin {
            version: current,
            asked: 0,
        });
        pin.asked |= bit;
        let version = pin.version;
        let everyone = if usize::from(self.nodes) == MAX_NODES {
            u64::MAX
        } else {
            (1u64 << self.nodes) - 1
        };
        if pin.asked == everyone {
            self.pins.remove(&req.round);
        }
        self.last_round[node] = Some(req.round);
        let reply = if req.version == version {
            Reply::Confirm(PolicyConfirm {
                version,
                round: req.round,
            })
        } else {
            Reply::Update(PolicyUpdate {
                version,
                round: req.round,
                policy: self.policies[&version].clone(),
            })
        };
        self.forget_unused();
        Ok(reply)
    }

    fn forget_unused(&mut self) {
        let (current, pins) = (self.version, &self.pins);
        self.policies
            .retain(|v, _| *v == current || pins.values().any(|p| p.version == *v));
    }
}

/// A chunk's data, which nodes add up. The runtime implements it for its buffers (e.g. a
/// chunk of f32 elements); the model checker for contributor counts.
pub trait Payload: Clone {
    /// Adds `other` into `self`.
    fn accumulate(&mut self, other: &Self);

    /// Whether `other` can be added into `self` (e.g. the same number of elements): a chunk
    /// that cannot is refused, never added in part.
    fn same_shape(&self, _other: &Self) -> bool {
        true
    }
}

/// What a node state machine asks the runtime to do.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Output<P> {
    /// Send this TRP to the scheduler, then feed its answer to [`NodeState::on_reply`].
    Request(TopologyRequest),
    /// Send a chunk to node `to`: `frame(header) ++ payload`. A PUSH on the primary path may
    /// instead go on one of `policy.aux_paths(me, to)` (when the primary path is busy,
    /// §VI-A): send `header.via(path)` to `path[1]`.
    Send {
        /// The next node.
        to: u16,
        /// The chunk's metadata.
        header: ChunkHeader,
        /// The chunk's data.
        payload: P,
    },
    /// The round's policy is known: call [`NodeState::contribute`] with the node's chunks,
    /// assigned to roots by this policy's shares.
    Adopted {
        /// The round.
        round: u32,
        /// Its policy version.
        version: u32,
    },
    /// The final aggregate of one chunk (the sum of every node's contribution).
    Result {
        /// The round.
        round: u32,
        /// The chunk's root.
        root: u16,
        /// The chunk id.
        chunk: u32,
        /// The aggregate.
        payload: P,
    },
    /// Every chunk of the round has its result: the next round may begin.
    RoundDone {
        /// The round.
        round: u32,
    },
}

/// Where a node is in its current round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Between rounds: the next is [`NodeState::round`].
    Idle,
    /// TRP sent, waiting for the scheduler's answer (blocked: nothing of the round is sent).
    Requested,
    /// The round's policy is known, the node's own chunks are not.
    Adopted,
    /// Aggregating and forwarding.
    Running,
}

/// One chunk's progress at a node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Work<P> {
    /// Own contribution plus the children's so far; taken when pushed up.
    acc: Option<P>,
    /// Children in the chunk's tree not heard from yet.
    waiting: u64,
    /// The result is known (and forwarded down).
    done: bool,
}

/// A chunk kept until the node can process it (Case 2, or the next round's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Cached<P> {
    from: u16,
    header: ChunkHeader,
    payload: P,
}

/// One node's side of the protocol, round after round (see the module docs). Rounds are
/// consecutive from the first one given to [`NodeState::new`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeState<P> {
    me: u16,
    /// The round in progress, or the next one when idle.
    round: u32,
    stage: Stage,
    /// Shared so that cloning a node state (the model checker does it for every state)
    /// does not copy the policy.
    held: Option<(u32, Arc<Policy>)>,
    work: BTreeMap<(u16, u32), Work<P>>,
    /// Arrival order.
    cache: Vec<Cached<P>>,
}

impl<P: Payload> NodeState<P> {
    /// Node `me`, whose first round is `first_round`.
    pub fn new(me: u16, first_round: u32) -> NodeState<P> {
        NodeState {
            me,
            round: first_round,
            stage: Stage::Idle,
            held: None,
            work: BTreeMap::new(),
            cache: Vec::new(),
        }
    }

    /// This node's id.
    pub fn me(&self) -> u16 {
        self.me
    }

    /// The round in progress, or the next one when idle.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Where the node is in its round.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The policy the node holds and its version (the round's from [`Stage::Adopted`] on).
    pub fn policy(&self) -> Option<(u32, &Policy)> {
        self.held.as_ref().map(|(v, p)| (*v, &**p))
    }

    /// Chunks waiting for this node to get to their round or its policy.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    fn wrong_stage(&self, what: &'static str) -> ConsistencyError {
        ConsistencyError::WrongStage {
            node: self.me,
            what,
            stage: format!("{:?} in round {}", self.stage, self.round),
        }
    }

    /// Begins round `round` (the next one) before its PUSH: returns the TRP to send. The node
    /// sends nothing else of the round before the answer (Case 1).
    pub fn begin_round(&mut self, round: u32) -> Result<Vec<Output<P>>, ConsistencyError> {
        if self.stage != Stage::Idle {
            return Err(self.wrong_stage("round begun"));
        }
        if round != self.round {
            return Err(ConsistencyError::WrongRound {
                node: self.me,
                expected: self.round,
                got: round,
            });
        }
        self.stage = Stage::Requested;
        Ok(vec![Output::Request(TopologyRequest {
            node: self.me,
            version: self.held.as_ref().map_or(NO_VERSION, |(v, _)| *v),
            round,
        })])
    }

    /// The scheduler's answer to the TRP: adopts the round's policy.
    pub fn on_reply(&mut self, reply: Reply) -> Result<Vec<Output<P>>, ConsistencyError> {
        if self.stage != Stage::Requested {
            return Err(self.wrong_stage("policy answer received"));
        }
        if reply.round() != self.round {
            return Err(ConsistencyError::ReplyForOtherRound {
                node: self.me,
                expected: self.round,
                got: reply.round(),
            });
        }
        match reply {
            Reply::Update(u) => {
                if self.me >= u.policy.nodes() {
                    return Err(ConsistencyError::UnknownNode {
                        node: self.me,
                        nodes: u.policy.nodes(),
                    });
                }
                self.held = Some((u.version, Arc::new(u.policy)));
            }
            Reply::Confirm(c) => {
                let held = self.held.as_ref().map_or(NO_VERSION, |(v, _)| *v);
                if held != c.version {
                    return Err(ConsistencyError::ConfirmMismatch {
                        node: self.me,
                        version: c.version,
                        held,
                    });
                }
            }
        }
        self.stage = Stage::Adopted;
        let version = self.held.as_ref().map_or(NO_VERSION, |(v, _)| *v);
        Ok(vec![Output::Adopted {
            round: self.round,
            version,
        }])
    }

    /// The node's own chunks of the round, `(root, chunk id, data)`, every chunk of the round
    /// once, assigned to roots by the adopted policy's shares (the same on every node, since
    /// every node of a round has the same policy). Starts aggregating, first with the chunks
    /// cached for this round.
    pub fn contribute(
        &mut self,
        chunks: Vec<(u16, u32, P)>,
    ) -> Result<Vec<Output<P>>, ConsistencyError> {
        if self.stage != Stage::Adopted {
            return Err(self.wrong_stage("own chunks given"));
        }
        let Some((_, policy)) = &self.held else {
            return Err(self.wrong_stage("own chunks given without a policy"));
        };
        let mut work = BTreeMap::new();
        for (root, chunk, payload) in chunks {
            let bad = |why| ConsistencyError::BadContribution {
                node: self.me,
                root,
                chunk,
                why,
            };
            let tree = policy
                .tree(root)
                .ok_or(bad("has a root not in the policy"))?;
            let waiting = tree.children(self.me).fold(0u64, |m, c| m | (1u64 << c));
            let w = Work {
                acc: Some(payload),
                waiting,
                done: false,
            };
            if work.insert((root, chunk), w).is_some() {
                return Err(bad("is given twice"));
            }
        }
        self.work = work;
        self.stage = Stage::Running;
        let mut out = Vec::new();
        let keys: Vec<(u16, u32)> = self.work.keys().copied().collect();
        for (root, chunk) in keys {
            self.advance(root, chunk, &mut out);
        }
        // Case 2: what arrived early, in arrival order. Later rounds stay cached.
        let round = self.round;
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.cache)
            .into_iter()
            .partition(|c| c.header.round == round);
        self.cache = later;
        for c in now {
            self.process(c.from, c.header, c.payload, &mut out)?;
        }
        self.finish_round(&mut out);
        Ok(out)
    }

    /// A chunk from peer `from`. An auxiliary chunk not at the end of its path is forwarded at
    /// once, whatever this node's state; anything else is processed if the node is running
    /// its round and cached if it is early.
    pub fn on_chunk(
        &mut self,
        from: u16,
        header: ChunkHeader,
        payload: P,
    ) -> Result<Vec<Output<P>>, ConsistencyError> {
        let mut sender = from;
        if header.is_aux {
            let hop = usize::from(header.hop);
            let here = header.receiver() == Some(self.me);
            let prev = hop.checked_sub(1).and_then(|i| header.path.get(i)).copied();
            if !here || prev != Some(from) {
                return Err(ConsistencyError::Misrouted {
                    node: self.me,
                    from,
                    path: header.path,
                    hop: header.hop,
                });
            }
            if let Some((to, header)) = header.forwarded() {
                return Ok(vec![Output::Send {
                    to,
                    header,
                    payload,
                }]);
            }
            sender = header.origin().unwrap_or(from);
        }
        let current = self.round;
        let active = self.stage != Stage::Idle;
        if header.round < current {
            return Err(ConsistencyError::LateChunk {
                node: self.me,
                from: sender,
                round: header.round,
                current,
            });
        }
        // A correct peer is at most one round ahead of a node in round k (the peer cannot
        // finish round k without this node's contribution), and sends nothing beyond round
        // k while this node is idle before k, for the same reason with k - 1 finished.
        let limit = if active {
            u64::from(current) + 1
        } else {
            u64::from(current)
        };
        if u64::from(header.round) > limit {
            return Err(ConsistencyError::EarlyChunk {
                node: self.me,
                from: sender,
                round: header.round,
                current,
            });
        }
        let mut out = Vec::new();
        if self.stage == Stage::Running && header.round == current {
            self.process(sender, header, payload, &mut out)?;
            self.finish_round(&mut out);
        } else {
            self.cache.push(Cached {
                from: sender,
                header,
                payload,
            });
        }
        Ok(out)
    }

    /// A chunk of the running round from `from` (the source, for an auxiliary chunk).
    fn process(
        &mut self,
        from: u16,
        header: ChunkHeader,
        payload: P,
        out: &mut Vec<Output<P>>,
    ) -> Result<(), ConsistencyError> {
        let me = self.me;
        let Some((version, policy)) = &self.held else {
            return Err(self.wrong_stage("chunk processed without a policy"));
        };
        if header.version != *version {
            return Err(ConsistencyError::VersionMismatch {
                node: me,
                from,
                round: header.round,
                expected: *version,
                got: header.version,
            });
        }
        let (root, chunk, phase) = (header.root, header.chunk, header.phase);
        let unknown = ConsistencyError::UnknownChunk {
            node: me,
            from,
            root,
            chunk,
        };
        let tree = policy.tree(root).ok_or(unknown.clone())?;
        let parent = tree.parent_of(me);
        let is_child = from != me && tree.parent_of(from) == Some(me);
        let unexpected = |why| ConsistencyError::Unexpected {
            node: me,
            from,
            phase,
            root,
            chunk,
            why,
        };
        // An auxiliary chunk names its source by its path's first node: take it only on a
        // path the round's policy gives from that source to this node (none when the policy
        // has no auxiliary paths there), and only as a push. A node cannot pass its chunk off
        // as another node's push, or a result, by writing a path of its own.
        if header.is_aux
            && (phase != Phase::Push || !policy.aux_paths(from, me).contains(&header.path))
        {
            return Err(unexpected(
                "an auxiliary path the round's policy does not give from its source to this node",
            ));
        }
        let w = self.work.get_mut(&(root, chunk)).ok_or(unknown)?;
        match phase {
            Phase::Push => {
                if !is_child {
                    return Err(unexpected("the sender is not a child in the chunk's tree"));
                }
                let bit = 1u64 << from;
                if w.waiting & bit == 0 {
                    return Err(unexpected("a second copy from this child"));
                }
                let Some(acc) = w.acc.as_mut() else {
                    return Err(unexpected("the chunk was already pushed up"));
                };
                if !acc.same_shape(&payload) {
                    return Err(unexpected("a chunk of another length than this node's own"));
                }
                acc.accumulate(&payload);
                w.waiting &= !bit;
                self.advance(root, chunk, out);
            }
            Phase::Pull => {
                if parent != Some(from) {
                    return Err(unexpected(
                        "the sender is not the parent in the chunk's tree",
                    ));
                }
                if w.done || w.acc.is_some() {
                    return Err(unexpected(
                        "a result before this node pushed its sum, or a second one",
                    ));
                }
                w.done = true;
                self.deliver(root, chunk, payload, out);
            }
        }
        Ok(())
    }

    /// Pushes the chunk up once every child has been heard (at the root: the result).
    fn advance(&mut self, root: u16, chunk: u32, out: &mut Vec<Output<P>>) {
        let Some((version, policy)) = &self.held else {
            return;
        };
        let Some(w) = self.work.get_mut(&(root, chunk)) else {
            return;
        };
        if w.waiting != 0 {
            return;
        }
        let Some(acc) = w.acc.take() else {
            return;
        };
        match policy.tree(root).and_then(|t| t.parent_of(self.me)) {
            Some(parent) => out.push(Output::Send {
                to: parent,
                header: ChunkHeader::primary(*version, self.round, root, chunk, Phase::Push),
                payload: acc,
            }),
            None => {
                w.done = true;
                self.deliver(root, chunk, acc, out);
            }
        }
    }

    /// The result of a chunk: down to the children, and to the runtime.
    fn deliver(&mut self, root: u16, chunk: u32, result: P, out: &mut Vec<Output<P>>) {
        if let Some((version, policy)) = &self.held {
            if let Some(tree) = policy.tree(root) {
                for child in tree.children(self.me) {
                    out.push(Output::Send {
                        to: child,
                        header: ChunkHeader::primary(
                            *version,
                            self.round,
                            root,
                            chunk,
                            Phase::Pull,
                        ),
                        payload: result.clone(),
                    });
                }
            }
        }
        out.push(Output::Result {
            round: self.round,
            root,
            chunk,
            payload: result,
        });
    }

    /// Ends the round when every chunk has its result.
    fn finish_round(&mut self, out: &mut Vec<Output<P>>) {
        if self.stage == Stage::Running && self.work.values().all(|w| w.done) {
            out.push(Output::RoundDone { round: self.round });
            self.work.clear();
            self.stage = Stage::Idle;
            // Round numbers wrap after 2^32 rounds.
            self.round = self.round.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{AuxPaths, RootTree};

    impl Payload for u64 {
        fn accumulate(&mut self, other: &Self) {
            *self += other;
        }
    }

    /// Root 0 only: `chain` lists the nodes from the leaf up, e.g. [1, 2] is 1 -> 2 -> 0.
    fn chain(chain: [u16; 2], aux: Vec<AuxPaths>) -> Policy {
        let mut parent = vec![None; 3];
        parent[usize::from(chain[0])] = Some(chain[1]);
        parent[usize::from(chain[1])] = Some(0);
        Policy::new(
            3,
            vec![RootTree {
                root: 0,
                share: 1,
                parent,
            }],
            aux,
        )
        .unwrap()
    }

    fn trp(node: u16, version: u32, round: u32) -> TopologyRequest {
        TopologyRequest {
            node,
            version,
            round,
        }
    }

    #[test]
    fn a_request_rounds_ahead_of_the_slowest_node_is_refused_and_changes_nothing() {
        // A stranger speaking for node 1 asks for round u32::MAX: believed, it would make
        // every real request of node 1 "go back". Refused, node 1 still gets round 0.
        let mut s = SchedulerState::new(chain([1, 2], vec![]));
        assert_eq!(
            s.on_request(&trp(1, NO_VERSION, u32::MAX)),
            Err(ConsistencyError::RoundAhead {
                node: 1,
                round: u32::MAX,
                slowest: None
            })
        );
        // Until every node has asked, only round 0 can be asked for.
        assert!(matches!(
            s.on_request(&trp(0, NO_VERSION, 1)),
            Err(ConsistencyError::RoundAhead { .. })
        ));
        for n in 0..3 {
            assert_eq!(s.on_request(&trp(n, NO_VERSION, 0)).unwrap().version(), 1);
        }
        // Every node asked for round 0: round 1 may be asked for, round 2 not yet.
        assert!(matches!(
            s.on_request(&trp(2, 1, 2)),
            Err(ConsistencyError::RoundAhead {
                slowest: Some(0),
                ..
            })
        ));
        assert_eq!(s.on_request(&trp(2, 1, 1)).unwrap().version(), 1);
    }

    #[test]
    fn a_refresh_takes_effect_from_the_next_round_nobody_started() {
        let v1 = chain([1, 2], vec![]);
        let v2 = chain([2, 1], vec![]);
        let mut s = SchedulerState::new(v1.clone());
        assert_eq!(s.version(), 1);
        let r = s.on_request(&trp(0, NO_VERSION, 0)).unwrap();
        assert_eq!(
            r,
            Reply::Update(PolicyUpdate {
                version: 1,
                round: 0,
                policy: v1.clone()
            })
        );
        assert_eq!(s.pinned(0), Some(1));
        // The refresh lands between two TRPs of round 0: round 0 stays on version 1.
        assert_eq!(s.install(v2.clone()).unwrap(), 2);
        assert_eq!(s.policy(), &v2);
        assert_eq!(s.on_request(&trp(1, NO_VERSION, 0)).unwrap().version(), 1);
        // A repeated request while the round is pinned gets the same answer.
        assert_eq!(s.on_request(&trp(1, NO_VERSION, 0)).unwrap().version(), 1);
        // A node holding the round's version gets a confirmation.
        assert_eq!(
            s.on_request(&trp(2, 1, 0)).unwrap(),
            Reply::Confirm(PolicyConfirm {
                version: 1,
                round: 0
            })
        );
        // Everyone asked: the pin is gone and version 1 is forgotten.
        assert_eq!(s.pinned(0), None);
        assert_eq!(
            s.on_request(&trp(2, 1, 0)),
            Err(ConsistencyError::RoundClosed { node: 2, round: 0 })
        );
        // Round 1 is the first nobody started: version 2, as an update to a v1 holder.
        let r = s.on_request(&trp(0, 1, 1)).unwrap();
        assert_eq!(
            r,
            Reply::Update(PolicyUpdate {
                version: 2,
                round: 1,
                policy: v2
            })
        );
        assert_eq!(
            s.on_request(&trp(0, 2, 0)),
            Err(ConsistencyError::RoundWentBack {
                node: 0,
                round: 0,
                last: 1
            })
        );
        assert!(matches!(
            s.on_request(&trp(3, 2, 1)),
            Err(ConsistencyError::UnknownNode { node: 3, .. })
        ));
        let four = Policy::new(
            4,
            vec![RootTree {
                root: 0,
                share: 1,
                parent: vec![None, Some(0), Some(0), Some(0)],
            }],
            vec![],
        )
        .unwrap();
        assert!(matches!(
            s.install(four),
            Err(ConsistencyError::NodeCountChanged { had: 3, got: 4 })
        ));
    }

    fn update(version: u32, round: u32, policy: &Policy) -> Reply {
        Reply::Update(PolicyUpdate {
            version,
            round,
            policy: policy.clone(),
        })
    }

    fn sends(out: &[Output<u64>]) -> Vec<(u16, Phase, bool, u64)> {
        out.iter()
            .filter_map(|o| match o {
                Output::Send {
                    to,
                    header,
                    payload,
                } => Some((*to, header.phase, header.is_aux, *payload)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn middle_node_caches_early_data_aggregates_and_forwards() {
        // 1 -> 2 -> 0; node 2 aggregates.
        let p = chain([1, 2], vec![]);
        let mut n = NodeState::<u64>::new(2, 0);
        let out = n.begin_round(0).unwrap();
        assert_eq!(out, vec![Output::Request(trp(2, NO_VERSION, 0))]);
        // Node 1's push arrives before node 2 knows the round's policy: cached (Case 2).
        let push = ChunkHeader::primary(1, 0, 0, 7, Phase::Push);
        assert_eq!(n.on_chunk(1, push.clone(), 10).unwrap(), vec![]);
        assert_eq!(n.cached(), 1);
        let out = n.on_reply(update(1, 0, &p)).unwrap();
        assert_eq!(
            out,
            vec![Output::Adopted {
                round: 0,
                version: 1
            }]
        );
        assert_eq!(n.stage(), Stage::Adopted);
        // Own chunk: with the cached child chunk, the sum goes up at once.
        let out = n.contribute(vec![(0, 7, 5)]).unwrap();
        assert_eq!(sends(&out), vec![(0, Phase::Push, false, 15)]);
        assert_eq!(n.cached(), 0);
        // A second copy from the child is refused.
        assert!(matches!(
            n.on_chunk(1, push, 10),
            Err(ConsistencyError::Unexpected { .. })
        ));
        // The result comes down from the parent and goes on to the child.
        let pull = ChunkHeader::primary(1, 0, 0, 7, Phase::Pull);
        let out = n.on_chunk(0, pull.clone(), 99).unwrap();
        assert_eq!(sends(&out), vec![(1, Phase::Pull, false, 99)]);
        assert!(out.contains(&Output::Result {
            round: 0,
            root: 0,
            chunk: 7,
            payload: 99
        }));
        assert_eq!(out.last(), Some(&Output::RoundDone { round: 0 }));
        assert_eq!((n.stage(), n.round()), (Stage::Idle, 1));
        // Anything of round 0 now is late.
        assert!(matches!(
            n.on_chunk(0, pull, 99),
            Err(ConsistencyError::LateChunk { .. })
        ));
        // The next round asks with the held version.
        assert_eq!(
            n.begin_round(1).unwrap(),
            vec![Output::Request(trp(2, 1, 1))]
        );
        assert_eq!(
            n.on_reply(Reply::Confirm(PolicyConfirm {
                version: 1,
                round: 1
            }))
            .unwrap(),
            vec![Output::Adopted {
                round: 1,
                version: 1
            }]
        );
    }

    #[test]
    fn auxiliary_chunks_are_source_routed_whatever_the_node_state() {
        // Node 0 is idle (it has not even begun a round) and is on 1's auxiliary path to 2.
        let mut n0 = NodeState::<u64>::new(0, 0);
        let h = ChunkHeader::primary(1, 0, 0, 3, Phase::Push)
            .via(&[1, 0, 2])
            .unwrap();
        let out = n0.on_chunk(1, h.clone(), 4).unwrap();
        assert_eq!(out.len(), 1);
        let Output::Send { to, header, .. } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!((*to, header.hop), (2, 2));
        // From the wrong peer, or not addressed to this node: refused.
        assert!(matches!(
            n0.on_chunk(2, h.clone(), 4),
            Err(ConsistencyError::Misrouted { .. })
        ));
        let mut n1 = NodeState::<u64>::new(1, 0);
        assert!(matches!(
            n1.on_chunk(1, h, 4),
            Err(ConsistencyError::Misrouted { .. })
        ));
        // At the end of the path, node 2 takes it as node 1's own push.
        let p = chain(
            [1, 2],
            vec![AuxPaths {
                from: 1,
                to: 2,
                paths: vec![vec![1, 0, 2]],
            }],
        );
        let mut n2 = NodeState::<u64>::new(2, 0);
        n2.begin_round(0).unwrap();
        n2.on_reply(update(1, 0, &p)).unwrap();
        n2.contribute(vec![(0, 3, 1)]).unwrap();
        let out = n2.on_chunk(0, header.clone(), 4).unwrap();
        assert_eq!(sends(&out), vec![(0, Phase::Push, false, 5)]);
    }

    #[test]
    fn an_auxiliary_chunk_is_taken_only_on_a_path_the_policy_gives() {
        // 1 -> 2 -> 0. Node 0 delivers a chunk to 2 on the path [1, 0, 2], naming node 1 as
        // its source: with the policy's auxiliary paths off, or as a result, it is node 0's
        // own invention.
        let h = ChunkHeader::primary(1, 0, 0, 3, Phase::Push)
            .via(&[1, 0, 2])
            .unwrap();
        let (_, at_2) = h.forwarded().unwrap();
        let aux = vec![AuxPaths {
            from: 1,
            to: 2,
            paths: vec![vec![1, 0, 2]],
        }];
        let node2 = |aux: Vec<AuxPaths>| {
            let mut n = NodeState::<u64>::new(2, 0);
            n.begin_round(0).unwrap();
            n.on_reply(update(1, 0, &chain([1, 2], aux))).unwrap();
            n.contribute(vec![(0, 3, 1)]).unwrap();
            n
        };
        let refused = |r: Result<Vec<Output<u64>>, ConsistencyError>| matches!(r, Err(ConsistencyError::Unexpected { from: 1, why, .. }) if why.contains("auxiliary path"));
        assert!(refused(node2(vec![]).on_chunk(0, at_2.clone(), 4)));
        let mut pull = at_2.clone();
        pull.phase = Phase::Pull;
        assert!(refused(node2(aux.clone()).on_chunk(0, pull, 4)));
        // Another path than the policy's, e.g. one the policy gives a different edge.
        let other = vec![AuxPaths {
            from: 2,
            to: 0,
            paths: vec![vec![2, 1, 0]],
        }];
        assert!(refused(node2(other).on_chunk(0, at_2.clone(), 4)));
        // On the policy's path it is node 1's push.
        let out = node2(aux).on_chunk(0, at_2, 4).unwrap();
        assert_eq!(sends(&out), vec![(0, Phase::Push, false, 5)]);
    }

    /// A payload with a length, as the runtime's chunks of elements.
    #[derive(Debug, Clone, PartialEq)]
    struct Elems(Vec<u64>);

    impl Payload for Elems {
        fn accumulate(&mut self, other: &Self) {
            for (a, b) in self.0.iter_mut().zip(&other.0) {
                *a += b;
            }
        }
        fn same_shape(&self, other: &Self) -> bool {
            self.0.len() == other.0.len()
        }
    }

    #[test]
    fn a_pushed_chunk_of_another_length_is_refused_not_added_in_part() {
        // 1 -> 2 -> 0: node 2 sums its child 1's chunk 3 into its own.
        let p = chain([1, 2], vec![]);
        let mut n2 = NodeState::<Elems>::new(2, 0);
        n2.begin_round(0).unwrap();
        n2.on_reply(update(1, 0, &p)).unwrap();
        n2.contribute(vec![(0, 3, Elems(vec![1, 2, 3]))]).unwrap();
        let h = ChunkHeader::primary(1, 0, 0, 3, Phase::Push);
        assert!(matches!(
            n2.on_chunk(1, h.clone(), Elems(vec![10, 20])),
            Err(ConsistencyError::Unexpected { from: 1, .. })
        ));
        // The right length still goes through, once.
        let out = n2.on_chunk(1, h, Elems(vec![10, 20, 30])).unwrap();
        assert!(out.iter().any(|o| matches!(
            o,
            Output::Send { to: 0, payload, .. } if payload == &Elems(vec![11, 22, 33])
        )));
    }

    #[test]
    fn what_no_correct_peer_sends_is_refused() {
        let p = chain([1, 2], vec![]);
        let mut n = NodeState::<u64>::new(2, 5);
        assert!(matches!(
            n.begin_round(4),
            Err(ConsistencyError::WrongRound { expected: 5, .. })
        ));
        assert!(matches!(
            n.on_reply(update(1, 5, &p)),
            Err(ConsistencyError::WrongStage { .. })
        ));
        // Idle before round 5: a round-6 chunk cannot come from a correct peer.
        let early = ChunkHeader::primary(1, 6, 0, 0, Phase::Push);
        assert!(matches!(
            n.on_chunk(1, early.clone(), 1),
            Err(ConsistencyError::EarlyChunk { .. })
        ));
        n.begin_round(5).unwrap();
        assert!(matches!(
            n.on_reply(update(1, 4, &p)),
            Err(ConsistencyError::ReplyForOtherRound { .. })
        ));
        assert!(matches!(
            n.on_reply(Reply::Confirm(PolicyConfirm {
                version: 1,
                round: 5
            })),
            Err(ConsistencyError::ConfirmMismatch { held: 0, .. })
        ));
        n.on_reply(update(1, 5, &p)).unwrap();
        assert!(matches!(
            n.contribute(vec![(1, 0, 1)]),
            Err(ConsistencyError::BadContribution { .. })
        ));
        assert!(matches!(
            n.contribute(vec![(0, 0, 1), (0, 0, 1)]),
            Err(ConsistencyError::BadContribution { .. })
        ));
        n.contribute(vec![(0, 0, 1)]).unwrap();
        // In round 5, a round-6 chunk is cached (a peer may be one round ahead).
        assert_eq!(n.on_chunk(1, early, 1).unwrap(), vec![]);
        assert_eq!(n.cached(), 1);
        // Another version in the round, a push from the parent, a pull from the child, an
        // unknown chunk.
        let mk = |v, phase, chunk| ChunkHeader::primary(v, 5, 0, chunk, phase);
        assert!(matches!(
            n.on_chunk(1, mk(2, Phase::Push, 0), 1),
            Err(ConsistencyError::VersionMismatch { .. })
        ));
        assert!(matches!(
            n.on_chunk(0, mk(1, Phase::Push, 0), 1),
            Err(ConsistencyError::Unexpected { .. })
        ));
        assert!(matches!(
            n.on_chunk(1, mk(1, Phase::Pull, 0), 1),
            Err(ConsistencyError::Unexpected { .. })
        ));
        assert!(matches!(
            n.on_chunk(1, mk(1, Phase::Push, 9), 1),
            Err(ConsistencyError::UnknownChunk { .. })
        ));
        // A result before this node pushed its sum.
        assert!(matches!(
            n.on_chunk(0, mk(1, Phase::Pull, 0), 1),
            Err(ConsistencyError::Unexpected { .. })
        ));
    }

    #[test]
    fn a_single_node_round_finishes_alone() {
        let p = Policy::new(
            1,
            vec![RootTree {
                root: 0,
                share: 1,
                parent: vec![None],
            }],
            vec![],
        )
        .unwrap();
        let mut s = SchedulerState::new(p);
        let mut n = NodeState::<u64>::new(0, 0);
        let Output::Request(r) = n.begin_round(0).unwrap().remove(0) else {
            panic!()
        };
        n.on_reply(s.on_request(&r).unwrap()).unwrap();
        let out = n.contribute(vec![(0, 0, 3), (0, 1, 4)]).unwrap();
        assert_eq!(
            out,
            vec![
                Output::Result {
                    round: 0,
                    root: 0,
                    chunk: 0,
                    payload: 3
                },
                Output::Result {
                    round: 0,
                    root: 0,
                    chunk: 1,
                    payload: 4
                },
                Output::RoundDone { round: 0 }
            ]
        );
        assert_eq!(s.pinned(0), None);
    }
}
