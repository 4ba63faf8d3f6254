//! The overlay network NetStorm schedules on: sites (nodes `0..n`, optionally named) joined by
//! undirected links, each carrying a measured throughput per direction.
//!
//! NetStorm (§III-A) weighs each edge of an undirected graph with its transfer delay. Passive
//! awareness (§V) measures one sender -> receiver direction at a time and WAN paths are often
//! asymmetric, so a [`Link`] keeps one throughput per direction and a *directed use* `a -> b`
//! costs `latency + bytes * 8 / throughput(a -> b)` seconds. Aggregation trees weigh the
//! child -> parent direction: the PUSH is what blocks aggregation (Theorem 1); the PULL travels
//! the same tree the other way. With equal throughputs both ways this is the paper's model.
//!
//! Shortest paths ([`Overlay::shortest_paths_to`]) are a small array-based Dijkstra toward one
//! target, deterministic on ties (fewer hops first, then the lower-numbered next hop), so the
//! scheduler's policies are reproducible from the same reports.

use std::fmt::Write as _;
use std::time::Duration;

/// A link's index in [`Overlay::links`], in insertion order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinkId(pub usize);

/// A link to add: its endpoints, throughput each way (bit/s) and fixed one-way latency.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    /// One endpoint.
    pub a: usize,
    /// The other endpoint.
    pub b: usize,
    /// Measured throughput from `a` to `b`, bit/s.
    pub throughput_ab_bps: f64,
    /// Measured throughput from `b` to `a`, bit/s.
    pub throughput_ba_bps: f64,
    /// Added to every transfer delay over the link (propagation). Zero in the paper's model,
    /// which counts transfer delays only.
    pub latency: Duration,
}

impl LinkSpec {
    /// A link with the same throughput both ways and no fixed latency (the paper's model).
    pub fn symmetric(a: usize, b: usize, throughput_bps: f64) -> Self {
        LinkSpec {
            a,
            b,
            throughput_ab_bps: throughput_bps,
            throughput_ba_bps: throughput_bps,
            latency: Duration::ZERO,
        }
    }
}

/// An undirected overlay link with a throughput per direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    a: usize,
    b: usize,
    throughput_ab: f64,
    throughput_ba: f64,
    latency: Duration,
}

impl Link {
    /// The endpoints, as given when the link was added.
    pub fn endpoints(&self) -> (usize, usize) {
        (self.a, self.b)
    }

    /// The endpoint other than `v`, or `None` if `v` is not an endpoint.
    pub fn other(&self, v: usize) -> Option<usize> {
        if v == self.a {
            Some(self.b)
        } else if v == self.b {
            Some(self.a)
        } else {
            None
        }
    }

    /// Throughput (bit/s) when `from` sends over this link, or `None` if `from` is not an
    /// endpoint.
    pub fn throughput_from(&self, from: usize) -> Option<f64> {
        if from == self.a {
            Some(self.throughput_ab)
        } else if from == self.b {
            Some(self.throughput_ba)
        } else {
            None
        }
    }

    /// The slower direction's throughput (bit/s): what an undirected algorithm such as the
    /// MST baseline weighs the link by.
    pub fn min_throughput(&self) -> f64 {
        self.throughput_ab.min(self.throughput_ba)
    }

    /// Fixed one-way latency added to each transfer.
    pub fn latency(&self) -> Duration {
        self.latency
    }

    /// Seconds for `from` to send `bytes` over this link: `latency + bytes * 8 / throughput`;
    /// `None` if `from` is not an endpoint.
    pub fn delay_from(&self, from: usize, bytes: u64) -> Option<f64> {
        let bps = self.throughput_from(from)?;
        Some(self.latency.as_secs_f64() + bytes as f64 * 8.0 / bps)
    }
}

