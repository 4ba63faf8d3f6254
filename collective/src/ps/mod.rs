//! MLNET's parameter server (§3) over an aggregation/multicast [`Tree`]: `push`, `pull(s)`,
//! `clock()`.
//!
//! The tree is rooted at the server; every other member is a worker whose process also
//! aggregates for its children (MLNET's interior nodes are workers too). Every rank runs a
//! [`PsNode`]: one background thread owns the rank's [`Links`] for the node's lifetime and runs
//! one sub-thread per link plus the aggregator, so the API calls never touch the network.
//!
//! **What travels where.** Each link carries a sequence of messages, each a small reliable
//! header flow (kind, flags, clock) followed by its data flows:
//!
//! - *Up* (child -> parent), per clock `c = 0, 1, ...`: the sum of the gradients of clock `c`
//!   of the child's whole subtree (flow round = `c`). A worker node sums its own push of
//!   clock `c` (from the API) and each child's sum of clock `c`, in any arrival order, and
//!   sends one sum upstream: a node with `d` children receives `d` values and sends one. The
//!   root averages each block over the workers summed in it, applies `w -= lr * avg`, and its
//!   weights become version `c + 1`. The model clock (the minimum worker clock) thus emerges
//!   from the tree: the root completes clock `c` only once every worker pushed clock `c`.
//! - *Down* (parent -> child): the root multicasts every new version (flow round = its clock);
//!   each node merges it into its cache (which never goes backwards, as [`WeightCache`]) and
//!   forwards its cache to its children. The root multicasts version 0 (its `initial`) at
//!   start, so every replica starts from the server's model. A child link that is busy
//!   forwards only the newest version (older ones are superseded).
//! - *Heartbeats* on every idle link (every [`PsConfig::heartbeat`], 200 ms by default) keep
//!   a slow but live peer apart from a dead one: a link silent for
//!   [`PsConfig::failure_timeout`] (1 s) has failed. A node that fails on its own (a protocol
//!   error, a bad update) tells its neighbours (a *fail* message, passed on), so every rank
//!   learns which rank failed instead of only timing out.
//! - *Bye* ends a link: a node leaves once it was told to stop, its children have left and
//!   its sums are sent; it says Bye on every link and each peer answers with Bye. A node's
//!   shutdown thus waits for its subtree and its neighbours' answers, the root's for the
//!   whole tree.
//!
//! **Routing around failures (MLNET §3.1, [`PsConfig::reroute`]).** Every node also holds
//! the spare links of [`fault_tolerant_edges`] (to its grandparent, and between the root and
//! every member), idle but for heartbeats. The root alone declares a rank dead: when its link
//! with it fails (closed, or silent for `failure_timeout`). It then floods a *tree update*
//! (the dead set; its size is the tree version) over every live link, each node passing it
//! on once, and every node computes the same tree from the original one and the dead set
//! ([`repaired_tree`]): the dead node's children re-attach to their grandparent, or, after
//! more than [`PsConfig::max_reparents`] failures, everyone becomes a child of the root
//! (STAR). A dead server cannot be routed around: MLNET waits for a replacement; here every
//! worker fails with an error naming it (its link closes or falls silent).
//!
//! *Exchanging clocks.* A node that takes in a child (its grandparent, or the root in STAR)
//! sends it an *adopt* message: "send me your sums from clock `k` on". After a re-parenting,
//! `k` is the number of sums the new parent received from the dead node: the dead node's
//! sums of clocks below `k` already hold the child's subtree, the later ones never arrived,
//! so the child re-sends its buffered sums of clocks `k..` (a worker keeps its sums until a
//! version says they were applied) and nothing is counted twice or lost. After the STAR
//! fallback the partial sums in the tree mix workers that now send on their own, so the root
//! discards its pending (unapplied) clocks and every worker re-sends its own pushes from the
//! root's next clock. Sums carry the tree version their sender attached at; a parent ignores
//! a dead node's late sums and sums sent before a child's re-attachment. Until the adopt
//! message arrives a re-attached child keeps its sums. The dead node's contributions of the
//! clocks its parent had not received are lost: the server averages over the workers whose
//! sums arrived, as always, and [`UpdateRecord`] names them. Pulls are still served only
//! under [`pull_allowed`], so the staleness bound holds throughout; [`PsStats`] names the
//! dead ranks, the tree version and whether the job fell back to STAR.
//!
//! **Why the staleness bound holds.** A pull by a worker at `c_worker` is answered from the
//! local cache only when [`pull_allowed`]`(v, c_worker, s)` holds for the version `v` the
//! cache holds, and that version is what it returns (its clock is in the [`PullReport`]);
//! otherwise it waits (at most `op_timeout`) for the multicast of a newer version. Only the
//! root makes versions, version `v` once every worker's push of clock `v - 1` is in it, so a
//! version's clock never claims more than it holds. Because the root multicasts every
//! version eagerly, a pull never has to travel up: the cache is as fresh as the tree allows
//! and a blocked pull just waits for the next multicast. A worker's pull at clock `c` thus
//! needs every worker's push of clock `c - s - 1`: it runs at most `s` clocks ahead of the
//! slowest worker's pushes. Its pushes of later clocks wait in the aggregators until the
//! slower workers' pushes of the earlier clocks arrive; each clock's sum is applied once, in
//! clock order, so the sequence of updates does not depend on who was fast. MLNET's push
//! gate (batching several clocks of a subtree into one push) is not used: every clock's sum
//! is applied on its own.
//!
//! **Bounded loss (DLCP).** With a loss bound `p > 0` each hop of a tree of height `h` gets
//! `p / h`, so by the union bound every worker's gradients reach the root in at least
//! `1 - p` of their blocks and every node holds at least `1 - p` of each version's blocks
//! (blocks are transport segments unless `block_elems` says otherwise). Sums travel with
//! their contributor sets and each block is averaged over the workers actually summed in it
//! ([`crate::aggregate`]); a block that no worker's gradient reached is not updated. Versions
//! travel down with per-block clocks: a block lost on the way keeps its previous (older)
//! values at the receiver, and [`PullReport::delivered_fraction`] says how much of the
//! returned version is exactly that version. With `p = 0` nothing is lost and no set or
//! block clock is sent.
//!
//! **Limits.** One server (one tree), and no replacement for it. Only the root declares
//! deaths, so a failure must break a link with the root: without the spare links (links of
//! [`crate::link::tree_edges`] only) a failure deeper in the tree is not repaired and the
//! ranks waiting on it time out. A rank the root declared dead by mistake (silent for
//! `failure_timeout` under load) is cut off: its sums are ignored and its calls time out. A
//! child that left before its parent died is not re-attached (its new parent's later clocks
//! are dropped at shutdown). Each message is one flow of the whole model (no pipelining in
//! chunks, unlike the communicator's tree all-reduce).
//!
//! **Files.** `wire`: the message header and block-clock codecs; `repair`: the repaired
//! tree and the spare links; `core`: the aggregator (sums, updates, versions,
//! re-parenting); `state`: what the background work shares with the API; `io`: the links;
//! `api`: [`PsNode`], its configuration, errors and reports.

mod api;
mod core;
mod io;
mod repair;
mod state;
mod types;
mod wire;

pub use api::PsNode;
pub use repair::{fault_tolerant_edges, repaired_tree};
pub use types::{PsConfig, PsError, PsStats, PullReport, UpdateRecord};
#[doc(hidden)]
pub use wire::header_codec;
