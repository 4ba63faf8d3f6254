//! A forged rank 1 of a 2-rank job: real links and a real message-layer endpoint (the same
//! set-up a session makes), then the first all-reduce's first message with contributor sets
//! the test chooses, so the victim's validation of aggregation data is driven from the wire,
//! as a malicious or corrupt peer would.
//!
//! The victim all-reduces one block with a loss bound above 0 (contributor sets travel only
//! then). Two ranks run the two-phase all-reduce: the whole block is chunk 0, rank 0's, so
//! rank 1's first message is its contribution to that block, whose set must be exactly
//! {rank 1}. This rank sends it with the set `mask` instead.
//!
//! Shared by the C API tests (`tests/common`) and `examples/forged_peer.rs`, the same forged
//! rank as a program for the Python package's test.
#![allow(dead_code)]

use std::net::IpAddr;
use std::time::Duration;

use gradwire_collective::group::{Group, GroupConfig, PendingGroup};
use gradwire_collective::link::{Links, NetLinkConfig, PendingLinks};
use gradwire_msg::core::SendOpts;
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Op, OpCx, OpEvent, Step};

/// Rank 1's sockets, bound: give `endpoint()` to rank 0, then [`ForgedRank::connect`].
pub struct ForgedRank {
    pending: PendingLinks,
    group: PendingGroup,
    job: u32,
}

impl ForgedRank {
    /// Rank 1 of a 2-rank job `job` at `ip`: a message-layer socket and no flow links (as a
    /// session on the message layer makes it).
    pub fn bind(job: u32, ip: IpAddr, timeout: Duration) -> ForgedRank {
        let group = PendingGroup::bind(GroupConfig::new(job, 1, 2, ip, timeout))
            .expect("forged rank: message-layer socket");
        let cfg = NetLinkConfig {
            connect_timeout: timeout,
            msg_port: Some(group.address().port()),
            ..NetLinkConfig::default()
        };
        let pending = Links::bind(job, 1, 2, ip, &[], None, &cfg).expect("forged rank: bind");
        ForgedRank {
            pending,
            group,
            job,
        }
    }

    pub fn endpoint(&self) -> Vec<u8> {
        self.pending.endpoint().to_vec()
    }

    /// Connects, then sends rank 0's first all-reduce (`elems` f32 of `value`, one block) a
    /// contribution whose contributor set is the 64-bit mask `mask`. Returns the links and
    /// the endpoint: the caller drops them once the victim has failed.
    pub fn connect_and_forge(
        self,
        table: &[Vec<u8>],
        elems: usize,
        value: f32,
        mask: u64,
    ) -> (Links, Group) {
        let links = self.pending.finish(table).expect("forged rank: connect");
        let addrs = links
            .msg_addrs()
            .iter()
            .map(|a| a.expect("forged rank: rank 0 publishes a message-layer socket"))
            .collect();
        let group = self.group.start(addrs).expect("forged rank: endpoint");
        // A session's set-up ends with a barrier on the layer: take part, as a real rank does.
        group.barrier().expect("forged rank: set-up barrier");
        group
            .run_op_for_tests(ForgedContribution { elems, value, mask })
            .expect("forged rank: the contribution");
        (links, group)
    }
}

/// Rank 1's first message of the two-phase all-reduce (`gradwire_collective::algo::direct`,
/// message numbers reserved as it does), with a chosen contributor set. Ends when rank 0 has
/// received it.
struct ForgedContribution {
    elems: usize,
    value: f32,
    mask: u64,
}

impl Op for ForgedContribution {
    type Output = ();

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        let values: Vec<u8> = std::iter::repeat_n(self.value.to_le_bytes(), self.elems)
            .flatten()
            .collect();
        let len = values.len();
        let blocks = len.div_ceil(cx.seg_payload());
        assert_eq!(
            blocks, 1,
            "forged rank: one block, all of it rank 0's chunk"
        );
        let buf = cx.register(Region::owned(values));
        let send = cx.reserve_sends(0, 2)?;
        let recv = cx.reserve_recvs(0, 2)?;
        // Rank 1's own chunk is empty: no phase-1 message to it, nothing to send in phase 2;
        // rank 0's finished chunk (phase 2) is never awaited.
        cx.skip_recv(0, recv)?;
        cx.skip_recv(0, recv + 1)?;
        let forged = SendOpts {
            meta: vec![self.mask],
            ..SendOpts::default()
        };
        cx.send(0, send, buf, 0..len, forged)?;
        Ok(None)
    }

    fn on_event(&mut self, _ev: OpEvent, _cx: &mut OpCx<'_>) -> Step<()> {
        Ok(Some(()))
    }
}