/// A malformed overlay or a question about nodes or links it does not have.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// A node index beyond the overlay.
    #[error("node {node} does not exist: the overlay has nodes 0..{num_nodes}")]
    NodeOutOfRange {
        /// The index given.
        node: usize,
        /// The overlay's size.
        num_nodes: usize,
    },
    /// A link from a node to itself.
    #[error("link {node}-{node} joins a node to itself: remove it")]
    SelfLink {
        /// The node.
        node: usize,
    },
    /// A second link between the same two nodes.
    #[error(
        "link {a}-{b} is given twice: give each pair of sites one link, with a throughput per \
         direction"
    )]
    DuplicateLink {
        /// One endpoint.
        a: usize,
        /// The other endpoint.
        b: usize,
    },
    /// A throughput that is zero, negative, infinite or NaN.
    #[error(
        "throughput {bps} bit/s from {from} to {to} is invalid: a throughput must be positive \
         and finite (a dead link is removed from the overlay, not given zero)"
    )]
    BadThroughput {
        /// Sending node.
        from: usize,
        /// Receiving node.
        to: usize,
        /// The value given.
        bps: f64,
    },
    /// Two nodes that no link joins.
    #[error("no link joins nodes {a} and {b}")]
    NoLink {
        /// One node.
        a: usize,
        /// The other node.
        b: usize,
    },
    /// An overlay without nodes.
    #[error("the overlay has no nodes: give at least one site")]
    Empty,
    /// Two sites with the same name.
    #[error("site name {name:?} is given to nodes {first} and {second}: site names must differ")]
    DuplicateName {
        /// The name.
        name: String,
        /// Its first node.
        first: usize,
        /// Its second node.
        second: usize,
    },
    /// Nodes with no path to a node they must reach.
    #[error(
        "node(s) {labels} cannot reach node {target}: the overlay is not connected; add links so \
         that every site has a path to every other"
    )]
    Disconnected {
        /// The node they cannot reach.
        target: usize,
        /// The nodes without a path, ascending.
        unreachable: Vec<usize>,
        /// The same nodes with their site names, for the message.
        labels: String,
    },
    /// Two overlays that do not have the same nodes and links.
    #[error("the overlays differ in {what}: compare two measurements of the same overlay")]
    DifferentOverlays {
        /// What differs.
        what: &'static str,
    },
}

/// Sites and links, with the latest throughput measured on each link direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Overlay {
    names: Vec<Option<String>>,
    links: Vec<Link>,
    /// Per node: `(neighbour, link)`, sorted by neighbour so iteration order (and so tie
    /// breaking) does not depend on the order links were added.
    adjacency: Vec<Vec<(usize, LinkId)>>,
}

impl Overlay {
    /// An overlay of `num_nodes` unnamed sites and no links.
    pub fn new(num_nodes: usize) -> Self {
        Overlay {
            names: vec![None; num_nodes],
            links: Vec::new(),
            adjacency: vec![Vec::new(); num_nodes],
        }
    }

