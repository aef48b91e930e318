//! All criterion benchmarks, one module per area, gathered into one binary
//! (`cargo bench --bench bench_main`).

mod compress;
mod io_engine;

criterion::criterion_group!(benches, io_engine::bench, compress::bench);
criterion::criterion_main!(benches);
