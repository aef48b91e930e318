//! Benchmarks of chunk compression on real Adam state: does shuffle + zstd pay on disk?
//!
//! Setup: 16 Mi fp32 parameters (64 MiB) drawn from N(0, 0.02²), then `STEPS` AdamW
//! steps (β1 0.9, β2 0.999, lr 1e-3, weight decay 0.01, ε 1e-8) on random gradients whose
//! scale varies from block to block (log-uniform in [1e-4, 1e-2], 4096 values per block,
//! like tensors of different layers). That gives M and V as the optimizer would store
//! them on the NVMe tier.
//!
//! Printed once (stderr): the compression ratio (raw / stored) of M, V, the fp32 params
//! and the params cast to bf16, with the byte shuffle (word = dtype size) and without it
//! (word 1), at zstd levels 1 and 3 and the fast level -3.
//!
//! Timed (criterion, throughput in bytes of uncompressed chunk): `shuffle_zstd1` (shuffle
//! then zstd level 1, what a swap-file write does) and `unzstd_unshuffle` (what a read
//! does) on the 64 MiB M and V chunks.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use tidestore_io::compress::{compress_bound, unshuffle, Codec};

const PARAMS: usize = 16 << 20;
const STEPS: usize = 10;
const BLOCK: usize = 4096;
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const LR: f32 = 1e-3;
const WEIGHT_DECAY: f32 = 0.01;
const EPS: f32 = 1e-8;

/// xorshift64* with Box–Muller normals: no extra dependency, same state every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 1.0) / (1u64 << 24) as f32
    }

    /// Two independent N(0, 1) draws.
    fn normal_pair(&mut self) -> (f32, f32) {
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let theta = std::f32::consts::TAU * self.uniform();
        (r * theta.cos(), r * theta.sin())
    }

    fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        for pair in out.chunks_mut(2) {
            let (a, b) = self.normal_pair();
            pair[0] = a * std;
            if let Some(x) = pair.get_mut(1) {
                *x = b * std;
            }
        }
    }
}

struct AdamState {
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// Plain scalar AdamW, `STEPS` steps on random gradients.
fn adam_state() -> AdamState {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut params = vec![0f32; PARAMS];
    rng.fill_normal(&mut params, 0.02);
    let mut m = vec![0f32; PARAMS];
    let mut v = vec![0f32; PARAMS];
    let mut grad = vec![0f32; PARAMS];
    // One gradient scale per block, fixed across steps (a layer keeps its scale).
    let scales: Vec<f32> = (0..PARAMS / BLOCK)
        .map(|_| 10f32.powf(-4.0 + 2.0 * rng.uniform()))
        .collect();
    for step in 1..=STEPS {
        rng.fill_normal(&mut grad, 1.0);
        let bias1 = 1.0 - BETA1.powi(step as i32);
        let bias2 = 1.0 - BETA2.powi(step as i32);
        for (b, &scale) in scales.iter().enumerate() {
            let r = b * BLOCK..(b + 1) * BLOCK;
            for (((p, m), v), g) in params[r.clone()]
                .iter_mut()
                .zip(&mut m[r.clone()])
                .zip(&mut v[r.clone()])
                .zip(&grad[r])
            {
                let g = g * scale;
                *m = BETA1 * *m + (1.0 - BETA1) * g;
                *v = BETA2 * *v + (1.0 - BETA2) * g * g;
                let update = (*m / bias1) / ((*v / bias2).sqrt() + EPS);
                *p -= LR * (update + WEIGHT_DECAY * *p);
            }
        }
    }
    AdamState { params, m, v }
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// bf16 with round-to-nearest-even (no NaNs here).
fn bf16_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter()
        .flat_map(|x| {
            let bits = x.to_bits();
            let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
            (rounded as u16).to_le_bytes()
        })
        .collect()
}

struct Chunks {
    m: Vec<u8>,
    v: Vec<u8>,
    params: Vec<u8>,
    params_bf16: Vec<u8>,
}

fn chunks() -> &'static Chunks {
    static CHUNKS: OnceLock<Chunks> = OnceLock::new();
    CHUNKS.get_or_init(|| {
        let t = Instant::now();
        let s = adam_state();
        eprintln!(
            "compress bench: {STEPS} AdamW steps on {PARAMS} params took {:.1} s",
            t.elapsed().as_secs_f64()
        );
        Chunks {
            m: f32_bytes(&s.m),
            v: f32_bytes(&s.v),
            params: f32_bytes(&s.params),
            params_bf16: bf16_bytes(&s.params),
        }
    })
}

