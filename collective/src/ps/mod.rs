//! MLNET's parameter server (§3) over an aggregation/multicast [`Tree`]: `push`, `pull(s)`,
//! `clock()`.
//!
//! The tree is rooted at the server; every other member is a worker whose process also
//! aggregates for its children (MLNET's interior nodes are workers too). Every rank runs a
//! [`PsNode`]: one endpoint of the message layer (`gradwire-msg`, its own UDP socket) and
//! one background thread, the node's, which runs the aggregator and submits the node's
//! sends; each link's receiving end is an operation on the endpoint's progress thread. No
//! thread per link, so the API calls never touch the network. The given [`Links`] carry
//! only the set-up: each node sends its endpoint's address to every neighbour over them
//! (one small reliable flow each way per link) and drops them.
//!
//! **What travels where.** Each link (a channel of the layer, sender -> receiver) carries a
//! sequence of PS messages. Each is a *header message* (the 16-byte header: kind, flags,
//! clock, length; then its body: a failure's reason or a tree update's dead ranks; small
//! and reliable), followed for a push or a version by its data as messages of the layer:
//! the values under the hop's loss bound, then, when the header says so, the contributor
//! sets (a push) or per-block clocks (a version), reliable. The receiver always has the
//! link's next header message posted (a variable-length `up_to` receive of at most the
//! header and the longest body); a header that announces data posts that message's data
//! receives, of exact lengths (the model's size at most, plus its sets or clocks), so a
//! peer cannot make a node allocate more than that per link:
//!
//! - *Up* (child -> parent), per clock `c = 0, 1, ...`: the sum of the gradients of clock `c`
//!   of the child's whole subtree. A worker node sums its own push of
//!   clock `c` (from the API) and each child's sum of clock `c`, in any arrival order, and
//!   sends one sum upstream: a node with `d` children receives `d` values and sends one. The
//!   root averages each block over the workers summed in it, applies `w -= lr * avg`, and its
//!   weights become version `c + 1`. The model clock (the minimum worker clock) thus emerges
//!   from the tree: the root completes clock `c` only once every worker pushed clock `c`.
//! - *Down* (parent -> child): the root multicasts every new version;
//!   each node merges it into its cache (which never goes backwards, as [`WeightCache`]) and
//!   forwards its cache to its children. The root multicasts version 0 (its `initial`) at
//!   start, so every replica starts from the server's model. A child link with a version
//!   still in flight gets only the newest one after it (older ones are superseded).
//! - *Heartbeats* (header messages) on every link idle for [`PsConfig::heartbeat`]
//!   (200 ms by default) keep a slow but live peer apart from a dead one: a link heard from
//!   and then silent for [`PsConfig::failure_timeout`] (1 s) has failed. The layer judges
//!   what the node cannot see: a link's header receive is always posted, so the layer pings
//!   a silent peer and fails the receive naming it (its peer timeout is twice
//!   `failure_timeout`, for a neighbour still busy with its set-up, and at least the
//!   transfers' `idle_timeout`, 5 s, for data stalled under incast); a peer whose socket
//!   closed fails at once (ICMP port unreachable); a message's data that makes no progress
//!   fails the same way. A link's failure ends that link only
//!   (`Op::isolated` is true for its operations): the node routes around the
//!   peer and goes on with the others. A node that fails on its own (a protocol error, a
//!   bad update) tells its neighbours (a *fail* message, passed on), so every rank learns
//!   which rank failed instead of only timing out.
//! - *Bye* ends a link: a node leaves once it was told to stop, its children have left and
//!   its sums are sent; it says Bye on every link and each peer answers with Bye. A node's
//!   shutdown thus waits for its subtree and its neighbours' answers, the root's for the
//!   whole tree.
//!
//! **Routing around failures (MLNET §3.1, [`PsConfig::reroute`]).** Every node also holds
//! the spare links of [`fault_tolerant_edges`] (to its grandparent, and between the root and
//! every member), idle but for heartbeats. The root alone declares a rank dead: when its link
//! with it fails (the address exchange failed, the socket closed, or silent for
//! `failure_timeout`). It then floods a *tree update*
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
//! (blocks are the layer's segments unless `block_elems` says otherwise). Sums travel with
//! their contributor sets and each block is averaged over the workers actually summed in it
//! ([`crate::aggregate`]); a block that no worker's gradient reached is not updated. Versions
//! travel down with per-block clocks: a block lost on the way keeps its previous (older)
//! values at the receiver, and [`PullReport::delivered_fraction`] says how much of the
//! returned version is exactly that version. With `p = 0` nothing is lost and no set or
//! block clock is sent.
//!
//! **Who may say what.** Roles come from the original tree, which every rank holds. A
//! rank takes weights versions and tree updates only from its ancestors in it (the server
//! and its aggregators, who hold its weights anyway and are the only ranks a repair makes
//! its parent); a version from anyone else, or one newer than the worker's own clocks (the
//! server cannot have applied it), fails the node with an error naming the sender. A
//! failure report is taken from an ancestor, or from a rank about a rank in its own subtree
//! (the news travels up from the failed rank and then down); other tree updates and
//! failure reports are refused, logged and counted ([`PsStats::claims_refused`]), and
//! nodes pass the news on only to ranks that take it from them. Sums come only from
//! children, naming only workers of their subtree. A failed node leaves without a Bye, so
//! its peers see the link end rather than a clean finish. What an ancestor sends is
//! believed unless [`PsConfig::verify_versions`] is on: then the server also sends the
//! digest (SHA-256) of every version straight to each worker below its children (over the
//! spare links), which holds a version apart until its digest matches and takes it only
//! then, so no pull returns weights an aggregator changed; a mismatch, or two different
//! versions of one clock, fails the node naming the rank that passed it down. (Reliable
//! servers only: a bounded version is merged block by block.) An aggregator still controls
//! its subtree's sums.
//!
//! **Limits.** One server (one tree), and no replacement for it. Only the root declares
//! deaths, so a failure must break a link with the root: without the spare links (links of
//! [`crate::link::tree_edges`] only) a failure deeper in the tree is not repaired and the
//! ranks waiting on it time out. A rank the root declared dead by mistake (silent for
//! `failure_timeout` under load) is cut off: its sums are ignored and its calls time out. A
//! child that left before its parent died is not re-attached (its new parent's later clocks
//! are dropped at shutdown). Each push or version is one message of the whole model (no
//! pipelining in chunks, unlike the tree all-reduce); contributor sets and block clocks
//! travel as a reliable message of their own rather than in the segments' meta words, as
//! a block need not be a segment ([`PsConfig::block_elems`]). `PsStats::bytes_sent` counts
//! the bytes of the messages submitted, not the layer's retransmissions.
//!
//! **Files.** `wire`: the message header and the codecs of header messages and block
//! clocks; `repair`: the repaired tree and the spare links; `core`: the aggregator (sums,
//! updates, versions, re-parenting), `Beats` and `Liveness` (heartbeats due and silent
//! links), all driven by events and a clock passed in, with no I/O; `state`: what the
//! background work shares with the API; `io`: the endpoint, the set-up exchange, the
//! links' inboxes, the node's sends and loop; `api`: [`PsNode`]; `types`: its
//! configuration, errors and reports.

//!
//! [`Tree`]: crate::tree::Tree
//! [`Links`]: crate::link::Links
//! [`WeightCache`]: crate::clock::WeightCache
//! [`pull_allowed`]: crate::clock::pull_allowed
mod api;
mod core;
mod io;
mod repair;
#[cfg(test)]
mod roles_tests;
mod state;
mod types;
mod wire;

pub use api::PsNode;
pub use repair::{fault_tolerant_edges, repaired_tree};
pub use types::{PsConfig, PsError, PsStats, PullReport, UpdateRecord};
#[doc(hidden)]
pub use wire::header_codec;
