//! A forged rank 1 of a 2-rank job: real links (the same set-up a session makes), then the
//! first all-reduce's reduce-scatter step with contributor sets the test chooses, so the
//! victim's validation of aggregation data (`gradwire_collective::aggregate`) is driven from
//! the wire, as a malicious or corrupt peer would.
//!
//! The victim all-reduces one block with a loss bound above 0 (contributor sets travel only
//! then): in a ring of 2 its reduce-scatter step 0 sends its empty chunk 0 and receives chunk
//! 1, that one block, from rank 1, values first and then the sets. The flow ids come from
//! `gradwire_collective::comm::flow_ids`, the communicator's own, so they cannot drift.
//!
//! Shared by the C API tests (`tests/common`) and `examples/forged_peer.rs`, the same forged
//! rank as a program for the Python package's test.
#![allow(dead_code)]

use std::net::IpAddr;
use std::time::Duration;

use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{SendOptions, TransferConfig};
use gradwire_collective::comm::flow_ids;
use gradwire_collective::link::{Links, NetLinkConfig, PendingLinks};

/// Rank 1's sockets, bound: give `endpoint()` to rank 0, then [`ForgedRank::connect`].
pub struct ForgedRank {
    pending: PendingLinks,
    job: u32,
}

impl ForgedRank {
    /// Rank 1 of a 2-rank job `job` at `ip`, with every pair linked (a session's default).
    pub fn bind(job: u32, ip: IpAddr, timeout: Duration) -> ForgedRank {
        let cfg = NetLinkConfig {
            connect_timeout: timeout,
            ..NetLinkConfig::default()
        };
        let pending =
            Links::bind(job, 1, 2, ip, &[(0, 1), (1, 0)], None, &cfg).expect("forged rank: bind");
        ForgedRank { pending, job }
    }

    pub fn endpoint(&self) -> Vec<u8> {
        self.pending.endpoint().to_vec()
    }

    /// Connects, then sends rank 0's first all-reduce (`elems` f32 of `value`, one block,
    /// bound `bound`) a partial sum whose contributor set is the 64-bit mask `mask`. Returns
    /// the links: the caller drops them once the victim has failed.
    pub fn connect_and_forge(
        self,
        table: &[Vec<u8>],
        elems: usize,
        value: f32,
        bound: f64,
        mask: u64,
    ) -> Links {
        let mut links = self.pending.finish(table).expect("forged rank: connect");
        let bound = LossBound::from_fraction(bound).expect("forged rank: loss bound");
        let prio = fixed_priority(Tag { dscp: 0, ect: true });
        let cfg = TransferConfig::default();
        let tensor = flow_ids::reduce_scatter(0, 1);
        let opts = |tensor, loss_bound| SendOptions {
            job: self.job,
            tensor,
            round: 0,
            layer: 0,
            stage: Stage::Push,
            loss_bound: Some(loss_bound),
        };
        let mut values = Tensor::zeros(DType::F32, elems);
        for (c, v) in values
            .as_bytes_mut()
            .chunks_exact_mut(4)
            .zip(std::iter::repeat(value))
        {
            c.copy_from_slice(&v.to_le_bytes());
        }
        let out = links.out(0).expect("forged rank: link to rank 0");
        out.send(&values, &opts(tensor, bound), &prio, &cfg)
            .expect("forged rank: values");
        let mut sets = Tensor::zeros(DType::Raw, 8);
        sets.as_bytes_mut().copy_from_slice(&mask.to_le_bytes());
        out.send(
            &sets,
            &opts(tensor | flow_ids::SETS_BIT, LossBound::RELIABLE),
            &prio,
            &cfg,
        )
        .expect("forged rank: contributor sets");
        links
    }
}
