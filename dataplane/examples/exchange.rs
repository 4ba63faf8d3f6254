//! Send one f32 gradient tensor to a receiver over kernel UDP on 127.0.0.1 with a 1% loss
//! bound, the way an ML framework would call `dlcp_send` / `dlcp_recv`.
//!
//! Run with `cargo run --release -p gradwire --example exchange`.

use std::error::Error;
use std::net::SocketAddr;

use gradwire::ctrl_listener::{CtrlListener, ListenerConfig};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::flow::{SegmentInfo, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let lo: SocketAddr = "127.0.0.1:0".parse()?;
    // The control listener: handshakes every connection in the background (bounded time,
    // bounded pending connections) and hands out the senders that completed it.
    let listener = CtrlListener::bind(lo, ListenerConfig::default())?;
    let ctrl_addr = listener.local_addr();
    let cfg = TransferConfig::default();

    // A 16 MiB gradient tensor (4 Mi f32 elements) from "layer 12".
    let mut grads = Tensor::zeros(DType::F32, 4 << 20);
    grads.fill_pattern(42);

    let sender = std::thread::spawn({
        let cfg = cfg.clone();
        move || -> Result<_, Box<dyn Error + Send + Sync>> {
            let dp = UdpDatapath::bind(lo, UdpConfig::default())?;
            let mut tx = Sender::connect(ctrl_addr, dp, cfg)?;
            // The priority function: DSCP from the layer, ECN-capable when the segment's
            // mean |g| is large (here: a fixed threshold, for illustration).
            let prio = |s: &SegmentInfo<'_>| {
                let n = s.payload.len() / 4;
                let sum: f32 = s
                    .payload
                    .chunks_exact(4)
                    .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]).abs())
                    .sum();
                let mean = sum / n.max(1) as f32;
                Tag {
                    dscp: 8 + (s.layer % 8) as u8,
                    ect: mean >= 0.5,
                }
            };
            let opts = SendOptions {
                layer: 12,
                loss_bound: Some(LossBound::from_fraction(0.01)?),
                ..SendOptions::new(1, 12)
            };
            Ok(tx.send(&grads, &opts, &prio)?)
        }
    });

    let dp = UdpDatapath::bind(lo, UdpConfig::default())?;
    let mut rx = Receiver::accept(&listener, dp, cfg)?;
    let mut out = Tensor::zeros(DType::F32, 4 << 20);
    let report = rx.recv(&mut out, &RecvOptions::new(1, 12))?;
    let sent = sender.join().map_err(|_| "sender panicked")??;

    println!(
        "received {:.3}% of {} segments in {:?} ({} retransmission rounds); sender sent {} packets",
        report.delivered_fraction * 100.0,
        report.segments,
        report.fct,
        report.rounds,
        sent.stats.packets
    );
    println!(
        "missing byte ranges (zero-filled): {}",
        report.missing_byte_ranges().len()
    );
    Ok(())
}