    /// An overlay whose node `i` is the site `names[i]`.
    pub fn with_names<I, S>(names: I) -> Result<Self, GraphError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let names: Vec<String> = names.into_iter().map(Into::into).collect();
        for (second, name) in names.iter().enumerate() {
            if let Some(first) = names[..second].iter().position(|n| n == name) {
                return Err(GraphError::DuplicateName {
                    name: name.clone(),
                    first,
                    second,
                });
            }
        }
        let mut overlay = Overlay::new(names.len());
        overlay.names = names.into_iter().map(Some).collect();
        Ok(overlay)
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.names.len()
    }

    /// Number of links.
    pub fn num_links(&self) -> usize {
        self.links.len()
    }

    /// The site name of node `v`, if it has one.
    pub fn name(&self, v: usize) -> Option<&str> {
        self.names.get(v).and_then(|n| n.as_deref())
    }

    /// The node named `name`.
    pub fn node_by_name(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n.as_deref() == Some(name))
    }

    /// `v`, or `v (name)` when the site is named: for messages.
    pub fn label(&self, v: usize) -> String {
        match self.name(v) {
            Some(name) => format!("{v} ({name})"),
            None => v.to_string(),
        }
    }

    /// Adds a link with the same throughput both ways and no fixed latency.
    pub fn add_link(
        &mut self,
        a: usize,
        b: usize,
        throughput_bps: f64,
    ) -> Result<LinkId, GraphError> {
        self.add_link_spec(LinkSpec::symmetric(a, b, throughput_bps))
    }

    /// Adds a link. Refuses self-links, a second link between the same nodes, unknown nodes
    /// and throughputs that are not positive and finite.
    pub fn add_link_spec(&mut self, spec: LinkSpec) -> Result<LinkId, GraphError> {
        let LinkSpec {
            a,
            b,
            throughput_ab_bps,
            throughput_ba_bps,
            latency,
        } = spec;
        self.check_node(a)?;
        self.check_node(b)?;
        if a == b {
            return Err(GraphError::SelfLink { node: a });
        }
        if self.link_between(a, b).is_some() {
            return Err(GraphError::DuplicateLink { a, b });
        }
        check_throughput(a, b, throughput_ab_bps)?;
        check_throughput(b, a, throughput_ba_bps)?;
        let id = LinkId(self.links.len());
        self.links.push(Link {
            a,
            b,
            throughput_ab: throughput_ab_bps,
            throughput_ba: throughput_ba_bps,
            latency,
        });
        for (v, w) in [(a, b), (b, a)] {
            let adj = &mut self.adjacency[v];
            let at = adj.partition_point(|&(n, _)| n < w);
            adj.insert(at, (w, id));
        }
        Ok(id)
    }

    /// All links, indexed by [`LinkId`].
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// One link. Panics on an id this overlay did not return, like slice indexing.
    pub fn link(&self, id: LinkId) -> &Link {
        &self.links[id.0]
    }

    /// The link joining `a` and `b`, in either direction.
    pub fn link_between(&self, a: usize, b: usize) -> Option<LinkId> {
        let adj = self.adjacency.get(a)?;
        adj.binary_search_by_key(&b, |&(n, _)| n)
            .ok()
            .map(|i| adj[i].1)
    }

    /// `v`'s neighbours, ascending.
    pub fn neighbours(&self, v: usize) -> impl Iterator<Item = usize> + '_ {
        self.adjacency.get(v).into_iter().flatten().map(|&(n, _)| n)
    }

    /// `v`'s neighbours with the link to each, ascending by neighbour.
    pub fn neighbour_links(&self, v: usize) -> &[(usize, LinkId)] {
        self.adjacency.get(v).map_or(&[], Vec::as_slice)
    }

    /// Records a measurement (an awareness report): `from` sends to `to` at `bps` bit/s over
    /// their link. The other direction keeps its value.
    pub fn set_throughput(&mut self, from: usize, to: usize, bps: f64) -> Result<(), GraphError> {
        check_throughput(from, to, bps)?;
        let id = self
            .link_between(from, to)
            .ok_or(GraphError::NoLink { a: from, b: to })?;
        let link = &mut self.links[id.0];
        if link.a == from {
            link.throughput_ab = bps;
        } else {
            link.throughput_ba = bps;
        }
        Ok(())
    }

    /// Sets both directions of the link joining `a` and `b` to `bps` bit/s.
    pub fn set_link_throughput(&mut self, a: usize, b: usize, bps: f64) -> Result<(), GraphError> {
        self.set_throughput(a, b, bps)?;
        self.set_throughput(b, a, bps)
    }

    /// Seconds for `from` to send `bytes` to its neighbour `to` over their link.
    pub fn transfer_delay(&self, from: usize, to: usize, bytes: u64) -> Result<f64, GraphError> {
        let id = self
            .link_between(from, to)
            .ok_or(GraphError::NoLink { a: from, b: to })?;
        Ok(self.link_delay(id, from, bytes))
    }

    /// Seconds for `from` (an endpoint of `id`) to send `bytes` over link `id`.
    fn link_delay(&self, id: LinkId, from: usize, bytes: u64) -> f64 {
        let link = &self.links[id.0];
        let bps = if link.a == from {
            link.throughput_ab
        } else {
            link.throughput_ba
        };
        link.latency.as_secs_f64() + bytes as f64 * 8.0 / bps
    }

    /// Seconds for `from` to deliver `bytes` to `to` over the fastest overlay path, relayed
    /// store-and-forward by the nodes on it (as NetStorm's forwarding nodes do at the
    /// application layer): the sum of the hops' transfer delays. This is how a tree edge between
    /// sites that no link joins (STAR, BKT) is costed. Zero when `from == to`.
    pub fn pair_delay(&self, from: usize, to: usize, bytes: u64) -> Result<f64, GraphError> {
        self.check_node(from)?;
        let sp = self.shortest_paths_to(to, bytes)?;
        sp.delay(from)
            .ok_or_else(|| self.disconnected(to, vec![from]))
    }

    /// The cost of tree edge `from -> to`: the link's transfer delay if a link joins them (the
    /// tree says to use it), else [`Overlay::pair_delay`].
    pub fn edge_delay(&self, from: usize, to: usize, bytes: u64) -> Result<f64, GraphError> {
        self.check_node(from)?;
        self.check_node(to)?;
        match self.link_between(from, to) {
            Some(id) => Ok(self.link_delay(id, from, bytes)),
            None => self.pair_delay(from, to, bytes),
        }
    }

    /// Fastest paths from every node toward `target`, each hop costed by its directed transfer
    /// delay for `bytes`.
    pub fn shortest_paths_to(
        &self,
        target: usize,
        bytes: u64,
    ) -> Result<ShortestPaths, GraphError> {
        self.check_node(target)?;
        Ok(self.shortest_paths_to_filtered(target, bytes, &|_| true))
    }

    /// [`Overlay::shortest_paths_to`] over the links for which `usable` holds (Algorithm 3's
    /// pruned graph). `target` must be a node.
    pub(crate) fn shortest_paths_to_filtered(
        &self,
        target: usize,
        bytes: u64,
        usable: &dyn Fn(LinkId) -> bool,
    ) -> ShortestPaths {
        let n = self.num_nodes();
        let mut dist = vec![f64::INFINITY; n];
        let mut hops = vec![usize::MAX; n];
        let mut next: Vec<Option<usize>> = vec![None; n];
        let mut done = vec![false; n];
        dist[target] = 0.0;
        hops[target] = 0;
        // O(n^2) selection: overlays have tens of sites, and a scan picks the lowest index on
        // equal distances without a heap's ordering subtleties.
        while let Some(u) = (0..n)
            .filter(|&v| !done[v] && dist[v].is_finite())
            .min_by(|&x, &y| dist[x].total_cmp(&dist[y]).then(x.cmp(&y)))
        {
            done[u] = true;
            for &(v, id) in &self.adjacency[u] {
                if done[v] || !usable(id) {
                    continue;
                }
                // v would send to u: the directed use v -> u.
                let cand = dist[u] + self.link_delay(id, v, bytes);
                let better = cand < dist[v]
                    || (cand == dist[v]
                        && (hops[u] + 1, u) < (hops[v], next[v].unwrap_or(usize::MAX)));
                if better {
                    dist[v] = cand;
                    hops[v] = hops[u] + 1;
                    next[v] = Some(u);
                }
            }
        }
        ShortestPaths { target, dist, next }
    }

    /// Ok if the overlay has a node and every node reaches every other (links are undirected,
    /// so reaching node 0 is enough); else an error naming the nodes cut off from node 0.
    pub fn check_connected(&self) -> Result<(), GraphError> {
        if self.num_nodes() == 0 {
            return Err(GraphError::Empty);
        }
        let sp = self.shortest_paths_to_filtered(0, 1, &|_| true);
        let unreachable = sp.unreachable();
        if unreachable.is_empty() {
            Ok(())
        } else {
            Err(self.disconnected(0, unreachable))
        }
    }

    /// The largest relative change of any link direction's throughput since `before` (the
    /// same overlay measured earlier): `max |now - before| / before`. The network collector
    /// refreshes the policy when this reaches UPDATE_RATE
    /// ([`crate::config::NetStormConfig::is_significant_change`]).
    pub fn max_relative_change(&self, before: &Overlay) -> Result<f64, GraphError> {
        if self.num_nodes() != before.num_nodes() {
            return Err(GraphError::DifferentOverlays { what: "node count" });
        }
        if self.links.len() != before.links.len() {
            return Err(GraphError::DifferentOverlays { what: "link count" });
        }
        let mut change: f64 = 0.0;
        for (now, old) in self.links.iter().zip(&before.links) {
            if (now.a, now.b) != (old.a, old.b) {
                return Err(GraphError::DifferentOverlays { what: "links" });
            }
            for (x, y) in [
                (now.throughput_ab, old.throughput_ab),
                (now.throughput_ba, old.throughput_ba),
            ] {
                change = change.max((x - y).abs() / y);
            }
        }
        Ok(change)
    }

    pub(crate) fn check_node(&self, node: usize) -> Result<(), GraphError> {
        if node < self.num_nodes() {
            Ok(())
        } else {
            Err(GraphError::NodeOutOfRange {
                node,
                num_nodes: self.num_nodes(),
            })
        }
    }

    /// The error for `unreachable` (ascending) having no path to `target`.
    pub(crate) fn disconnected(&self, target: usize, unreachable: Vec<usize>) -> GraphError {
        let mut labels = String::new();
        for (i, &v) in unreachable.iter().enumerate() {
            if i > 0 {
                labels.push_str(", ");
            }
            let _ = write!(labels, "{}", self.label(v));
        }
        GraphError::Disconnected {
            target,
            unreachable,
            labels,
        }
    }
}

