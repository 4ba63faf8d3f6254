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
use gradwire_wan::scheduler::{
    self, ConnectionOptions, SchedulerConfig, SchedulerHandle, Strategy,
};

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
        node_ips: None,
        auth: None,
    }
}

fn scheduler() -> SchedulerHandle {
    scheduler::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), config()).unwrap()
}

fn scheduler_with(opts: ConnectionOptions) -> SchedulerHandle {
    scheduler::spawn_with(TcpListener::bind("127.0.0.1:0").unwrap(), config(), opts).unwrap()
}

fn scheduler_with_frame_timeout(t: Duration) -> SchedulerHandle {
    scheduler_with(ConnectionOptions {
        frame_timeout: t,
        ..ConnectionOptions::default()
    })
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
fn a_connection_beyond_the_cap_takes_the_place_of_the_one_silent_longest() {
    let s = scheduler();
    let cap = scheduler::CONNECTIONS_PER_NODE * 3;
    // Accepted in this order: the first has been silent longest.
    let mut idle: Vec<TcpStream> = (0..cap).map(|_| connect(&s)).collect();
    std::thread::sleep(Duration::from_millis(400));
    assert_serves(&s, 2);
    assert_closed(&mut idle[0], "a connection beyond the cap came");
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

/// How long a node's request on a fresh connection took to be answered, or why it was not.
fn answered(s: &SchedulerHandle, node: u16) -> Result<Duration, String> {
    let t = std::time::Instant::now();
    let mut c = connect(s);
    c.write_all(&trp(node))
        .map_err(|e| format!("sending the request: {e}"))?;
    match read_frame(&mut c) {
        Ok(Message::PolicyUpdate(_) | Message::PolicyConfirm(_)) => Ok(t.elapsed()),
        Ok(m) => Err(format!("a {:?} in answer to a request", m.kind())),
        Err(e) => Err(format!("no answer after {:?}: {e}", t.elapsed())),
    }
}

/// A hang guard for a node's request behind a flood of idle connections: it is answered as
/// soon as the scheduler's accept loop has made room (milliseconds), far within this.
const ROOM_WITHIN: Duration = Duration::from_secs(5);

/// Panics unless `node`'s request on a fresh connection is answered within
/// [`ROOM_WITHIN`], behind `behind` (what holds the scheduler's places).
fn assert_answered_behind(s: &SchedulerHandle, node: u16, behind: &str) {
    match answered(s, node) {
        Ok(took) => {
            eprintln!("node {node} answered in {took:?} behind {behind}");
            assert!(took < ROOM_WITHIN, "node {node} waited {took:?} for room");
        }
        Err(why) => panic!("{behind} locked node {node} out: {why}"),
    }
}

#[test]
fn silent_connections_filling_every_slot_do_not_lock_a_node_out() {
    let s = scheduler();
    let cap = scheduler::CONNECTIONS_PER_NODE * 3;
    // A stranger's connections: accepted, never a byte.
    let silent: Vec<TcpStream> = (0..cap).map(|_| connect(&s)).collect();
    // Longer than the eviction's least silence.
    std::thread::sleep(Duration::from_millis(400));
    assert_answered_behind(&s, 1, &format!("{cap} silent connections"));
    drop(silent);
    s.stop().unwrap();
}

#[test]
fn connections_that_spoke_once_then_idle_do_not_lock_a_node_out() {
    let s = scheduler();
    let cap = scheduler::CONNECTIONS_PER_NODE * 3;
    // A stranger's connections, each one request (as node 0, the first of round 0), then
    // nothing.
    let idle: Vec<TcpStream> = (0..cap)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(&trp(0)).unwrap();
            read_frame(&mut c).unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(400));
    assert_answered_behind(&s, 2, &format!("{cap} idle connections"));
    drop(idle);
    s.stop().unwrap();
}

/// The first-frame timeout of the test's scheduler.
const HELLO: Duration = Duration::from_secs(1);

#[test]
fn a_connection_silent_from_the_start_is_closed_but_not_one_idle_between_frames() {
    let s = scheduler_with(ConnectionOptions {
        hello_timeout: HELLO,
        ..ConnectionOptions::default()
    });
    let mut silent = connect(&s);
    // A node that has spoken once may idle between rounds for as long as it computes.
    let mut node = connect(&s);
    node.write_all(&trp(0)).unwrap();
    read_frame(&mut node).unwrap();
    let t = std::time::Instant::now();
    assert_closed(&mut silent, "a connection never sent a byte");
    let took = t.elapsed();
    assert!(
        took >= HELLO - Duration::from_millis(500),
        "closed after {took:?}, before the first-frame timeout"
    );
    std::thread::sleep(HELLO);
    // The request again (round 0 is still pinned: nodes 1 and 2 have not asked), on the same
    // connection, idle for longer than the first-frame timeout.
    node.write_all(&trp(0)).unwrap();
    assert!(matches!(
        read_frame(&mut node).unwrap(),
        Message::PolicyUpdate(_) | Message::PolicyConfirm(_)
    ));
    s.stop().unwrap();
}

#[test]
fn a_first_frame_begun_but_not_finished_within_the_first_frame_timeout_is_dropped() {
    // The frame timeout is an hour: only the first-frame timeout can end the connection.
    let s = scheduler_with(ConnectionOptions {
        frame_timeout: NEVER,
        hello_timeout: HELLO,
    });
    let mut c = connect(&s);
    c.write_all(&trp(0)[..14]).unwrap();
    assert_closed(
        &mut c,
        "a first frame stayed half-sent past the first-frame timeout",
    );
    assert_serves(&s, 0);
    s.stop().unwrap();
}

/// `f` on a thread in a fresh network namespace whose loopback also has 127.0.0.2, so that a
/// connection to 127.0.0.2 comes from 127.0.0.2 (outside a namespace the kernel would pick
/// 127.0.0.1); `None` when not root (the test is skipped, or fails under
/// GRADWIRE_REQUIRE_PRIV).
fn with_second_loopback<R: Send + 'static>(
    test: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    use gradwire_netns::{new_netns_prefix, require_root, run_in_netns, IpBatch, NamespaceSet};
    if !require_root(test) {
        return None;
    }
    let ns = format!("{}-sched", new_netns_prefix());
    let set = NamespaceSet::temporary("gradwire-wan test", std::slice::from_ref(&ns)).unwrap();
    IpBatch::new()
        .up("lo")
        .addr("lo", "127.0.0.2".parse().unwrap(), 32)
        .apply(&ns)
        .unwrap();
    let r = run_in_netns(&ns, f).unwrap();
    set.down().unwrap();
    Some(r)
}

