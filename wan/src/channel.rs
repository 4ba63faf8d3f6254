//! Chunk channels: one directed link carrying a sequence of model chunks, each with its
//! metadata, driven by a thread per direction.
//!
//! A chunk travels as **one reliable flow** on the link, a raw tensor sized by the sender
//! (the receiver bounds it: [`MAX_CHUNK_BYTES`] plus the header, see
//! [`RecvOptions::max_bytes`]):
//!
//! ```text
//! off  size  field
//! 0    4     data_len   bytes of values (at most MAX_CHUNK_BYTES)
//! 4    1     dtype      the values' dtype code
//! 5    8     sent_ns    the sender's send time, nanoseconds on its own clock
//! 13   2     meta_len   bytes of the caller's metadata (at most MAX_META)
//! 15   ..    meta       the caller's metadata (NetStorm's chunk header frame)
//! ..   ..    values     data_len bytes
//! ```
//!
//! The flow's length must be exactly `15 + meta_len + data_len`. One flow per chunk, not a
//! meta flow announcing a data flow: each flow costs its link about two round trips of
//! handshakes (FlowStart/FlowAccept, FlowStop/FlowFinish), which on a WAN link of 60 ms
//! round trip is as long as sending 120 kB at 8 Mbit/s.
//!
//! The link's two ends number the flows the same way (one sender thread, one receiver
//! thread), so every flow's ids are known to both in advance. The receiver measures each
//! flow from its first to its last packet on its own clock (the passive awareness of
//! [`gradwire_netstorm::awareness`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use gradwire::ctrl_channel::ChannelError;
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{RecvOptions, SendOptions, TransferConfig, TransferError};
use gradwire_collective::link::{InLink, OutLink};
use gradwire_netstorm::awareness::ChunkSample;

/// The chunk header's fixed part: data length, dtype, send time, metadata length.
const HEAD: usize = 4 + 1 + 8 + 2;
/// Largest caller metadata.
pub const MAX_META: usize = 2048 - HEAD;
/// Largest chunk's values (16 M f32, 16 x NetStorm's default CHUNK_SIZE): with the header,
/// bounds what a peer's flow can make this end allocate (the flow, then its values: twice
/// this per receiving thread at most).
pub const MAX_CHUNK_BYTES: usize = 64 << 20;

/// The tensor id of every chunk flow (flows differ by their sequence number, the round).
const CHUNK_TENSOR: u32 = 1;

/// What the channels need of the transport.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// The job id of every flow.
    pub job: u32,
    /// Transfers (the receivers wait up to `connect_timeout` for each next chunk).
    pub transfer: TransferConfig,
    /// DSCP of the data.
    pub dscp: u8,
}

/// One chunk to send.
#[derive(Debug)]
pub struct Outgoing {
    /// The caller's metadata (at most [`MAX_META`] bytes).
    pub meta: Vec<u8>,
    /// The values.
    pub data: Tensor,
}

/// One chunk received.
#[derive(Debug)]
pub struct Incoming {
    /// The link's sending end.
    pub from: usize,
    /// The caller's metadata.
    pub meta: Vec<u8>,
    /// The values.
    pub data: Tensor,
    /// The data flow's timing for link measurements (send time on the sender's clock,
    /// arrivals on this host's [`Instant`] epoch of the channel).
    pub sample: ChunkSample,
}

/// What a channel thread reports.
#[derive(Debug)]
pub enum Event {
    /// A chunk arrived.
    Chunk(Box<Incoming>),
    /// A chunk was sent over the link to `to` (its queue shrank).
    Sent {
        /// The receiving end.
        to: usize,
    },
    /// The peer closed the link between chunks (it finished, or its process ended): the
    /// channel thread ended. Whether that is a failure depends on what the node still
    /// expects from it.
    Closed {
        /// The other end.
        peer: usize,
    },
    /// The link failed (the peer died mid-chunk or broke the protocol): the channel thread
    /// ended.
    Failed {
        /// The other end.
        peer: usize,
        /// What happened.
        error: String,
    },
}

