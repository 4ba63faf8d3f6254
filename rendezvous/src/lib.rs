//! Ranks find each other through rank 0: an all-gather of one opaque payload per rank over
//! TCP, with rank 0 listening at the master address (`MASTER_ADDR:MASTER_PORT`). No daemon
//! of our own and no store: the launcher already said who rank 0 is.
//!
//! Every rank calls [`exchange`] with its payload (typically its data-path addresses and
//! key material); every rank gets the same table of all payloads in rank order. Rank 0
//! binds the master address and collects one `Join` per other rank; each other rank
//! connects (retrying while rank 0 is not up yet), sends its `Join` and waits for the
//! `Table` (or a `Refuse` saying why not).
//!
//! # Trust and bounds
//!
//! **With a job secret** ([`RendezvousConfig::key`]) both ends prove it before the table
//! moves ([`auth`]): a joiner before rank 0 reads its Join, rank 0 with the table, each frame
//! tagged; a stranger gets only "not authenticated", and a fake rank 0 is not believed.
//! **Without one** the rendezvous is not authenticated: anyone who can reach the master port
//! can join as a missing rank (and read the table) or answer as a fake rank 0. It only
//! distributes addresses, and in a plain job whoever joins first as rank k takes rank k's
//! place (the real rank k is refused as a duplicate): use a secret where that matters.
//! Rank 0 refuses joins for another job id or world size, out-of-range and duplicate ranks
//! (the right rank can still join afterwards). A refusal names only what the joiner sent,
//! never rank 0's job id or world size, so probing the port tells a stranger nothing of the
//! job; rank 0's log has both sides.
//!
//! Everything is bounded in size and time: payloads by [`RendezvousConfig::max_payload`]
//! (the same on every rank), the world by [`MAX_RANKS`], frames are length-checked before
//! anything is allocated from them, a connection that has not sent a complete `Join`
//! within [`JOIN_WAIT`] is dropped, at most [`MAX_PENDING`] connections wait for their
//! `Join` at a time (when all are taken, the one silent longest, for at least
//! [`EVICT_IDLE`], makes room for a new one, so idle connections cannot keep a rank out),
//! and the whole exchange ends at [`RendezvousConfig::timeout`] with the
//! list of ranks that never joined; the table then goes out to every rank within
//! [`SEND_WAIT`] in all, however slowly a rank reads. Rank 0 holds one connection per joined rank until the
//! table goes out, so a job of `n` ranks needs `n` file descriptors there (`ulimit -n`).
//!
//! The listener is bound with `std`'s `TcpListener::bind`, which sets `SO_REUSEADDR` on
//! Unix, so rank 0 can rebind the port right after an earlier run despite `TIME_WAIT`.
//!
//! The encoding ([`wire`]) is pure (no I/O) and never panics on any input; it is fuzzed by
//! `fuzz/fuzz_targets/rendezvous.rs`.

#![deny(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire_proto::auth::JobKey;
use wire::{Join, Kind, Refuse, Table, WireError, HEADER_LEN};

pub mod auth;

/// Largest number of ranks in a job (bounds every per-rank table, on the wire too); the
/// collectives' job files use the same bound (`gradwire_collective::job::MAX_RANKS`).
pub const MAX_RANKS: usize = 4096;
/// Default overall deadline of an exchange.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default largest payload per rank.
pub const DEFAULT_MAX_PAYLOAD: usize = 64 * 1024;
/// How long rank 0 waits for a new connection's complete `Join` before dropping it.
pub const JOIN_WAIT: Duration = Duration::from_secs(5);
/// Most connections rank 0 reads `Join`s from at once; more wait in the listen backlog,
/// or take the place of one that has sent nothing for [`EVICT_IDLE`].
pub const MAX_PENDING: usize = 256;
/// A pending connection silent this long gives its slot to a new one when all are taken.
pub const EVICT_IDLE: Duration = Duration::from_millis(200);

/// Which of a service's connections makes room for a new one when every place is taken:
/// the index of the one silent longest, for at least [`EVICT_IDLE`], among those `heard`
/// gives a last-heard time for (`None`: never evicted); `None` when none has been silent
/// that long. The rendezvous and NetStorm's scheduler evict by this one rule.
pub fn stalest<T>(items: &[T], heard: impl Fn(&T) -> Option<Instant>) -> Option<usize> {
    items
        .iter()
        .enumerate()
        .filter_map(|(i, x)| heard(x).map(|t| (i, t)))
        .min_by_key(|&(_, t)| t)
        .filter(|&(_, t)| t.elapsed() >= EVICT_IDLE)
        .map(|(i, _)| i)
}
/// How long rank 0 may take to write the table to every rank, all together: a rank that
/// reads it slower is left to fail on its own side (a client draining a few kilobytes every
/// few seconds would otherwise hold rank 0 for as long as it likes).
pub const SEND_WAIT: Duration = Duration::from_secs(5);
/// Bytes a waiting connection must send, short of a whole frame, to count as heard from
/// (rather than as a slow loris) for eviction.
const PROGRESS_BYTES: usize = 512;
/// Rank 0's pause when nothing happened in a round of its accept/read loop.
const IDLE: Duration = Duration::from_millis(2);

/// Limits of an exchange; every rank of a job must use the same `max_payload`.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// Overall deadline, from the call of [`exchange`].
    pub timeout: Duration,
    /// Largest payload per rank, in bytes.
    pub max_payload: usize,
    /// The job key of an authenticated job (from its secret): every rank proves the secret
    /// before rank 0 says anything about the job, and rank 0 proves it with the table, each
    /// frame tagged ([`auth`]). Every rank must give a key of the same secret, or none.
    pub key: Option<Arc<JobKey>>,
}

impl Default for RendezvousConfig {
    fn default() -> RendezvousConfig {
        RendezvousConfig {
            timeout: DEFAULT_TIMEOUT,
            max_payload: DEFAULT_MAX_PAYLOAD,
            key: None,
        }
    }
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The arguments cannot make a rendezvous (rank out of range, payload too large, ...).
    #[error("invalid rendezvous arguments: {0}")]
    Invalid(String),
    /// Rank 0 could not listen.
    #[error(
        "rank 0 cannot listen on {master}: {source}; MASTER_ADDR must be an address of rank \
         0's host and MASTER_PORT a free port"
    )]
    Bind {
        /// The master address.
        master: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Rank 0: not every rank joined before the deadline.
    #[error(
        "rendezvous timed out after {waited:?}: rank(s) {missing:?} never joined; check that \
         they were started with the same job id, world size and MASTER_ADDR/MASTER_PORT{}",
        if *unauthenticated > 0 {
            format!(
                " ({unauthenticated} join(s) were refused as not authenticated: give every \
                 rank the same job secret)"
            )
        } else {
            String::new()
        }
    )]
    Timeout {
        /// The configured timeout.
        waited: Duration,
        /// The ranks that never joined, ascending.
        missing: Vec<usize>,
        /// Joins refused because they did not prove the job's secret (or proved it to a
        /// plain rendezvous).
        unauthenticated: usize,
    },
    /// Other ranks: rank 0 could not be reached before the deadline.
    #[error(
        "cannot reach rank 0 at {master} within {waited:?} (last error: {source}); check \
         MASTER_ADDR/MASTER_PORT and that rank 0 is running"
    )]
    Unreachable {
        /// The master address.
        master: SocketAddr,
        /// The configured timeout.
        waited: Duration,
        /// The last connection error.
        source: io::Error,
    },
    /// Other ranks: joined, but no table came before the deadline.
    #[error(
        "joined rank 0 at {master} but got no table within {waited:?}: some rank has not \
         joined yet; rank 0's log names it"
    )]
    NoTable {
        /// The master address.
        master: SocketAddr,
        /// The configured timeout.
        waited: Duration,
    },
    /// Rank 0 refused this rank's join.
    #[error("rank 0 refused this rank: {reason}")]
    Refused {
        /// Rank 0's reason.
        reason: String,
    },
    /// Sending to or receiving from rank 0 failed.
    #[error(
        "rendezvous with rank 0 at {master} failed while {doing}: {source}; check that rank 0 \
         is still running"
    )]
    Io {
        /// The master address.
        master: SocketAddr,
        /// What this rank was doing.
        doing: &'static str,
        /// Why.
        source: io::Error,
    },
    /// What came back is not a rendezvous frame this rank accepts.
    #[error(
        "rank 0 at {master} sent an invalid frame: {source}; is another program listening on \
         MASTER_PORT, or do the ranks run different gradwire versions or max_payload?"
    )]
    Protocol {
        /// The master address.
        master: SocketAddr,
        /// What is wrong with it.
        source: WireError,
    },
    /// Authenticated jobs: what came back as rank 0's table is not proven with the job's
    /// secret (a fake rank 0, or a plain one in an authenticated job).
    #[error(
        "the table from {master} is not proven with this job's secret: it is not this job's \
         rank 0, or rank 0 runs without the secret (give every rank the same)"
    )]
    NotAuthenticated {
        /// The master address.
        master: SocketAddr,
    },
    /// A well-formed table that does not fit this rank's exchange.
    #[error("the table from rank 0 at {master} {problem}; another job may be using MASTER_PORT")]
    BadTable {
        /// The master address.
        master: SocketAddr,
        /// What does not fit.
        problem: String,
    },
}

