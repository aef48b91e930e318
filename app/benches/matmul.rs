//! The CPU trainer's matrix products: candle's matmul (the `gemm` crate) against
//! `tidestore_candle::blas::matmul` (OpenBLAS's `cblas_sgemm`, banded over rayon's
//! threads), on the shapes of the issue-29 model's blocks (a 0.51B LLaMA: hidden 2048,
//! 8 query / 8 key-value heads of 128, intermediate 5632, vocabulary 32000) at 512 rows
//! (sequence 512, micro-batch 1):
//!
//! - `{q,kv,up,down}/fwd`: a projection's forward, `x · Wᵀ`;
//! - `up/dx`: its input's gradient, `g · W`;
//! - `up/dw`: its weight's gradient, `gᵀ · x`;
//! - `head/fwd`, `head/dw`: the head's;
//! - `attn/qk`, `attn/pv`: attention's batched products (8 key-value groups of
//!   `2 · 512` query rows against 512 keys, 128 wide): `q · kᵀ` and `P · v`.
//!
//! Each shape is measured with both, one after the other, so each pair is side by side.
//! Throughput is in floating-point operations (`2·m·k·n`): criterion's `thrpt` is
//! FLOP/s. Without OpenBLAS on the machine the `openblas` cases are left out, saying so.

use std::hint::black_box;
use std::time::Duration;

use candle_core::{Device, Tensor};
use criterion::{Criterion, Throughput};

/// `(name, batch, m, k, n, how the operands are stored)`: `nt` is `a (m, k) · (b (n,
/// k))ᵀ`, `nn` `a (m, k) · b (k, n)`, `tn` `(a (k, m))ᵀ · b (k, n)`; a batch of 1 is
/// one 2-D product.
const SHAPES: [(&str, usize, usize, usize, usize, &str); 10] = [
    ("q/fwd", 1, 512, 2048, 2048, "nt"),
    ("kv/fwd", 1, 512, 2048, 1024, "nt"),
    ("up/fwd", 1, 512, 2048, 5632, "nt"),
    ("down/fwd", 1, 512, 5632, 2048, "nt"),
    ("up/dx", 1, 512, 5632, 2048, "nn"),
    ("up/dw", 1, 5632, 512, 2048, "tn"),
    ("head/fwd", 1, 512, 2048, 32000, "nt"),
    ("head/dw", 1, 32000, 512, 2048, "tn"),
    ("attn/qk", 8, 1024, 128, 512, "nt"),
    ("attn/pv", 8, 1024, 512, 128, "nn"),
];

fn operands(batch: usize, m: usize, k: usize, n: usize, how: &str) -> (Tensor, Tensor) {
    let cpu = &Device::Cpu;
    let rand = |r, c| {
        let t = Tensor::randn(0f32, 1.0, (batch, r, c), cpu).expect("a CPU tensor");
        if batch == 1 {
            t.squeeze(0).expect("a batch of 1")
        } else {
            t
        }
    };
    let t = |x: Tensor| x.t().expect("the last two dimensions");
    match how {
        "nt" => (rand(m, k), t(rand(n, k))),
        "nn" => (rand(m, k), rand(k, n)),
        _ => (t(rand(k, m)), rand(k, n)),
    }
}

pub fn bench(c: &mut Criterion) {
    let backend = tidestore_candle::blas::backend().expect("TIDESTORE_BLAS names a usable library");
    let blas = !backend.starts_with("candle");
    if !blas {
        eprintln!("matmul: no OpenBLAS here ({backend}): only candle's matmul is measured");
    }
    let mut group = c.benchmark_group("matmul");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (name, batch, m, k, n, how) in SHAPES {
        let (a, b) = operands(batch, m, k, n, how);
        group.throughput(Throughput::Elements((2 * batch * m * k * n) as u64));
        group.bench_function(format!("{name}/candle"), |bench| {
            bench.iter(|| black_box(a.matmul(&b).expect("matching shapes")))
        });
        if blas {
            group.bench_function(format!("{name}/openblas"), |bench| {
                bench.iter(|| {
                    black_box(tidestore_candle::blas::matmul(&a, &b).expect("matching shapes"))
                })
            });
        }
    }
    group.finish();
}
