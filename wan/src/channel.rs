//! Chunk channels: one directed link carrying a sequence of model chunks, each with its
//! metadata, driven by a thread per direction.
//!
//! A chunk travels as two flows on the link: a small reliable *meta* flow (a raw tensor of
//! [`META_CAP`] bytes: `u32` length of the data in bytes, `u8` dtype code, `u64` the
//! sender's send time in nanoseconds on its own clock, `u16` length of the caller's
//! metadata, the metadata, zero padding), then the data flow, sized by the meta flow.
//! The link's two ends number the flows the same way (one sender thread, one receiver
//! thread), so every flow's ids are known to both in advance.
//!
//! The receiver measures each data flow from its first to its last packet on its own clock
//! (the passive awareness of [`gradwire_netstorm::awareness`]).

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

/// Bytes of a meta flow: the link header and the caller's metadata.
pub const META_CAP: usize = 2048;
const META_HEAD: usize = 4 + 1 + 8 + 2;
/// Largest caller metadata.
pub const MAX_META: usize = META_CAP - META_HEAD;
/// Largest chunk: bounds what a peer's meta flow can make this end allocate.
pub const MAX_CHUNK_BYTES: usize = 256 << 20;

const META_TENSOR: u32 = 1;
const DATA_TENSOR: u32 = 2;

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
    let meta = encode_meta(
        &chunk.meta,
        chunk.data.dtype(),
        chunk.data.len_bytes(),
        epoch.elapsed(),
    )?;
    let reliable = |tensor| SendOptions {
        round: seq,
        loss_bound: Some(LossBound::RELIABLE),
        ..SendOptions::new(cfg.job, tensor)
    };
    let prio = fixed_priority(Tag {
        dscp: cfg.dscp,
        ect: true,
    });
    link.send(&meta, &reliable(META_TENSOR), &prio, &cfg.transfer)
        .map_err(|e| e.to_string())?;
    if chunk.data.len_bytes() > 0 {
        link.send(&chunk.data, &reliable(DATA_TENSOR), &prio, &cfg.transfer)
            .map_err(|e| e.to_string())?;
    }
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
    let opts = |tensor| RecvOptions {
        round: Some(seq),
        loss_bound: Some(LossBound::RELIABLE),
        ..RecvOptions::new(cfg.job, tensor)
    };
    let mut meta = Tensor::zeros(DType::Raw, META_CAP);
    match link.recv(&mut meta, &opts(META_TENSOR), &cfg.transfer) {
        Ok(_) => {}
        Err(TransferError::Stalled {
            during: "waiting for FlowStart",
            ..
        }) => return Ok(None),
        Err(TransferError::Channel(ChannelError::Closed { .. })) => return Err(RxError::Closed),
        Err(e) => return Err(RxError::Failed(e.to_string())),
    }
    let (bytes, dtype, sent_ns, caller_meta) = decode_meta(meta.as_bytes())?;
    let mut data = Tensor::zeros_bytes(dtype, bytes).ok_or_else(|| {
        format!("rank {from} announced {bytes} bytes of {dtype}: not whole elements")
    })?;
    let started = epoch.elapsed();
    let mut sample = ChunkSample {
        bytes: bytes as u64,
        sent_at: Duration::from_nanos(sent_ns),
        first_arrival: started,
        last_arrival: started,
        packets: 0,
    };
    if bytes > 0 {
        let r = link
            .recv(&mut data, &opts(DATA_TENSOR), &cfg.transfer)
            .map_err(|e| RxError::Failed(e.to_string()))?;
        let first = r.stats.first_data_ns.unwrap_or(r.stats.start_ns);
        let last = r.stats.bound_met_ns.unwrap_or(first);
        sample.first_arrival = started + Duration::from_nanos(first);
        sample.last_arrival = started + Duration::from_nanos(last);
        sample.packets = u32::try_from(r.stats.placed).unwrap_or(u32::MAX);
    }
    Ok(Some(Incoming {
        from,
        meta: caller_meta,
        data,
        sample,
    }))
}

/// The meta flow's bytes.
fn encode_meta(meta: &[u8], dtype: DType, bytes: usize, sent: Duration) -> Result<Tensor, String> {
    if meta.len() > MAX_META {
        return Err(format!(
            "chunk metadata of {} bytes is above {MAX_META}",
            meta.len()
        ));
    }
    let len = u32::try_from(bytes)
        .ok()
        .filter(|&b| b as usize <= MAX_CHUNK_BYTES)
        .ok_or_else(|| format!("a chunk of {bytes} bytes is above {MAX_CHUNK_BYTES}"))?;
    let mut t = Tensor::zeros(DType::Raw, META_CAP);
    let b = t.as_bytes_mut();
    b[0..4].copy_from_slice(&len.to_be_bytes());
    b[4] = dtype.code();
    b[5..13].copy_from_slice(&(sent.as_nanos() as u64).to_be_bytes());
    b[13..15].copy_from_slice(&(meta.len() as u16).to_be_bytes());
    b[META_HEAD..META_HEAD + meta.len()].copy_from_slice(meta);
    Ok(t)
}

/// Parse a meta flow: (data bytes, dtype, send time ns, caller metadata).
pub fn decode_meta(b: &[u8]) -> Result<(usize, DType, u64, Vec<u8>), String> {
    let head = b
        .get(..META_HEAD)
        .ok_or("chunk meta flow shorter than its header")?;
    let bytes = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if bytes > MAX_CHUNK_BYTES {
        return Err(format!(
            "peer announced a chunk of {bytes} bytes, above {MAX_CHUNK_BYTES}"
        ));
    }
    let dtype =
        DType::from_code(head[4]).ok_or_else(|| format!("unknown dtype code {}", head[4]))?;
    let mut ns = [0u8; 8];
    ns.copy_from_slice(&head[5..13]);
    let meta_len = usize::from(u16::from_be_bytes([head[13], head[14]]));
    let meta = b
        .get(META_HEAD..META_HEAD + meta_len)
        .ok_or("chunk metadata runs past its flow")?;
    Ok((bytes, dtype, u64::from_be_bytes(ns), meta.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips_and_bad_meta_is_refused() {
        let t = encode_meta(b"hello", DType::F32, 4096, Duration::from_nanos(77)).unwrap();
        let (bytes, dtype, ns, meta) = decode_meta(t.as_bytes()).unwrap();
        assert_eq!(
            (bytes, dtype, ns, meta.as_slice()),
            (4096, DType::F32, 77, &b"hello"[..])
        );
        assert!(encode_meta(&[0; MAX_META + 1], DType::F32, 4, Duration::ZERO).is_err());
        assert!(encode_meta(b"", DType::F32, MAX_CHUNK_BYTES + 1, Duration::ZERO).is_err());
        let mut b = t.as_bytes().to_vec();
        b[4] = 9;
        assert!(decode_meta(&b).is_err());
        let mut b = t.as_bytes().to_vec();
        b[13..15].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(decode_meta(&b).is_err());
        let mut b = t.as_bytes().to_vec();
        b[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_meta(&b).is_err());
        assert!(decode_meta(&b[..3]).is_err());
    }
}
