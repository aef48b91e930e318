//! Benchmarks of the CPU AdamW kernel against its memory roofline.
//!
//! - `step/{fp32,bf16}/{1,2}t`: one `AdamW::step_slice` over 10M parameters (fp32
//!   master, M, V in place); `fp32` reads fp32 gradients, `bf16` reads bf16 gradients and
//!   writes bf16 parameters in the same pass;
//! - `norm/fp32/{1,2}t`: `AdamW::grad_sq_norm` over the fp32 gradients (the pass a step
//!   that checks for non-finite gradients or clips makes before it; 4 bytes a
//!   parameter, read only);
//! - `probe/...`: `AdamW::probe_slice` over the same arrays: the same bytes (28 per
//!   parameter on both paths), same blocks and threads, almost no arithmetic — the
//!   in-place read-modify-write roofline.
//!
//! Throughput is in parameters, so criterion's `thrpt` is params/s; bytes/s is 28 times
//! that. `tidestore_optimizer::bench::run` (and the `adamw_bench` example) gives the
//! same comparison with medians and the fraction of the probe at 10M and 100M.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use tidestore_optimizer::half::bf16;
use tidestore_optimizer::{AdamW, CpuConfig, Grads, HyperParams, ParamOut, StepState};

const PARAMS: usize = 10_000_000;

/// `n` values of `f` in a `Vec` with a 64-byte aligned window `[off, off + n)`, as chunk
/// buffers are (so 16-bit outputs take the streaming-store path, as in production).
fn aligned<T: Copy + Default>(n: usize, f: impl Fn(usize) -> T) -> (Vec<T>, usize) {
    let extra = 64 / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n + extra];
    let off = ((64 - v.as_ptr() as usize % 64) % 64) / std::mem::size_of::<T>();
    for (i, x) in v[off..off + n].iter_mut().enumerate() {
        *x = f(i);
    }
    (v, off)
}

fn unit(i: usize) -> f32 {
    let x = (i as u32).wrapping_mul(2_654_435_761);
    (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
}

pub fn bench(c: &mut Criterion) {
    let (mut master, om) = aligned(PARAMS, unit);
    let (mut m, omm) = aligned(PARAMS, |i| 1e-3 * unit(i + 1));
    let (mut v, ov) = aligned(PARAMS, |i| 1e-6 * (1.0 + unit(i + 2)));
    let (g32, og) = aligned(PARAMS, |i| 1e-2 * unit(i + 3));
    let (g16, og16) = aligned(PARAMS, |i| bf16::from_f32(1e-2 * unit(i + 3)));
    let (mut out16, oo) = aligned(PARAMS, |_| bf16::ZERO);
    let master = &mut master[om..om + PARAMS];
    let m = &mut m[omm..omm + PARAMS];
    let v = &mut v[ov..ov + PARAMS];
    let g32 = &g32[og..og + PARAMS];
    let g16 = &g16[og16..og16 + PARAMS];
    let out16 = &mut out16[oo..oo + PARAMS];
    let hp = HyperParams::default();

    let mut group = c.benchmark_group("adamw");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(PARAMS as u64));
    for threads in [1, 2] {
        let opt = AdamW::new(CpuConfig {
            threads,
            ..CpuConfig::default()
        })
        .expect("a CPU optimizer with 1 or 2 threads");
        let mut step = 0u64;
        group.bench_function(format!("norm/fp32/{threads}t"), |b| {
            b.iter(|| black_box(opt.grad_sq_norm(Grads::F32(g32))))
        });
        for path in ["fp32", "bf16"] {
            group.bench_function(format!("step/{path}/{threads}t"), |b| {
                b.iter(|| {
                    step += 1;
                    let (grads, out) = if path == "fp32" {
                        (Grads::F32(g32), None)
                    } else {
                        (Grads::Bf16(g16), Some(ParamOut::Bf16(&mut *out16)))
                    };
                    opt.step_slice(StepState::new(step), &hp, master, m, v, grads, out)
                        .expect("equal lengths");
                    black_box(&*master);
                })
            });
            group.bench_function(format!("probe/{path}/{threads}t"), |b| {
                b.iter(|| {
                    let (grads, out) = if path == "fp32" {
                        (Grads::F32(g32), None)
                    } else {
                        (Grads::Bf16(g16), Some(ParamOut::Bf16(&mut *out16)))
                    };
                    opt.probe_slice(master, m, v, grads, out)
                        .expect("equal lengths");
                    black_box(&*master);
                })
            });
        }
    }
    group.finish();
}