/// The sending end of a chunk channel: a queue and the thread that drains it.
#[derive(Debug)]
pub struct ChunkTx {
    to: usize,
    queue: Sender<Outgoing>,
    in_flight: Arc<AtomicUsize>,
}

impl ChunkTx {
    /// The receiving end's rank.
    pub fn to(&self) -> usize {
        self.to
    }

    /// Chunks queued or being sent.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Queue a chunk; `false` when the channel's thread has ended (its failure was reported).
    pub fn send(&self, chunk: Outgoing) -> bool {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if self.queue.send(chunk).is_err() {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }
}

/// Start the sending thread of `link`; it reports to `events` and ends when the returned
/// [`ChunkTx`] is dropped or the link fails.
pub fn spawn_tx(
    mut link: OutLink,
    cfg: ChannelConfig,
    epoch: Instant,
    events: Sender<Event>,
) -> std::io::Result<ChunkTx> {
    let to = link.peer();
    let (queue, rx) = crossbeam_channel::unbounded::<Outgoing>();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&in_flight);
    std::thread::Builder::new()
        .name(format!("chunk-tx-{to}"))
        .spawn(move || {
            let mut seq = 0u32;
            for chunk in rx.iter() {
                let r = send_chunk(&mut link, &cfg, epoch, seq, &chunk);
                seq = seq.wrapping_add(1);
                counter.fetch_sub(1, Ordering::AcqRel);
                match r {
                    Ok(()) => {
                        if events.send(Event::Sent { to }).is_err() {
                            return;
                        }
                    }
                    Err(error) => {
                        let _ = events.send(Event::Failed { peer: to, error });
                        return;
                    }
                }
            }
        })?;
    Ok(ChunkTx {
        to,
        queue,
        in_flight,
    })
}

