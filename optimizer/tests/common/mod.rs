//! Shared helpers of the optimizer's integration tests: a seeded PRNG and one optimizer
//! per (SIMD level, threads) pair, built once.

#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod gpu;

use std::sync::OnceLock;

use proptest::prelude::*;
use tidestore_optimizer::{AdamW, CpuConfig, HyperParams, Mode, SimdLevel, StepState};

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

/// The scalar kernel, one thread: the reference every level is held to.
pub fn scalar() -> AdamW {
    AdamW::new(CpuConfig {
        threads: 1,
        block_params: 1 << 16,
        simd: Some(SimdLevel::Scalar),
    })
    .unwrap()
}

/// Fails the case at the first element whose bits differ from the scalar kernel's.
pub fn check_same(a: &[f32], b: &[f32], what: &str) -> Result<(), TestCaseError> {
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        prop_assert!(
            same_f32(x, y),
            "{what}[{i}]: {x:e} ({:#x}) vs scalar {y:e} ({:#x})",
            x.to_bits(),
            y.to_bits()
        );
    }
    Ok(())
}

#[derive(Debug, Clone)]
/// One property-test case of a step.
pub struct Case {
    pub len: usize,
    pub seed: u64,
    pub hp: HyperParams,
    pub state: StepState,
    pub gkind: u8,
    pub okind: u8,
    pub specials: bool,
    pub block: usize,
}

/// A random step: `len` below `len_max`, hyper-parameters, state, gradient and output
/// kinds, special values or not, and a block size from `blocks`.
pub fn case(len_max: usize, blocks: &[usize]) -> impl Strategy<Value = Case> {
    (
        (
            0usize..len_max,
            any::<u64>(),
            0f32..1e-2,
            0f32..0.999,
            0.9f32..0.99999,
        ),
        (-12i32..-3, 0f32..0.2, any::<bool>(), 1u64..5000, -6i32..4),
        (
            0u8..3,
            0u8..3,
            any::<bool>(),
            prop::sample::select(blocks.to_vec()),
        ),
    )
        .prop_map(
            |(
                (len, seed, lr, beta1, beta2),
                (eps_e, wd, l2, step, gs_e),
                (gkind, okind, specials, block),
            )| Case {
                len,
                seed,
                hp: HyperParams {
                    lr,
                    beta1,
                    beta2,
                    eps: 10f32.powi(eps_e),
                    weight_decay: wd,
                    mode: if l2 { Mode::AdamL2 } else { Mode::AdamW },
                },
                state: StepState {
                    step,
                    grad_scale: 2f32.powi(gs_e) * 0.7,
                },
                gkind,
                okind,
                specials,
                block,
            },
        )
}