/// Compressed size of `data`, and the seconds compression and decompression took.
fn measure(data: &[u8], level: i32, word_bytes: usize) -> (usize, f64, f64) {
    let mut codec = Codec::new(level, word_bytes).expect("valid codec settings");
    let mut scratch = vec![0u8; data.len()];
    let mut packed = vec![0u8; compress_bound(data.len())];
    let mut back = vec![0u8; data.len()];
    let t = Instant::now();
    let n = codec
        .compress(0, data, &mut scratch, &mut packed)
        .expect("compression into a bound-sized buffer");
    let compress_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    codec
        .decompress(0, &packed[..n], &mut scratch, &mut back)
        .expect("decompression of what was just compressed");
    let decompress_s = t.elapsed().as_secs_f64();
    assert!(back == data, "round trip changed the data");
    (n, compress_s, decompress_s)
}

fn report_ratios(c: &Chunks) {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!("compress bench: ratio = raw / compressed; MB/s of raw bytes (one run each)");
    let cases: [(&str, &[u8], usize); 4] = [
        ("M (fp32)", &c.m, 4),
        ("V (fp32)", &c.v, 4),
        ("params (fp32)", &c.params, 4),
        ("params (bf16)", &c.params_bf16, 2),
    ];
    for (name, data, word_bytes) in cases {
        for (level, word) in [(1, word_bytes), (3, word_bytes), (-3, word_bytes), (1, 1)] {
            let (n, cs, ds) = measure(data, level, word);
            eprintln!(
                "  {name:<14} {:>5.1} MiB  zstd {level} shuffle {:<3}  ratio {:.3}  ({:.1} MiB stored)  compress {:>6.0} MB/s  decompress {:>6.0} MB/s",
                mib(data.len()),
                if word > 1 { word.to_string() } else { "off".into() },
                data.len() as f64 / n as f64,
                mib(n),
                data.len() as f64 / cs / 1e6,
                data.len() as f64 / ds / 1e6,
            );
        }
    }
}

/// Shuffle + zstd 1 and zstd + unshuffle throughput on the 64 MiB M and V chunks.
pub fn bench(c: &mut Criterion) {
    let chunks = chunks();
    report_ratios(chunks);
    let mut group = c.benchmark_group("compress");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (name, data) in [("M", &chunks.m), ("V", &chunks.v)] {
        group.throughput(Throughput::Bytes(data.len() as u64));
        let mut codec = Codec::new(1, 4).expect("valid codec settings");
        let mut scratch = vec![0u8; data.len()];
        let mut packed = vec![0u8; compress_bound(data.len())];
        group.bench_function(format!("shuffle_zstd1/{name}"), |b| {
            b.iter(|| {
                codec
                    .compress(0, black_box(data), &mut scratch, &mut packed)
                    .expect("compression into a bound-sized buffer")
            })
        });
        let n = codec
            .compress(0, data, &mut scratch, &mut packed)
            .expect("compression into a bound-sized buffer");
        let mut out = vec![0u8; data.len()];
        group.bench_function(format!("unzstd_unshuffle/{name}"), |b| {
            b.iter(|| {
                codec
                    .decompress(0, black_box(&packed[..n]), &mut scratch, &mut out)
                    .expect("decompression of a good frame")
            })
        });
        // The shuffle alone, to see its share of the write path.
        group.bench_function(format!("unshuffle_only/{name}"), |b| {
            b.iter(|| unshuffle(black_box(&scratch[..]), &mut out, 4))
        });
    }
    group.finish();
}
