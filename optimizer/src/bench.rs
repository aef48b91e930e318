//! The CPU AdamW throughput benchmark with its memory roofline, measured in one run.
//!
//! For every size, thread count and path, the step ([`AdamW::step_slice`]) and the
//! in-place read-modify-write probe ([`AdamW::probe_slice`]) run alternately over the
//! very same arrays (64-byte aligned, first touched before timing), with the same
//! blocking and threads; each reports the median of `repeats` timed calls. The probe
//! moves exactly the bytes the step moves, so `fraction_of_probe` is the share of the
//! attainable in-place bandwidth the kernel reaches.
//!
//! Bytes per parameter, as counted (write-allocate traffic of the 16-bit output is not
//! counted, for the step and the probe alike):
//! - [`BenchPath::Fp32`]: master, M, V read and written (24) + fp32 grad read (4) = 28;
//! - [`BenchPath::Bf16`]: 24 + bf16 grad read (2) + bf16 param written (2) = 28.
//!
//! This module allocates (the arrays) and is meant for benchmarks only; it never prints.

use std::time::Instant;

use half::bf16;

use crate::cpu::{AdamW, CpuConfig, SimdLevel, BLOCK_PARAMS_DEFAULT};
use crate::error::{OptimError, Result};
use crate::params::{HyperParams, StepState};
use crate::slices::{Grads, ParamOut};

/// Which gradient / output dtypes a benchmark row uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BenchPath {
    /// fp32 gradients in, no 16-bit output.
    Fp32,
    /// bf16 gradients in, fp32 master, bf16 parameters out.
    Bf16,
    /// bf16 gradients and output, bf16 moments (`step_moments`).
    StatesBf16,
    /// bf16 gradients and output, block-wise int8 moments (`step_moments`).
    StatesInt8,
}

impl BenchPath {
    /// Bytes moved per parameter by a step (and by the probe) on this path.
    pub fn bytes_per_param(self) -> usize {
        match self {
            BenchPath::Fp32 => 3 * 8 + 4,
            BenchPath::Bf16 => 3 * 8 + 2 + 2,
            BenchPath::StatesBf16 => 8 + 2 * 4 + 2 + 2,
            // Rounded down: the absmax adds 2 x 8 bytes per 256 (0.0625 per parameter),
            // which `bytes_per_param_exact` counts.
            BenchPath::StatesInt8 => 8 + 2 * 2 + 2 + 2,
        }
    }

    /// Bytes moved per parameter, the int8 absmax included.
    pub fn bytes_per_param_exact(self) -> f64 {
        match self {
            BenchPath::StatesInt8 => 16.0 + 16.0 / crate::quant::Q8_BLOCK as f64,
            p => p.bytes_per_param() as f64,
        }
    }

    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            BenchPath::Fp32 => "fp32",
            BenchPath::Bf16 => "bf16",
            BenchPath::StatesBf16 => "m-bf16",
            BenchPath::StatesInt8 => "m-int8",
        }
    }
}

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Parameter counts.
    pub sizes: Vec<usize>,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Paths.
    pub paths: Vec<BenchPath>,
    /// Timed calls of the step and of the probe per row (>= 1).
    pub repeats: usize,
    /// Parameters per parallel block.
    pub block_params: usize,
    /// Forced SIMD level, or the best.
    pub simd: Option<SimdLevel>,
}

impl Default for BenchConfig {
    /// 10M and 100M parameters, 1 and 2 threads, fp32 and bf16, 9 repeats.
    fn default() -> Self {
        BenchConfig {
            sizes: vec![10_000_000, 100_000_000],
            threads: vec![1, 2],
            paths: vec![
                BenchPath::Fp32,
                BenchPath::Bf16,
                BenchPath::StatesBf16,
                BenchPath::StatesInt8,
            ],
            repeats: 9,
            block_params: BLOCK_PARAMS_DEFAULT,
            simd: None,
        }
    }
}

/// One measured configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// Parameters per step.
    pub params: usize,
    /// Threads.
    pub threads: usize,
    /// Path.
    pub path: BenchPath,
    /// SIMD level used.
    pub simd: SimdLevel,
    /// Bytes counted per parameter (step and probe).
    pub bytes_per_param: usize,
    /// Median seconds per step.
    pub step_s_median: f64,
    /// Median seconds per probe pass.
    pub probe_s_median: f64,
    /// Parameters per second of the median step.
    pub params_per_s: f64,
    /// Bytes per second of the median step, in GB/s (1e9).
    pub step_gb_per_s: f64,
    /// Bytes per second of the median probe, in GB/s.
    pub probe_gb_per_s: f64,
    /// `step_gb_per_s / probe_gb_per_s`.
    pub fraction_of_probe: f64,
    /// Every timed step, seconds, in order.
    pub step_s: Vec<f64>,
    /// Every timed probe, seconds, in order.
    pub probe_s: Vec<f64>,
}

