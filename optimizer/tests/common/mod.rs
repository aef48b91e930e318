//! Shared helpers of the optimizer's integration tests: a seeded PRNG and one optimizer
//! per (SIMD level, threads) pair, built once.

#![allow(dead_code)]

use std::sync::OnceLock;

use tidestore_optimizer::{AdamW, CpuConfig, SimdLevel};

/// xorshift64*: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
    }

    /// Uniform in [0, 1).
    pub fn unit_pos(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32) / ((1u64 << 24) as f32)
    }
}

/// Optimizers for every supported level with 1 and 2 threads and a small block (so that
/// splitting and tails are exercised), built once per test binary.
pub fn optimizers(block_params: usize) -> Vec<(SimdLevel, usize, AdamW)> {
    type PerBlock = (usize, Vec<(SimdLevel, usize, AdamW)>);
    static CACHE: OnceLock<std::sync::Mutex<Vec<PerBlock>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap();
    if let Some((_, v)) = cache.iter().find(|(b, _)| *b == block_params) {
        return v.clone();
    }
    let mut v = Vec::new();
    for level in SimdLevel::supported() {
        for threads in [1, 2] {
            let opt = AdamW::new(CpuConfig {
                threads,
                block_params,
                simd: Some(level),
            })
            .unwrap();
            v.push((level, threads, opt));
        }
    }
    cache.push((block_params, v.clone()));
    v
}

/// Bitwise equality, treating any two NaNs as equal (NaN payloads from a software
/// `fmaf` and from hardware may differ; no finite value is excused).
pub fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}
