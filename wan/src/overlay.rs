//! The sites of a WAN topology and the scheduler's overlay of them.
//!
//! A WAN topology (`testbeds/wan9.toml`, `testbeds/wan4.toml`) has one switch (the site's
//! WAN router) and one host (the site's data centre) per site. Site `i` is host `i` in the
//! file's host order (rank `i`, address `198.18.1.0 + i`); its switch is the host's uplink
//! switch, which must hold no other host. The scheduler's overlay
//! ([`overlay_from_topology`]) has one link per switch-switch link of the topology between
//! two site switches, with the link's rate at the fabric's start as the throughput both ways
//! and its one-way delay as the fixed latency; switches without a host must not carry
//! inter-site links (the overlay would miss them). Trees use overlay links only, so a tree
//! edge crosses exactly one WAN link; a star's edges to non-neighbours cross several, routed
//! by the fabric (shortest hop count, ECMP).

use std::time::Duration;

use gradwire_fabric::topology::{Peer, Topology};
use gradwire_netstorm::graph::{LinkSpec, Overlay};
use serde::Serialize;

/// An inter-site link of a WAN topology.
#[derive(Debug, Clone, Serialize)]
pub struct SiteLink {
    /// One site (rank).
    pub a: usize,
    /// The other site.
    pub b: usize,
    /// `a`'s switch name.
    pub a_switch: String,
    /// `b`'s switch name.
    pub b_switch: String,
    /// Rate at the fabric's start, bit/s.
    pub rate_bps: u64,
    /// One-way delay, ns.
    pub delay_ns: u64,
    /// The rate over time, if it changes.
    pub schedule: Option<LinkSchedule>,
}

/// A link's rate schedule, for reports and plots.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkSchedule {
    /// (seconds since the fabric's start or the period's, bit/s from then on); before the
    /// first step (and at the start of every period) the link runs at its starting rate.
    pub steps: Vec<(f64, u64)>,
    /// The period after which the steps repeat, seconds; `None`: the last step stays.
    pub period_s: Option<f64>,
}

/// A topology that is not a WAN of sites.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SiteError {
    /// Two hosts on one switch.
    #[error(
        "topology {topology}: hosts {first} and {second} share switch {switch}; a WAN topology has \
         one host per site switch (site i = host i, its switch = the host's uplink)"
    )]
    SharedSwitch {
        /// Topology name.
        topology: String,
        /// One host.
        first: String,
        /// The other.
        second: String,
        /// The switch.
        switch: String,
    },
    /// An inter-switch link touching a switch without a host.
    #[error(
        "topology {topology}: link {a}-{b} ends at switch {transit}, which has no host; every \
         switch of a WAN topology is a site with one host (the overlay has sites only)"
    )]
    TransitSwitch {
        /// Topology name.
        topology: String,
        /// One end.
        a: String,
        /// The other.
        b: String,
        /// The end without a host.
        transit: String,
    },
    /// The node count and the topology disagree.
    #[error(
        "topology {topology} has {hosts} sites (hosts) but --world is {world}: start one node \
         per site"
    )]
    World {
        /// Topology name.
        topology: String,
        /// Hosts.
        hosts: usize,
        /// The world given.
        world: usize,
    },
    /// The overlay is not usable.
    #[error("topology {topology}: {error}")]
    Overlay {
        /// Topology name.
        topology: String,
        /// What the overlay said.
        error: String,
    },
}

/// The switch-switch links between site switches, once each (from the lower switch port).
pub fn site_links(topo: &Topology) -> Result<Vec<SiteLink>, SiteError> {
    let mut site_of: Vec<Option<usize>> = vec![None; topo.switches.len()];
    for (i, h) in topo.hosts.iter().enumerate() {
        if let Some(first) = site_of[h.switch] {
            return Err(SiteError::SharedSwitch {
                topology: topo.name.clone(),
                first: topo.hosts[first].name.clone(),
                second: h.name.clone(),
                switch: topo.switches[h.switch].name.clone(),
            });
        }
        site_of[h.switch] = Some(i);
    }
    let mut out = Vec::new();
    for (si, s) in topo.switches.iter().enumerate() {
        for (pi, p) in s.ports.iter().enumerate() {
            let Peer::Switch(t, tp) = p.peer else {
                continue;
            };
            if (si, pi) > (t, tp) {
                continue;
            }
            let (Some(a), Some(b)) = (site_of[si], site_of[t]) else {
                let transit = if site_of[si].is_none() { si } else { t };
                return Err(SiteError::TransitSwitch {
                    topology: topo.name.clone(),
                    a: s.name.clone(),
                    b: topo.switches[t].name.clone(),
                    transit: topo.switches[transit].name.clone(),
                });
            };
            let schedule = p.link.schedule.as_ref().map(|sc| LinkSchedule {
                steps: sc
                    .steps()
                    .iter()
                    .map(|st| (st.at_ns as f64 / 1e9, st.rate_bps))
                    .collect(),
                period_s: sc.period_ns().map(|ns| ns as f64 / 1e9),
            });
            out.push(SiteLink {
                a,
                b,
                a_switch: s.name.clone(),
                b_switch: topo.switches[t].name.clone(),
                rate_bps: p.link.rate_bps,
                delay_ns: p.link.delay_ns,
                schedule,
            });
        }
    }
    Ok(out)
}