/// A slice of `len` elements inside a `Vec` whose start is 64-byte aligned.
struct Aligned<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    fn new(len: usize, f: impl Fn(usize) -> T) -> Result<Self> {
        let extra = 64 / std::mem::size_of::<T>();
        let mut buf = Vec::new();
        buf.try_reserve_exact(len + extra)
            .map_err(|e| OptimError::Bench {
                reason: format!("cannot allocate {len} elements: {e}"),
            })?;
        buf.resize(len + extra, T::default());
        let addr = buf.as_ptr() as usize;
        let off = ((64 - addr % 64) % 64) / std::mem::size_of::<T>();
        for (i, x) in buf[off..off + len].iter_mut().enumerate() {
            *x = f(i);
        }
        Ok(Aligned { buf, off, len })
    }

    fn as_slice(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// Deterministic pseudo-random value in [-1, 1) from an index.
fn unit(i: usize, salt: u64) -> f32 {
    let mut x = (i as u64)
        .wrapping_add(salt)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    ((x >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

struct Arrays {
    master: Aligned<f32>,
    m: Aligned<f32>,
    v: Aligned<f32>,
    g32: Aligned<f32>,
    g16: Aligned<bf16>,
    out16: Aligned<bf16>,
    mb: Aligned<bf16>,
    vb: Aligned<bf16>,
    mc: Aligned<u8>,
    vc: Aligned<u8>,
    ma: Aligned<f32>,
    va: Aligned<f32>,
}

impl Arrays {
    fn new(n: usize) -> Result<Self> {
        Ok(Arrays {
            master: Aligned::new(n, |i| unit(i, 1))?,
            m: Aligned::new(n, |i| 1e-3 * unit(i, 2))?,
            v: Aligned::new(n, |i| 1e-6 * (1.5 + unit(i, 3)))?,
            g32: Aligned::new(n, |i| 1e-2 * unit(i, 4))?,
            g16: Aligned::new(n, |i| bf16::from_f32(1e-2 * unit(i, 4)))?,
            out16: Aligned::new(n, |_| bf16::ZERO)?,
            mb: Aligned::new(n, |i| bf16::from_f32(1e-3 * unit(i, 2)))?,
            vb: Aligned::new(n, |i| bf16::from_f32(1e-6 * (1.5 + unit(i, 3))))?,
            // Codes of realistic magnitudes (mid-map), absmax of the fp32 arrays' scale.
            mc: Aligned::new(n, |i| (unit(i, 5) * 100.0 + 128.0) as u8)?,
            vc: Aligned::new(n, |i| ((unit(i, 6) + 1.0) * 100.0 + 20.0) as u8)?,
            ma: Aligned::new(crate::quant::absmax_len(n), |_| 1e-3)?,
            va: Aligned::new(crate::quant::absmax_len(n), |_| 2.5e-6)?,
        })
    }

    fn moments(&mut self, path: BenchPath) -> crate::Moments<'_> {
        match path {
            BenchPath::StatesInt8 => crate::Moments::Int8 {
                m: crate::Q8Mut {
                    codes: self.mc.as_mut_slice(),
                    absmax: self.ma.as_mut_slice(),
                },
                v: crate::Q8Mut {
                    codes: self.vc.as_mut_slice(),
                    absmax: self.va.as_mut_slice(),
                },
            },
            _ => crate::Moments::Bf16 {
                m: self.mb.as_mut_slice(),
                v: self.vb.as_mut_slice(),
            },
        }
    }

    fn step(&mut self, opt: &AdamW, path: BenchPath, step: u64) -> Result<f64> {
        let hp = HyperParams::default();
        let state = StepState::new(step);
        let t = Instant::now();
        match path {
            BenchPath::Fp32 => opt.step_slice(
                state,
                &hp,
                self.master.as_mut_slice(),
                self.m.as_mut_slice(),
                self.v.as_mut_slice(),
                Grads::F32(self.g32.as_slice()),
                None,
            )?,
            BenchPath::Bf16 => opt.step_slice(
                state,
                &hp,
                self.master.as_mut_slice(),
                self.m.as_mut_slice(),
                self.v.as_mut_slice(),
                Grads::Bf16(self.g16.as_slice()),
                Some(ParamOut::Bf16(self.out16.as_mut_slice())),
            )?,
            BenchPath::StatesBf16 | BenchPath::StatesInt8 => {
                // Disjoint fields: the moments borrow only their own arrays.
                let mut master = std::mem::take(&mut self.master.buf);
                let (off, len) = (self.master.off, self.master.len);
                let (goff, ooff) = (self.g16.off, self.out16.off);
                let g16 = std::mem::take(&mut self.g16.buf);
                let mut out = std::mem::take(&mut self.out16.buf);
                let r = opt.step_moments(
                    state,
                    &hp,
                    &mut master[off..off + len],
                    self.moments(path),
                    Grads::Bf16(&g16[goff..goff + len]),
                    Some(ParamOut::Bf16(&mut out[ooff..ooff + len])),
                );
                self.master.buf = master;
                self.g16.buf = g16;
                self.out16.buf = out;
                r?
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    fn probe(&mut self, opt: &AdamW, path: BenchPath) -> Result<f64> {
        let t = Instant::now();
        match path {
            BenchPath::Fp32 => opt.probe_slice(
                self.master.as_mut_slice(),
                self.m.as_mut_slice(),
                self.v.as_mut_slice(),
                Grads::F32(self.g32.as_slice()),
                None,
            )?,
            BenchPath::Bf16 => opt.probe_slice(
                self.master.as_mut_slice(),
                self.m.as_mut_slice(),
                self.v.as_mut_slice(),
                Grads::Bf16(self.g16.as_slice()),
                Some(ParamOut::Bf16(self.out16.as_mut_slice())),
            )?,
            BenchPath::StatesBf16 | BenchPath::StatesInt8 => {
                let mut master = std::mem::take(&mut self.master.buf);
                let (off, len) = (self.master.off, self.master.len);
                let (goff, ooff) = (self.g16.off, self.out16.off);
                let g16 = std::mem::take(&mut self.g16.buf);
                let mut out = std::mem::take(&mut self.out16.buf);
                let r = opt.probe_moments(
                    &mut master[off..off + len],
                    self.moments(path),
                    Grads::Bf16(&g16[goff..goff + len]),
                    Some(ParamOut::Bf16(&mut out[ooff..ooff + len])),
                );
                self.master.buf = master;
                self.g16.buf = g16;
                self.out16.buf = out;
                r?
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Median of a non-empty list (mean of the middle two for even lengths).
/// Column titles matching [`BenchRow::table_line`].
pub fn table_header() -> String {
    format!(
        "{:>11} {:>3} {:>6} {:>10} {:>9} {:>10} {:>8} {:>9} {:>6}  bytes/param",
        "params", "thr", "path", "simd", "ms/step", "Gparams/s", "GB/s", "probeGB/s", "frac"
    )
}

impl BenchRow {
    /// One line of the results table: median step time, params/s, GB/s at the bytes
    /// counted per parameter, the probe's GB/s over the same arrays, and the fraction.
    pub fn table_line(&self) -> String {
        format!(
            "{:>11} {:>3} {:>6} {:>10} {:>9.2} {:>10.3} {:>8.2} {:>9.2} {:>6.3}  {}",
            self.params,
            self.threads,
            self.path.name(),
            format!("{:?}", self.simd),
            self.step_s_median * 1e3,
            self.params_per_s / 1e9,
            self.step_gb_per_s,
            self.probe_gb_per_s,
            self.fraction_of_probe,
            self.bytes_per_param
        )
    }
}

pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Runs the benchmark; see the module docs. Equivalent to [`run_with`] without a
/// callback.
pub fn run(cfg: &BenchConfig) -> Result<Vec<BenchRow>> {
    run_with(cfg, |_| {})
}

/// Runs the benchmark, calling `on_row` as each row completes (for progress output).
pub fn run_with(cfg: &BenchConfig, mut on_row: impl FnMut(&BenchRow)) -> Result<Vec<BenchRow>> {
    if cfg.repeats == 0 || cfg.sizes.is_empty() || cfg.threads.is_empty() || cfg.paths.is_empty() {
        return Err(OptimError::Bench {
            reason: "sizes, threads, paths and repeats must be non-empty / > 0".into(),
        });
    }
    let mut rows = Vec::new();
    let mut step_no = 0u64;
    for &n in &cfg.sizes {
        let mut a = Arrays::new(n)?;
        for &threads in &cfg.threads {
            let opt = AdamW::new(CpuConfig {
                threads,
                block_params: cfg.block_params,
                simd: cfg.simd,
            })?;
            for &path in &cfg.paths {
                // Warm-up: page tables, pool threads, frequency.
                step_no += 1;
                a.step(&opt, path, step_no)?;
                a.probe(&opt, path)?;
                let mut step_s = Vec::with_capacity(cfg.repeats);
                let mut probe_s = Vec::with_capacity(cfg.repeats);
                for r in 0..cfg.repeats {
                    step_no += 1;
                    // Alternate which goes first so drifting load hits both alike.
                    if r % 2 == 0 {
                        step_s.push(a.step(&opt, path, step_no)?);
                        probe_s.push(a.probe(&opt, path)?);
                    } else {
                        probe_s.push(a.probe(&opt, path)?);
                        step_s.push(a.step(&opt, path, step_no)?);
                    }
                }
                let bpp = path.bytes_per_param();
                let sm = median(&step_s);
                let pm = median(&probe_s);
                let bytes = path.bytes_per_param_exact() * n as f64;
                let row = BenchRow {
                    params: n,
                    threads: opt.threads(),
                    path,
                    simd: opt.simd_level(),
                    bytes_per_param: bpp,
                    step_s_median: sm,
                    probe_s_median: pm,
                    params_per_s: n as f64 / sm,
                    step_gb_per_s: bytes / sm / 1e9,
                    probe_gb_per_s: bytes / pm / 1e9,
                    fraction_of_probe: pm / sm,
                    step_s,
                    probe_s,
                };
                tracing::info!(
                    params = n,
                    threads,
                    path = path.name(),
                    params_per_s = row.params_per_s,
                    fraction = row.fraction_of_probe,
                    "adamw bench row"
                );
                on_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}
