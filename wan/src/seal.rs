//! Authenticated scheduler connections (NetStorm jobs with a secret).
//!
//! A node's connection to the scheduler opens with a hello: the node's id and a random
//! nonce; the scheduler answers with its own nonce. Both ends then derive the connection's
//! keys from the job key, both nonces, both members' X25519 public keys (published, proven,
//! in the rendezvous table) and the two members' X25519 agreement
//! (`gradwire_proto::auth::JobKey::session`): only that node and the node serving the
//! scheduler (node 0) can compute them, and every connection gets its own. Every NetStorm
//! frame is then followed by a 16-byte tag (`CtrlSealer`: HMAC-SHA256 over an implicit
//! sequence number and the frame), so a frame from anyone else, altered, replayed or
//! reordered is refused and the connection dropped. The frames themselves are unchanged
//! (the model-checked wire format of `gradwire-netstorm`).
//!
//! ```text
//! node -> scheduler:  node (u16 BE) | client nonce (32 B)
//! scheduler -> node:  server nonce (32 B)
//! then every frame:   frame | tag (16 B)
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use gradwire_proto::auth::{
    CtrlOpener, CtrlSealer, JobKey, MemberEntry, MemberKey, Role, Transcript, CTRL_TAG_LEN,
    NONCE_LEN,
};

/// Bytes of the node's hello.
pub const HELLO_LEN: usize = 2 + NONCE_LEN;
/// Bytes of a frame's tag.
pub const TAG_LEN: usize = CTRL_TAG_LEN;
/// The node that serves the scheduler in an authenticated job: its member key is the
/// scheduler's.
pub const SCHEDULER_NODE: u16 = 0;

/// What a node or the scheduler needs to authenticate scheduler connections: the job key,
/// its own member key and every node's published entry.
#[derive(Clone)]
pub struct ControlAuth {
    key: Arc<JobKey>,
    job: u32,
    member: Arc<MemberKey>,
    members: Arc<Vec<MemberEntry>>,
}

impl std::fmt::Debug for ControlAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ControlAuth(job {}, {} members, <keys redacted>)",
            self.job,
            self.members.len()
        )
    }
}

/// The tags of one authenticated connection, both directions.
pub struct Seal {
    sealer: CtrlSealer,
    opener: CtrlOpener,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seal(<redacted>)")
    }
}

impl Seal {
    /// The tag of the next frame sent.
    pub fn tag(&mut self, frame: &[u8]) -> [u8; TAG_LEN] {
        self.sealer.seal(frame)
    }

    /// Whether `tag` is the next received frame's (constant time).
    pub fn check(&mut self, frame: &[u8], tag: &[u8]) -> bool {
        self.opener.open(frame, tag)
    }
}

fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    gradwire_proto::auth::random(&ring::rand::SystemRandom::new()).map_err(std::io::Error::other)
}

impl ControlAuth {
    /// `member` is this node's key (the endpoint's), `members[n]` node n's published entry.
    pub fn new(
        key: Arc<JobKey>,
        job: u32,
        member: Arc<MemberKey>,
        members: Vec<MemberEntry>,
    ) -> ControlAuth {
        ControlAuth {
            key,
            job,
            member,
            members: Arc::new(members),
        }
    }

    /// The connection's keys for `node`, with this side's `peer` entry (the scheduler's for
    /// a node, the node's for the scheduler).
    fn seal(
        &self,
        node: u16,
        peer: u16,
        client_nonce: [u8; NONCE_LEN],
        server_nonce: [u8; NONCE_LEN],
        role: Role,
    ) -> Result<Seal, String> {
        let entry = |n: u16| {
            self.members
                .get(usize::from(n))
                .ok_or_else(|| format!("node {n} is beyond the job's {}", self.members.len()))
        };
        let t = Transcript {
            client_nonce,
            server_nonce,
            client_public: entry(node)?.public,
            server_public: entry(SCHEDULER_NODE)?.public,
        };
        let shared = self
            .member
            .agree(&self.key, self.job, peer, entry(peer)?)
            .map_err(|e| format!("node {peer}'s member key: {e}"))?;
        let (sealer, opener) = self.key.session(&t, &shared).control(role);
        Ok(Seal { sealer, opener })
    }

