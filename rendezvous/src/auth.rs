//! The authenticated rendezvous's handshake (jobs with a secret), with no I/O.
//!
//! ```text
//! joiner -> rank 0:  Hello     (nonce Nc, ephemeral X25519 key Pc)
//! rank 0 -> joiner:  Challenge (nonce Ns, ephemeral X25519 key Ps)
//! joiner -> rank 0:  Sealed    (client proof over T, the Join, its tag)
//! rank 0 -> joiner:  Sealed    (server proof over T, the Table, its tag)    or a Refuse
//! ```
//!
//! `T = Nc || Ns || Pc || Ps`; proofs and keys are the control channel's
//! (`gradwire_proto::auth`: `JobKey::client_proof`/`server_proof`, `JobKey::session` over
//! the ephemeral agreement, `CtrlSealer` tags), so the joiner proves the secret before rank
//! 0 says anything about the job (its Challenge is random), and rank 0 proves it with the
//! table: a fake rank 0 without the secret cannot make a table a rank accepts, and nobody on
//! the path can change a Join or a Table without the tag failing.

use std::sync::Arc;

use gradwire_proto::auth::{random, CtrlOpener, CtrlSealer, Ephemeral, JobKey, Role, Transcript};

use crate::wire::{self, Greeting, Kind, Sealed, WireError};

/// Why a handshake step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The OS's random source failed.
    #[error("the system random number generator failed: check that getrandom(2) works")]
    Random,
    /// The peer's ephemeral key is unusable.
    #[error("the peer's X25519 key is invalid")]
    BadKey,
    /// The peer's proof of the secret, or its frame's tag, does not verify.
    #[error("the peer does not hold this job's secret (its proof or tag does not verify)")]
    NotAuthenticated,
    /// A frame could not be encoded.
    #[error("{0}")]
    Wire(#[from] WireError),
}

fn greeting() -> Result<(Ephemeral, Greeting), HandshakeError> {
    let rng = ring::rand::SystemRandom::new();
    let nonce = random(&rng).map_err(|_| HandshakeError::Random)?;
    let eph = Ephemeral::generate(&rng).map_err(|_| HandshakeError::Random)?;
    let public = *eph.public();
    Ok((eph, Greeting { nonce, public }))
}

fn keys(
    key: &JobKey,
    eph: Ephemeral,
    t: &Transcript,
    peer: &[u8; 32],
    role: Role,
) -> Result<(CtrlSealer, CtrlOpener), HandshakeError> {
    let shared = eph.agree(peer).map_err(|_| HandshakeError::BadKey)?;
    Ok(key.session(t, &shared).control(role))
}

/// A joiner between its Hello and rank 0's Challenge.
pub struct ClientHello {
    key: Arc<JobKey>,
    eph: Ephemeral,
    hello: Greeting,
}

/// A joiner that sent its sealed Join and waits for the table.
pub struct ClientWait {
    key: Arc<JobKey>,
    t: Transcript,
    opener: CtrlOpener,
}

impl ClientHello {
    /// A fresh Hello: the handshake state and the frame to send.
    pub fn start(key: Arc<JobKey>) -> Result<(ClientHello, Vec<u8>), HandshakeError> {
        let (eph, hello) = greeting()?;
        let frame = wire::encode_greeting(Kind::Hello, &hello)?;
        Ok((ClientHello { key, eph, hello }, frame))
    }

    /// Rank 0's Challenge: the sealed Join frame to send (`join`: the encoded Join).
    pub fn answer(
        self,
        challenge: &Greeting,
        join: &[u8],
    ) -> Result<(ClientWait, Vec<u8>), HandshakeError> {
        let t = Transcript {
            client_nonce: self.hello.nonce,
            server_nonce: challenge.nonce,
            client_public: self.hello.public,
            server_public: challenge.public,
        };
        let (mut sealer, opener) = keys(&self.key, self.eph, &t, &challenge.public, Role::Client)?;
        let frame = wire::encode_sealed(&Sealed {
            proof: self.key.client_proof(&t),
            inner: join.to_vec(),
            tag: sealer.seal(join),
        })?;
        Ok((
            ClientWait {
                key: self.key,
                t,
                opener,
            },
            frame,
        ))
    }
}

impl ClientWait {
    /// Rank 0's sealed Table: its inner frame, once rank 0's proof and the tag verified.
    pub fn open(mut self, sealed: Sealed) -> Result<Vec<u8>, HandshakeError> {
        if !self.key.verify_server_proof(&self.t, &sealed.proof)
            || !self.opener.open(&sealed.inner, &sealed.tag)
        {
            return Err(HandshakeError::NotAuthenticated);
        }
        Ok(sealed.inner)
    }
}

