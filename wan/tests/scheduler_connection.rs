//! The scheduler's side of a node connection, spoken to byte by byte: a frame that arrives
//! in pieces is answered, and a connection that speaks for a second node is dropped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::{LinkReport, Message, TopologyRequest, NO_VERSION};
use gradwire_wan::control::read_frame;
use gradwire_wan::scheduler::{self, SchedulerConfig, SchedulerHandle, Strategy};

fn scheduler() -> SchedulerHandle {
    let mut o = Overlay::new(3);
    o.add_link(0, 1, 10e6).unwrap();
    o.add_link(1, 2, 10e6).unwrap();
    o.add_link(0, 2, 10e6).unwrap();
    scheduler::spawn(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        SchedulerConfig {
            world: 3,
            strategy: Strategy::MrFaptAware,
            netstorm: NetStormConfig::default(),
            overlay: o,
            round_bytes: 4_000,
        },
    )
    .unwrap()
}

fn connect(s: &SchedulerHandle) -> TcpStream {
    let c = TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c
}

fn trp(node: u16) -> Vec<u8> {
    Message::TopologyRequest(TopologyRequest {
        node,
        version: NO_VERSION,
        round: 0,
    })
    .to_vec()
    .unwrap()
}

/// The connection was closed by the scheduler: a read gives end of stream (or a reset).
fn closed(c: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    matches!(c.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn a_request_that_arrives_in_pieces_is_answered() {
    let s = scheduler();
    let mut c = connect(&s);
    let bytes = trp(0);
    // Longer than the connection's idle poll: the scheduler must not abandon the frame.
    c.write_all(&bytes[..7]).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    c.write_all(&bytes[7..]).unwrap();
    match read_frame(&mut c).unwrap() {
        Message::PolicyUpdate(u) => assert_eq!((u.version, u.round), (1, 0)),
        m => panic!("a {:?} in answer to a first request", m.kind()),
    }
    s.stop().unwrap();
}

#[test]
fn a_connection_that_speaks_for_another_node_is_dropped() {
    let s = scheduler();
    let mut c = connect(&s);
    c.write_all(&trp(0)).unwrap();
    assert!(matches!(
        read_frame(&mut c).unwrap(),
        Message::PolicyUpdate(_)
    ));
    // Node 0's connection asks for node 1's round.
    c.write_all(&trp(1)).unwrap();
    assert!(
        closed(&mut c),
        "node 0's connection spoke for node 1 and was kept"
    );

    // A report of a link into node 2 on node 1's connection.
    let mut c = connect(&s);
    c.write_all(&trp(1)).unwrap();
    read_frame(&mut c).unwrap();
    let report = Message::LinkReport(LinkReport {
        from: 0,
        to: 2,
        throughput_bps: 1,
        samples: 4,
        measured_at_round: 0,
    });
    c.write_all(&report.to_vec().unwrap()).unwrap();
    assert!(
        closed(&mut c),
        "node 1's connection reported node 2's link and was kept"
    );
    let r = s.stop().unwrap();
    assert_eq!(r.link_reports, 0, "a forged report reached the collector");
}

#[test]
fn a_connection_stuck_in_a_frame_does_not_hold_up_the_scheduler_stopping() {
    let s = scheduler();
    let mut c = connect(&s);
    // A request's header and half its body, then nothing.
    let bytes = trp(0);
    c.write_all(&bytes[..14]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = std::time::Instant::now();
    s.stop().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "stopping took {:?} behind a half-sent frame",
        t.elapsed()
    );
}

#[test]
fn a_frame_only_the_scheduler_sends_is_refused_at_its_header() {
    let s = scheduler();
    let mut c = connect(&s);
    // A PolicyUpdate header announcing a large body: dropped without reading it.
    let mut h = b"GWNS".to_vec();
    h.extend_from_slice(&[1, 3]);
    h.extend_from_slice(&(1u32 << 20).to_be_bytes());
    c.write_all(&h).unwrap();
    assert!(closed(&mut c), "a PolicyUpdate from a node was read on");
    s.stop().unwrap();
}
