//! Two senders incast one receiver through one emulated switch, one queue at a time: the same
//! burst (half ECN-capable, half not) crosses the thresholds of the front-layer queues but not
//! those of the back-layer queues. Checks, against the switch's counters, the receiver's XDP
//! counters and what the senders sent: CE only on ECT packets, drops only of non-ECT packets
//! and only in queues whose threshold was crossed, lower thresholds crossed first, no
//! shared-buffer drops, and every packet accounted for.
//!
//! Each queue gets its own burst, so whether a threshold was crossed is judged against what
//! the switch reports for that queue (its largest depth, its first mark or drop), never
//! against how fast another burst happened to arrive. The receiver's link runs at a tenth of
//! the senders' (10 vs 100 Mbit/s), so even one sender's 16 frames alone build a queue above
//! the lowest threshold, however the two senders are scheduled on a loaded machine.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::*;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_netns::require_root;
use gradwire_qos::DATA_DSCP;

const TOPO: &str = r#"
name = "inc"
[defaults]
rate = "100Mbit"
delay = "10us"
[[switch]]
name = "s0"
[[host]]
name = "h"
count = 2
uplink = "s0"
[[host]]
name = "r"
[[link]]
a = "r"
b = "s0"
rate = "10Mbit"
"#;

/// Bytes the switch counts for one test frame (Ethernet header included).
const FRAME: u64 = PAYLOAD as u64 + 42;

/// Datagrams per sender per queue: 2 x 16 full frames = 48448 bytes, above the thresholds of
/// queues 6..2 (15000..45000) and below those of queues 1 and 0 (52500, 60000).
const PER_SENDER: usize = 16;

const NOT_ECT: u8 = 0;
const ECT0: u8 = 2;
const CE: u8 = 3;

