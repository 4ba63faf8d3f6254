//! The scheduler's side of a node connection, spoken to byte by byte: a frame that arrives
//! in pieces is answered, a frame not complete within the frame timeout is dropped, and a
//! connection that speaks for a second node or sends what only the scheduler sends is
//! dropped. "Dropped" means the node's side reads end of stream or a reset; a connection the
//! scheduler keeps open without answering is a failure, not a drop.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::{LinkReport, Message, TopologyRequest, NO_VERSION};
use gradwire_wan::control::read_frame;
use gradwire_wan::scheduler::{self, SchedulerConfig, SchedulerHandle, Strategy};

/// How long the node's side waits for the scheduler to answer or close: far beyond what
/// either takes (milliseconds), so reaching it means the scheduler did neither.
const READ_TIMEOUT: Duration = Duration::from_secs(20);

fn config() -> SchedulerConfig {
    let mut o = Overlay::new(3);
    o.add_link(0, 1, 10e6).unwrap();
    o.add_link(1, 2, 10e6).unwrap();
    o.add_link(0, 2, 10e6).unwrap();
    SchedulerConfig {
        world: 3,
        strategy: Strategy::MrFaptAware,
        netstorm: NetStormConfig::default(),
        overlay: o,
        round_bytes: 4_000,
    }
}

fn scheduler() -> SchedulerHandle {
    scheduler::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), config()).unwrap()
}

fn scheduler_with_frame_timeout(t: Duration) -> SchedulerHandle {
    scheduler::spawn_with_frame_timeout(TcpListener::bind("127.0.0.1:0").unwrap(), config(), t)
        .unwrap()
}

fn connect(s: &SchedulerHandle) -> TcpStream {
    let c = TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
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

/// The scheduler closed the connection: a read gives end of stream, or a reset (the
/// scheduler closed with bytes of ours unread). Anything else says why not: it answered, or
/// it kept the connection open and silent until [`READ_TIMEOUT`].
fn closed(c: &mut TcpStream) -> Result<(), String> {
    let mut b = [0u8; 64];
    match c.read(&mut b) {
        Ok(0) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
            ) =>
        {
            Ok(())
        }
        Ok(n) => Err(format!("it sent {n} bytes and kept the connection")),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(format!(
            "it kept the connection open and silent for {READ_TIMEOUT:?}"
        )),
        Err(e) => Err(format!(
            "reading gave {e}, neither end of stream nor a reset"
        )),
    }
}

/// Panics unless the scheduler closed `c`, saying `what` the connection did.
fn assert_closed(c: &mut TcpStream, what: &str) {
    if let Err(why) = closed(c) {
        panic!("{what}, and the scheduler did not close the connection: {why}");
    }
}

