//! Shared helpers of the integration tests: privilege gate (the namespace kit's) and frame
//! builders.
//!
//! Frames are built byte by byte here (not with the dataplane crate) so that these tests
//! exercise the classifier against an independent encoding of the wire formats.

#![allow(dead_code)]

use std::net::{Ipv4Addr, Ipv6Addr};

use gradwire_ebpf::{XdpConfig, XdpCounters, XdpProgram};

/// The privilege gate of every root-only test: the namespace kit's.
pub use gradwire_netns::require_root;

/// The gradwire port the fixtures use.
pub const PORT: u16 = 7000;
/// Another UDP port, not configured.
pub const OTHER_PORT: u16 = 7001;

pub const SRC4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const DST4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const FOREIGN4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 99);
/// RFC 5180 benchmarking range; these frames never leave BPF_PROG_TEST_RUN.
pub const SRC6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 2);
pub const DST6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
pub const FOREIGN6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x99);

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;

/// Network layer of a fixture frame.
#[derive(Debug, Clone)]
pub enum L3 {
    V4 {
        src: Ipv4Addr,
        /// IPv4 options, a multiple of 4 bytes (IHL grows accordingly).
        options: Vec<u8>,
        /// Flags and fragment offset field (host order), e.g. 0x2000 = MF.
        frag: u16,
        /// Overrides the total length field.
        tot_len: Option<u16>,
    },
    V6 {
        src: Ipv6Addr,
        /// Insert an 8-byte hop-by-hop options header before UDP.
        hop_by_hop: bool,
        /// Overrides the payload length field.
        payload_len: Option<u16>,
    },
}

/// A fixture frame: Ethernet, VLAN tags, IPv4/IPv6, UDP (or TCP), gradwire header, payload.
#[derive(Debug, Clone)]
pub struct Frame {
    /// TPIDs of the VLAN tags, outermost first.
    pub vlans: Vec<u16>,
    pub l3: L3,
    /// DS field: dscp << 2 | ecn.
    pub tos: u8,
    /// IP protocol / next header of the transport (17 UDP, 6 TCP).
    pub proto: u8,
    pub dport: u16,
    /// Bytes after the UDP header (the gradwire header is the first 32 of them).
    pub body_len: usize,
    /// Overrides the UDP length field.
    pub udp_len: Option<u16>,
}

impl Frame {
    pub fn v4() -> Frame {
        Frame {
            vlans: vec![],
            l3: L3::V4 {
                src: SRC4,
                options: vec![],
                frag: 0x4000, /* DF */
                tot_len: None,
            },
            tos: 0,
            proto: 17,
            dport: PORT,
            body_len: 32 + 100,
            udp_len: None,
        }
    }

    pub fn v6() -> Frame {
        Frame {
            l3: L3::V6 {
                src: SRC6,
                hop_by_hop: false,
                payload_len: None,
            },
            ..Frame::v4()
        }
    }

    pub fn dscp_ecn(mut self, dscp: u8, ecn: u8) -> Frame {
        self.tos = dscp << 2 | ecn;
        self
    }

    pub fn port(mut self, p: u16) -> Frame {
        self.dport = p;
        self
    }

    pub fn vlan(mut self, tpid: u16) -> Frame {
        self.vlans.push(tpid);
        self
    }

    pub fn body(mut self, len: usize) -> Frame {
        self.body_len = len;
        self
    }

    pub fn src4(mut self, a: Ipv4Addr) -> Frame {
        if let L3::V4 { src, .. } = &mut self.l3 {
            *src = a;
        }
        self
    }

    pub fn src6(mut self, a: Ipv6Addr) -> Frame {
        if let L3::V6 { src, .. } = &mut self.l3 {
            *src = a;
        }
        self
    }

    /// Length of the Ethernet + VLAN + IP headers (where UDP starts).
    pub fn l4_offset(&self) -> usize {
        14 + 4 * self.vlans.len()
            + match &self.l3 {
                L3::V4 { options, .. } => 20 + options.len(),
                L3::V6 { hop_by_hop, .. } => 40 + if *hop_by_hop { 8 } else { 0 },
            }
    }