/// All-gathers one payload per rank through rank 0 at `master`: returns the payloads of
/// ranks `0..world` in rank order, the same on every rank.
///
/// Rank 0 listens on `master`; every other rank connects to it, retrying every 50-100 ms
/// until `cfg.timeout` (rank 0 may start later). `world == 1` returns at once without I/O.
pub fn exchange(
    master: SocketAddr,
    job: u32,
    rank: usize,
    world: usize,
    payload: &[u8],
    cfg: &RendezvousConfig,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let start = Instant::now();
    check_args(rank, world, payload, cfg)?;
    if world == 1 {
        return Ok(vec![payload.to_vec()]);
    }
    let deadline = start.checked_add(cfg.timeout);
    if rank == 0 {
        serve(master, job, world, payload, cfg, deadline)
    } else {
        join(master, job, rank, world, payload, cfg, deadline)
    }
}

fn check_args(
    rank: usize,
    world: usize,
    payload: &[u8],
    cfg: &RendezvousConfig,
) -> Result<(), RendezvousError> {
    let bad = |m: String| Err(RendezvousError::Invalid(m));
    if world == 0 || world > MAX_RANKS {
        return bad(format!("world size {world}: use 1..={MAX_RANKS}"));
    }
    if rank >= world {
        return bad(format!("rank {rank} is not below the world size {world}"));
    }
    if payload.len() > cfg.max_payload {
        return bad(format!(
            "payload of {} bytes exceeds max_payload {}: raise max_payload on every rank",
            payload.len(),
            cfg.max_payload
        ));
    }
    if wire::table_body_limit(world, cfg.max_payload) > u64::from(u32::MAX) {
        return bad(format!(
            "a table of {world} payloads of up to {} bytes does not fit one frame: lower \
             max_payload",
            cfg.max_payload
        ));
    }
    Ok(())
}

