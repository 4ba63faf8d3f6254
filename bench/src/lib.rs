//! gradwire benchmarks live in `benches/`.
