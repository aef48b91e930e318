//! Guards against NaN bits that depend on where a step ran: x86 arithmetic keeps an input
//! NaN's payload and sign, a GPU writes its canonical NaN, so without a policy a group
//! stepped on the CPU and one stepped on the GPU differ in the bits of every NaN.
//!
//! Claim tested: at every SIMD level this CPU supports, with one and two threads, for
//! every gradient and output dtype and both modes, each NaN a step writes into master, M
//! or V has exactly the bits [`CANONICAL_NAN_BITS`] — whatever NaN (signalling, negative,
//! with a payload) was in the parameter, a moment or the gradient — and the 16-bit copy
//! of such a parameter is `0x7FFF`. Lengths cover the SIMD bodies and their scalar tails.
//! (The GPU kernel selects the same NaN explicitly; that is confirmed on a GPU only.)

mod common;

use half::{bf16, f16};
use tidestore_optimizer::{Grads, HyperParams, Mode, ParamOut, StepState, CANONICAL_NAN_BITS};

/// NaNs of every kind: quiet, signalling, negative, with payloads.
const NANS: [u32; 5] = [
    0x7FC0_0000,
    0xFFC0_1234,
    0x7F80_0001,
    0xFFBF_FFFF,
    0x7FFF_FFFF,
];

/// A slice of `n` ordinary values with NaNs of every kind at every fifth element (from
/// index 0 for seed 1, so every case has one).
fn with_nans(n: usize, seed: u64, base: f32) -> Vec<f32> {
    let mut rng = common::Rng::new(seed);
    (0..n)
        .map(|i| {
            if (i + seed as usize) % 5 == 1 {
                f32::from_bits(NANS[(i / 5) % NANS.len()])
            } else {
                base + rng.unit() * 0.5
            }
        })
        .collect()
}

fn hp(mode: Mode) -> HyperParams {
    HyperParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        mode,
    }
}

#[test]
fn every_nan_a_step_writes_is_the_canonical_nan_at_every_simd_level() {
    let state = StepState {
        step: 3,
        grad_scale: 1.0,
    };
    let mut checked = 0usize;
    for (level, threads, opt) in common::optimizers(64) {
        for n in [1usize, 7, 8, 15, 16, 17, 33, 200] {
            for mode in [Mode::AdamW, Mode::AdamL2] {
                for gk in 0..3 {
                    for ok in 0..3 {
                        let mut p = with_nans(n, 1, 0.0);
                        let mut m = with_nans(n, 2, 0.0);
                        let mut v = with_nans(n, 3, 1.0);
                        for x in v.iter_mut().filter(|x| !x.is_nan()) {
                            *x = x.abs();
                        }
                        let g32 = with_nans(n, 4, 0.0);
                        let g16: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
                        let gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
                        let grads = match gk {
                            0 => Grads::F32(&g32),
                            1 => Grads::F16(&g16),
                            _ => Grads::Bf16(&gb),
                        };
                        let mut o16 = vec![f16::ZERO; n];
                        let mut ob = vec![bf16::ZERO; n];
                        let out = match ok {
                            0 => None,
                            1 => Some(ParamOut::F16(&mut o16)),
                            _ => Some(ParamOut::Bf16(&mut ob)),
                        };
                        opt.step_slice(state, &hp(mode), &mut p, &mut m, &mut v, grads, out)
                            .unwrap();
                        let what = format!("{level:?} x{threads} n={n} {mode:?} g{gk} o{ok}");
                        let mut nans = 0;
                        for (name, xs) in [("master", &p), ("m", &m), ("v", &v)] {
                            for (i, x) in xs.iter().enumerate() {
                                if x.is_nan() {
                                    nans += 1;
                                    assert_eq!(
                                        x.to_bits(),
                                        CANONICAL_NAN_BITS,
                                        "{what}: {name}[{i}] = {:#010x}",
                                        x.to_bits()
                                    );
                                }
                            }
                        }
                        assert!(nans > 0, "{what}: the case must produce NaNs");
                        for (i, x) in p.iter().enumerate() {
                            let bits = match ok {
                                0 => continue,
                                1 => o16[i].to_bits(),
                                _ => ob[i].to_bits(),
                            };
                            if x.is_nan() {
                                assert_eq!(bits, 0x7FFF, "{what}: out[{i}] = {bits:#06x}");
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 0);
}

#[test]
fn the_gpu_kernel_source_selects_the_same_nan() {
    // The GPU side of the policy, as far as it can be checked without a GPU.
    let cu = tidestore_optimizer::gpu::ADAMW_CU;
    assert!(cu.contains("__uint_as_float(0x7fffffffu)"));
    assert_eq!(CANONICAL_NAN_BITS, 0x7fff_ffff);
    for stored in [
        "canon_nan(__fmaf_rn(c.neg_step",
        "mi = canon_nan(mi)",
        "vi = canon_nan(vi)",
    ] {
        assert!(
            cu.contains(stored),
            "the kernel no longer canonicalizes: {stored}"
        );
    }
}
