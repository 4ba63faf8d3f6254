//! The control connection's opening handshake, as two state machines with no I/O.
//!
//! Every control connection starts with it, authenticated or not, so a receiver learns what
//! the sender expects before it keeps any state for it, and a version-1 peer or a stray
//! client fails here instead of in the middle of a flow.
//!
//! ```text
//!  plain job                          authenticated job (both ends hold the job secret)
//!  client            server           client                              server
//!  Hello{false,Nc,0} ->               Hello{true,Nc,Pc} ->
//!         <- Welcome{false,0}                        <- Challenge{Ns,Ps}
//!                                     (X25519, session keys)
//!                                     Proof{client_proof(T)} ->
//!                                                                 (verify; X25519, keys)
//!                                     =========== every later frame is sealed ===========
//!                                                    <- Welcome{true, server_proof(T)}
//!                                     (verify)
//! ```
//!
//! `T` is the transcript (both nonces, both ephemeral X25519 public keys,
//! [`crate::auth::Transcript`]); the session keys need the job secret and the X25519 shared
//! secret, so only the two ends of this connection have them. The client proves the secret
//! first and the server only then: a stranger at the control port gets no value it could test
//! guesses of the secret against (only someone who impersonates the receiver gets the
//! client's proof). The proofs use distinct labels per direction, so a server's proof
//! replayed as a client's fails. A refusal is sent to the peer as [`CtrlMsg::Abort`] with code
//! [`ABORT_AUTH`] and the reason, unsealed, and the connection is closed. Any message out of
//! place is an error that names it.
//!
//! The caller does the I/O and draws the randomness (nonces, ephemeral keys): it sends what
//! each [`Step`] says, and once the client has sent its `Proof` it seals every frame it sends
//! and verifies every frame it receives (with [`ClientHandshake::session`]'s control keys)
//! before handing it to [`ClientHandshake::on_msg`]; the server seals from its `Welcome` on.

use crate::auth::{Ephemeral, JobKey, SessionKeys, Transcript, NONCE_LEN, PUBLIC_LEN};
use crate::message::CtrlMsg;

/// `Abort` code of a refusal at the handshake (authentication mode or secret mismatch).
pub const ABORT_AUTH: u8 = 6;

/// Why one end refuses the other at the handshake. The [`Refusal::reason`] is what the
/// refused peer is told and shows its user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Server with a job secret, client without one.
    UnauthenticatedPeer,
    /// Server without a job secret, client with one.
    AuthenticationUnavailable,
    /// The client's proof does not verify: the client holds another secret (or replayed a
    /// proof from elsewhere).
    SecretMismatch,
    /// Client: the server's proof (in its sealed `Welcome`) does not verify.
    ServerNotProven,
    /// Client with a secret: the server offered an unauthenticated connection instead of a
    /// challenge.
    Downgrade,
    /// The peer's ephemeral X25519 public key is unusable (a low-order point).
    BadPublicKey,
    /// Plain server that published a link token: the client's `Hello` does not carry it
    /// (a process that is not the job's rank for this link, or a scan).
    LinkToken,
}

