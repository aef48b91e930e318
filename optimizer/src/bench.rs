//! The CPU AdamW throughput benchmark with its memory roofline, measured in one run.
//!
//! For every size, thread count and path, the step ([`AdamW::step_slice`]) and the
//! in-place read-modify-write probe ([`AdamW::probe_slice`]) run alternately over the
//! very same arrays (64-byte aligned, first touched before timing), with the same
//! blocking and threads; each reports the median of `repeats` timed calls. The probe
//! moves exactly the bytes the step moves, so `fraction_of_probe` is the share of the
//! attainable in-place bandwidth the kernel reaches. The probe runs in two forms, with
//! the step's software prefetch and without, and the faster one is the roofline: which
//! is faster depends on the CPU (on the AMD EPYC development VM, for the fp32 and bf16
//! paths at 100M parameters on one core, the plain form moved 61-63 GB/s against 54-57
//! with the prefetch, which the bf16 step beat by up to 13 %), and a roofline the step
//! can beat is no roofline.
//!
//! Bytes per parameter, as counted (write-allocate traffic of the 16-bit output is not
//! counted, for the step and the probe alike):
//! - [`BenchPath::Fp32`]: master, M, V read and written (24) + fp32 grad read (4) = 28;
//! - [`BenchPath::Bf16`]: 24 + bf16 grad read (2) + bf16 param written (2) = 28;
//! - [`BenchPath::StatesBf16`]: master (8) + bf16 M, V read and written (8) + bf16 grad
//!   (2) + bf16 param (2) = 20;
//! - [`BenchPath::StatesInt8`]: master (8) + int8 codes of M, V read and written (4) +
//!   grad (2) + param (2) = 16, plus both absmax arrays read and written (16 bytes per
//!   block of 256): 16.0625 ([`BenchPath::bytes_moved`]).
//!
//! The probe folds a key the compiler cannot see into every value it moves (see
//! `ProbeKey`): a plain load and store back of a value is a no-op that LLVM deletes,
//! which once left the compact probe moving 12 bytes per parameter while 20 (bf16) or
//! 16 (int8) were counted. A unit test runs the probe with a key that changes every
//! value and checks that each counted byte came back changed.
//!
//! Each row also times the same step over spans small enough to stay in the cores'
//! caches ([`CACHE_PARAMS_PER_THREAD`] per thread, as many threads): the kernel's own
//! ceiling on this CPU, with memory out of the way. Next to the probe's rate in
//! parameters/s, it says what limits the step at that size ([`Limit`]): a kernel whose
//! in-cache rate is below what memory allows cannot reach the probe however it streams.
//!
//! This module allocates (the arrays) and is meant for benchmarks only; it never prints.

use std::time::Instant;

use half::bf16;

use crate::cpu::{AdamW, CpuConfig, ProbeKey, SimdLevel, BLOCK_PARAMS_DEFAULT};
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

    /// Bytes a step (and the probe) of `n` parameters moves: `bytes_per_param` each, and
    /// for int8 the two absmax arrays (`absmax_len(n)` fp32 each) read and written.
    pub fn bytes_moved(self, n: usize) -> u64 {
        let absmax = match self {
            BenchPath::StatesInt8 => 2 * 2 * 4 * crate::quant::absmax_len(n),
            _ => 0,
        };
        (self.bytes_per_param() * n + absmax) as u64
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

/// Parameters per thread of the in-cache span: at most 28 bytes each, 448 KiB per thread,
/// inside the L2 of the cores this is meant for (512 KiB to 2 MiB), and a multiple of the
/// int8 block.
pub const CACHE_PARAMS_PER_THREAD: usize = 16 * 1024;

/// Parameters each thread steps in one timed sample of the in-cache step (its span again
/// and again), so that a sample lasts milliseconds, not the microseconds of one call.
const CACHE_SAMPLE_PARAMS: usize = 1 << 23;

/// What bounds a row's step: the kernel's own work (its in-cache rate is below what the
/// probe's bandwidth allows) or memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// In cache the step runs slower than memory could feed it.
    Compute,
    /// Memory feeds the step no faster than the step runs in cache.
    Memory,
}