fn link_report(from: u16, to: u16, bps: u64) -> Vec<u8> {
    Message::LinkReport(LinkReport {
        from,
        to,
        throughput_bps: bps,
        samples: 4,
        measured_at_round: 0,
    })
    .to_vec()
    .unwrap()
}

#[test]
fn a_connection_from_another_address_cannot_speak_for_a_node() {
    let _ = with_second_loopback(
        "a_connection_from_another_address_cannot_speak_for_a_node",
        || {
            let mut cfg = config();
            // Any report is in the next round's policy.
            cfg.netstorm.update_time = Duration::from_millis(1);
            // Every node on 127.0.0.1.
            cfg.node_ips = Some(vec!["127.0.0.1".parse().unwrap(); 3]);
            let s = scheduler::spawn(TcpListener::bind("0.0.0.0:0").unwrap(), cfg).unwrap();
            let port = s.addr().port();
            let at = |ip: &str| {
                let c =
                    TcpStream::connect((ip.parse::<std::net::IpAddr>().unwrap(), port)).unwrap();
                c.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
                c
            };
            // A stranger on 127.0.0.2 claims node 1 (at 127.0.0.1) and reports node 1's link
            // from node 0 as nearly dead.
            let mut stranger = at("127.0.0.2");
            assert_eq!(stranger.local_addr().unwrap().ip().to_string(), "127.0.0.2");
            stranger.write_all(&link_report(0, 1, 1)).unwrap();
            let stranger_closed = closed(&mut stranger);
            // Round 0, first request: the policy is formulated from every report so far.
            let mut n0 = at("127.0.0.1");
            n0.write_all(&trp(0)).unwrap();
            read_frame(&mut n0).unwrap();
            // Node 1 itself, from its address: served, and its report collected.
            let mut n1 = at("127.0.0.1");
            n1.write_all(&trp(1)).unwrap();
            read_frame(&mut n1).unwrap();
            n1.write_all(&link_report(0, 1, 10_000_000)).unwrap();
            // Node 1's own round trip after its report: the report has been collected.
            n1.write_all(&trp(1)).unwrap();
            read_frame(&mut n1).unwrap();
            let r = s.stop().unwrap();
            eprintln!(
                "stranger: {stranger_closed:?}; link reports collected: {}; policies: {:?}",
                r.link_reports, r.policies
            );
            if let Err(why) = stranger_closed {
                panic!("a connection from 127.0.0.2 spoke for node 1 and was not dropped: {why}");
            }
            assert_eq!(
                r.link_reports, 1,
                "reports other than node 1's own were collected"
            );
            assert_eq!(
                r.policies.len(),
                1,
                "the stranger's report changed the policy: {:?}",
                r.policies
            );
        },
    );
}