#[test]
fn incast_marks_ect_drops_non_ect_lower_thresholds_first() {
    if !require_root("incast_marks_ect_drops_non_ect_lower_thresholds_first") {
        return;
    }
    let topo = topo(TOPO);
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let (h0, h1, h2) = (&topo.hosts[0], &topo.hosts[1], &topo.hosts[2]);
    assert_eq!(h2.name, "r", "the receiver is the third host");
    let rx = Receiver::start(net.host_ns(2).unwrap(), h2.ip);
    let dst = SocketAddr::from((h2.ip, PORT));

    // [queue] -> (non-ECT sent, ECT sent)
    let mut sent = [(0u64, 0u64); 7];
    for (q, dscp) in DATA_DSCP.iter().enumerate() {
        let tos = vec![dscp << 2 | NOT_ECT, dscp << 2 | ECT0];
        let sport = 10_000 + 10 * q as u16;
        let a = blast(
            net.host_ns(0).unwrap(),
            h0.ip,
            sport,
            dst,
            tos.clone(),
            PER_SENDER,
        );
        let b = blast(net.host_ns(1).unwrap(), h1.ip, sport, dst, tos, PER_SENDER);
        for s in [a.join().unwrap(), b.join().unwrap()] {
            sent[q].0 += s[0];
            sent[q].1 += s[1];
        }
        // Let the queue drain completely before the next one: phases must not interact.
        assert!(
            fabric.wait_idle(Duration::from_secs(10)),
            "fabric did not drain"
        );
    }
    // One datagram to an address no switch has a route for.
    blast(
        net.host_ns(0).unwrap(),
        h0.ip,
        20_000,
        SocketAddr::from((Ipv4Addr::new(198, 19, 200, 1), PORT)),
        vec![0],
        1,
    )
    .join()
    .unwrap();
    assert!(fabric.wait_idle(Duration::from_secs(10)));
    let host_view = rx.finish();
    let st = fabric.stop().unwrap();
    net.down().unwrap();

    let sw = st.switch("s0").unwrap();
    let port = sw.ports.iter().find(|p| p.peer == "host r").unwrap();
    let th = &topo.qos.thresholds_bytes;
    eprintln!("lag: {:?}", st.lag);
    let mut crossed = Vec::new();
    for (q, dscp) in DATA_DSCP.iter().enumerate() {
        let c = &port.egress.queues[q];
        let k = th[q].unwrap();
        let (non_ect, ect) = sent[q];
        eprintln!(
            "queue {q} (T={k}): sent {non_ect}+{ect} enq {} marked {} dropped {} max depth {}",
            c.enqueued_pkts, c.marked, c.dropped_threshold, c.max_depth_bytes
        );
        assert_eq!(
            non_ect as usize,
            2 * PER_SENDER / 2,
            "queue {q}: non-ECT sent"
        );
        assert_eq!(ect as usize, 2 * PER_SENDER / 2, "queue {q}: ECT sent");
        // Every packet reached the switch; the shared buffer never overflowed.
        assert_eq!(c.arrivals(), non_ect + ect, "queue {q}: arrivals");
        assert_eq!(c.dropped_buffer, 0, "queue {q}: buffer drops");
        // Only ECT packets are marked, only non-ECT packets dropped.
        assert!(
            c.marked <= ect && c.dropped_threshold <= non_ect,
            "queue {q}"
        );
        // The receiver's classifier agrees with the switch, class by class.
        let got = |ecn| host_view.class(*dscp, ecn).packets;
        assert_eq!(
            got(NOT_ECT),
            non_ect - c.dropped_threshold,
            "queue {q}: non-ECT"
        );
        assert_eq!(
            got(CE),
            c.marked,
            "queue {q}: CE at the receiver = marks at the switch"
        );
        assert_eq!(got(ECT0) + got(CE), ect, "queue {q}: no ECT packet lost");
        assert_eq!(got(1), 0, "queue {q}: nothing became ECT(1)");
        // Marks and drops exactly above the threshold, as the queue's own counters show: a
        // queue that was hit went above it, and a queue whose depth went more than one frame
        // above it (so some frame arrived while it was above) was hit.
        let hit = c.marked + c.dropped_threshold > 0;
        if hit {
            assert!(c.max_depth_bytes > k, "queue {q}: hit below its threshold");
            assert!(c.first_mark_ns.is_some() || c.first_drop_ns.is_some());
        } else {
            assert!(
                c.max_depth_bytes <= k + FRAME,
                "queue {q}: depth {} went above its threshold {k} and nothing was marked",
                c.max_depth_bytes
            );
            assert_eq!(
                (c.first_mark_ns, c.first_drop_ns),
                (None, None),
                "queue {q}"
            );
        }
        crossed.push((k, hit, c.dropped_threshold, c.max_depth_bytes));
    }
    // Lower thresholds are crossed first: of two queues whose bursts built the same depth or
    // more, the one with the lower threshold was hit whenever the other one was. Judged from
    // each queue's reported depth, so a burst that happened to arrive more slowly (and built
    // less depth) cannot make the check fail.
    for &(k, hit, _, depth) in &crossed {
        if hit {
            assert!(
                crossed
                    .iter()
                    .all(|&(k2, hit2, _, depth2)| k2 >= k || depth2 < depth || hit2),
                "threshold {k} was crossed before a lower one at no less depth: {crossed:?}"
            );
        }
    }
    assert!(
        crossed[6].1 && crossed[6].2 > 0,
        "queue 6 must drop: {crossed:?}"
    );
    assert!(
        !crossed[0].1 && !crossed[1].1,
        "queues 0 and 1 cannot be crossed: {crossed:?}"
    );
    // Nothing else travelled to the receiver, and every departure arrived there.
    let data_pkts: u64 = sent.iter().map(|(a, b)| a + b).sum::<u64>()
        - port
            .egress
            .queues
            .iter()
            .map(|c| c.dropped_threshold)
            .sum::<u64>();
    assert_eq!(port.egress.delivered_pkts, data_pkts);
    assert_eq!(host_view.classes_total().packets, data_pkts);
    assert_eq!(host_view.ce_packets, port.egress.sum().marked);
    assert_eq!(sw.forward.no_route, 1);
    assert_eq!(
        sw.forward.forwarded,
        data_pkts + port.egress.sum().dropped_threshold
    );
    // Lag is timing, reported but not asserted (the assertions above hold whatever it is).
    eprintln!("fabric lag: {:?}", st.lag);
}