impl Limit {
    /// `"compute"` or `"memory"`.
    pub fn name(self) -> &'static str {
        match self {
            Limit::Compute => "compute",
            Limit::Memory => "memory",
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
    /// Median seconds per probe pass, of the faster form.
    pub probe_s_median: f64,
    /// Parameters per second of the median step.
    pub params_per_s: f64,
    /// Bytes per second of the median step, in GB/s (1e9).
    pub step_gb_per_s: f64,
    /// Bytes per second of the median probe, in GB/s.
    pub probe_gb_per_s: f64,
    /// `step_gb_per_s / probe_gb_per_s`.
    pub fraction_of_probe: f64,
    /// Parameters of the in-cache span ([`CACHE_PARAMS_PER_THREAD`] per thread).
    pub cache_params: usize,
    /// Parameters per second of the median in-cache step.
    pub cache_params_per_s: f64,
    /// Every timed step, seconds, in order.
    pub step_s: Vec<f64>,
    /// Every timed probe with the step's prefetch, seconds, in order.
    pub probe_s: Vec<f64>,
    /// Every timed probe without it, seconds, in order.
    pub probe_plain_s: Vec<f64>,
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
        self.timed(
            path,
            |master, m, v, g, out| opt.step_slice(state, &hp, master, m, v, g, out),
            |master, mv, g, out| opt.step_moments(state, &hp, master, mv, g, out),
        )
    }

    fn probe(&mut self, opt: &AdamW, path: BenchPath, prefetch: bool) -> Result<f64> {
        self.probe_keyed(opt, path, ProbeKey::identity().with_prefetch(prefetch))
    }

    fn probe_keyed(&mut self, opt: &AdamW, path: BenchPath, key: ProbeKey) -> Result<f64> {
        self.timed(
            path,
            |master, m, v, g, out| opt.probe_slice_keyed(key, master, m, v, g, out),
            |master, mv, g, out| opt.probe_moments_keyed(key, master, mv, g, out),
        )
    }