/// A request on a fresh connection is answered: the scheduler still serves.
fn assert_serves(s: &SchedulerHandle, node: u16) {
    let mut c = connect(s);
    c.write_all(&trp(node)).unwrap();
    match read_frame(&mut c).unwrap() {
        Message::PolicyUpdate(_) | Message::PolicyConfirm(_) => {}
        m => panic!("a {:?} in answer to a request", m.kind()),
    }
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

/// A frame timeout no test reaches: a connection the scheduler does not drop at once stays
/// open, and the node's side reads a timeout rather than a late drop.
const NEVER: Duration = Duration::from_secs(3600);

#[test]
fn a_connection_that_speaks_for_another_node_is_dropped() {
    let s = scheduler_with_frame_timeout(NEVER);
    let mut c = connect(&s);
    c.write_all(&trp(0)).unwrap();
    assert!(matches!(
        read_frame(&mut c).unwrap(),
        Message::PolicyUpdate(_)
    ));
    // Node 0's connection asks for node 1's round.
    c.write_all(&trp(1)).unwrap();
    assert_closed(&mut c, "node 0's connection spoke for node 1");

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
    assert_closed(&mut c, "node 1's connection reported node 2's link");
    let r = s.stop().unwrap();
    assert_eq!(r.link_reports, 0, "a forged report reached the collector");
}

#[test]
fn a_connection_stuck_in_a_frame_does_not_hold_up_the_scheduler_stopping() {
    // Only the stop flag can end the stuck connection's wait.
    let s = scheduler_with_frame_timeout(NEVER);
    let mut c = connect(&s);
    // A request's header and half its body, then nothing.
    let bytes = trp(0);
    c.write_all(&bytes[..14]).unwrap();
    // A round trip on a second connection: the first was accepted before it, so its thread
    // has had the scheduler's time to start on the half frame.
    assert_serves(&s, 1);
    let (done, stopped) = mpsc::channel();
    std::thread::spawn(move || done.send(s.stop().map(|r| r.requests)));
    // A hang guard, not a timing: stopping takes milliseconds, the frame timeout an hour.
    let requests = stopped
        .recv_timeout(Duration::from_secs(60))
        .expect("stopping waited for the half-sent frame")
        .unwrap();
    assert_eq!(requests, 1, "the half-sent request was answered");
    assert_closed(&mut c, "the scheduler stopped");
}

#[test]
fn a_frame_not_complete_within_the_frame_timeout_is_dropped() {
    let s = scheduler_with_frame_timeout(Duration::from_secs(1));
    let mut c = connect(&s);
    // A request's header and half its body, then nothing: the scheduler, still running,
    // drops the connection when the frame timeout has passed.
    let bytes = trp(0);
    c.write_all(&bytes[..14]).unwrap();
    assert_closed(
        &mut c,
        "a frame stayed half-sent for 20 times the frame timeout",
    );
    // Only that connection: the scheduler serves the next.
    assert_serves(&s, 0);
    let r = s.stop().unwrap();
    assert_eq!(r.requests, 1, "the half-sent request was answered");
}

#[test]
fn a_frame_only_the_scheduler_sends_is_refused_at_its_header() {
    // Were the body read on, the scheduler would wait for its megabyte until the frame
    // timeout: the connection stays open and silent.
    let s = scheduler_with_frame_timeout(NEVER);
    let mut c = connect(&s);
    // A PolicyUpdate header announcing a large body: dropped without reading it.
    let mut h = b"GWNS".to_vec();
    h.extend_from_slice(&[1, 3]);
    h.extend_from_slice(&(1u32 << 20).to_be_bytes());
    c.write_all(&h).unwrap();
    assert_closed(&mut c, "a node sent a PolicyUpdate header");
    s.stop().unwrap();
}

#[test]
fn a_node_that_never_reads_its_answers_holds_neither_a_thread_nor_stop() {
    // The node sends requests as fast as it can and never reads: the answers fill both
    // sockets' buffers and the scheduler's write blocks. It gives up on the connection
    // within the frame timeout, and stop() returns.
    let s = scheduler_with_frame_timeout(Duration::from_secs(2));
    let c = connect(&s);
    c.set_nonblocking(true).unwrap();
    let one = trp(0);
    let burst: Vec<u8> = one.iter().copied().cycle().take(one.len() * 4096).collect();
    let mut c = c;
    let until = std::time::Instant::now() + Duration::from_secs(4);
    let mut written = 0usize;
    while std::time::Instant::now() < until {
        match c.write(&burst) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(_) => break, // dropped by the scheduler: what the test wants
        }
    }
    assert!(
        written > one.len() * 10_000,
        "only {written} bytes of requests went out"
    );
    // A new node is still served meanwhile.
    assert_serves(&s, 1);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(s.stop().map(|_| ()));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("stop() did not return within 10 s with a node that never reads"),
    }
    drop(c);
}

#[test]
fn connections_beyond_the_cap_are_closed_and_finished_ones_free_their_place() {
    let s = scheduler();
    let cap = scheduler::CONNECTIONS_PER_NODE * 3;
    let idle: Vec<TcpStream> = (0..cap).map(|_| connect(&s)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = connect(&s);
    assert_closed(&mut extra, "a connection beyond the cap");
    // Closing the idle ones frees their places: a node is served again.
    drop(idle);
    std::thread::sleep(Duration::from_millis(500));
    assert_serves(&s, 2);
    s.stop().unwrap();
}

#[test]
fn a_request_for_a_round_far_ahead_is_dropped_and_the_real_node_still_served() {
    // A stranger speaking for node 0 asks for round u32::MAX: the scheduler drops it, and
    // node 0's real request for round 0 is answered.
    let s = scheduler();
    let mut c = connect(&s);
    let far = Message::TopologyRequest(TopologyRequest {
        node: 0,
        version: NO_VERSION,
        round: u32::MAX,
    })
    .to_vec()
    .unwrap();
    c.write_all(&far).unwrap();
    assert_closed(&mut c, "a request for round u32::MAX");
    assert_serves(&s, 0);
    s.stop().unwrap();
}