fn check_throughput(from: usize, to: usize, bps: f64) -> Result<(), GraphError> {
    if bps.is_finite() && bps > 0.0 {
        Ok(())
    } else {
        Err(GraphError::BadThroughput { from, to, bps })
    }
}

/// Fastest paths from every node toward one target (a shortest-path tree over directed
/// transfer delays).
#[derive(Debug, Clone, PartialEq)]
pub struct ShortestPaths {
    target: usize,
    dist: Vec<f64>,
    next: Vec<Option<usize>>,
}

impl ShortestPaths {
    /// The node every path leads to.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Seconds from `from` to the target along its fastest path; `None` if unreachable or not
    /// a node.
    pub fn delay(&self, from: usize) -> Option<f64> {
        self.dist.get(from).copied().filter(|d| d.is_finite())
    }

    /// The next node on `from`'s fastest path (`None` at the target or if unreachable).
    pub fn next_hop(&self, from: usize) -> Option<usize> {
        self.next.get(from).copied().flatten()
    }

    /// Every node's next hop, indexed by node: a parent array rooted at the target.
    pub fn next_hops(&self) -> &[Option<usize>] {
        &self.next
    }

    /// The nodes from `from` to the target, both included; `None` if unreachable.
    pub fn path(&self, from: usize) -> Option<Vec<usize>> {
        self.delay(from)?;
        let mut path = vec![from];
        let mut v = from;
        while let Some(n) = self.next_hop(v) {
            path.push(n);
            v = n;
        }
        Some(path)
    }