    pub fn build(&self) -> Vec<u8> {
        let l4_len = 8 + self.body_len;
        let mut f = Vec::with_capacity(self.l4_offset() + l4_len);
        f.extend_from_slice(&[0x02, 0x67, 0x77, 0, 0, 1]); // dst
        f.extend_from_slice(&[0x02, 0x67, 0x77, 0, 0, 2]); // src
        for (i, tpid) in self.vlans.iter().enumerate() {
            f.extend_from_slice(&tpid.to_be_bytes());
            f.extend_from_slice(&(100 + i as u16).to_be_bytes()); // VID 100, 101
        }
        match &self.l3 {
            L3::V4 {
                src,
                options,
                frag,
                tot_len,
            } => {
                f.extend_from_slice(&ETH_P_IP.to_be_bytes());
                let ip_start = f.len();
                let hlen = 20 + options.len();
                assert_eq!(options.len() % 4, 0);
                let tot = tot_len.unwrap_or((hlen + l4_len) as u16);
                f.push(0x40 | (hlen / 4) as u8);
                f.push(self.tos);
                f.extend_from_slice(&tot.to_be_bytes());
                f.extend_from_slice(&0x1234u16.to_be_bytes()); // id
                f.extend_from_slice(&frag.to_be_bytes());
                f.push(64); // ttl
                f.push(self.proto);
                f.extend_from_slice(&[0, 0]); // checksum, below
                f.extend_from_slice(&src.octets());
                f.extend_from_slice(&DST4.octets());
                f.extend_from_slice(options);
                let csum = ipv4_checksum(&f[ip_start..ip_start + hlen]);
                f[ip_start + 10..ip_start + 12].copy_from_slice(&csum.to_be_bytes());
            }
            L3::V6 {
                src,
                hop_by_hop,
                payload_len,
            } => {
                f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
                let ext = if *hop_by_hop { 8 } else { 0 };
                let plen = payload_len.unwrap_or((ext + l4_len) as u16);
                let tc = self.tos;
                f.push(0x60 | (tc >> 4));
                f.push((tc & 0x0f) << 4); // flow label 0
                f.extend_from_slice(&[0, 0]);
                f.extend_from_slice(&plen.to_be_bytes());
                f.push(if *hop_by_hop { 0 } else { self.proto });
                f.push(64); // hop limit
                f.extend_from_slice(&src.octets());
                f.extend_from_slice(&DST6.octets());
                if *hop_by_hop {
                    // next header, length 0 (8 bytes), PadN of 4 bytes of padding.
                    f.extend_from_slice(&[self.proto, 0, 1, 4, 0, 0, 0, 0]);
                }
            }
        }
        // Transport: UDP header (for TCP the same 8 bytes stand in for ports/seq; the
        // classifier must not look past the protocol field anyway).
        f.extend_from_slice(&40000u16.to_be_bytes());
        f.extend_from_slice(&self.dport.to_be_bytes());
        f.extend_from_slice(&self.udp_len.unwrap_or(l4_len as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]); // no checksum (XDP does not verify it)
        for i in 0..self.body_len {
            f.push(if i < 32 { 0x47 } else { i as u8 });
        }
        f
    }
}

pub fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in h.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ARP request for 198.18.0.1 from 198.18.0.2.
pub fn arp() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0x67, 0x77, 0, 0, 2]);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]); // Ethernet/IPv4, request
    f.extend_from_slice(&[0x02, 0x67, 0x77, 0, 0, 2]);
    f.extend_from_slice(&SRC4.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&DST4.octets());
    f.resize(60, 0); // minimum frame, padded
    f
}

/// Loads the classifier detached with `config`.
pub fn load(config: &XdpConfig) -> XdpProgram {
    XdpProgram::load_detached(config).expect("load classifier")
}

/// Runs `frame` through the program and returns the verdict and the counter change.
pub fn run(p: &XdpProgram, frame: &[u8]) -> (u32, XdpCounters) {
    let before = p.counters().expect("counters");
    let (verdict, out) = p.test_run(frame).expect("test_run");
    let after = p.counters().expect("counters");
    // The program never rewrites frames.
    assert_eq!(out, frame, "frame modified");
    (verdict, after.since(&before))
}

fn one(len: usize) -> gradwire_ebpf::Counter {
    gradwire_ebpf::Counter {
        packets: 1,
        bytes: len as u64,
    }
}

fn with_class(mut c: XdpCounters, tos: u8, len: usize) -> XdpCounters {
    c.classes = vec![gradwire_ebpf::ClassCounter {
        dscp: tos >> 2,
        ecn: tos & 3,
        packets: 1,
        bytes: len as u64,
    }];
    if tos & 3 == 3 {
        c.ce_packets = 1;
        c.ce_bytes = len as u64;
    }
    c
}

/// Expected change for a frame that is not gradwire.
pub fn expect_passed(len: usize) -> XdpCounters {
    XdpCounters {
        passed: one(len),
        ..XdpCounters::default()
    }
}

/// Expected change for a good gradwire frame with no socket on its queue.
pub fn expect_to_kernel(tos: u8, len: usize) -> XdpCounters {
    let c = XdpCounters {
        gradwire: one(len),
        to_kernel: one(len),
        ..XdpCounters::default()
    };
    with_class(c, tos, len)
}

/// Expected change for a good gradwire frame redirected to a socket.
pub fn expect_redirected(tos: u8, len: usize) -> XdpCounters {
    let c = XdpCounters {
        gradwire: one(len),
        redirected: one(len),
        ..XdpCounters::default()
    };
    with_class(c, tos, len)
}

/// Expected change for a truncated gradwire frame (not in the class table).
pub fn expect_truncated(len: usize) -> XdpCounters {
    XdpCounters {
        gradwire: one(len),
        drop_truncated: one(len),
        ..XdpCounters::default()
    }
}

/// Expected change for a gradwire frame from a source outside the allowlist.
pub fn expect_not_allowed(tos: u8, len: usize) -> XdpCounters {
    let c = XdpCounters {
        gradwire: one(len),
        drop_not_allowed: one(len),
        ..XdpCounters::default()
    };
    with_class(c, tos, len)
}

/// Expected change for a gradwire frame dropped by fault injection.
pub fn expect_fault(tos: u8, len: usize) -> XdpCounters {
    let c = XdpCounters {
        gradwire: one(len),
        drop_fault: one(len),
        ..XdpCounters::default()
    };
    with_class(c, tos, len)
}