/// Time left until `deadline` (`None`: no deadline, the timeout overflowed `Instant`).
fn left(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(Duration::from_secs(3600)),
        Some(d) => {
            let l = d.saturating_duration_since(Instant::now());
            (!l.is_zero()).then_some(l)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Rank 0
// ---------------------------------------------------------------------------------------

/// Rank 0's bookkeeping of who joined (pure; the I/O is in [`serve`]).
#[derive(Debug)]
struct Roster {
    job: u32,
    payloads: Vec<Option<Vec<u8>>>,
    joined: usize,
}

impl Roster {
    fn new(job: u32, world: usize, own: &[u8]) -> Roster {
        let mut payloads = vec![None; world];
        payloads[0] = Some(own.to_vec());
        Roster {
            job,
            payloads,
            joined: 1,
        }
    }

    /// Takes a join, or says why not: the first string goes back in a `Refuse`, the second
    /// to rank 0's log. A refusal names only what the joiner sent, never rank 0's job id or
    /// world size: a stranger who probes the port learns nothing of the job (rank 0's log
    /// has both sides, for whoever runs the job).
    fn admit(&mut self, j: Join) -> Result<usize, (String, String)> {
        let world = self.payloads.len();
        if j.job != self.job {
            return Err((
                format!(
                    "job id {} is not the job this rendezvous serves: check the job id of every \
                     rank",
                    j.job
                ),
                format!("job id {} where this is job {}", j.job, self.job),
            ));
        }
        if j.world as usize != world {
            let why = format!(
                "world size {} does not match rank 0's world size {world}",
                j.world
            );
            return Err((
                format!(
                    "world size {} is not this job's: check the world size of every rank",
                    j.world
                ),
                why,
            ));
        }
        let rank = j.rank as usize;
        let both = |why: String| Err((why.clone(), why));
        match self.payloads.get_mut(rank) {
            None => both(format!("rank {rank} is out of range 1..{world}")),
            Some(_) if rank == 0 => both(
                "rank 0 is the rendezvous master itself: two processes were given rank 0"
                    .to_owned(),
            ),
            Some(Some(_)) => both(format!(
                "rank {rank} has already joined: two processes were given rank {rank}"
            )),
            Some(slot) => {
                *slot = Some(j.payload);
                self.joined += 1;
                Ok(rank)
            }
        }
    }

    fn complete(&self) -> bool {
        self.joined == self.payloads.len()
    }

    fn missing(&self) -> Vec<usize> {
        (0..self.payloads.len())
            .filter(|&r| self.payloads[r].is_none())
            .collect()
    }

    fn into_table(self) -> Vec<Vec<u8>> {
        self.payloads
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect()
    }
}

/// A connection whose `Join` rank 0 is still reading.
#[derive(Debug)]
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    /// When it last made progress: it was accepted, completed a frame, or sent
    /// [`PROGRESS_BYTES`] more of one. A slow loris trickling bytes counts as silent, so it
    /// can be evicted like an idle connection.
    heard: Instant,
    /// Bytes arrived since `heard`.
    unheard: usize,
    buf: Vec<u8>,
    /// Bytes of the frame, once the header says.
    need: Option<usize>,
    /// Where an authenticated connection's handshake stands (`None`: a plain job's).
    stage: Option<Stage>,
}

/// An authenticated connection's handshake at rank 0.
#[derive(Debug)]
enum Stage {
    /// Waiting for the joiner's Hello.
    Hello,
    /// Challenge sent; waiting for the sealed Join.
    Sealed(Box<auth::ServerChallenged>),
}

impl Pending {
    /// The frame kind this connection may send next.
    fn expects(&self) -> Kind {
        match self.stage {
            None => Kind::Join,
            Some(Stage::Hello) => Kind::Hello,
            Some(Stage::Sealed(_)) => Kind::Sealed,
        }
    }
}

/// What reading a pending connection gave.
#[derive(Debug)]
enum Read1 {
    /// Nothing complete yet.
    More,
    /// Closed or failed before a complete join.
    Gone(Option<io::Error>),
    /// Not our protocol: drop without answering.
    Garbage(WireError),
    /// Our magic but not a join we can decode: answer with a `Refuse`.
    BadJoin(WireError),
    /// A complete frame of the kind expected ([`Pending::expects`]).
    Frame(Vec<u8>),
}

impl Pending {
    fn read(&mut self, max_payload: usize) -> Read1 {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let target = self.need.unwrap_or(HEADER_LEN);
            let want = (target - self.buf.len()).min(chunk.len());
            match self.stream.read(&mut chunk[..want]) {
                Ok(0) => return Read1::Gone(None),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    self.unheard += n;
                    if self.unheard >= PROGRESS_BYTES {
                        self.heard = Instant::now();
                        self.unheard = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Read1::More,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Read1::Gone(Some(e)),
            }
            if self.buf.len() < target {
                continue;
            }
            if self.need.is_none() {
                let expected = self.expects();
                match wire::decode_header(&self.buf, max_payload) {
                    Ok(h) if h.kind == expected => self.need = Some(HEADER_LEN + h.body_len),
                    Ok(h) => {
                        return Read1::BadJoin(WireError::WrongKind {
                            expected,
                            got: h.kind,
                        })
                    }
                    Err(e) if self.buf.starts_with(&wire::MAGIC) => return Read1::BadJoin(e),
                    Err(e) => return Read1::Garbage(e),
                }
                if self.buf.len() < self.need.unwrap_or(0) {
                    continue;
                }
            }
            self.need = None;
            self.heard = Instant::now();
            self.unheard = 0;
            return Read1::Frame(std::mem::take(&mut self.buf));
        }
    }
}

/// Best effort: a `Refuse` fits any fresh socket's send buffer, so a nonblocking write
/// either goes out whole or the peer is not worth waiting for.
fn send_refuse(stream: &mut TcpStream, peer: SocketAddr, reason: &str) {
    let frame = wire::encode_refuse(&Refuse {
        reason: reason.to_owned(),
    });
    if let Err(e) = stream
        .set_nonblocking(true)
        .and_then(|()| stream.write_all(&frame))
    {
        log::debug!("rendezvous: could not send the refusal to {peer}: {e}");
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Closing with unread bytes (the rest of a frame refused by its header) would send a
    // reset, which can destroy the refusal before the peer reads it: take what has arrived.
    let mut chunk = [0u8; 16 * 1024];
    for _ in 0..64 {
        match stream.read(&mut chunk) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

fn serve(
    master: SocketAddr,
    job: u32,
    world: usize,
    payload: &[u8],
    cfg: &RendezvousConfig,
    deadline: Option<Instant>,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let listener = TcpListener::bind(master)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|source| RendezvousError::Bind { master, source })?;
    log::info!("rendezvous: rank 0 of job {job} waiting for {world} ranks on {master}");
    let mut roster = Roster::new(job, world, payload);
    let mut pending: Vec<Pending> = Vec::new();
    let mut joined: Vec<Joined> = Vec::new();
    let mut unauthenticated = 0;

    while !roster.complete() {
        if left(deadline).is_none() {
            let missing = roster.missing();
            let reason = format!(
                "rendezvous timed out after {:?}: rank(s) {missing:?} never joined",
                cfg.timeout
            );
            for mut j in joined {
                send_refuse(&mut j.stream, j.peer, &reason);
            }
            log::warn!("rendezvous: {reason}");
            return Err(RendezvousError::Timeout {
                waited: cfg.timeout,
                missing,
                unauthenticated,
            });
        }
        let mut busy = false;

        loop {
            // Slots full: the connection silent the longest (for at least EVICT_IDLE) makes
            // room, so a flood of idle connections cannot keep a real rank waiting for
            // JOIN_WAIT; a real join arrives at once and is read within a round.
            if pending.len() >= MAX_PENDING {
                let Some(i) = stalest(&pending, |p| Some(p.heard)) else {
                    break;
                };
                let p = pending.swap_remove(i);
                log::warn!(
                    "rendezvous: dropping connection from {}: silent for {:?} while {MAX_PENDING} \
                     connections wait",
                    p.peer,
                    p.heard.elapsed()
                );
            }
            match listener.accept() {
                Ok((stream, peer)) => {
                    busy = true;
                    // Accepted sockets do not inherit nonblocking mode on Linux.
                    if let Err(e) = stream.set_nonblocking(true) {
                        log::warn!("rendezvous: dropping connection from {peer}: {e}");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let now = Instant::now();
                    pending.push(Pending {
                        stream,
                        peer,
                        since: now,
                        heard: now,
                        unheard: 0,
                        buf: Vec::new(),
                        need: None,
                        stage: cfg.key.as_ref().map(|_| Stage::Hello),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. out of file descriptors: the connection stays in the backlog.
                    log::warn!("rendezvous: accept on {master} failed: {e}");
                    break;
                }
            }
        }

        let mut i = 0;
        while i < pending.len() {
            let before = pending[i].buf.len();
            let got = pending[i].read(cfg.max_payload);
            busy |= pending[i].buf.len() != before;
            match got {
                Read1::More => {
                    if pending[i].since.elapsed() >= JOIN_WAIT {
                        let p = pending.swap_remove(i);
                        log::warn!(
                            "rendezvous: dropping connection from {}: no complete join within \
                             {JOIN_WAIT:?}",
                            p.peer
                        );
                    } else {
                        i += 1;
                    }
                    continue;
                }
                Read1::Gone(e) => {
                    let p = pending.swap_remove(i);
                    match e {
                        Some(e) => log::warn!(
                            "rendezvous: connection from {} failed before joining: {e}",
                            p.peer
                        ),
                        None => log::warn!(
                            "rendezvous: connection from {} closed before joining",
                            p.peer
                        ),
                    }
                }
                Read1::Garbage(e) => {
                    let p = pending.swap_remove(i);
                    log::warn!(
                        "rendezvous: dropping connection from {}: not a rendezvous join ({e})",
                        p.peer
                    );
                }
                Read1::BadJoin(e) => {
                    let mut p = pending.swap_remove(i);
                    let reason = match (&cfg.key, e) {
                        (
                            Some(_),
                            WireError::WrongKind {
                                got: Kind::Join, ..
                            },
                        ) => {
                            unauthenticated += 1;
                            NOT_AUTHENTICATED.to_owned()
                        }
                        (
                            None,
                            WireError::WrongKind {
                                got: Kind::Hello, ..
                            },
                        ) => {
                            unauthenticated += 1;
                            NOT_PLAIN.to_owned()
                        }
                        (_, e) => format!("invalid join: {e}"),
                    };
                    log::warn!("rendezvous: refusing {}: {reason}", p.peer);
                    send_refuse(&mut p.stream, p.peer, &reason);
                }
                Read1::Frame(frame) => {
                    let mut p = pending.swap_remove(i);
                    match step(&mut p, frame, cfg) {
                        Ok(None) => pending.push(p),
                        Ok(Some((j, session))) => match roster.admit(j) {
                            Ok(rank) => {
                                log::debug!("rendezvous: rank {rank} joined from {}", p.peer);
                                joined.push(Joined {
                                    rank,
                                    peer: p.peer,
                                    stream: p.stream,
                                    session,
                                });
                            }
                            Err((reason, detail)) => {
                                log::warn!("rendezvous: refusing {}: {detail}", p.peer);
                                send_refuse(&mut p.stream, p.peer, &reason);
                            }
                        },
                        Err(reason) => {
                            unauthenticated += usize::from(reason == NOT_AUTHENTICATED);
                            log::warn!("rendezvous: refusing {}: {reason}", p.peer);
                            send_refuse(&mut p.stream, p.peer, &reason);
                        }
                    }
                }
            }
            busy = true;
        }

        if !busy {
            std::thread::sleep(IDLE);
        }
    }
    drop(listener);
    drop(pending);

    let table = Table {
        job,
        payloads: roster.into_table(),
    };
    let frame = wire::encode_table(&table)
        .map_err(|e| RendezvousError::Invalid(format!("cannot encode the table: {e}")))?;
    let mut out = Vec::with_capacity(joined.len());
    for j in joined {
        let f = match j.session {
            None => frame.clone(),
            Some(s) => s
                .seal(&frame)
                .map_err(|e| RendezvousError::Invalid(format!("cannot seal the table: {e}")))?,
        };
        out.push((j.rank, j.peer, j.stream, f));
    }
    send_table(out);
    log::info!("rendezvous: all {world} ranks of job {job} joined");
    Ok(table.payloads)
}

/// Refusal of a plain join (or an unproven one) by an authenticated rendezvous: it says no
/// more than that.
const NOT_AUTHENTICATED: &str =
    "not authenticated: this rendezvous needs the job's secret (give every rank the same)";
/// Refusal of an authenticated join by a plain rendezvous.
const NOT_PLAIN: &str =
    "this rendezvous runs without a job secret: give every rank the same secret, or none";

/// A rank that joined: where its table goes, and (authenticated) how it is sealed.
struct Joined {
    rank: usize,
    peer: SocketAddr,
    stream: TcpStream,
    session: Option<auth::ServerJoined>,
}

/// One complete frame of a pending connection, by its stage: a plain Join; a Hello, which
/// is answered with the Challenge (`Ok(None)`: the connection waits for its sealed Join);
/// a sealed Join, opened. `Err`: the refusal to send.
#[allow(clippy::type_complexity)]
fn step(
    p: &mut Pending,
    frame: Vec<u8>,
    cfg: &RendezvousConfig,
) -> Result<Option<(Join, Option<auth::ServerJoined>)>, String> {
    let bad = |e: WireError| format!("invalid join: {e}");
    match (p.stage.take(), &cfg.key) {
        (None, _) => Ok(Some((
            wire::decode_join(&frame, cfg.max_payload).map_err(bad)?,
            None,
        ))),
        (Some(Stage::Hello), Some(key)) => {
            let hello = wire::decode_greeting(&frame, Kind::Hello).map_err(bad)?;
            let (hs, challenge) =
                auth::ServerChallenged::new(key.clone(), &hello).map_err(|e| e.to_string())?;
            // 74 bytes on a fresh socket: they fit its send buffer, or the peer is not
            // worth waiting for.
            p.stream
                .write_all(&challenge)
                .map_err(|e| format!("could not send the challenge: {e}"))?;
            p.stage = Some(Stage::Sealed(Box::new(hs)));
            p.heard = Instant::now();
            Ok(None)
        }
        (Some(Stage::Sealed(hs)), Some(_)) => {
            let sealed = wire::decode_sealed(&frame, cfg.max_payload).map_err(bad)?;
            let (session, inner) = hs.open(sealed).map_err(|_| NOT_AUTHENTICATED.to_owned())?;
            let j = wire::decode_join(&inner, cfg.max_payload).map_err(bad)?;
            Ok(Some((j, Some(session))))
        }
        (Some(_), None) => Err("internal: a handshake stage without a key".into()),
    }
}

/// Writes each joined rank's table frame to it, all at once (the sockets are nonblocking),
/// within [`SEND_WAIT`] in all. A rank whose connection fails, or that has not taken the
/// whole table by then, is dropped with a warning: its process reports its own failure, and
/// the table is complete here.
fn send_table(joined: Vec<(usize, SocketAddr, TcpStream, Vec<u8>)>) {
    let until = Instant::now() + SEND_WAIT;
    let mut left: Vec<(usize, SocketAddr, TcpStream, Vec<u8>, usize)> = joined
        .into_iter()
        .map(|(r, p, s, f)| (r, p, s, f, 0))
        .collect();
    while !left.is_empty() {
        let mut progress = false;
        left.retain_mut(
            |(rank, peer, s, frame, off)| match s.write(&frame[*off..]) {
                Ok(n) => {
                    *off += n;
                    progress |= n > 0;
                    *off < frame.len()
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    true
                }
                Err(e) => {
                    log::warn!(
                        "rendezvous: could not send the table to rank {rank} at {peer}: {e}"
                    );
                    false
                }
            },
        );
        if left.is_empty() {
            break;
        }
        if Instant::now() >= until {
            for (rank, peer, _, frame, off) in &left {
                log::warn!(
                    "rendezvous: rank {rank} at {peer} took {off} of the table's {} bytes in \
                     {SEND_WAIT:?}; dropping it",
                    frame.len()
                );
            }
            break;
        }
        if !progress {
            std::thread::sleep(IDLE);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Ranks 1..world
// ---------------------------------------------------------------------------------------

/// Connects, retrying every 50-100 ms until the deadline.
fn connect(
    master: SocketAddr,
    deadline: Option<Instant>,
    waited: Duration,
) -> Result<TcpStream, RendezvousError> {
    let mut last: Option<io::Error> = None;
    loop {
        let Some(l) = left(deadline) else {
            return Err(RendezvousError::Unreachable {
                master,
                waited,
                source: last
                    .unwrap_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "no attempt")),
            });
        };
        match TcpStream::connect_timeout(&master, l.min(Duration::from_secs(1))) {
            Ok(s) => return Ok(s),
            Err(e) => {
                log::debug!("rendezvous: connecting to {master}: {e}; retrying");
                last = Some(e);
                let pause = Duration::from_millis(50 + fastrand::u64(0..50));
                if let Some(l) = left(deadline) {
                    std::thread::sleep(pause.min(l));
                }
            }
        }
    }
}

/// Why reading from rank 0 stopped early.
#[derive(Debug)]
enum ReadStop {
    Deadline,
    Closed,
    Io(io::Error),
}

/// Reads until `buf` holds `total` bytes, growing it only as data arrives.
fn read_to(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    total: usize,
    deadline: Option<Instant>,
) -> Result<(), ReadStop> {
    let mut chunk = [0u8; 64 * 1024];
    while buf.len() < total {
        let l = left(deadline).ok_or(ReadStop::Deadline)?;
        s.set_read_timeout(Some(l)).map_err(ReadStop::Io)?;
        let want = (total - buf.len()).min(chunk.len());
        match s.read(&mut chunk[..want]) {
            Ok(0) => return Err(ReadStop::Closed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(ReadStop::Io(e)),
        }
    }
    Ok(())
}

/// One attempt's outcome: a final result, or "rank 0 went away before answering anything,
/// connect again" (e.g. an earlier rendezvous's listener was just closing).
enum Attempt {
    Done(Result<Vec<Vec<u8>>, RendezvousError>),
    Again(io::Error),
}

fn join(
    master: SocketAddr,
    job: u32,
    rank: usize,
    world: usize,
    payload: &[u8],
    cfg: &RendezvousConfig,
    deadline: Option<Instant>,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let frame = wire::encode_join(&Join {
        job,
        rank: rank as u32,
        world: world as u32,
        payload: payload.to_vec(),
    })
    .map_err(|e| RendezvousError::Invalid(format!("cannot encode the join: {e}")))?;
    loop {
        let mut stream = connect(master, deadline, cfg.timeout)?;
        match attempt(
            &mut stream,
            &frame,
            master,
            job,
            rank,
            world,
            payload,
            cfg,
            deadline,
        ) {
            Attempt::Done(r) => return r,
            Attempt::Again(e) => {
                log::debug!("rendezvous: rank 0 at {master} dropped the connection ({e}); again");
                if left(deadline).is_none() {
                    return Err(RendezvousError::NoTable {
                        master,
                        waited: cfg.timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(50 + fastrand::u64(0..50)));
            }
        }
    }
}

/// Why an attempt's read of one frame from rank 0 stopped: a result to give, or "connect
/// again" (nothing came back at all on the attempt's first read).
fn read_answer(
    s: &mut TcpStream,
    master: SocketAddr,
    world: usize,
    cfg: &RendezvousConfig,
    deadline: Option<Instant>,
    first: bool,
) -> Result<Vec<u8>, Attempt> {
    let no_table = || {
        Attempt::Done(Err(RendezvousError::NoTable {
            master,
            waited: cfg.timeout,
        }))
    };
    let io_err = |source| {
        Attempt::Done(Err(RendezvousError::Io {
            master,
            doing: "reading the answer",
            source,
        }))
    };
    let mid_frame = || {
        io_err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed mid-frame",
        ))
    };
    let mut buf = Vec::new();
    match read_to(s, &mut buf, HEADER_LEN, deadline) {
        Ok(()) => {}
        Err(ReadStop::Deadline) => return Err(no_table()),
        // Nothing came back at all: rank 0 went away (or was an earlier listener closing).
        Err(ReadStop::Closed) if buf.is_empty() && first => {
            return Err(Attempt::Again(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed without an answer",
            )))
        }
        Err(ReadStop::Io(e)) if buf.is_empty() && first => return Err(Attempt::Again(e)),
        Err(ReadStop::Closed) => return Err(mid_frame()),
        Err(ReadStop::Io(e)) => return Err(io_err(e)),
    }
    let protocol = |source| Attempt::Done(Err(RendezvousError::Protocol { master, source }));
    let header = wire::decode_header(&buf, cfg.max_payload).map_err(protocol)?;
    // A table for this world is smaller than the general bound.
    let table = wire::table_body_limit(world, cfg.max_payload);
    let limit = match header.kind {
        Kind::Table => table,
        Kind::Sealed => table.saturating_add((HEADER_LEN + wire::PROOF_LEN + wire::TAG_LEN) as u64),
        Kind::Refuse | Kind::Challenge => header.body_len as u64,
        got @ (Kind::Join | Kind::Hello) => {
            return Err(protocol(WireError::WrongKind {
                expected: Kind::Table,
                got,
            }))
        }
    };
    if header.body_len as u64 > limit {
        return Err(protocol(WireError::TooLarge {
            what: "table",
            len: header.body_len as u64,
            max: limit,
        }));
    }
    match read_to(s, &mut buf, HEADER_LEN + header.body_len, deadline) {
        Ok(()) => Ok(buf),
        Err(ReadStop::Deadline) => Err(no_table()),
        Err(ReadStop::Closed) => Err(mid_frame()),
        Err(ReadStop::Io(e)) => Err(io_err(e)),
    }
}

/// Writes `frame` to rank 0 by the deadline.
fn send(s: &mut TcpStream, frame: &[u8], deadline: Option<Instant>) -> Result<(), io::Error> {
    let l = left(deadline).ok_or_else(|| io::Error::from(io::ErrorKind::TimedOut))?;
    s.set_write_timeout(Some(l))
        .and_then(|()| s.write_all(frame))
}

#[allow(clippy::too_many_arguments)]
fn attempt(
    s: &mut TcpStream,
    frame: &[u8],
    master: SocketAddr,
    job: u32,
    rank: usize,
    world: usize,
    payload: &[u8],
    cfg: &RendezvousConfig,
    deadline: Option<Instant>,
) -> Attempt {
    let no_table = || RendezvousError::NoTable {
        master,
        waited: cfg.timeout,
    };
    let protocol = |source| Attempt::Done(Err(RendezvousError::Protocol { master, source }));
    let _ = s.set_nodelay(true);
    let sent = |r: Result<(), io::Error>| match r {
        Ok(()) => None,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Some(Attempt::Done(Err(no_table())))
        }
        Err(e) => Some(Attempt::Again(e)),
    };
    // Authenticated: Hello and Challenge first, then the Join sealed with this rank's proof.
    let mut wait = None;
    let mut first = true;
    let join = match &cfg.key {
        None => frame.to_vec(),
        Some(key) => {
            let (hs, hello) = match auth::ClientHello::start(key.clone()) {
                Ok(x) => x,
                Err(e) => return Attempt::Done(Err(RendezvousError::Invalid(e.to_string()))),
            };
            if let Some(a) = sent(send(s, &hello, deadline)) {
                return a;
            }
            let answer = match read_answer(s, master, world, cfg, deadline, true) {
                Ok(f) => f,
                Err(a) => return a,
            };
            first = false;
            let challenge = match wire::decode(&answer, cfg.max_payload) {
                Ok(wire::Frame::Greeting(Kind::Challenge, g)) => g,
                Ok(wire::Frame::Refuse(r)) => {
                    return Attempt::Done(Err(RendezvousError::Refused { reason: r.reason }))
                }
                Ok(_) => {
                    return protocol(WireError::WrongKind {
                        expected: Kind::Challenge,
                        got: wire::decode_header(&answer, cfg.max_payload)
                            .map_or(Kind::Join, |h| h.kind),
                    })
                }
                Err(e) => return protocol(e),
            };
            match hs.answer(&challenge, frame) {
                Ok((w, sealed)) => {
                    wait = Some(w);
                    sealed
                }
                Err(e) => {
                    return Attempt::Done(Err(RendezvousError::Refused {
                        reason: format!("rank 0's challenge: {e}"),
                    }))
                }
            }
        }
    };
    if let Some(a) = sent(send(s, &join, deadline)) {
        return a;
    }
    let buf = match read_answer(s, master, world, cfg, deadline, first) {
        Ok(f) => f,
        Err(a) => return a,
    };
    let decoded = match (wire::decode(&buf, cfg.max_payload), wait) {
        (Ok(wire::Frame::Sealed(sealed)), Some(w)) => match w.open(sealed) {
            Ok(inner) => wire::decode(&inner, cfg.max_payload),
            Err(_) => {
                return Attempt::Done(Err(RendezvousError::NotAuthenticated { master }));
            }
        },
        (Ok(wire::Frame::Table(_)), Some(_)) => {
            return Attempt::Done(Err(RendezvousError::NotAuthenticated { master }));
        }
        (other, _) => other,
    };
    let table = match decoded {
        Ok(wire::Frame::Table(t)) => t,
        Ok(wire::Frame::Refuse(r)) => {
            return Attempt::Done(Err(RendezvousError::Refused { reason: r.reason }))
        }
        Ok(_) => {
            return protocol(WireError::WrongKind {
                expected: Kind::Table,
                got: wire::decode_header(&buf, cfg.max_payload).map_or(Kind::Join, |h| h.kind),
            })
        }
        Err(e) => return protocol(e),
    };
    let bad = |problem: String| Attempt::Done(Err(RendezvousError::BadTable { master, problem }));
    if table.job != job {
        return bad(format!("is for job {}, not job {job}", table.job));
    }
    if table.payloads.len() != world {
        return bad(format!(
            "has {} ranks, not the world size {world}",
            table.payloads.len()
        ));
    }
    if table.payloads[rank] != payload {
        return bad(format!("does not hold rank {rank}'s payload"));
    }
    Attempt::Done(Ok(table.payloads))
}

pub mod wire;

#[cfg(test)]
mod tests {
    use super::wire::*;
    use super::*;
    use proptest::prelude::*;
    use std::thread;

    const MAXP: usize = 1024;

    fn join_frame(job: u32, rank: u32, world: u32, payload: &[u8]) -> Vec<u8> {
        encode_join(&Join {
            job,
            rank,
            world,
            payload: payload.to_vec(),
        })
        .unwrap()
    }

    #[test]
    fn frames_round_trip_with_the_documented_layout() {
        let j = Join {
            job: 7,
            rank: 2,
            world: 4,
            payload: b"abc".to_vec(),
        };
        let f = encode_join(&j).unwrap();
        assert_eq!(
            f,
            [
                &b"GWRV"[..],
                &[1, 1, 0, 0, 0, 19],
                &[0, 0, 0, 7, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 3],
                b"abc"
            ]
            .concat()
        );
        assert_eq!(decode_join(&f, MAXP).unwrap(), j);
        assert_eq!(decode(&f, MAXP).unwrap(), Frame::Join(j));

        let t = Table {
            job: 7,
            payloads: vec![b"x".to_vec(), vec![], b"yz".to_vec()],
        };
        let f = encode_table(&t).unwrap();
        assert_eq!(&f[..10], &[b'G', b'W', b'R', b'V', 1, 2, 0, 0, 0, 23]);
        assert_eq!(&f[10..18], &[0, 0, 0, 7, 0, 0, 0, 3]);
        assert_eq!(decode_table(&f, MAXP).unwrap(), t);

        let r = Refuse {
            reason: "wrong job".to_owned(),
        };
        let f = encode_refuse(&r);
        assert_eq!(&f[5..12], &[3, 0, 0, 0, 11, 0, 9]);
        assert_eq!(decode_refuse(&f).unwrap(), r);
        assert_eq!(decode(&f, MAXP).unwrap(), Frame::Refuse(r));
    }

    #[test]
    fn decoders_enforce_bounds() {
        // Payload over max_payload: the header already says too much.
        let f = join_frame(1, 0, 1, &[0; 100]);
        assert!(matches!(
            decode_join(&f, 99),
            Err(WireError::TooLarge { .. })
        ));
        assert!(decode_join(&f, 100).is_ok());
        // World and rank.
        assert!(encode_join(&Join {
            job: 1,
            rank: 0,
            world: 0,
            payload: vec![]
        })
        .is_err());
        assert!(encode_join(&Join {
            job: 1,
            rank: 3,
            world: 3,
            payload: vec![]
        })
        .is_err());
        let mut f = join_frame(1, 1, 2, b"");
        f[16] = 1; // rank 257 of 2
        assert!(matches!(
            decode_join(&f, MAXP),
            Err(WireError::Field { field: "rank", .. })
        ));
        let too_many = Table {
            job: 1,
            payloads: vec![vec![]; MAX_RANKS + 1],
        };
        assert!(encode_table(&too_many).is_err());
        let max = Table {
            job: 1,
            payloads: vec![vec![]; MAX_RANKS],
        };
        assert_eq!(decode_table(&encode_table(&max).unwrap(), 0).unwrap(), max);
        // A long reason is cut at a character boundary.
        let r = Refuse {
            reason: "é".repeat(200),
        };
        let back = decode_refuse(&encode_refuse(&r)).unwrap();
        assert_eq!(back.reason, "é".repeat(128));
        // Wrong kind, magic, version, unknown kind.
        let f = encode_refuse(&r);
        assert!(matches!(
            decode_join(&f, MAXP),
            Err(WireError::WrongKind {
                expected: Kind::Join,
                got: Kind::Refuse
            })
        ));
        let mut g = f.clone();
        g[0] = b'X';
        assert!(matches!(decode(&g, MAXP), Err(WireError::BadMagic(_))));
        let mut g = f.clone();
        g[4] = 2;
        assert_eq!(decode(&g, MAXP), Err(WireError::Version(2)));
        let mut g = f;
        g[5] = 9;
        assert_eq!(decode(&g, MAXP), Err(WireError::UnknownKind(9)));
    }

    #[test]
    fn body_length_must_match_fields() {
        // Body length says 1 more than the fields use, with the extra byte present.
        let mut f = join_frame(1, 0, 1, b"ab");
        f[9] += 1;
        f.push(0);
        assert!(matches!(
            decode_join(&f, MAXP),
            Err(WireError::BodyLength { .. })
        ));
        // Payload length claims more than the body holds.
        let mut f = join_frame(1, 0, 1, b"ab");
        f[25] = 3;
        assert!(matches!(
            decode_join(&f, MAXP),
            Err(WireError::BodyLength { .. })
        ));
        let mut f = join_frame(1, 0, 1, b"ab");
        f.push(0);
        assert_eq!(decode_join(&f, MAXP), Err(WireError::Trailing(1)));
    }

    fn arb_frame() -> impl Strategy<Value = Vec<u8>> {
        let join = (
            any::<u32>(),
            1u32..=16,
            proptest::collection::vec(any::<u8>(), 0..64),
        )
            .prop_flat_map(|(job, world, payload)| {
                (0..world).prop_map(move |rank| join_frame(job, rank, world, &payload))
            });
        let table = (
            any::<u32>(),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..32), 1..8),
        )
            .prop_map(|(job, payloads)| encode_table(&Table { job, payloads }).unwrap());
        let refuse = ".{0,80}".prop_map(|reason| encode_refuse(&Refuse { reason }));
        prop_oneof![join, table, refuse]
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            max_payload in prop_oneof![Just(0usize), Just(16), Just(MAXP), Just(usize::MAX)],
        ) {
            let _ = decode_header(&bytes, max_payload);
            let _ = decode_join(&bytes, max_payload);
            let _ = decode_table(&bytes, max_payload);
            let _ = decode_refuse(&bytes);
            let _ = decode(&bytes, max_payload);
        }

        #[test]
        fn decoding_after_a_valid_header_never_panics(
            kind in 0u8..5,
            len in any::<u32>(),
            body in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut f = b"GWRV".to_vec();
            f.push(VERSION);
            f.push(kind);
            f.extend_from_slice(&len.to_be_bytes());
            f.extend_from_slice(&body);
            let _ = decode(&f, MAXP);
            // Whatever the length, a decoder for another kind says so.
            if let Some(k) = [Kind::Join, Kind::Table, Kind::Refuse].into_iter().find(|k| *k as u8 == kind) {
                let wrong = |expected| Err(WireError::WrongKind { expected, got: k });
                if k != Kind::Join {
                    prop_assert_eq!(decode_join(&f, 0).map(drop), wrong(Kind::Join));
                }
                if k != Kind::Table {
                    prop_assert_eq!(decode_table(&f, 0).map(drop), wrong(Kind::Table));
                }
                if k != Kind::Refuse {
                    prop_assert_eq!(decode_refuse(&f).map(drop), wrong(Kind::Refuse));
                }
            }
            // With the body length made consistent too.
            let len = body.len() as u32;
            f[6..10].copy_from_slice(&len.to_be_bytes());
            if let Ok(frame) = decode(&f, MAXP) {
                // Canonical: what decodes re-encodes to the same bytes.
                let again = match &frame {
                    Frame::Join(j) => encode_join(j).unwrap(),
                    Frame::Table(t) => encode_table(t).unwrap(),
                    Frame::Refuse(r) => encode_refuse(r),
                    Frame::Greeting(k, g) => encode_greeting(*k, g).unwrap(),
                    Frame::Sealed(x) => encode_sealed(x).unwrap(),
                };
                prop_assert_eq!(again, f);
            }
        }

        #[test]
        fn valid_frames_round_trip_and_reject_truncation(f in arb_frame()) {
            let frame = decode(&f, MAXP).unwrap();
            let again = match &frame {
                Frame::Join(j) => encode_join(j).unwrap(),
                Frame::Table(t) => encode_table(t).unwrap(),
                Frame::Refuse(r) => encode_refuse(r),
                Frame::Greeting(k, g) => encode_greeting(*k, g).unwrap(),
                Frame::Sealed(x) => encode_sealed(x).unwrap(),
            };
            prop_assert_eq!(&again, &f);
            for cut in 0..f.len() {
                let is_truncated = matches!(
                    decode(&f[..cut], MAXP),
                    Err(WireError::Truncated { .. })
                );
                prop_assert!(is_truncated);
            }
            let mut longer = f.clone();
            longer.push(0);
            prop_assert_eq!(decode(&longer, MAXP), Err(WireError::Trailing(1)));
        }
    }

    fn join_of(job: u32, rank: u32, world: u32, payload: &[u8]) -> Join {
        Join {
            job,
            rank,
            world,
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn roster_admits_each_rank_once() {
        let mut r = Roster::new(5, 4, b"zero");
        assert_eq!(r.missing(), vec![1, 2, 3]);
        assert_eq!(r.admit(join_of(5, 2, 4, b"two")), Ok(2));
        let (e, _) = r.admit(join_of(5, 2, 4, b"again")).unwrap_err();
        assert!(e.contains("rank 2 has already joined"), "{e}");
        // The refusal names only what the joiner sent; rank 0's log has its side too.
        let (e, log) = r.admit(join_of(6, 1, 4, b"")).unwrap_err();
        assert!(e.contains("job id 6") && !e.contains('5'), "{e}");
        assert!(log.contains("job id 6") && log.contains("job 5"), "{log}");
        let (e, log) = r.admit(join_of(5, 1, 3, b"")).unwrap_err();
        assert!(e.contains("world size 3") && !e.contains('4'), "{e}");
        assert!(log.contains("world size 4"), "{log}");
        let (e, _) = r.admit(join_of(5, 0, 4, b"")).unwrap_err();
        assert!(e.contains("rank 0"), "{e}");
        assert_eq!(r.missing(), vec![1, 3]);
        assert!(!r.complete());
        assert_eq!(r.admit(join_of(5, 3, 4, b"three")), Ok(3));
        assert_eq!(r.admit(join_of(5, 1, 4, b"one")), Ok(1));
        assert!(r.complete());
        assert_eq!(
            r.into_table(),
            vec![
                b"zero".to_vec(),
                b"one".to_vec(),
                b"two".to_vec(),
                b"three".to_vec()
            ]
        );
    }

    /// A master address where nothing listens unless this test put it there: a loopback
    /// address of this process alone (its id in the low 22 bits of 127.64.0.0/10) and a port
    /// per test (`test`), below the ephemeral range, so nothing else listens or connects from
    /// there. Rank 0 binds it itself: nothing is found free and bound again later, which
    /// parallel tests could race.
    fn own_master(test: u16) -> SocketAddr {
        let pid = std::process::id() & 0x3f_ffff;
        SocketAddr::from((std::net::Ipv4Addr::from(0x7f40_0000 | pid), 7_200 + test))
    }

    fn cfg(secs: u64) -> RendezvousConfig {
        RendezvousConfig {
            timeout: Duration::from_secs(secs),
            max_payload: MAXP,
            key: None,
        }
    }

    fn key(fill: u8) -> Arc<JobKey> {
        Arc::new(JobKey::new(
            &gradwire_proto::auth::JobSecret::new(vec![fill; 32]).unwrap(),
        ))
    }

    fn sealed_cfg(secs: u64, fill: u8) -> RendezvousConfig {
        RendezvousConfig {
            key: Some(key(fill)),
            ..cfg(secs)
        }
    }

    fn spawn_rank(
        master: SocketAddr,
        job: u32,
        rank: usize,
        world: usize,
        payload: Vec<u8>,
        c: RendezvousConfig,
    ) -> thread::JoinHandle<Result<Vec<Vec<u8>>, RendezvousError>> {
        thread::spawn(move || exchange(master, job, rank, world, &payload, &c))
    }

    fn payload_of(rank: usize) -> Vec<u8> {
        format!("rank {rank} at 10.0.0.{rank}")
            .repeat(rank + 1)
            .into_bytes()
    }

    #[test]
    fn four_ranks_get_the_same_table() {
        let master = own_master(1);
        // Rank 0 last, so the others retry until it listens.
        let mut handles: Vec<_> = (1..4)
            .map(|r| spawn_rank(master, 42, r, 4, payload_of(r), cfg(30)))
            .collect();
        handles.push(spawn_rank(master, 42, 0, 4, payload_of(0), cfg(30)));
        let expect: Vec<Vec<u8>> = (0..4).map(payload_of).collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), expect);
        }
    }

    #[test]
    fn world_of_one_needs_no_master() {
        // TEST-NET-1: nothing listens there; the call must not try.
        let master: SocketAddr = "192.0.2.1:9".parse().unwrap();
        let got = exchange(master, 1, 0, 1, b"solo", &cfg(30)).unwrap();
        assert_eq!(got, vec![b"solo".to_vec()]);
    }

    #[test]
    fn bad_arguments_are_rejected_before_io() {
        let master: SocketAddr = "192.0.2.1:9".parse().unwrap();
        let c = cfg(30);
        for (rank, world, len) in [
            (2, 2, 0),
            (0, 0, 0),
            (0, MAX_RANKS + 1, 0),
            (0, 2, MAXP + 1),
        ] {
            match exchange(master, 1, rank, world, &vec![0; len], &c) {
                Err(RendezvousError::Invalid(_)) => {}
                other => panic!("({rank}, {world}, {len}): {other:?}"),
            }
        }
        let huge = RendezvousConfig {
            timeout: Duration::from_secs(1),
            max_payload: 1 << 20,
            key: None,
        };
        match exchange(master, 1, 1, MAX_RANKS, b"", &huge) {
            Err(RendezvousError::Invalid(m)) => assert!(m.contains("lower max_payload"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_job_or_world_is_refused_and_the_right_rank_still_joins() {
        let master = own_master(2);
        let r0 = spawn_rank(master, 42, 0, 3, payload_of(0), cfg(30));
        let r1 = spawn_rank(master, 42, 1, 3, payload_of(1), cfg(30));
        match exchange(master, 99, 2, 3, b"impostor", &cfg(30)) {
            Err(RendezvousError::Refused { reason }) => {
                // Its own job id, not the one it probed for.
                assert!(
                    reason.contains("job id 99") && !reason.contains("42"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        match exchange(master, 42, 2, 5, b"impostor", &cfg(30)) {
            Err(e @ RendezvousError::Refused { .. }) => {
                let e = e.to_string();
                assert!(e.contains("world size 5") && !e.contains('3'), "{e}")
            }
            other => panic!("{other:?}"),
        }
        let r2 = spawn_rank(master, 42, 2, 3, payload_of(2), cfg(30));
        let expect: Vec<Vec<u8>> = (0..3).map(payload_of).collect();
        for h in [r0, r1, r2] {
            assert_eq!(h.join().unwrap().unwrap(), expect);
        }
    }

    #[test]
    fn a_missing_rank_times_out_by_name() {
        let master = own_master(3);
        let r0 = spawn_rank(master, 42, 0, 3, payload_of(0), cfg(1));
        // Rank 1 waits longer than rank 0, so it hears rank 0's verdict.
        let r1 = spawn_rank(master, 42, 1, 3, payload_of(1), cfg(30));
        match r0.join().unwrap() {
            Err(RendezvousError::Timeout {
                waited, missing, ..
            }) => {
                assert_eq!(missing, vec![2]);
                assert_eq!(waited, Duration::from_secs(1));
            }
            other => panic!("{other:?}"),
        }
        match r1.join().unwrap() {
            Err(RendezvousError::Refused { reason }) => {
                assert!(reason.contains("[2] never joined"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rank_0_absent_is_unreachable() {
        let master = own_master(4);
        let c = RendezvousConfig {
            timeout: Duration::from_millis(300),
            max_payload: MAXP,
            key: None,
        };
        match exchange(master, 1, 1, 2, b"x", &c) {
            Err(e @ RendezvousError::Unreachable { .. }) => {
                assert!(e.to_string().contains("MASTER_ADDR/MASTER_PORT"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }

    fn connect_raw(master: SocketAddr) -> TcpStream {
        let s = connect(
            master,
            Instant::now().checked_add(Duration::from_secs(30)),
            cfg(30).timeout,
        )
        .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    fn read_frame(s: &mut TcpStream) -> Vec<u8> {
        let mut f = vec![0; HEADER_LEN];
        s.read_exact(&mut f).unwrap();
        let h = decode_header(&f, MAXP).unwrap();
        let mut body = vec![0; h.body_len];
        s.read_exact(&mut body).unwrap();
        f.extend_from_slice(&body);
        f
    }

    /// The peer closed: read gives end of stream or a reset, not data.
    fn assert_closed(s: &mut TcpStream) {
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => {}
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            Ok(n) => panic!("got {n} bytes from a dropped connection"),
        }
    }

    #[test]
    fn garbage_and_silent_connections_do_not_stop_the_rendezvous() {
        let master = own_master(5);
        let r0 = spawn_rank(master, 42, 0, 2, payload_of(0), cfg(30));

        let mut silent = connect_raw(master);
        let mut half = connect_raw(master);
        half.write_all(&join_frame(42, 1, 2, b"never finished")[..12])
            .unwrap();
        let mut http = connect_raw(master);
        http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        // Our magic, another version: answered with a Refuse saying so.
        let mut v2 = connect_raw(master);
        let mut f = join_frame(42, 1, 2, b"v2");
        f[4] = 2;
        v2.write_all(&f).unwrap();
        let refused = decode_refuse(&read_frame(&mut v2)).unwrap();
        assert!(refused.reason.contains("version 2"), "{}", refused.reason);
        // Not a rendezvous frame at all: dropped without an answer.
        assert_closed(&mut http);

        let r1 = spawn_rank(master, 42, 1, 2, payload_of(1), cfg(30));
        let expect: Vec<Vec<u8>> = (0..2).map(payload_of).collect();
        assert_eq!(r1.join().unwrap().unwrap(), expect);
        assert_eq!(r0.join().unwrap().unwrap(), expect);
        // Rank 0 is done: the connections that never joined are closed.
        assert_closed(&mut silent);
        assert_closed(&mut half);
    }

    #[test]
    fn idle_connections_filling_every_slot_do_not_keep_a_rank_out() {
        // MAX_PENDING connections that never send a byte take every slot; a real rank
        // joining after them gets in once they have been silent for EVICT_IDLE, not after
        // they time out at JOIN_WAIT.
        let master = own_master(9);
        let r0 = spawn_rank(master, 42, 0, 2, payload_of(0), cfg(30));
        let idle: Vec<TcpStream> = (0..MAX_PENDING).map(|_| connect_raw(master)).collect();
        thread::sleep(EVICT_IDLE + Duration::from_millis(100));
        let started = Instant::now();
        let r1 = spawn_rank(master, 42, 1, 2, payload_of(1), cfg(30));
        let expect: Vec<Vec<u8>> = (0..2).map(payload_of).collect();
        assert_eq!(r1.join().unwrap().unwrap(), expect);
        let took = started.elapsed();
        assert_eq!(r0.join().unwrap().unwrap(), expect);
        assert!(
            took < JOIN_WAIT / 2,
            "rank 1 took {took:?} behind idle connections"
        );
        drop(idle);
    }

    #[test]
    fn slow_loris_connections_filling_every_slot_do_not_keep_a_rank_out() {
        // MAX_PENDING connections each trickle a byte of a join header every 50 ms: never
        // silent for EVICT_IDLE by the clock, but no progress either. A real rank joining
        // after them gets in by evicting them, not after they time out at JOIN_WAIT.
        let master = own_master(23);
        let r0 = spawn_rank(master, 42, 0, 2, payload_of(0), cfg(30));
        let mut loris: Vec<TcpStream> = (0..MAX_PENDING).map(|_| connect_raw(master)).collect();
        let header = b"GWRV\x01\x01\x00\x00\x01\x00";
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trickle = {
            let stop = stop.clone();
            thread::spawn(move || {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    for s in &mut loris {
                        let _ = s.write(&header[i % header.len()..][..1]);
                    }
                    i += 1;
                    thread::sleep(Duration::from_millis(50));
                }
            })
        };
        thread::sleep(EVICT_IDLE + Duration::from_millis(100));
        let started = Instant::now();
        let r1 = spawn_rank(master, 42, 1, 2, payload_of(1), cfg(30));
        let expect: Vec<Vec<u8>> = (0..2).map(payload_of).collect();
        assert_eq!(r1.join().unwrap().unwrap(), expect);
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Release);
        trickle.join().unwrap();
        assert_eq!(r0.join().unwrap().unwrap(), expect);
        assert!(
            took < JOIN_WAIT / 2,
            "rank 1 took {took:?} behind slow-loris connections"
        );
    }

    #[test]
    fn a_rank_that_reads_the_table_slowly_does_not_hold_rank_0() {
        // Rank 1 joins with a 16 MiB payload, so the table does not fit in the sockets'
        // buffers, then drains 64 KiB every 200 ms: enough for every write to progress
        // within a per-write timeout, 50 s for the whole table. Rank 0 gives up on it after
        // SEND_WAIT in all and returns the complete table.
        let master = own_master(8);
        let big = RendezvousConfig {
            timeout: Duration::from_secs(30),
            max_payload: 16 << 20,
            key: None,
        };
        let started = Instant::now();
        let r0 = spawn_rank(master, 42, 0, 2, payload_of(0), big.clone());
        let mut slow = connect_raw(master);
        let mut f = vec![0u8; 0];
        let payload = vec![7u8; 16 << 20];
        let join = wire::encode_join(&Join {
            job: 42,
            rank: 1,
            world: 2,
            payload: payload.clone(),
        })
        .unwrap();
        slow.write_all(&join).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let slow_down = done.clone();
        let reader = thread::spawn(move || {
            let mut chunk = vec![0u8; 64 * 1024];
            let until = Instant::now() + Duration::from_secs(120);
            while Instant::now() < until {
                match slow.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => f.extend_from_slice(&chunk[..n]),
                }
                // Slowly while rank 0 writes; then what is left, to see the end.
                if !slow_down.load(std::sync::atomic::Ordering::Acquire) {
                    thread::sleep(Duration::from_millis(200));
                }
            }
            f.len()
        });
        let table = r0.join().unwrap().unwrap();
        let took = started.elapsed();
        done.store(true, std::sync::atomic::Ordering::Release);
        assert_eq!(table, vec![payload_of(0), payload]);
        assert!(
            took < SEND_WAIT + Duration::from_secs(5),
            "rank 0 took {took:?} with a slow reader"
        );
        // Rank 0 closed the connection: the reader ends with part of the table.
        let got = reader.join().unwrap();
        assert!(
            got < (16 << 20),
            "the slow reader got the whole table ({got} bytes)"
        );
    }

    #[test]
    fn a_fake_rank_0_answer_is_checked() {
        // A listener that answers every join with a table of the wrong job.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = l.local_addr().unwrap();
        let fake = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut f = vec![0; HEADER_LEN];
            s.read_exact(&mut f).unwrap();
            let h = decode_header(&f, MAXP).unwrap();
            let mut body = vec![0; h.body_len];
            s.read_exact(&mut body).unwrap();
            let t = encode_table(&Table {
                job: 41,
                payloads: vec![vec![], b"me".to_vec()],
            })
            .unwrap();
            s.write_all(&t).unwrap();
        });
        match exchange(master, 42, 1, 2, b"me", &cfg(30)) {
            Err(RendezvousError::BadTable { problem, .. }) => {
                assert!(problem.contains("job 41"), "{problem}")
            }
            other => panic!("{other:?}"),
        }
        fake.join().unwrap();
    }

    /// A stranger who knows the job id and world size (or guesses them) joins as a missing
    /// rank. Against a plain rendezvous it gets every rank's payload (the attack works, and
    /// it has taken rank 2's place). Against an authenticated one it is refused with
    /// nothing but "not authenticated", and the real rank 2 joins; every rank gets the table.
    #[test]
    fn a_stranger_gets_the_table_of_a_plain_rendezvous_but_nothing_of_an_authenticated_one() {
        let master = own_master(20);
        let r1 = spawn_rank(master, 42, 1, 3, payload_of(1), cfg(30));
        let r0 = spawn_rank(master, 42, 0, 3, payload_of(0), cfg(30));
        let stolen = exchange(master, 42, 2, 3, b"stranger", &cfg(30)).unwrap();
        assert_eq!(
            stolen[0],
            payload_of(0),
            "the stranger read rank 0's payload"
        );
        r0.join().unwrap().unwrap();
        r1.join().unwrap().unwrap();

        let master = own_master(21);
        let r1 = spawn_rank(master, 42, 1, 3, payload_of(1), sealed_cfg(30, 1));
        let r0 = spawn_rank(master, 42, 0, 3, payload_of(0), sealed_cfg(30, 1));
        for c in [cfg(30), sealed_cfg(30, 2)] {
            match exchange(master, 42, 2, 3, b"stranger", &c) {
                Err(RendezvousError::Refused { reason }) => {
                    assert!(reason.contains("not authenticated"), "{reason}");
                    assert!(!reason.contains("42") && !reason.contains('3'), "{reason}");
                }
                other => panic!("a stranger got {other:?}"),
            }
        }
        let r2 = spawn_rank(master, 42, 2, 3, payload_of(2), sealed_cfg(30, 1));
        let want: Vec<Vec<u8>> = (0..3).map(payload_of).collect();
        for h in [r0, r1, r2] {
            assert_eq!(h.join().unwrap().unwrap(), want);
        }
    }

    /// A fake rank 0 that has no secret answers an authenticated rank's Hello and sends a
    /// table: the rank refuses it as not proven. A plain rank 0 refuses an authenticated
    /// join and says why.
    #[test]
    fn an_authenticated_rank_believes_no_rank_0_without_the_secret() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = l.local_addr().unwrap();
        let fake = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let read = |s: &mut TcpStream| {
                let mut f = vec![0; HEADER_LEN];
                s.read_exact(&mut f).unwrap();
                let h = decode_header(&f, MAXP).unwrap();
                let mut body = vec![0; h.body_len];
                s.read_exact(&mut body).unwrap();
                [f, body].concat()
            };
            let hello = decode_greeting(&read(&mut s), Kind::Hello).unwrap();
            let (_, challenge) = auth::ServerChallenged::new(key(9), &hello).unwrap();
            s.write_all(&challenge).unwrap();
            let _join = read(&mut s);
            let table = encode_table(&Table {
                job: 42,
                payloads: vec![b"evil".to_vec(), b"me".to_vec()],
            })
            .unwrap();
            let forged = encode_sealed(&Sealed {
                proof: [7; PROOF_LEN],
                inner: table,
                tag: [7; TAG_LEN],
            })
            .unwrap();
            s.write_all(&forged).unwrap();
        });
        match exchange(master, 42, 1, 2, b"me", &sealed_cfg(30, 1)) {
            Err(RendezvousError::NotAuthenticated { .. }) => {}
            other => panic!("{other:?}"),
        }
        fake.join().unwrap();

        let master = own_master(22);
        let r0 = spawn_rank(master, 42, 0, 2, payload_of(0), cfg(5));
        match exchange(master, 42, 1, 2, b"me", &sealed_cfg(30, 1)) {
            Err(RendezvousError::Refused { reason }) => {
                assert!(reason.contains("without a job secret"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert!(r0.join().unwrap().is_err(), "rank 1 never joined");
    }
}
