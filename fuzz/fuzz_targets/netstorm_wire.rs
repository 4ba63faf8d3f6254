//! Fuzzes NetStorm's messages (`gradwire_netstorm::wire`) on raw bytes, and the consistency
//! state machines (`gradwire_netstorm::consistency`) on whatever sequence of frames parses.
//!
//! The first input byte picks a mode, the rest is the input:
//! - even: one frame. No parser panics; `parse` agrees with `parse_prefix`, `frame_len`, the
//!   `Packet` view and the typed parser of the frame's kind (the others say "wrong kind"); an
//!   accepted frame is canonical (re-encoding gives the input bytes exactly), within the
//!   bounds (nodes, path lengths, policy size), and a policy rebuilt with `Policy::new` from
//!   its parts is the same policy; its strict prefixes are rejected as truncated, one more
//!   byte as trailing; a chunk header splits off a payload and forwards along its path.
//! - odd: a stream of frames, parsed one after the other with `parse_prefix`, fed to a
//!   scheduler and to one node (TRPs to the scheduler, its answers and the policy messages to
//!   the node, chunks to the node from the peer the next byte names). The state machines may
//!   refuse anything, but never panic.
#![no_main]

use gradwire_netstorm::consistency::{NodeState, Output, Payload, Reply, SchedulerState};
use gradwire_netstorm::wire::{
    frame_len, ChunkHeader, Kind, LinkReport, Message, Packet, Policy, PolicyConfirm, PolicyUpdate,
    RootTree, TopologyRequest, WireError, HEADER_LEN, MAX_NODES, MAX_PATH_LEN, MAX_POLICY_LEN,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Clone)]
struct Sum(u64);

impl Payload for Sum {
    fn accumulate(&mut self, other: &Self) {
        self.0 = self.0.wrapping_add(other.0);
    }
}

fn typed_agree(frame: &[u8], msg: &Result<Message, WireError>) {
    let kind = match msg {
        Ok(m) => Some(m.kind()),
        Err(_) => None,
    };
    let check = |k: Kind, r: Result<Message, WireError>| match (kind, msg) {
        (Some(got), Ok(m)) if got == k => assert_eq!(r.as_ref(), Ok(m)),
        (Some(got), Ok(_)) => assert_eq!(
            r,
            Err(WireError::WrongKind { expected: k, got }),
            "typed parser for {k:?} on a {got:?}"
        ),
        (_, Err(e)) => assert_eq!(r.as_ref(), Err(e)),
        (None, Ok(_)) => unreachable!(),
    };
    check(
        Kind::LinkReport,
        LinkReport::parse(frame).map(Message::from),
    );
    check(
        Kind::TopologyRequest,
        TopologyRequest::parse(frame).map(Message::from),
    );
    check(
        Kind::PolicyUpdate,
        PolicyUpdate::parse(frame).map(Message::from),
    );
    check(
        Kind::PolicyConfirm,
        PolicyConfirm::parse(frame).map(Message::from),
    );
    check(Kind::Chunk, ChunkHeader::parse(frame).map(Message::from));
}