impl Refusal {
    /// What the refused peer is told: what happened and what to do.
    pub const fn reason(self) -> &'static str {
        match self {
            Refusal::UnauthenticatedPeer => {
                "this receiver requires an authenticated job: start the sender with the job's \
                 secret (GRADWIRE_JOB_SECRET or --secret-file)"
            }
            Refusal::AuthenticationUnavailable => {
                "this receiver runs without a job secret and accepts only unauthenticated \
                 senders: start the receiver with the job's secret (GRADWIRE_JOB_SECRET or \
                 --secret-file), or the sender without one"
            }
            Refusal::SecretMismatch => {
                "job secret mismatch: the sender's proof does not verify with the receiver's \
                 job secret"
            }
            Refusal::ServerNotProven => {
                "the receiver could not prove the job secret: wrong secret, or not this job's \
                 receiver"
            }
            Refusal::Downgrade => {
                "the receiver offered an unauthenticated connection to a sender that holds a \
                 job secret: start the receiver with the job's secret too"
            }
            Refusal::BadPublicKey => {
                "the peer's ephemeral X25519 public key is invalid (a low-order point): not a \
                 gradwire peer, or a broken one"
            }
            Refusal::LinkToken => {
                "this link's listener takes only the rank named in the job's endpoint table: \
                 the Hello does not carry the link's token (is this process that rank, with \
                 the table of this run?)"
            }
        }
    }

    /// The `Abort` that tells the peer.
    pub fn abort(self) -> CtrlMsg {
        CtrlMsg::Abort {
            code: ABORT_AUTH,
            reason: self.reason().to_owned(),
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// We refuse the peer: send it [`Refusal::abort`], then close.
    #[error("{}", .0.reason())]
    Refused(Refusal),
    /// The peer sent `Abort` (code [`ABORT_AUTH`]: it refused us, the reason says why).
    #[error("peer aborted the handshake (code {code}): {reason}")]
    PeerAborted {
        /// The peer's code.
        code: u8,
        /// The peer's reason.
        reason: String,
    },
    /// The peer sent a message that has no place here: not a gradwire peer of this protocol
    /// version, or a broken one. Close.
    #[error("handshake: expected {expected}, got {got}")]
    Unexpected {
        /// What this end was waiting for.
        expected: &'static str,
        /// What arrived.
        got: &'static str,
    },
}

impl HandshakeError {
    /// The `Abort` to send the peer before closing, if any (refusals only: a peer that broke
    /// the protocol or aborted itself is not answered).
    pub fn abort(&self) -> Option<CtrlMsg> {
        match self {
            HandshakeError::Refused(r) => Some(r.abort()),
            _ => None,
        }
    }
}

/// What the caller does after [`ClientHandshake::on_msg`] or [`ServerHandshake::on_msg`].
#[derive(Debug)]
pub enum Step {
    /// Send this message (unsealed) and feed the peer's next message back in. A client of an
    /// authenticated job that is told to send its `Proof` seals everything after it: see
    /// [`ClientHandshake::session`].
    Send(CtrlMsg),
    /// The handshake is complete.
    Established {
        /// Send this first (the server's `Welcome`; sealed when `session` is set).
        send: Option<CtrlMsg>,
        /// The connection's keys when it is authenticated: every later frame is sealed with
        /// `session.control(role)`, and flows derive their data keys from it. `None` for a
        /// plain connection.
        session: Option<SessionKeys>,
    },
}

/// Name of a message's kind, for errors: the flow names, with the handshake's messages told
/// apart by whether they are authenticated.
pub fn msg_name(msg: &CtrlMsg) -> &'static str {
    match msg {
        CtrlMsg::Hello { auth: false, .. } => "Hello (unauthenticated)",
        CtrlMsg::Hello { auth: true, .. } => "Hello (authenticated)",
        CtrlMsg::Welcome { auth: false, .. } => "Welcome (unauthenticated)",
        CtrlMsg::Welcome { auth: true, .. } => "Welcome (authenticated)",
        other => crate::flow::msg_name(other),
    }
}

/// An `Abort` from the peer, or the message out of place.
fn unexpected(expected: &'static str, got: CtrlMsg) -> HandshakeError {
    match got {
        CtrlMsg::Abort { code, reason } => HandshakeError::PeerAborted { code, reason },
        other => HandshakeError::Unexpected {
            expected,
            got: msg_name(&other),
        },
    }
}

/// Where the client is.
#[derive(Debug)]
enum ClientState {
    /// Hello sent, waiting for `Welcome` (plain) or `Challenge` (authenticated).
    AwaitAnswer(Option<Ephemeral>),
    /// Proof sent; waiting for the sealed `Welcome{auth: true}` with the server's proof.
    AwaitWelcome(SessionKeys, Box<Transcript>),
    /// Established or failed: nothing more is accepted.
    Finished,
}

/// The connecting end (the sender of tensors).
#[derive(Debug)]
pub struct ClientHandshake<'k> {
    key: Option<&'k JobKey>,
    nonce: [u8; NONCE_LEN],
    public: [u8; PUBLIC_LEN],
    state: ClientState,
}

impl<'k> ClientHandshake<'k> {
    /// A client that holds `key` (authenticated) or none (plain), with a fresh random `nonce`
    /// and ephemeral key (both drawn by the caller from the OS; the ephemeral is used only
    /// with a key), and the `Hello` to send first.
    pub fn new(
        key: Option<&'k JobKey>,
        nonce: [u8; NONCE_LEN],
        ephemeral: Ephemeral,
    ) -> (ClientHandshake<'k>, CtrlMsg) {
        let (public, ephemeral) = match key {
            Some(_) => (*ephemeral.public(), Some(ephemeral)),
            None => ([0; PUBLIC_LEN], None),
        };
        let hello = CtrlMsg::Hello {
            auth: key.is_some(),
            nonce,
            public,
        };
        (
            ClientHandshake {
                key,
                nonce,
                public,
                state: ClientState::AwaitAnswer(ephemeral),
            },
            hello,
        )
    }

    /// After the `Proof` has been sent: the connection's keys. From then on every frame is
    /// sealed in both directions, the server's `Welcome` first: build the sealer and opener
    /// with `session.control(Role::Client)` once, and verify each frame before `on_msg`.
    pub fn session(&self) -> Option<&SessionKeys> {
        match &self.state {
            ClientState::AwaitWelcome(s, _) => Some(s),
            _ => None,
        }
    }