    /// After a warm-up (page tables, pool threads, frequency), `repeats` timed steps,
    /// probes with prefetch and probes without, in alternating order so that drifting
    /// load hits all three alike; their seconds, in that order. `step_no` counts steps.
    fn alternated(
        &mut self,
        opt: &AdamW,
        path: BenchPath,
        repeats: usize,
        step_no: &mut u64,
    ) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
        *step_no += 1;
        self.step(opt, path, *step_no)?;
        self.probe(opt, path, true)?;
        self.probe(opt, path, false)?;
        let mut step_s = Vec::with_capacity(repeats);
        let mut probe_s = Vec::with_capacity(repeats);
        let mut probe_plain_s = Vec::with_capacity(repeats);
        for r in 0..repeats {
            *step_no += 1;
            if r % 2 == 0 {
                step_s.push(self.step(opt, path, *step_no)?);
                probe_s.push(self.probe(opt, path, true)?);
                probe_plain_s.push(self.probe(opt, path, false)?);
            } else {
                probe_plain_s.push(self.probe(opt, path, false)?);
                probe_s.push(self.probe(opt, path, true)?);
                step_s.push(self.step(opt, path, *step_no)?);
            }
        }
        Ok((step_s, probe_s, probe_plain_s))
    }

    /// Runs `full` (fp32 moments: the fp32 and bf16 paths) or `compact` (the compact
    /// moments of the states paths) over `path`'s arrays; the seconds it took.
    fn timed(
        &mut self,
        path: BenchPath,
        full: impl FnOnce(
            &mut [f32],
            &mut [f32],
            &mut [f32],
            Grads<'_>,
            Option<ParamOut<'_>>,
        ) -> Result<()>,
        compact: impl FnOnce(
            &mut [f32],
            crate::Moments<'_>,
            Grads<'_>,
            Option<ParamOut<'_>>,
        ) -> Result<()>,
    ) -> Result<f64> {
        let t = Instant::now();
        match path {
            BenchPath::Fp32 => full(
                self.master.as_mut_slice(),
                self.m.as_mut_slice(),
                self.v.as_mut_slice(),
                Grads::F32(self.g32.as_slice()),
                None,
            )?,
            BenchPath::Bf16 => full(
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
                let r = compact(
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

/// The SIMD level the benchmark's optimizers will run and why, as one line (`forced`:
/// how the caller spells a forced [`BenchConfig::simd`], e.g. a command-line flag).
pub fn level_line(cfg: &BenchConfig, forced: &str) -> Result<String> {
    let (level, reason) = SimdLevel::choose(cfg.simd)?;
    let why = match reason {
        crate::SimdReason::Requested => format!("forced by {forced}"),
        r => r.describe(),
    };
    Ok(format!(
        "SIMD level: {} ({why}; the best this CPU supports: {})",
        level.name(),
        SimdLevel::detect().name()
    ))
}

/// Column titles matching [`BenchRow::table_line`].
pub fn table_header() -> String {
    format!(
        "{:>11} {:>3} {:>6} {:>10} {:>9} {:>10} {:>8} {:>9} {:>6} {:>10} {:>8}  bytes/param",
        "params",
        "thr",
        "path",
        "simd",
        "ms/step",
        "Gparams/s",
        "GB/s",
        "probeGB/s",
        "frac",
        "cacheGp/s",
        "limit"
    )
}

impl BenchRow {
    /// Parameters per second the probe's bandwidth allows at this path's bytes per
    /// parameter: the rate of a step that moved its bytes as fast as the probe.
    pub fn memory_params_per_s(&self) -> f64 {
        self.params as f64 / self.probe_s_median
    }

    /// Whether the faster probe form is the one with the step's software prefetch.
    pub fn probe_prefetch(&self) -> bool {
        median(&self.probe_s) <= median(&self.probe_plain_s)
    }

    /// What bounds the step (see [`Limit`]).
    pub fn limit(&self) -> Limit {
        if self.cache_params_per_s < self.memory_params_per_s() {
            Limit::Compute
        } else {
            Limit::Memory
        }
    }

    /// One line of the results table: median step time, params/s, GB/s at the bytes
    /// counted per parameter, the probe's GB/s over the same arrays, the fraction, the
    /// in-cache params/s and what limits the step.
    pub fn table_line(&self) -> String {
        format!(
            "{:>11} {:>3} {:>6} {:>10} {:>9.2} {:>10.3} {:>8.2} {:>9.2} {:>6.3} {:>10.3} {:>8}  {:.2}",
            self.params,
            self.threads,
            self.path.name(),
            format!("{:?}", self.simd),
            self.step_s_median * 1e3,
            self.params_per_s / 1e9,
            self.step_gb_per_s,
            self.probe_gb_per_s,
            self.fraction_of_probe,
            self.cache_params_per_s / 1e9,
            self.limit().name(),
            self.path.bytes_moved(self.params) as f64 / self.params as f64
        )
    }
}

/// Median of a non-empty list (mean of the middle two for even lengths).
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
    let mut cache = std::collections::HashMap::new();
    for &n in &cfg.sizes {
        let mut a = Arrays::new(n)?;
        for &threads in &cfg.threads {
            let opt = AdamW::new(CpuConfig {
                threads,
                block_params: cfg.block_params,
                simd: cfg.simd,
            })?;
            for &path in &cfg.paths {
                let (step_s, probe_s, probe_plain_s) =
                    a.alternated(&opt, path, cfg.repeats, &mut step_no)?;
                let key = (opt.threads(), path);
                let (cache_params, cache_s) = match cache.get(&key) {
                    Some(&c) => c,
                    None => {
                        let c = cache_step(cfg, opt.threads(), path, &mut step_no)?;
                        cache.insert(key, c);
                        c
                    }
                };
                let bpp = path.bytes_per_param();
                let sm = median(&step_s);
                let pm = median(&probe_s).min(median(&probe_plain_s));
                let bytes = path.bytes_moved(n) as f64;
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
                    cache_params,
                    cache_params_per_s: cache_params as f64 / cache_s,
                    step_s,
                    probe_s,
                    probe_plain_s,
                };
                tracing::info!(
                    params = n,
                    threads,
                    path = path.name(),
                    params_per_s = row.params_per_s,
                    fraction = row.fraction_of_probe,
                    probe_prefetch = row.probe_prefetch(),
                    cache_params_per_s = row.cache_params_per_s,
                    limit = row.limit().name(),
                    "adamw bench row"
                );
                on_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// The median seconds of one step over the in-cache span of `threads` threads (as the
/// row's optimizer resolved them: at least 1) on `path` (measured once per thread count
/// and path, then shared by the sizes' rows), with the span's length. Each of the `threads` threads steps its own arrays of
/// [`CACHE_PARAMS_PER_THREAD`] with its own one-thread optimizer, all at once from a
/// common start: a pool splitting so small a span would time its dispatch, not the
/// kernel. A sample is the time from the first thread's start to the last one's end,
/// per call.
fn cache_step(
    cfg: &BenchConfig,
    threads: usize,
    path: BenchPath,
    step_no: &mut u64,
) -> Result<(usize, f64)> {
    let mut lanes = Vec::with_capacity(threads);
    for _ in 0..threads {
        let opt = AdamW::new(CpuConfig {
            threads: 1,
            block_params: CACHE_PARAMS_PER_THREAD,
            simd: cfg.simd,
        })?;
        lanes.push((opt, Arrays::new(CACHE_PARAMS_PER_THREAD)?));
    }
    let calls = CACHE_SAMPLE_PARAMS.div_ceil(CACHE_PARAMS_PER_THREAD);
    let mut sample = |first: u64| -> Result<f64> {
        let start = std::sync::Barrier::new(threads);
        std::thread::scope(|scope| {
            let workers: Vec<_> = lanes
                .iter_mut()
                .map(|(opt, a)| {
                    let start = &start;
                    scope.spawn(move || -> Result<(Instant, Instant)> {
                        start.wait();
                        let t0 = Instant::now();
                        for c in 0..calls {
                            a.step(opt, path, first + c as u64)?;
                        }
                        Ok((t0, Instant::now()))
                    })
                })
                .collect();
            // From the first thread's start to the last one's end, each read by the
            // worker itself: the spawning thread may not get a core until one is done.
            let mut span: Option<(Instant, Instant)> = None;
            for w in workers {
                let (t0, t1) = w.join().map_err(|_| OptimError::Bench {
                    reason: "an in-cache benchmark thread panicked".into(),
                })??;
                span = Some(span.map_or((t0, t1), |(a, b)| (a.min(t0), b.max(t1))));
            }
            let (t0, t1) = span.expect("at least one thread");
            Ok((t1 - t0).as_secs_f64() / calls as f64)
        })
    };
    *step_no += calls as u64;
    sample(*step_no)?; // warm-up: caches, frequency
    let mut times = Vec::with_capacity(cfg.repeats);
    for _ in 0..cfg.repeats {
        *step_no += calls as u64;
        times.push(sample(*step_no)?);
    }
    Ok((CACHE_PARAMS_PER_THREAD * threads, median(&times)))
}

#[cfg(test)]
mod tests {
    //! The yardstick's honesty: the probe must read and write back every byte the
    //! benchmark counts for the step. A load and store back of an unchanged value is a
    //! no-op the compiler may delete (the compact probe's moment bytes once were, so it
    //! moved 12 of the 20 or 16 bytes it claimed); with a key that changes every value,
    //! each counted byte must come back changed as the key says.

    use super::*;

    /// Sets every array to values the test key changes visibly: master 0 (becomes the
    /// gradient), gradients in 1..=7, fp32 moments 1 (doubled), compact moment bytes as
    /// they are (each flipped), absmax as they are (doubled), output a NaN pattern no
    /// finite master value rounds or truncates to.
    fn known_values(a: &mut Arrays) {
        for (i, g) in a.g32.as_mut_slice().iter_mut().enumerate() {
            *g = (1 + i % 7) as f32;
        }
        for (i, g) in a.g16.as_mut_slice().iter_mut().enumerate() {
            *g = bf16::from_f32((1 + i % 7) as f32);
        }
        a.master.as_mut_slice().fill(0.0);
        a.m.as_mut_slice().fill(1.0);
        a.v.as_mut_slice().fill(1.0);
        a.out16.as_mut_slice().fill(bf16::from_bits(0xFFFF));
    }

    /// Counts the bytes the keyed probe (one 2, zero 1, flip 0xFF) provably read and wrote
    /// back, comparing every array with its copy `b` from before.
    fn bytes_seen(path: BenchPath, a: &Arrays, b: &Arrays) -> u64 {
        let n = a.master.len;
        let mut bytes = 0u64;
        let grad = |i: usize| (1 + i % 7) as f32;
        let master = a.master.as_slice();
        let gb = if path == BenchPath::Fp32 { 4 } else { 2 };
        bytes += (0..n).filter(|&i| master[i] == grad(i)).count() as u64 * (8 + gb);
        let same = |x: &[u8], y: &[u8]| x.iter().zip(y).filter(|(p, q)| **p == !**q).count();
        match path {
            BenchPath::Fp32 | BenchPath::Bf16 => {
                for x in [a.m.as_slice(), a.v.as_slice()] {
                    bytes += x.iter().filter(|&&m| m == 2.0).count() as u64 * 8;
                }
            }
            BenchPath::StatesBf16 => {
                for (x, y) in [(&a.mb, &b.mb), (&a.vb, &b.vb)] {
                    let bits = |s: &Aligned<bf16>| -> Vec<u8> {
                        s.as_slice()
                            .iter()
                            .flat_map(|h| h.to_bits().to_le_bytes())
                            .collect()
                    };
                    bytes += 2 * same(&bits(x), &bits(y)) as u64;
                }
            }
            BenchPath::StatesInt8 => {
                for (x, y) in [(&a.mc, &b.mc), (&a.vc, &b.vc)] {
                    bytes += 2 * same(x.as_slice(), y.as_slice()) as u64;
                }
                for (x, y) in [(&a.ma, &b.ma), (&a.va, &b.va)] {
                    let doubled = x.as_slice().iter().zip(y.as_slice());
                    bytes += 8 * doubled.filter(|(p, q)| **p == 2.0 * **q).count() as u64;
                }
            }
        }
        if path != BenchPath::Fp32 {
            let written = a.out16.as_slice().iter().zip(master).filter(|(o, p)| {
                let o = o.to_bits();
                o == (p.to_bits() >> 16) as u16 || o == bf16::from_f32(**p).to_bits()
            });
            bytes += 2 * written.count() as u64;
        }
        bytes
    }

    fn copy(a: &Arrays) -> Arrays {
        let n = a.master.len;
        let mut b = Arrays::new(n).unwrap();
        b.mb.as_mut_slice().copy_from_slice(a.mb.as_slice());
        b.vb.as_mut_slice().copy_from_slice(a.vb.as_slice());
        b.mc.as_mut_slice().copy_from_slice(a.mc.as_slice());
        b.vc.as_mut_slice().copy_from_slice(a.vc.as_slice());
        b.ma.as_mut_slice().copy_from_slice(a.ma.as_slice());
        b.va.as_mut_slice().copy_from_slice(a.va.as_slice());
        b
    }

    #[test]
    fn the_probe_reads_and_writes_back_every_byte_it_counts() {
        let key = ProbeKey {
            one: 2.0,
            zero: 1.0,
            flip: 0xFF,
            prefetch: true,
        };
        let paths = [
            BenchPath::Fp32,
            BenchPath::Bf16,
            BenchPath::StatesBf16,
            BenchPath::StatesInt8,
        ];
        // Whole blocks, a vector tail and a scalar tail; one and two threads, parallel
        // blocks small enough to split.
        for n in [4096, 3 * 256 + 16 + 5] {
            for level in SimdLevel::supported() {
                for threads in [1, 2] {
                    let opt = AdamW::new(CpuConfig {
                        threads,
                        block_params: 512,
                        simd: Some(level),
                    })
                    .unwrap();
                    for (path, prefetch) in paths.into_iter().flat_map(|p| [(p, true), (p, false)])
                    {
                        let mut a = Arrays::new(n).unwrap();
                        known_values(&mut a);
                        let before = copy(&a);
                        a.probe_keyed(&opt, path, key.with_prefetch(prefetch))
                            .unwrap();
                        assert_eq!(
                            bytes_seen(path, &a, &before),
                            path.bytes_moved(n),
                            "{path:?} at {level:?}, {threads} threads, n = {n}, prefetch {prefetch}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_limit_is_the_slower_of_the_cache_rate_and_the_memory_rate() {
        let row = |cache_params_per_s: f64| BenchRow {
            params: 1000,
            threads: 1,
            path: BenchPath::StatesInt8,
            simd: SimdLevel::Scalar,
            bytes_per_param: 16,
            step_s_median: 2e-6,
            probe_s_median: 1e-6,
            params_per_s: 5e8,
            step_gb_per_s: 8.0,
            probe_gb_per_s: 16.0,
            fraction_of_probe: 0.5,
            cache_params: 16384,
            cache_params_per_s,
            step_s: vec![2e-6],
            probe_s: vec![1e-6],
            probe_plain_s: vec![1.5e-6],
        };
        // Memory allows 1000 params per microsecond: 1e9 params/s.
        assert_eq!(row(1e9).memory_params_per_s(), 1e9);
        assert_eq!(row(0.6e9).limit(), Limit::Compute);
        assert_eq!(row(2e9).limit(), Limit::Memory);
        let line = row(0.6e9).table_line();
        assert!(line.contains(" compute "), "{line}");
        assert_eq!(
            line.split_whitespace().count(),
            table_header().split_whitespace().count(),
            "{line}"
        );
    }

    #[test]
    fn the_roofline_is_the_faster_probe_form() {
        let cfg = BenchConfig {
            sizes: vec![8192],
            threads: vec![1],
            repeats: 3,
            ..BenchConfig::default()
        };
        for row in run(&cfg).unwrap() {
            let (pf, plain) = (median(&row.probe_s), median(&row.probe_plain_s));
            assert_eq!(row.probe_s.len(), 3);
            assert_eq!(row.probe_plain_s.len(), 3);
            assert_eq!(row.probe_s_median, pf.min(plain), "{:?}", row.path);
            assert_eq!(row.probe_prefetch(), pf <= plain, "{:?}", row.path);
            assert_eq!(
                row.fraction_of_probe,
                row.probe_s_median / row.step_s_median
            );
        }
    }

    #[test]
    fn bytes_moved_counts_the_absmax_of_a_partial_block() {
        assert_eq!(BenchPath::StatesInt8.bytes_moved(256), 256 * 16 + 16);
        assert_eq!(BenchPath::StatesInt8.bytes_moved(257), 257 * 16 + 32);
        assert_eq!(BenchPath::StatesBf16.bytes_moved(10), 200);
        assert_eq!(BenchPath::Fp32.bytes_moved(10), 280);
    }
}