fn one_frame(frame: &[u8]) {
    let msg = Message::parse(frame);
    let prefix = Message::parse_prefix(frame);
    let header = frame_len(frame);
    typed_agree(frame, &msg);
    if let Ok((m, used)) = &prefix {
        assert_eq!(header.as_ref().ok().map(|h| h.1), Some(*used));
        let p = Packet::new_checked(frame).expect("accepted frame has its length");
        assert_eq!(p.frame_len(), *used);
        // Canonical: the accepted prefix re-encodes to itself.
        assert_eq!(m.to_vec().expect("re-encode").as_slice(), &frame[..*used]);
        if *used < frame.len() {
            assert_eq!(msg, Err(WireError::Trailing(frame.len() - used)));
        }
    }
    let Ok(m) = msg else {
        return;
    };
    assert_eq!(m.buffer_len(), frame.len());
    match &m {
        Message::LinkReport(r) => {
            assert!(usize::from(r.from) < MAX_NODES && usize::from(r.to) < MAX_NODES);
            assert!(r.from != r.to && r.samples > 0);
        }
        Message::TopologyRequest(r) => assert!(usize::from(r.node) < MAX_NODES),
        Message::PolicyConfirm(c) => assert!(c.version > 0),
        Message::PolicyUpdate(u) => {
            let p = &u.policy;
            assert!(u.version > 0);
            assert!(p.nodes() >= 1 && usize::from(p.nodes()) <= MAX_NODES);
            assert!(p.encoded_len() <= MAX_POLICY_LEN);
            let rebuilt = Policy::new(p.nodes(), p.trees().to_vec(), p.aux().to_vec())
                .expect("Policy::new accepts a parsed policy");
            assert_eq!(&rebuilt, p);
            for t in p.trees() {
                // Every node walks up to the root.
                for v in 0..p.nodes() {
                    let (mut at, mut steps) = (v, 0);
                    while let Some(up) = t.parent_of(at) {
                        at = up;
                        steps += 1;
                        assert!(steps <= p.nodes(), "cycle in a parsed tree");
                    }
                    assert_eq!(at, t.root);
                }
            }
            for a in p.aux() {
                for path in &a.paths {
                    assert!(path.len() >= 2 && path.len() <= MAX_PATH_LEN);
                    assert_eq!((path[0], path[path.len() - 1]), (a.from, a.to));
                }
            }
        }
        Message::Chunk(h) => {
            let mut with_payload = frame.to_vec();
            with_payload.extend_from_slice(b"payload");
            let (back, rest) = ChunkHeader::split(&with_payload).expect("split");
            assert_eq!((&back, rest), (h, &b"payload"[..]));
            if let Some((next, f)) = h.forwarded() {
                assert_eq!(f.receiver(), Some(next));
                let bytes = f.to_vec().expect("a forwarded header is valid");
                assert_eq!(ChunkHeader::parse(&bytes).expect("reparse"), f);
            }
        }
    }
    for cut in [
        0,
        HEADER_LEN.min(frame.len()),
        frame.len() / 2,
        frame.len() - 1,
    ] {
        if cut < frame.len() {
            assert!(
                matches!(
                    Message::parse(&frame[..cut]),
                    Err(WireError::Truncated { .. })
                ),
                "prefix of {cut} bytes accepted"
            );
        }
    }
    let mut longer = frame.to_vec();
    longer.push(0);
    assert_eq!(Message::parse(&longer), Err(WireError::Trailing(1)));
}

fn state_machines(mut data: &[u8]) {
    let star = Policy::new(
        4,
        vec![RootTree {
            root: 0,
            share: 1,
            parent: vec![None, Some(0), Some(0), Some(0)],
        }],
        vec![],
    )
    .expect("star policy");
    let mut sched = SchedulerState::new(star.clone());
    let mut node = NodeState::<Sum>::new(1, 0);
    let _ = node.begin_round(0);
    while let Ok((m, used)) = Message::parse_prefix(data) {
        data = &data[used..];
        let peer = data.first().copied().unwrap_or(0) % 8;
        let outs = match m {
            Message::TopologyRequest(r) => match sched.on_request(&r) {
                Ok(reply) => node.on_reply(reply),
                Err(_) => continue,
            },
            Message::PolicyUpdate(u) => {
                let _ = sched.install(u.policy.clone());
                node.on_reply(Reply::Update(u))
            }
            Message::PolicyConfirm(c) => node.on_reply(Reply::Confirm(c)),
            Message::Chunk(h) => node.on_chunk(u16::from(peer), h, Sum(1)),
            Message::LinkReport(_) => continue,
        };
        for o in outs.into_iter().flatten() {
            match o {
                Output::Adopted { .. } => {
                    let plan = node
                        .policy()
                        .map(|(_, p)| p.roots().map(|r| (r, 0, Sum(1))).collect())
                        .unwrap_or_default();
                    let _ = node.contribute(plan);
                }
                Output::RoundDone { round } => {
                    let _ = node.begin_round(round.wrapping_add(1));
                }
                Output::Request(_) | Output::Send { .. } | Output::Result { .. } => {}
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        one_frame(rest);
    } else {
        state_machines(rest);
    }
});