    /// The server's next message (verified, once [`Self::session`] is set).
    pub fn on_msg(&mut self, msg: CtrlMsg) -> Result<Step, HandshakeError> {
        let state = std::mem::replace(&mut self.state, ClientState::Finished);
        match (state, self.key, msg) {
            (ClientState::AwaitAnswer(_), None, CtrlMsg::Welcome { auth: false, .. }) => {
                Ok(Step::Established {
                    send: None,
                    session: None,
                })
            }
            (
                ClientState::AwaitAnswer(Some(ephemeral)),
                Some(key),
                CtrlMsg::Challenge { nonce, public },
            ) => {
                let t = Transcript {
                    client_nonce: self.nonce,
                    server_nonce: nonce,
                    client_public: self.public,
                    server_public: public,
                };
                let shared = ephemeral
                    .agree(&public)
                    .map_err(|_| HandshakeError::Refused(Refusal::BadPublicKey))?;
                let proof = key.client_proof(&t);
                self.state = ClientState::AwaitWelcome(key.session(&t, &shared), Box::new(t));
                Ok(Step::Send(CtrlMsg::Proof { proof }))
            }
            (ClientState::AwaitAnswer(_), Some(_), CtrlMsg::Welcome { auth: false, .. }) => {
                Err(HandshakeError::Refused(Refusal::Downgrade))
            }
            (ClientState::AwaitAnswer(_), None, msg) => Err(unexpected("Welcome", msg)),
            (ClientState::AwaitAnswer(_), Some(_), msg) => Err(unexpected("Challenge", msg)),
            (
                ClientState::AwaitWelcome(session, t),
                Some(key),
                CtrlMsg::Welcome { auth: true, proof },
            ) => {
                if !key.verify_server_proof(&t, &proof) {
                    return Err(HandshakeError::Refused(Refusal::ServerNotProven));
                }
                Ok(Step::Established {
                    send: None,
                    session: Some(session),
                })
            }
            (ClientState::AwaitWelcome(..), _, msg) => Err(unexpected("sealed Welcome", msg)),
            (ClientState::Finished, _, msg) => Err(unexpected("nothing (handshake over)", msg)),
        }
    }
}

/// Where the server is.
#[derive(Debug)]
enum ServerState {
    /// Waiting for the client's `Hello`.
    AwaitHello(Ephemeral),
    /// Challenge sent; waiting for the client's `Proof`.
    AwaitProof(Ephemeral, Transcript),
    /// Established or failed.
    Finished,
}

/// The accepting end (the receiver of tensors).
#[derive(Debug)]
pub struct ServerHandshake<'k> {
    key: Option<&'k JobKey>,
    nonce: [u8; NONCE_LEN],
    /// Plain only: the nonce a client's `Hello` must carry ([`ServerHandshake::with_link_token`]).
    token: Option<[u8; NONCE_LEN]>,
    state: ServerState,
}

