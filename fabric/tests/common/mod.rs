//! Shared helpers for the fabric's namespace tests.

#![allow(clippy::unwrap_used)]
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use gradwire_control::render::fabric::FabricQos;
use gradwire_ebpf::{AttachMode, XdpConfig, XdpCounters, XdpProgram};
use gradwire_fabric::topology::{default_policy, Topology};
use gradwire_netns::spawn_in_netns;

/// The classifier's gradwire port on receivers.
pub const PORT: u16 = 7000;
/// UDP payload of a full-size test frame (1514-byte Ethernet frame).
pub const PAYLOAD: usize = 1472;

pub fn qos() -> FabricQos {
    FabricQos::from_policy(&default_policy()).unwrap()
}

pub fn topo(text: &str) -> Topology {
    Topology::from_toml(text, qos()).unwrap()
}

/// The shipped leaf-spine with per-flow ECMP at every switch (and the built-in policy, which
/// is the shipped one).
pub fn leaf_spine_per_flow() -> Topology {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbeds/leaf-spine.toml");
    let text = std::fs::read_to_string(file)
        .unwrap()
        .replace("ecmp = \"packet\"", "ecmp = \"flow\"")
        .replace("policy = \"fabric-policy.toml\"", "");
    topo(&text)
}

/// Connects a gradwire control channel to `addr` ([`gradwire_netns::connect_retry`] for up to
/// 10 s while the receiver starts).
pub fn connect_retry(addr: SocketAddr) -> gradwire::ctrl_channel::TcpCtrl {
    let stream = gradwire_netns::connect_retry(addr, Duration::from_secs(10)).unwrap();
    gradwire::ctrl_channel::TcpCtrl::client_handshake(stream, None, None, Duration::from_secs(10))
        .unwrap()
}

/// A receiver: the XDP classifier attached to `eth0` in `netns` (counting what arrives per
/// DSCP/ECN, passing it on) and a UDP socket bound to [`PORT`] so that the kernel answers
/// with no ICMP. Call `finish` to get the classifier's counters.
pub struct Receiver {
    done: mpsc::Sender<()>,
    thread: JoinHandle<XdpCounters>,
}

impl Receiver {
    pub fn start(netns: &str, ip: Ipv4Addr) -> Receiver {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let thread = spawn_in_netns(netns, move || {
            let mut cfg = XdpConfig::new(vec![PORT]);
            cfg.mode = AttachMode::Generic;
            let prog = XdpProgram::attach("eth0", &cfg).unwrap();
            let sock = UdpSocket::bind((ip, PORT)).unwrap();
            sock.set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = vec![0u8; 2048];
            // Drain the socket so that its buffer never matters; stop when told, or when the
            // test dropped its end without telling (it failed before `finish`).
            while let Err(std::sync::mpsc::TryRecvError::Empty) = done_rx.try_recv() {
                let _ = sock.recv(&mut buf);
            }
            let _ = sock.as_fd();
            prog.counters().unwrap()
        })
        .unwrap();
        ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        Receiver {
            done: done_tx,
            thread,
        }
    }

    pub fn finish(self) -> XdpCounters {
        self.done.send(()).unwrap();
        self.thread.join().unwrap()
    }
}

/// Sends `count` datagrams of [`PAYLOAD`] bytes from a socket bound in `netns` to `dst`,
/// alternating the TOS bytes in `tos` (DSCP << 2 | ECN). Returns how many of each were sent.
pub fn blast(
    netns: &str,
    src: Ipv4Addr,
    sport: u16,
    dst: SocketAddr,
    tos: Vec<u8>,
    count: usize,
) -> JoinHandle<Vec<u64>> {
    spawn_in_netns(netns, move || {
        let socks: Vec<UdpSocket> = tos
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let s = UdpSocket::bind((src, sport + i as u16)).unwrap();
                nix::sys::socket::setsockopt(
                    &s,
                    nix::sys::socket::sockopt::Ipv4Tos,
                    &i32::from(*t),
                )
                .unwrap();
                s
            })
            .collect();
        let payload = vec![0x5au8; PAYLOAD];
        let mut sent = vec![0u64; tos.len()];
        for k in 0..count {
            let i = k % socks.len();
            // Kernel UDP on a veth never drops on send except for a full socket buffer;
            // count only what the kernel took.
            if socks[i].send_to(&payload, dst).is_ok() {
                sent[i] += 1;
            }
        }
        sent
    })
    .unwrap()
}