#[test]
fn a_node_that_connects_again_replaces_its_older_connection() {
    let s = scheduler_with_frame_timeout(NEVER);
    let mut old = connect(&s);
    old.write_all(&trp(0)).unwrap();
    read_frame(&mut old).unwrap();
    // Node 0 again (after a network blip, say), from the same address: served.
    assert_serves(&s, 0);
    // Only one connection speaks for node 0: the newer.
    assert_closed(&mut old, "node 0 connected again");
    s.stop().unwrap();
}

/// Authenticated jobs: a connection must open with a node's hello and tag every frame with
/// keys only that node and the scheduler can derive. Against a plain scheduler, a process
/// that is not node 1 (here: node 2, which holds the job secret) speaks for node 1 and is
/// answered: the attack works. Against an authenticated scheduler it is dropped, and so is a
/// plain client; the real node 1 is answered.
#[test]
fn only_the_node_itself_can_speak_for_it_on_an_authenticated_scheduler() {
    use gradwire_proto::auth::{JobKey, JobSecret, MemberEntry, MemberKey};
    use gradwire_wan::control::SchedulerClient;
    use gradwire_wan::seal::ControlAuth;
    use std::sync::Arc;

    // Plain: anyone may say it is node 1.
    let plain = scheduler();
    let mut c = connect(&plain);
    c.write_all(&trp(1)).unwrap();
    assert!(
        read_frame(&mut c).is_ok(),
        "the plain scheduler took the forger as node 1"
    );

    let key = Arc::new(JobKey::new(&JobSecret::new(vec![5; 32]).unwrap()));
    let rng = ring::rand::SystemRandom::new();
    let members: Vec<Arc<MemberKey>> = (0..3)
        .map(|_| Arc::new(MemberKey::generate(&rng).unwrap()))
        .collect();
    let entries: Vec<MemberEntry> = (0..3)
        .map(|r| members[r].entry(&key, 9, r as u16))
        .collect();
    let auth = |r: usize| ControlAuth::new(key.clone(), 9, members[r].clone(), entries.clone());
    let mut cfg = config();
    cfg.auth = Some(auth(0));
    let s = scheduler::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), cfg).unwrap();

    // A plain client: its frame is no hello of a node it can prove.
    let mut c = connect(&s);
    c.write_all(&trp(1)).unwrap();
    assert_closed(&mut c, "a plain client sent a request");

    // Node 2 says hello as node 1, with its own key: its first tag does not verify.
    let mut c = connect(&s);
    let mut seal = auth(2).client(&mut c, 1).unwrap();
    let frame = trp(1);
    let tag = seal.tag(&frame);
    c.write_all(&[&frame[..], &tag[..]].concat()).unwrap();
    assert_closed(&mut c, "node 2 spoke as node 1");

    // The real node 1.
    let mut node1 = SchedulerClient::new(s.addr(), READ_TIMEOUT).authenticated(auth(1), 1);
    node1
        .request(TopologyRequest {
            node: 1,
            version: NO_VERSION,
            round: 0,
        })
        .unwrap();
}