fn send_chunk(
    link: &mut OutLink,
    cfg: &ChannelConfig,
    epoch: Instant,
    seq: u32,
    chunk: &Outgoing,
) -> Result<(), String> {
    let flow = encode_chunk(&chunk.meta, &chunk.data, epoch.elapsed())?;
    let opts = SendOptions {
        round: seq,
        loss_bound: Some(LossBound::RELIABLE),
        ..SendOptions::new(cfg.job, CHUNK_TENSOR)
    };
    let prio = fixed_priority(Tag {
        dscp: cfg.dscp,
        ect: true,
    });
    link.send(&flow, &opts, &prio, &cfg.transfer)
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Start the receiving thread of `link`; it reports every chunk to `events` and ends when
/// the link closes or fails (reported), when `events` is gone, or when `stop` is set and
/// its wait for the next chunk (`cfg.transfer.connect_timeout`) ends. Give that wait
/// generously: a receive that stops waiting aborts the peer's next flow.
pub fn spawn_rx(
    mut link: InLink,
    cfg: ChannelConfig,
    epoch: Instant,
    events: Sender<Event>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let from = link.peer();
    std::thread::Builder::new()
        .name(format!("chunk-rx-{from}"))
        .spawn(move || {
            let mut seq = 0u32;
            loop {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                match recv_chunk(&mut link, &cfg, epoch, seq, from) {
                    Ok(Some(c)) => {
                        if events.send(Event::Chunk(Box::new(c))).is_err() {
                            return;
                        }
                    }
                    // Nothing yet: keep waiting unless the node has stopped.
                    Ok(None) => {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        continue;
                    }
                    Err(RxError::Closed) => {
                        let _ = events.send(Event::Closed { peer: from });
                        return;
                    }
                    Err(RxError::Failed(error)) => {
                        let _ = events.send(Event::Failed { peer: from, error });
                        return;
                    }
                }
                seq = seq.wrapping_add(1);
            }
        })
}

/// Why a receive ended without a chunk.
enum RxError {
    /// The peer closed the link between chunks.
    Closed,
    /// Anything else.
    Failed(String),
}

impl From<String> for RxError {
    fn from(s: String) -> RxError {
        RxError::Failed(s)
    }
}

/// The next chunk, or `None` when no chunk started within the wait.
fn recv_chunk(
    link: &mut InLink,
    cfg: &ChannelConfig,
    epoch: Instant,
    seq: u32,
    from: usize,
) -> Result<Option<Incoming>, RxError> {
    let opts = RecvOptions {
        round: Some(seq),
        loss_bound: Some(LossBound::RELIABLE),
        max_bytes: Some((HEAD + MAX_META + MAX_CHUNK_BYTES) as u64),
        ..RecvOptions::new(cfg.job, CHUNK_TENSOR)
    };
    let mut flow = Tensor::zeros(DType::Raw, 0);
    let started = epoch.elapsed();
    let r = match link.recv(&mut flow, &opts, &cfg.transfer) {
        Ok(r) => r,
        Err(TransferError::Stalled {
            during: "waiting for FlowStart",
            ..
        }) => return Ok(None),
        Err(TransferError::Channel(ChannelError::Closed { .. })) => return Err(RxError::Closed),
        Err(e) => return Err(RxError::Failed(e.to_string())),
    };
    let (data, sent_ns, meta) =
        decode_chunk(flow.as_bytes()).map_err(|e| format!("rank {from}: {e}"))?;
    let first = r.stats.first_data_ns.unwrap_or(r.stats.start_ns);
    let last = r.stats.bound_met_ns.unwrap_or(first);
    let sample = ChunkSample {
        bytes: flow.len_bytes() as u64,
        sent_at: Duration::from_nanos(sent_ns),
        first_arrival: started + Duration::from_nanos(first),
        last_arrival: started + Duration::from_nanos(last),
        packets: u32::try_from(r.stats.placed).unwrap_or(u32::MAX),
    };
    Ok(Some(Incoming {
        from,
        meta,
        data,
        sample,
    }))
}

/// A chunk's flow: the header, the caller's metadata, the values.
fn encode_chunk(meta: &[u8], data: &Tensor, sent: Duration) -> Result<Tensor, String> {
    if meta.len() > MAX_META {
        return Err(format!(
            "chunk metadata of {} bytes is above {MAX_META}",
            meta.len()
        ));
    }
    let values = data.as_bytes();
    let len = u32::try_from(values.len())
        .ok()
        .filter(|&b| b as usize <= MAX_CHUNK_BYTES)
        .ok_or_else(|| {
            format!(
                "a chunk of {} bytes is above {MAX_CHUNK_BYTES}",
                values.len()
            )
        })?;
    let mut t = Tensor::zeros(DType::Raw, HEAD + meta.len() + values.len());
    let b = t.as_bytes_mut();
    b[0..4].copy_from_slice(&len.to_be_bytes());
    b[4] = data.dtype().code();
    b[5..13].copy_from_slice(&(sent.as_nanos() as u64).to_be_bytes());
    b[13..15].copy_from_slice(&(meta.len() as u16).to_be_bytes());
    b[HEAD..HEAD + meta.len()].copy_from_slice(meta);
    b[HEAD + meta.len()..].copy_from_slice(values);
    Ok(t)
}

/// Parse a chunk's flow: (values, send time ns, caller metadata). The flow must be exactly
/// as long as its header says.
pub fn decode_chunk(b: &[u8]) -> Result<(Tensor, u64, Vec<u8>), String> {
    let head = b
        .get(..HEAD)
        .ok_or("a chunk flow shorter than its header")?;
    let bytes = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if bytes > MAX_CHUNK_BYTES {
        return Err(format!(
            "a chunk of {bytes} bytes announced, above {MAX_CHUNK_BYTES}"
        ));
    }
    let dtype =
        DType::from_code(head[4]).ok_or_else(|| format!("unknown dtype code {}", head[4]))?;
    let mut ns = [0u8; 8];
    ns.copy_from_slice(&head[5..13]);
    let meta_len = usize::from(u16::from_be_bytes([head[13], head[14]]));
    if meta_len > MAX_META {
        return Err(format!(
            "chunk metadata of {meta_len} bytes, above {MAX_META}"
        ));
    }
    if b.len() != HEAD + meta_len + bytes {
        return Err(format!(
            "a chunk flow of {} bytes for a header saying {} (metadata {meta_len}, values {bytes})",
            b.len(),
            HEAD + meta_len + bytes
        ));
    }
    let mut data = Tensor::zeros_bytes(dtype, bytes)
        .ok_or_else(|| format!("{bytes} bytes of {dtype} are not whole elements"))?;
    data.as_bytes_mut().copy_from_slice(&b[HEAD + meta_len..]);
    Ok((
        data,
        u64::from_be_bytes(ns),
        b[HEAD..HEAD + meta_len].to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any chunk the encoder writes decodes to what was encoded, and decoding is
        /// canonical: a flow that decodes re-encodes to exactly its own bytes.
        #[test]
        fn chunks_round_trip_and_decoding_is_canonical(
            code in 0u8..4,
            elems in 0usize..300,
            meta in proptest::collection::vec(any::<u8>(), 0..64),
            ns in any::<u64>(),
            seed in any::<u64>(),
        ) {
            let dtype = DType::from_code(code).unwrap();
            let mut data = Tensor::zeros(dtype, elems);
            data.fill_pattern(seed);
            let t = encode_chunk(&meta, &data, Duration::from_nanos(ns)).unwrap();
            let (back, got_ns, got_meta) = decode_chunk(t.as_bytes()).unwrap();
            prop_assert_eq!(back.dtype(), dtype);
            prop_assert_eq!(got_ns, ns);
            prop_assert_eq!(&got_meta, &meta);
            prop_assert!(back.as_bytes() == data.as_bytes());
            let again = encode_chunk(&got_meta, &back, Duration::from_nanos(got_ns)).unwrap();
            prop_assert!(again.as_bytes() == t.as_bytes());
        }

        /// Arbitrary bytes never panic the decoder, and what it accepts is exactly as long
        /// as its header says and re-encodes to the same bytes.
        #[test]
        fn arbitrary_bytes_never_panic_and_accepted_flows_are_canonical(
            b in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            if let Ok((data, ns, meta)) = decode_chunk(&b) {
                prop_assert_eq!(b.len(), HEAD + meta.len() + data.len_bytes());
                let again = encode_chunk(&meta, &data, Duration::from_nanos(ns)).unwrap();
                prop_assert!(again.as_bytes() == b.as_slice());
            }
        }
    }

    #[test]
    fn chunks_round_trip_and_bad_headers_are_refused() {
        let mut data = Tensor::zeros(DType::F32, 1024);
        data.fill_pattern(3);
        let t = encode_chunk(b"hello", &data, Duration::from_nanos(77)).unwrap();
        let (back, ns, meta) = decode_chunk(t.as_bytes()).unwrap();
        assert_eq!(
            (back.dtype(), ns, meta.as_slice()),
            (DType::F32, 77, &b"hello"[..])
        );
        assert!(back.as_bytes() == data.as_bytes());
        assert!(encode_chunk(&[0; MAX_META + 1], &data, Duration::ZERO).is_err());
        // Unknown dtype, metadata past the end, a huge length, a short or long flow.
        let mut b = t.as_bytes().to_vec();
        b[4] = 99;
        assert!(decode_chunk(&b).is_err());
        let mut b = t.as_bytes().to_vec();
        b[13..15].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(decode_chunk(&b).is_err());
        let mut b = t.as_bytes().to_vec();
        b[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_chunk(&b).is_err());
        assert!(decode_chunk(&t.as_bytes()[..3]).is_err());
        assert!(decode_chunk(&t.as_bytes()[..t.len_bytes() - 1]).is_err());
        let mut b = t.as_bytes().to_vec();
        b.push(0);
        assert!(decode_chunk(&b).is_err());
        // Values that are not whole elements of their dtype.
        let mut b = t.as_bytes().to_vec();
        b[0..4].copy_from_slice(&4095u32.to_be_bytes());
        b.pop();
        assert!(decode_chunk(&b).is_err());
    }
}