    /// The node's side, on a fresh connection (blocking; the stream's timeouts bound it):
    /// sends the hello, reads the scheduler's nonce.
    pub fn client(&self, s: &mut TcpStream, node: u16) -> std::io::Result<Seal> {
        let client_nonce = nonce()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..2].copy_from_slice(&node.to_be_bytes());
        hello[2..].copy_from_slice(&client_nonce);
        s.write_all(&hello)?;
        let mut server_nonce = [0u8; NONCE_LEN];
        s.read_exact(&mut server_nonce)?;
        self.seal(
            node,
            SCHEDULER_NODE,
            client_nonce,
            server_nonce,
            Role::Client,
        )
        .map_err(std::io::Error::other)
    }

    /// The scheduler's side, given the node's hello: the node it names, the nonce to send
    /// back and the connection's seal. Refuses a node beyond the job or one whose entry
    /// does not verify.
    pub fn server(&self, hello: &[u8; HELLO_LEN]) -> Result<(u16, [u8; NONCE_LEN], Seal), String> {
        let node = u16::from_be_bytes([hello[0], hello[1]]);
        let mut client_nonce = [0u8; NONCE_LEN];
        client_nonce.copy_from_slice(&hello[2..]);
        let server_nonce = nonce().map_err(|e| e.to_string())?;
        let seal = self.seal(node, node, client_nonce, server_nonce, Role::Server)?;
        Ok((node, server_nonce, seal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_proto::auth::JobSecret;

    fn job(n: usize, secret: u8) -> Vec<ControlAuth> {
        let key = Arc::new(JobKey::new(&JobSecret::new(vec![secret; 32]).unwrap()));
        let rng = ring::rand::SystemRandom::new();
        let keys: Vec<Arc<MemberKey>> = (0..n)
            .map(|_| Arc::new(MemberKey::generate(&rng).unwrap()))
            .collect();
        let entries: Vec<MemberEntry> = (0..n).map(|r| keys[r].entry(&key, 3, r as u16)).collect();
        keys.into_iter()
            .map(|k| ControlAuth::new(key.clone(), 3, k, entries.clone()))
            .collect()
    }

    #[test]
    fn a_node_and_the_scheduler_agree_and_nobody_else_can_speak_for_the_node() {
        let nodes = job(3, 1);
        let hello = |node: u16| {
            let mut h = [0u8; HELLO_LEN];
            h[..2].copy_from_slice(&node.to_be_bytes());
            h[2..].copy_from_slice(&[9; NONCE_LEN]);
            h
        };
        let (node, server_nonce, mut sched) = nodes[0].server(&hello(1)).unwrap();
        assert_eq!(node, 1);
        let mut real = nodes[1]
            .seal(
                1,
                SCHEDULER_NODE,
                [9; NONCE_LEN],
                server_nonce,
                Role::Client,
            )
            .unwrap();
        let tag = real.tag(b"frame");
        assert!(sched.check(b"frame", &tag));
        let back = sched.tag(b"answer");
        assert!(real.check(b"answer", &back));
        // Node 2 holds the secret and every entry, and says it is node 1.
        let (_, n2, mut sched2) = nodes[0].server(&hello(1)).unwrap();
        let mut fake = nodes[2]
            .seal(1, SCHEDULER_NODE, [9; NONCE_LEN], n2, Role::Client)
            .unwrap();
        assert!(!sched2.check(b"frame", &fake.tag(b"frame")));
        // A node beyond the job is refused at its hello.
        assert!(nodes[0].server(&hello(7)).is_err());
        // Another secret: entries do not verify.
        let other = job(3, 2);
        assert!(other[0].seal(1, 1, [0; 32], [0; 32], Role::Server).is_ok());
        let mixed = ControlAuth {
            members: nodes[0].members.clone(),
            ..other[0].clone()
        };
        assert!(mixed.server(&hello(1)).is_err());
    }
}