/// The scheduler's overlay of a WAN topology (see the module's documentation): sites named
/// after their switches, one link per inter-site link with its starting rate both ways and
/// its delay as latency.
pub fn overlay_from_topology(topo: &Topology) -> Result<Overlay, SiteError> {
    let links = site_links(topo)?;
    let bad = |e: gradwire_netstorm::graph::GraphError| SiteError::Overlay {
        topology: topo.name.clone(),
        error: e.to_string(),
    };
    let names = topo
        .hosts
        .iter()
        .map(|h| topo.switches[h.switch].name.clone());
    let mut o = Overlay::with_names(names).map_err(bad)?;
    for l in &links {
        o.add_link_spec(LinkSpec {
            a: l.a,
            b: l.b,
            throughput_ab_bps: l.rate_bps as f64,
            throughput_ba_bps: l.rate_bps as f64,
            latency: Duration::from_nanos(l.delay_ns),
        })
        .map_err(bad)?;
    }
    o.check_connected().map_err(bad)?;
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_control::render::fabric::FabricQos;
    use gradwire_fabric::topology::default_policy;

    fn qos() -> FabricQos {
        FabricQos::from_policy(&default_policy()).unwrap()
    }

    /// Three sites, two inter-site links, one of them on a schedule.
    const THREE_SITES: &str = include_str!("../tests/fixtures/three_sites.toml");

    #[test]
    fn the_overlay_has_one_link_per_inter_site_link() {
        let t = Topology::from_toml(THREE_SITES, qos()).unwrap();
        let links = site_links(&t).unwrap();
        assert_eq!(links.len(), 2);
        let o = overlay_from_topology(&t).unwrap();
        assert_eq!((o.num_nodes(), o.num_links()), (3, 2));
        assert_eq!(o.name(2), Some("c"));
        let ab = o.link(o.link_between(0, 1).unwrap());
        assert_eq!(ab.throughput_from(1), Some(10e6));
        assert_eq!(ab.latency(), Duration::from_millis(30));
        assert!(o.link_between(0, 2).is_none());
        assert_eq!(
            o.link(o.link_between(2, 1).unwrap()).throughput_from(2),
            Some(4e6)
        );
        // Without its schedules, a link keeps its starting rate.
        let st = t.clone().without_schedules();
        assert_eq!(site_links(&st).unwrap()[0].rate_bps, 10_000_000);
        assert_eq!(site_links(&st).unwrap()[0].schedule, None);
        let ab = &links[0];
        assert_eq!(
            ab.schedule,
            Some(LinkSchedule {
                steps: vec![(20.0, 2_000_000)],
                period_s: Some(40.0)
            })
        );
    }

    #[test]
    fn topologies_that_are_not_wans_of_sites_are_refused() {
        let shared = THREE_SITES.replace("uplink = \"c\"", "uplink = \"b\"");
        let t = Topology::from_toml(&shared, qos()).unwrap();
        let e = overlay_from_topology(&t).unwrap_err().to_string();
        assert!(e.contains("share switch b"), "{e}");
        let transit =
            format!("{THREE_SITES}[[switch]]\nname = \"x\"\n[[link]]\na = \"x\"\nb = \"a\"\n");
        let t = Topology::from_toml(&transit, qos()).unwrap();
        let e = overlay_from_topology(&t).unwrap_err().to_string();
        assert!(e.contains("switch x, which has no host"), "{e}");
        let cut = THREE_SITES.replace("a = \"c\"\nb = \"b\"", "a = \"c\"\nb = \"c\"");
        if let Ok(t) = Topology::from_toml(&cut, qos()) {
            assert!(overlay_from_topology(&t).is_err());
        }
    }
}
