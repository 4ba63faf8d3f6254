//! Per-byte work of the message layer's receive path: adding an arriving segment into the
//! accumulator (`reduce::add_into`) against a plain `f32` slice add (what the compiler does
//! with aligned `f32`s), and parsing a data segment's header.
//!
//! `cargo bench -p gradwire-msg --bench reduce`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gradwire_msg::reduce::add_into;
use gradwire_msg::wire::{DataHeader, DATA_HEADER_LEN};
use gradwire_proto::tensor::DType;

fn add(c: &mut Criterion) {
    let mut g = c.benchmark_group("add_f32");
    for &len in &[1432usize, 1 << 20] {
        g.throughput(Throughput::Bytes(len as u64));
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; len];
        g.bench_with_input(BenchmarkId::new("add_into_bytes", len), &len, |b, _| {
            b.iter(|| add_into(DType::F32, std::hint::black_box(&mut dst), &src))
        });
        let a: Vec<f32> = (0..len / 4).map(|i| i as f32).collect();
        let mut d = vec![0f32; len / 4];
        g.bench_with_input(BenchmarkId::new("plain_f32_slices", len), &len, |b, _| {
            b.iter(|| {
                for (x, y) in std::hint::black_box(&mut d).iter_mut().zip(&a) {
                    *x += *y;
                }
            })
        });
    }
    g.finish();
}

fn parse(c: &mut Criterion) {
    let h = DataHeader {
        flags: 0,
        pass: 0,
        job: 1,
        src: 0,
        dst: 1,
        msg: 7,
        offset: 1432 * 3,
        total: 1 << 20,
        length: 1432,
        layer: 2,
        meta: 3,
    };
    let mut hb = [0u8; DATA_HEADER_LEN];
    h.emit(&mut hb);
    let mut seg = hb.to_vec();
    seg.extend(std::iter::repeat_n(0u8, 1432));
    c.bench_function("parse_data_segment", |b| {
        b.iter(|| DataHeader::parse(std::hint::black_box(&seg)))
    });
}

criterion_group!(benches, add, parse);
criterion_main!(benches);