    /// Nodes without a path to the target, ascending.
    pub fn unreachable(&self) -> Vec<usize> {
        (0..self.dist.len())
            .filter(|&v| !self.dist[v].is_finite())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MBIT: f64 = 1e6;

    fn line(n: usize, bps: f64) -> Overlay {
        let mut o = Overlay::new(n);
        for v in 1..n {
            o.add_link(v - 1, v, bps).unwrap();
        }
        o
    }

    #[test]
    fn transfer_delay_is_bits_over_throughput_plus_latency() {
        let mut o = Overlay::new(2);
        o.add_link_spec(LinkSpec {
            a: 0,
            b: 1,
            throughput_ab_bps: 100.0 * MBIT,
            throughput_ba_bps: 50.0 * MBIT,
            latency: Duration::from_millis(30),
        })
        .unwrap();
        // 12.5 MB = 100 Mbit: 1 s at 100 Mbit/s, 2 s at 50 Mbit/s, plus 30 ms.
        assert!((o.transfer_delay(0, 1, 12_500_000).unwrap() - 1.03).abs() < 1e-12);
        assert!((o.transfer_delay(1, 0, 12_500_000).unwrap() - 2.03).abs() < 1e-12);
        assert_eq!(
            o.transfer_delay(0, 0, 1),
            Err(GraphError::NoLink { a: 0, b: 0 })
        );
    }

    #[test]
    fn malformed_links_are_refused() {
        let mut o = Overlay::new(3);
        assert_eq!(
            o.add_link(1, 1, MBIT),
            Err(GraphError::SelfLink { node: 1 })
        );
        assert_eq!(
            o.add_link(0, 3, MBIT),
            Err(GraphError::NodeOutOfRange {
                node: 3,
                num_nodes: 3
            })
        );
        o.add_link(0, 1, MBIT).unwrap();
        assert_eq!(
            o.add_link(1, 0, MBIT),
            Err(GraphError::DuplicateLink { a: 1, b: 0 })
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                o.add_link(1, 2, bad),
                Err(GraphError::BadThroughput { from: 1, to: 2, .. })
            ));
            assert!(matches!(
                o.set_throughput(0, 1, bad),
                Err(GraphError::BadThroughput { .. })
            ));
        }
        assert_eq!(o.num_links(), 1);
        assert!(matches!(
            Overlay::with_names(["a", "b", "a"]),
            Err(GraphError::DuplicateName {
                first: 0,
                second: 2,
                ..
            })
        ));
    }

    #[test]
    fn reports_update_one_direction() {
        let mut o = line(2, 10.0 * MBIT);
        o.set_throughput(1, 0, 40.0 * MBIT).unwrap();
        let l = o.link(o.link_between(0, 1).unwrap());
        assert_eq!(l.throughput_from(0), Some(10.0 * MBIT));
        assert_eq!(l.throughput_from(1), Some(40.0 * MBIT));
        assert_eq!(l.min_throughput(), 10.0 * MBIT);
        assert_eq!(
            o.set_throughput(0, 2, MBIT),
            Err(GraphError::NoLink { a: 0, b: 2 })
        );
        let before = line(2, 10.0 * MBIT);
        assert!((o.max_relative_change(&before).unwrap() - 3.0).abs() < 1e-12);
        assert_eq!(o.max_relative_change(&o).unwrap(), 0.0);
    }

    #[test]
    fn neighbours_are_sorted_whatever_the_insertion_order() {
        let mut o = Overlay::new(4);
        o.add_link(0, 3, MBIT).unwrap();
        o.add_link(0, 1, MBIT).unwrap();
        o.add_link(2, 0, MBIT).unwrap();
        assert_eq!(o.neighbours(0).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(o.neighbours(2).collect::<Vec<_>>(), vec![0]);
        assert_eq!(o.neighbours(9).count(), 0);
    }

    #[test]
    fn disconnected_overlay_names_the_cut_off_sites() {
        let mut o = Overlay::with_names(["sea", "chi", "nyc", "atl"]).unwrap();
        o.add_link(0, 1, MBIT).unwrap();
        o.add_link(2, 3, MBIT).unwrap();
        let err = o.check_connected().unwrap_err();
        assert_eq!(
            err,
            GraphError::Disconnected {
                target: 0,
                unreachable: vec![2, 3],
                labels: "2 (nyc), 3 (atl)".into()
            }
        );
        assert!(err.to_string().contains("2 (nyc), 3 (atl)"));
        assert_eq!(Overlay::new(0).check_connected(), Err(GraphError::Empty));
        o.add_link(1, 2, MBIT).unwrap();
        o.check_connected().unwrap();
        assert_eq!(o.node_by_name("atl"), Some(3));
    }

    #[test]
    fn shortest_paths_prefer_fewer_hops_then_lower_index_on_ties() {
        // 0-1-3 and 0-2-3 cost the same; 0-3 direct costs the same as both two-hop paths.
        let mut o = Overlay::new(4);
        o.add_link(0, 1, 2.0 * MBIT).unwrap();
        o.add_link(1, 3, 2.0 * MBIT).unwrap();
        o.add_link(0, 2, 2.0 * MBIT).unwrap();
        o.add_link(2, 3, 2.0 * MBIT).unwrap();
        let sp = o.shortest_paths_to(3, 1000).unwrap();
        assert_eq!(sp.path(0), Some(vec![0, 1, 3]));
        o.add_link(0, 3, MBIT).unwrap();
        let sp = o.shortest_paths_to(3, 1000).unwrap();
        assert_eq!(sp.path(0), Some(vec![0, 3]));
        assert_eq!(sp.path(3), Some(vec![3]));
        assert_eq!(sp.next_hop(3), None);
    }

    #[test]
    fn pair_delay_sums_the_hops_of_the_fastest_path() {
        let mut o = line(3, 8.0 * MBIT);
        o.add_link(0, 2, MBIT).unwrap();
        // 1 MB: 1 s per 8 Mbit/s hop, 8 s over the slow direct link.
        assert!((o.pair_delay(0, 2, 1_000_000).unwrap() - 2.0).abs() < 1e-12);
        // A tree edge over an existing link uses that link even if a path is faster.
        assert!((o.edge_delay(0, 2, 1_000_000).unwrap() - 8.0).abs() < 1e-12);
        assert_eq!(o.pair_delay(1, 1, 5).unwrap(), 0.0);
        let mut cut = Overlay::new(3);
        cut.add_link(0, 1, MBIT).unwrap();
        assert!(matches!(
            cut.pair_delay(2, 0, 1),
            Err(GraphError::Disconnected { target: 0, .. })
        ));
    }
}
