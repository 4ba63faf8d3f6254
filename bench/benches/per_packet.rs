//! Per-packet CPU cost of the gradwire data path, against a bare 1440-byte memcpy.
//!
//! Group `per_packet`, throughput 1440 payload bytes per iteration (one packet):
//!
//! - `memcpy_1440`: `copy_from_slice` of a pre-built datagram's payload into the 64 MiB
//!   tensor, same source bytes and destination walk as `recv_place`.
//! - `recv_place`: `ReceiverFlow::on_datagram` (peer binding, `header::Packet::new_checked`,
//!   `Repr::parse`, `on_data`: bounds check, bitmap bit, the copy into the tensor), as
//!   `recv_tensor`'s place closure.
//! - `recv_frame_place`: `frame::parse` (IPv4 + UDP checksums verified) + the above.
//! - `send_build`: `SenderFlow::next_segment` + priority + header emit + payload copy into a
//!   1472-byte transmit buffer, as `send_tensor`'s fill closure.
//! - `send_build_frame`: the above + `frame::emit_headers` (IPv4 + UDP checksums).
//! - `send_build_tagged`: `send_build` with DLCP's default priority function.
//! - `recv_place_auth`, `recv_frame_place_auth`: the receive paths of an authenticated flow
//!   (AES-128-GCM `FlowKey::open` of the sealed datagram into a reused scratch buffer, then
//!   parse and place the plaintext).
//! - `send_build_auth`, `send_build_frame_auth`: the send paths with `FlowKey::seal`.
//!
//! Every timed receive packet is a first copy: flows are rebuilt after each lap over the
//! tensor, outside the timed part (`iter_custom`). See `gradwire_bench` for the details.
//!
//! ```text
//! cargo bench -p gradwire-bench --bench per_packet -- --warm-up-time 1 --measurement-time 2
//! ```

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use gradwire_bench::{
    time_packets, warm_up, MemcpyFixture, PerPacket, RecvFixture, SendFixture, PAYLOAD, SEGMENTS,
};

/// Benches one fixture, built (and warmed up over one whole lap) only if the bench is not
/// filtered out, and dropped afterwards.
fn bench_op<P: PerPacket>(g: &mut BenchmarkGroup<'_, WallTime>, name: &str, make: fn() -> P) {
    let mut fixture: Option<P> = None;
    g.bench_function(name, |b| {
        let fx = fixture.get_or_insert_with(|| {
            let mut fx = make();
            warm_up(&mut fx);
            fx
        });
        assert_eq!(fx.name(), name);
        b.iter_custom(|iters| time_packets(fx, iters));
    });
}

fn per_packet(c: &mut Criterion) {
    let mut g = c.benchmark_group("per_packet");
    g.throughput(Throughput::Bytes(PAYLOAD as u64));
    bench_op(&mut g, "memcpy_1440", || MemcpyFixture::new(SEGMENTS));
    bench_op(&mut g, "recv_place", || RecvFixture::new(false, SEGMENTS));
    bench_op(&mut g, "recv_frame_place", || {
        RecvFixture::new(true, SEGMENTS)
    });
    bench_op(&mut g, "send_build", || SendFixture::new(false, SEGMENTS));
    bench_op(&mut g, "send_build_frame", || {
        SendFixture::new(true, SEGMENTS)
    });
    bench_op(&mut g, "send_build_tagged", || {
        SendFixture::with_tagging(false, true, SEGMENTS)
    });
    bench_op(&mut g, "recv_place_auth", || {
        RecvFixture::authenticated(false, SEGMENTS)
    });
    bench_op(&mut g, "recv_frame_place_auth", || {
        RecvFixture::authenticated(true, SEGMENTS)
    });
    bench_op(&mut g, "send_build_auth", || {
        SendFixture::authenticated(false, SEGMENTS)
    });
    bench_op(&mut g, "send_build_frame_auth", || {
        SendFixture::authenticated(true, SEGMENTS)
    });
    bench_op(&mut g, "recv_place_unbound", || {
        RecvFixture::unbound(SEGMENTS)
    });
    g.finish();
}

criterion_group!(benches, per_packet);
criterion_main!(benches);