/// Rank 0's side of one connection after its Challenge.
pub struct ServerChallenged {
    key: Arc<JobKey>,
    t: Transcript,
    sealer: CtrlSealer,
    opener: CtrlOpener,
}

/// Rank 0's side of a connection whose Join verified: seals the table for it.
pub struct ServerJoined {
    key: Arc<JobKey>,
    t: Transcript,
    sealer: CtrlSealer,
}

impl std::fmt::Debug for ClientHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientHello(<keys redacted>)")
    }
}

impl std::fmt::Debug for ClientWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientWait(<keys redacted>)")
    }
}

impl std::fmt::Debug for ServerChallenged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerChallenged(<keys redacted>)")
    }
}

impl std::fmt::Debug for ServerJoined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerJoined(<keys redacted>)")
    }
}

impl ServerChallenged {
    /// A joiner's Hello: the state and the Challenge to send. Nothing in the Challenge
    /// depends on the job: a stranger learns nothing from it.
    pub fn new(
        key: Arc<JobKey>,
        hello: &Greeting,
    ) -> Result<(ServerChallenged, Vec<u8>), HandshakeError> {
        let (eph, challenge) = greeting()?;
        let t = Transcript {
            client_nonce: hello.nonce,
            server_nonce: challenge.nonce,
            client_public: hello.public,
            server_public: challenge.public,
        };
        let (sealer, opener) = keys(&key, eph, &t, &hello.public, Role::Server)?;
        let frame = wire::encode_greeting(Kind::Challenge, &challenge)?;
        Ok((
            ServerChallenged {
                key,
                t,
                sealer,
                opener,
            },
            frame,
        ))
    }

    /// The joiner's sealed Join: its inner frame, once the joiner's proof and the tag
    /// verified (constant time).
    pub fn open(mut self, sealed: Sealed) -> Result<(ServerJoined, Vec<u8>), HandshakeError> {
        if !self.key.verify_client_proof(&self.t, &sealed.proof)
            || !self.opener.open(&sealed.inner, &sealed.tag)
        {
            return Err(HandshakeError::NotAuthenticated);
        }
        Ok((
            ServerJoined {
                key: self.key,
                t: self.t,
                sealer: self.sealer,
            },
            sealed.inner,
        ))
    }
}

impl ServerJoined {
    /// The table frame sealed for this connection, with rank 0's proof.
    pub fn seal(mut self, table: &[u8]) -> Result<Vec<u8>, HandshakeError> {
        Ok(wire::encode_sealed(&Sealed {
            proof: self.key.server_proof(&self.t),
            inner: table.to_vec(),
            tag: self.sealer.seal(table),
        })?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_proto::auth::JobSecret;

    fn key(fill: u8) -> Arc<JobKey> {
        Arc::new(JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap()))
    }

    fn hs(client: u8, server: u8) -> Result<Vec<u8>, HandshakeError> {
        let join = wire::encode_join(&wire::Join {
            job: 1,
            rank: 1,
            world: 2,
            payload: b"me".to_vec(),
        })
        .unwrap();
        let (c, hello) = ClientHello::start(key(client))?;
        let hello = wire::decode_greeting(&hello, Kind::Hello).unwrap();
        let (s, challenge) = ServerChallenged::new(key(server), &hello)?;
        let challenge = wire::decode_greeting(&challenge, Kind::Challenge).unwrap();
        let (c, sealed_join) = c.answer(&challenge, &join)?;
        let (s, got) = s.open(wire::decode_sealed(&sealed_join, 64).unwrap())?;
        assert_eq!(got, join);
        let table = wire::encode_table(&wire::Table {
            job: 1,
            payloads: vec![b"r0".to_vec(), b"me".to_vec()],
        })
        .unwrap();
        let sealed_table = s.seal(&table)?;
        c.open(wire::decode_sealed(&sealed_table, 64).unwrap())
    }

    #[test]
    fn both_ends_with_the_secret_exchange_join_and_table() {
        assert!(hs(1, 1).is_ok());
    }

    #[test]
    fn either_end_without_the_secret_is_refused() {
        assert_eq!(hs(1, 2), Err(HandshakeError::NotAuthenticated));
        assert_eq!(hs(2, 1), Err(HandshakeError::NotAuthenticated));
    }
}
