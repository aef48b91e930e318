//! All criterion benchmarks, one module per area, gathered into one binary
//! (`cargo bench --bench bench_main`).

mod adamw;
mod compress;
mod io_engine;
mod matmul;
mod store;

criterion::criterion_group!(
    benches,
    io_engine::bench,
    compress::bench,
    adamw::bench,
    matmul::bench,
    store::bench
);
criterion::criterion_main!(benches);