impl<'k> ServerHandshake<'k> {
    /// A server that requires `key` (authenticated) or runs without one (plain), with a fresh
    /// random `nonce` and ephemeral key (drawn by the caller from the OS; the ephemeral is
    /// used only with a key). It waits for the client's `Hello`.
    pub fn new(
        key: Option<&'k JobKey>,
        nonce: [u8; NONCE_LEN],
        ephemeral: Ephemeral,
    ) -> ServerHandshake<'k> {
        ServerHandshake {
            key,
            nonce,
            token: None,
            state: ServerState::AwaitHello(ephemeral),
        }
    }

    /// A plain server for one link whose two ends share `token` through the job's endpoint
    /// table: a plain `Hello` must carry it as its nonce, or it is refused
    /// ([`Refusal::LinkToken`]) before the connection counts as established. Without a job
    /// secret this is what tells the job's rank from another process at its address. An
    /// authenticated server ignores it (the proofs decide).
    pub fn with_link_token(mut self, token: [u8; NONCE_LEN]) -> ServerHandshake<'k> {
        self.token = Some(token);
        self
    }

    /// The client's next message.
    pub fn on_msg(&mut self, msg: CtrlMsg) -> Result<Step, HandshakeError> {
        let state = std::mem::replace(&mut self.state, ServerState::Finished);
        match (state, self.key, msg) {
            (
                ServerState::AwaitHello(_),
                None,
                CtrlMsg::Hello {
                    auth: false, nonce, ..
                },
            ) => {
                if let Some(t) = &self.token {
                    // Constant time: a wrong guess says nothing about how close it was.
                    if !bool::from(subtle::ConstantTimeEq::ct_eq(&t[..], &nonce[..])) {
                        return Err(HandshakeError::Refused(Refusal::LinkToken));
                    }
                }
                Ok(Step::Established {
                    send: Some(CtrlMsg::Welcome {
                        auth: false,
                        proof: [0; crate::auth::PROOF_LEN],
                    }),
                    session: None,
                })
            }
            (ServerState::AwaitHello(_), None, CtrlMsg::Hello { auth: true, .. }) => {
                Err(HandshakeError::Refused(Refusal::AuthenticationUnavailable))
            }
            (ServerState::AwaitHello(_), Some(_), CtrlMsg::Hello { auth: false, .. }) => {
                Err(HandshakeError::Refused(Refusal::UnauthenticatedPeer))
            }
            (
                ServerState::AwaitHello(ephemeral),
                Some(_),
                CtrlMsg::Hello {
                    auth: true,
                    nonce,
                    public,
                },
            ) => {
                let t = Transcript {
                    client_nonce: nonce,
                    server_nonce: self.nonce,
                    client_public: public,
                    server_public: *ephemeral.public(),
                };
                self.state = ServerState::AwaitProof(ephemeral, t);
                Ok(Step::Send(CtrlMsg::Challenge {
                    nonce: self.nonce,
                    public: t.server_public,
                }))
            }
            (ServerState::AwaitHello(_), _, msg) => Err(unexpected("Hello", msg)),
            (ServerState::AwaitProof(ephemeral, t), Some(key), CtrlMsg::Proof { proof }) => {
                if !key.verify_client_proof(&t, &proof) {
                    return Err(HandshakeError::Refused(Refusal::SecretMismatch));
                }
                let shared = ephemeral
                    .agree(&t.client_public)
                    .map_err(|_| HandshakeError::Refused(Refusal::BadPublicKey))?;
                Ok(Step::Established {
                    send: Some(CtrlMsg::Welcome {
                        auth: true,
                        proof: key.server_proof(&t),
                    }),
                    session: Some(key.session(&t, &shared)),
                })
            }
            (ServerState::AwaitProof(..), _, msg) => Err(unexpected("Proof", msg)),
            (ServerState::Finished, _, msg) => Err(unexpected("nothing (handshake over)", msg)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::auth::{JobSecret, Role, PROOF_LEN};

    const NC: [u8; NONCE_LEN] = [0xC1; NONCE_LEN];
    const NS: [u8; NONCE_LEN] = [0x5E; NONCE_LEN];
    const ZERO: [u8; 32] = [0; 32];

    fn key(fill: u8) -> JobKey {
        JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap())
    }

    fn eph() -> Ephemeral {
        Ephemeral::generate(&ring::rand::SystemRandom::new()).unwrap()
    }

    /// One side's end of a handshake: its session (None: plain), or its error.
    type Outcome = Result<Option<SessionKeys>, HandshakeError>;

    /// Feeds each message of one side to the other until both are established or one fails.
    /// Returns (client outcome, server outcome, messages exchanged in order).
    fn run(ck: Option<&JobKey>, sk: Option<&JobKey>) -> (Outcome, Outcome, Vec<CtrlMsg>) {
        let (mut client, hello) = ClientHandshake::new(ck, NC, eph());
        let mut server = ServerHandshake::new(sk, NS, eph());
        let mut wire = vec![hello.clone()];
        let mut to_server = Some(hello);
        let mut to_client = None;
        let (mut cres, mut sres) = (None, None);
        for _ in 0..8 {
            if let Some(m) = to_server.take() {
                match server.on_msg(m) {
                    Ok(Step::Send(r)) => to_client = Some(r),
                    Ok(Step::Established { send, session }) => {
                        to_client = send;
                        sres = Some(Ok(session));
                    }
                    Err(e) => {
                        to_client = e.abort();
                        sres = Some(Err(e));
                    }
                }
                wire.extend(to_client.clone());
            } else if let Some(m) = to_client.take() {
                match client.on_msg(m) {
                    Ok(Step::Send(r)) => to_server = Some(r),
                    Ok(Step::Established { send, session }) => {
                        assert!(send.is_none(), "a client ends by receiving");
                        cres = Some(Ok(session));
                    }
                    Err(e) => {
                        to_server = e.abort();
                        cres = Some(Err(e));
                    }
                }
                wire.extend(to_server.clone());
            } else {
                break;
            }
        }
        (
            cres.expect("client finished"),
            sres.expect("server finished"),
            wire,
        )
    }

    /// Whether a frame sealed by the client opens at the server and the reverse.
    fn same_session(c: &SessionKeys, s: &SessionKeys) -> bool {
        let (mut ctx, mut crx) = c.control(Role::Client);
        let (mut stx, mut srx) = s.control(Role::Server);
        let t = stx.seal(b"welcome");
        let down = crx.open(b"welcome", &t);
        let t = ctx.seal(b"flow start");
        down && srx.open(b"flow start", &t)
    }

    /// The transcript of a server with nonce NS and public `ps` answering `Hello{NC, pc}`.
    fn transcript(pc: [u8; 32], ps: [u8; 32]) -> Transcript {
        Transcript {
            client_nonce: NC,
            server_nonce: NS,
            client_public: pc,
            server_public: ps,
        }
    }

    #[test]
    fn a_plain_link_token_admits_only_the_hello_that_carries_it() {
        let hello = |nonce| CtrlMsg::Hello {
            auth: false,
            nonce,
            public: ZERO,
        };
        let token = [0x5a; NONCE_LEN];
        let mut near = token;
        near[NONCE_LEN - 1] ^= 1;
        for wrong in [NC, near, ZERO] {
            let mut s = ServerHandshake::new(None, NS, eph()).with_link_token(token);
            assert!(matches!(
                s.on_msg(hello(wrong)),
                Err(HandshakeError::Refused(Refusal::LinkToken))
            ));
        }
        let mut s = ServerHandshake::new(None, NS, eph()).with_link_token(token);
        assert!(matches!(
            s.on_msg(hello(token)),
            Ok(Step::Established { session: None, .. })
        ));
        // An authenticated server goes by the proofs: the token plays no part.
        let key = key(1);
        let mut s = ServerHandshake::new(Some(&key), NS, eph()).with_link_token(token);
        let m = CtrlMsg::Hello {
            auth: true,
            nonce: NC,
            public: *eph().public(),
        };
        assert!(matches!(
            s.on_msg(m),
            Ok(Step::Send(CtrlMsg::Challenge { .. }))
        ));
    }

    #[test]
    fn plain_both_ends() {
        let (c, s, wire) = run(None, None);
        assert!(c.unwrap().is_none());
        assert!(s.unwrap().is_none());
        assert_eq!(
            wire,
            vec![
                CtrlMsg::Hello {
                    auth: false,
                    nonce: NC,
                    public: ZERO
                },
                CtrlMsg::Welcome {
                    auth: false,
                    proof: ZERO
                }
            ]
        );
    }

    #[test]
    fn authenticated_both_ends_share_session_keys_and_prove_in_order() {
        let k = key(1);
        let k2 = key(1);
        let (c, s, wire) = run(Some(&k), Some(&k2));
        let (cs, ss) = (c.unwrap().unwrap(), s.unwrap().unwrap());
        assert_eq!(wire.len(), 4);
        let CtrlMsg::Hello {
            auth: true,
            nonce: NC,
            public: pc,
        } = wire[0]
        else {
            panic!("{:?}", wire[0])
        };
        let CtrlMsg::Challenge {
            nonce: NS,
            public: ps,
        } = wire[1]
        else {
            panic!("{:?}", wire[1])
        };
        assert_ne!(pc, ZERO);
        assert_ne!(ps, ZERO);
        let t = transcript(pc, ps);
        // The client proves first; the server's proof comes only in its (sealed) Welcome.
        assert!(matches!(wire[2], CtrlMsg::Proof { proof } if k.verify_client_proof(&t, &proof)));
        assert!(
            matches!(wire[3], CtrlMsg::Welcome { auth: true, proof } if k.verify_server_proof(&t, &proof))
        );
        assert!(same_session(&cs, &ss));
    }

    #[test]
    fn every_connection_has_keys_of_its_own() {
        // Same job, same nonces: the ephemeral exchange alone makes the sessions differ, so a
        // job member that watched one handshake cannot derive its keys.
        let k = key(1);
        let (c1, s1, _) = run(Some(&k), Some(&k));
        let (c2, s2, _) = run(Some(&k), Some(&k));
        let (c1, s1, c2, s2) = (
            c1.unwrap().unwrap(),
            s1.unwrap().unwrap(),
            c2.unwrap().unwrap(),
            s2.unwrap().unwrap(),
        );
        assert!(same_session(&c1, &s1) && same_session(&c2, &s2));
        assert!(!same_session(&c1, &s2));
        assert!(!same_session(&c2, &s1));
    }

    #[test]
    fn unauthenticated_sender_to_authenticated_receiver_is_refused() {
        let k = key(1);
        let (c, s, wire) = run(None, Some(&k));
        assert_eq!(
            s.unwrap_err(),
            HandshakeError::Refused(Refusal::UnauthenticatedPeer)
        );
        let c = c.unwrap_err();
        assert_eq!(
            c,
            HandshakeError::PeerAborted {
                code: ABORT_AUTH,
                reason: Refusal::UnauthenticatedPeer.reason().into()
            }
        );
        assert!(
            c.to_string().contains("requires an authenticated job"),
            "{c}"
        );
        assert!(c.to_string().contains("GRADWIRE_JOB_SECRET"), "{c}");
        assert!(matches!(
            wire[1],
            CtrlMsg::Abort {
                code: ABORT_AUTH,
                ..
            }
        ));
    }

    #[test]
    fn authenticated_sender_to_plain_receiver_is_refused() {
        let k = key(1);
        let (c, s, _) = run(Some(&k), None);
        assert_eq!(
            s.unwrap_err(),
            HandshakeError::Refused(Refusal::AuthenticationUnavailable)
        );
        assert!(matches!(
            c.unwrap_err(),
            HandshakeError::PeerAborted { code: ABORT_AUTH, reason }
                if reason.contains("without a job secret")
        ));
    }

    #[test]
    fn wrong_secret_is_refused_and_the_server_never_proves_itself() {
        let (ck, sk) = (key(1), key(2));
        let (c, s, wire) = run(Some(&ck), Some(&sk));
        let s = s.unwrap_err();
        assert_eq!(s, HandshakeError::Refused(Refusal::SecretMismatch));
        assert!(s.to_string().contains("job secret mismatch"));
        assert!(matches!(
            c.unwrap_err(),
            HandshakeError::PeerAborted { code: ABORT_AUTH, reason } if reason.contains("mismatch")
        ));
        // A client without the right secret got nothing it could test guesses against: no
        // server proof was ever sent (the Challenge has none, and no Welcome followed).
        assert!(!wire.iter().any(|m| matches!(m, CtrlMsg::Welcome { .. })));
    }

    #[test]
    fn a_welcome_whose_proof_fails_is_refused_by_the_client() {
        let k = key(1);
        let (mut client, _) = ClientHandshake::new(Some(&k), NC, eph());
        let server_eph = eph();
        client
            .on_msg(CtrlMsg::Challenge {
                nonce: NS,
                public: *server_eph.public(),
            })
            .unwrap();
        let e = client
            .on_msg(CtrlMsg::Welcome {
                auth: true,
                proof: [7; PROOF_LEN],
            })
            .unwrap_err();
        assert_eq!(e, HandshakeError::Refused(Refusal::ServerNotProven));
        assert!(e.to_string().contains("could not prove the job secret"));
    }

    #[test]
    fn proofs_are_bound_to_their_direction_and_handshake() {
        let k = key(1);
        let server_eph = eph();
        let ps = *server_eph.public();
        let mut server = ServerHandshake::new(Some(&k), NS, server_eph);
        let pc = *eph().public();
        server
            .on_msg(CtrlMsg::Hello {
                auth: true,
                nonce: NC,
                public: pc,
            })
            .unwrap();
        let t = transcript(pc, ps);
        // A server's proof replayed as the client's (reflection), and a client proof of
        // another handshake (another server nonce or key), are refused.
        assert!(!k.verify_client_proof(&t, &k.server_proof(&t)));
        let other = Transcript {
            server_nonce: [0x77; NONCE_LEN],
            ..t
        };
        assert!(!k.verify_client_proof(&t, &k.client_proof(&other)));
        let other_key = Transcript {
            server_public: [9; 32],
            ..t
        };
        assert_eq!(
            server
                .on_msg(CtrlMsg::Proof {
                    proof: k.client_proof(&other_key)
                })
                .unwrap_err(),
            HandshakeError::Refused(Refusal::SecretMismatch)
        );
        // The server is finished: nothing more is accepted, not even the right proof.
        assert!(matches!(
            server.on_msg(CtrlMsg::Proof {
                proof: k.client_proof(&t)
            }),
            Err(HandshakeError::Unexpected { .. })
        ));
    }

    #[test]
    fn a_low_order_public_key_is_refused() {
        let k = key(1);
        // Client side: a Challenge with the all-zero point.
        let (mut client, _) = ClientHandshake::new(Some(&k), NC, eph());
        assert_eq!(
            client
                .on_msg(CtrlMsg::Challenge {
                    nonce: NS,
                    public: ZERO
                })
                .unwrap_err(),
            HandshakeError::Refused(Refusal::BadPublicKey)
        );
        // Server side: a Hello with it, then a valid proof over that transcript (a job
        // member trying to force a known shared secret).
        let server_eph = eph();
        let ps = *server_eph.public();
        let mut server = ServerHandshake::new(Some(&k), NS, server_eph);
        server
            .on_msg(CtrlMsg::Hello {
                auth: true,
                nonce: NC,
                public: ZERO,
            })
            .unwrap();
        let proof = k.client_proof(&transcript(ZERO, ps));
        assert_eq!(
            server.on_msg(CtrlMsg::Proof { proof }).unwrap_err(),
            HandshakeError::Refused(Refusal::BadPublicKey)
        );
    }

    #[test]
    fn plain_welcome_to_an_authenticated_client_is_a_downgrade() {
        let k = key(1);
        let (mut client, _) = ClientHandshake::new(Some(&k), NC, eph());
        let e = client
            .on_msg(CtrlMsg::Welcome {
                auth: false,
                proof: ZERO,
            })
            .unwrap_err();
        assert_eq!(e, HandshakeError::Refused(Refusal::Downgrade));
        assert!(e.abort().is_some());
        assert!(client.session().is_none());
    }

    #[test]
    fn challenge_to_a_plain_client_is_unexpected() {
        let (mut client, _) = ClientHandshake::new(None, NC, eph());
        assert_eq!(
            client
                .on_msg(CtrlMsg::Challenge {
                    nonce: NS,
                    public: [1; 32]
                })
                .unwrap_err(),
            HandshakeError::Unexpected {
                expected: "Welcome",
                got: "Challenge"
            }
        );
    }

    #[test]
    fn session_is_exposed_only_between_proof_and_welcome() {
        let k = key(1);
        let (mut client, hello) = ClientHandshake::new(Some(&k), NC, eph());
        let CtrlMsg::Hello { public: pc, .. } = hello else {
            panic!("{hello:?}")
        };
        assert!(client.session().is_none());
        let server_eph = eph();
        let ps = *server_eph.public();
        let ch = CtrlMsg::Challenge {
            nonce: NS,
            public: ps,
        };
        let t = transcript(pc, ps);
        assert!(
            matches!(client.on_msg(ch).unwrap(), Step::Send(CtrlMsg::Proof { proof }) if k.verify_client_proof(&t, &proof))
        );
        assert!(client.session().is_some());
        // An authenticated Welcome is the only way on; a plain one after the proof is not.
        let (mut c2, _) = ClientHandshake::new(Some(&k), NC, eph());
        c2.on_msg(CtrlMsg::Challenge {
            nonce: NS,
            public: ps,
        })
        .unwrap();
        assert_eq!(
            c2.on_msg(CtrlMsg::Welcome {
                auth: false,
                proof: ZERO
            })
            .unwrap_err(),
            HandshakeError::Unexpected {
                expected: "sealed Welcome",
                got: "Welcome (unauthenticated)"
            }
        );
        match client
            .on_msg(CtrlMsg::Welcome {
                auth: true,
                proof: k.server_proof(&t),
            })
            .unwrap()
        {
            Step::Established {
                send: None,
                session: Some(_),
            } => {}
            other => panic!("{other:?}"),
        }
        assert!(client.session().is_none());
    }

    #[test]
    fn out_of_order_messages_are_named() {
        let k = key(1);
        let every = || {
            vec![
                CtrlMsg::FinishConfirm,
                CtrlMsg::FlowStop {
                    pass: 0,
                    segments_sent: 1,
                },
                CtrlMsg::RateGrant { rate_bps: 1 },
                CtrlMsg::Hello {
                    auth: true,
                    nonce: NC,
                    public: [3; 32],
                },
                CtrlMsg::Hello {
                    auth: false,
                    nonce: NC,
                    public: ZERO,
                },
                CtrlMsg::Challenge {
                    nonce: NS,
                    public: [1; 32],
                },
                CtrlMsg::Proof { proof: [2; 32] },
                CtrlMsg::Welcome {
                    auth: true,
                    proof: [4; 32],
                },
                CtrlMsg::Welcome {
                    auth: false,
                    proof: ZERO,
                },
            ]
        };
        // Server waiting for Hello: everything but a Hello is unexpected.
        for m in every() {
            for sk in [None, Some(&k)] {
                let mut s = ServerHandshake::new(sk, NS, eph());
                let name = msg_name(&m);
                match s.on_msg(m.clone()) {
                    Err(HandshakeError::Unexpected { expected, got }) => {
                        assert_eq!(expected, "Hello");
                        assert_eq!(got, name);
                        assert!(!name.starts_with("Hello"));
                    }
                    Ok(_) | Err(HandshakeError::Refused(_)) => assert!(name.starts_with("Hello")),
                    Err(e) => panic!("{name}: {e}"),
                }
            }
        }
        // Server waiting for the Proof: only a Proof.
        for m in every() {
            let mut s = ServerHandshake::new(Some(&k), NS, eph());
            s.on_msg(CtrlMsg::Hello {
                auth: true,
                nonce: NC,
                public: *eph().public(),
            })
            .unwrap();
            let name = msg_name(&m);
            match s.on_msg(m) {
                Err(HandshakeError::Unexpected { expected, got }) => {
                    assert_eq!((expected, got), ("Proof", name));
                }
                Err(HandshakeError::Refused(Refusal::SecretMismatch)) => {
                    assert_eq!(name, "Proof")
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        // Client waiting for the answer to Hello.
        for m in every() {
            for ck in [None, Some(&k)] {
                let (mut c, _) = ClientHandshake::new(ck, NC, eph());
                let name = msg_name(&m);
                let r = c.on_msg(m.clone());
                match (&r, ck.is_some(), name) {
                    (Ok(Step::Established { .. }), false, "Welcome (unauthenticated)") => {}
                    (
                        Err(HandshakeError::Refused(Refusal::Downgrade)),
                        true,
                        "Welcome (unauthenticated)",
                    ) => {}
                    // Any valid-looking challenge is answered with a proof (the client proves
                    // first); it is the server's Welcome that must then prove itself.
                    (Ok(Step::Send(CtrlMsg::Proof { .. })), true, "Challenge") => {}
                    (Err(HandshakeError::Unexpected { expected, got }), _, _) => {
                        assert_eq!(*got, name);
                        assert_eq!(
                            *expected,
                            if ck.is_some() { "Challenge" } else { "Welcome" }
                        );
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    #[test]
    fn abort_from_the_peer_is_reported_with_its_reason() {
        let abort = CtrlMsg::Abort {
            code: 3,
            reason: "going away".into(),
        };
        let k = key(1);
        let (mut c, _) = ClientHandshake::new(Some(&k), NC, eph());
        assert_eq!(
            c.on_msg(abort.clone()).unwrap_err(),
            HandshakeError::PeerAborted {
                code: 3,
                reason: "going away".into()
            }
        );
        let mut s = ServerHandshake::new(None, NS, eph());
        let e = s.on_msg(abort).unwrap_err();
        assert!(e.to_string().contains("going away"), "{e}");
        assert_eq!(e.abort(), None, "an abort is not answered");
    }

    #[test]
    fn finished_machines_accept_nothing() {
        let plain_welcome = CtrlMsg::Welcome {
            auth: false,
            proof: ZERO,
        };
        let (mut c, _) = ClientHandshake::new(None, NC, eph());
        c.on_msg(plain_welcome.clone()).unwrap();
        assert!(matches!(
            c.on_msg(plain_welcome),
            Err(HandshakeError::Unexpected { .. })
        ));
        let plain_hello = CtrlMsg::Hello {
            auth: false,
            nonce: NC,
            public: ZERO,
        };
        let mut s = ServerHandshake::new(None, NS, eph());
        s.on_msg(plain_hello.clone()).unwrap();
        assert!(matches!(
            s.on_msg(plain_hello),
            Err(HandshakeError::Unexpected { .. })
        ));
    }

    fn arb_msg() -> impl proptest::strategy::Strategy<Value = CtrlMsg> {
        use proptest::prelude::*;
        prop_oneof![
            (any::<bool>(), any::<[u8; NONCE_LEN]>(), any::<[u8; 32]>()).prop_map(
                |(auth, nonce, public)| CtrlMsg::Hello {
                    auth,
                    nonce,
                    public
                }
            ),
            (any::<[u8; NONCE_LEN]>(), any::<[u8; 32]>())
                .prop_map(|(nonce, public)| CtrlMsg::Challenge { nonce, public }),
            any::<[u8; 32]>().prop_map(|proof| CtrlMsg::Proof { proof }),
            (any::<bool>(), any::<[u8; 32]>())
                .prop_map(|(auth, proof)| CtrlMsg::Welcome { auth, proof }),
            (any::<u8>(), "[a-z ]{0,20}")
                .prop_map(|(code, reason)| CtrlMsg::Abort { code, reason }),
            Just(CtrlMsg::FinishConfirm),
        ]
    }

    proptest::proptest! {
        /// Whatever a peer without the secret sends, in any order, neither end of an
        /// authenticated job completes the handshake, and a failed one accepts nothing more.
        #[test]
        fn no_session_without_the_secret(msgs in proptest::collection::vec(arb_msg(), 0..8)) {
            let k = key(1);
            let mut server = ServerHandshake::new(Some(&k), NS, eph());
            let (mut client, _) = ClientHandshake::new(Some(&k), NC, eph());
            let (mut s_over, mut c_over) = (false, false);
            for m in msgs {
                let r = server.on_msg(m.clone());
                proptest::prop_assert!(!s_over || r.is_err(), "server accepted after the end");
                match r {
                    Ok(Step::Established { .. }) => {
                        proptest::prop_assert!(false, "server established without a proof");
                    }
                    Ok(Step::Send(_)) => {}
                    Err(_) => s_over = true,
                }
                let r = client.on_msg(m);
                proptest::prop_assert!(!c_over || r.is_err(), "client accepted after the end");
                match r {
                    Ok(Step::Established { .. }) => {
                        proptest::prop_assert!(false, "client established without a proof");
                    }
                    Ok(Step::Send(_)) => {}
                    Err(_) => c_over = true,
                }
            }
        }
    }
}
