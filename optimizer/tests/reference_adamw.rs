//! Guards against an optimizer that drifts from AdamW's definition: 12 iterations of
//! two parameter groups (fp32 gradients with AdamW and a bf16 parameter copy; fp16
//! loss-scaled gradients with Adam-L2 and an fp16 copy) with global norm clipping (active
//! on some steps, not on others), weight decay, dynamic loss scaling with growth, and an
//! fp16 overflow (an inf gradient) that must skip the step and halve the scale — compared
//! after every iteration with a float64 AdamW written here, for every SIMD level and 1
//! and 2 threads.
//!
//! Relative error is measured per array as `max_i |x_i - r_i| / max_i |r_i|` (the
//! infinity-norm relative error): it bounds every element's error by the array's scale
//! and does not blow up on elements that pass near zero (moments change sign). Bound:
//! 1e-6 for master parameters, M and V.

mod common;

use common::Rng;
use half::{bf16, f16};
use tidestore_optimizer::{
    AdamW, Grads, HyperParams, LossScalerConfig, Mode, ParamGroup, ParamOut, StepController,
    StepDecision,
};

const ITERS: usize = 12;
const OVERFLOW_AT: usize = 4;
const MAX_NORM: f64 = 1.0;
const N_A: usize = 1000;
const N_B: usize = 517;

fn rel_inf(x: &[f32], r: &[f64]) -> f64 {
    let num = x
        .iter()
        .zip(r)
        .map(|(&a, &b)| (f64::from(a) - b).abs())
        .fold(0.0, f64::max);
    let den = r.iter().map(|b| b.abs()).fold(0.0, f64::max);
    num / den
}

/// The float64 reference state of one group.
struct RefGroup {
    hp: HyperParams,
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
}

impl RefGroup {
    // Four parallel arrays indexed as in the textbook formula.
    #[allow(clippy::needless_range_loop)]
    fn step(&mut self, raw: &[f64], grad_scale: f64, t: i32) {
        let lr = f64::from(self.hp.lr);
        let b1 = f64::from(self.hp.beta1);
        let b2 = f64::from(self.hp.beta2);
        let eps = f64::from(self.hp.eps);
        let wd = f64::from(self.hp.weight_decay);
        let bc1 = 1.0 - b1.powi(t);
        let bc2 = 1.0 - b2.powi(t);
        for i in 0..self.p.len() {
            let mut g = raw[i] * grad_scale;
            if self.hp.mode == Mode::AdamL2 {
                g += wd * self.p[i];
            }
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g;
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g * g;
            let denom = self.v[i].sqrt() / bc2.sqrt() + eps;
            if self.hp.mode == Mode::AdamW {
                self.p[i] *= 1.0 - lr * wd;
            }
            self.p[i] -= lr / bc1 * self.m[i] / denom;
        }
    }
}

fn run(opt: &AdamW, label: &str) {
    let hp_a = HyperParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        mode: Mode::AdamW,
    };
    let hp_b = HyperParams {
        lr: 3e-3,
        beta1: 0.8,
        beta2: 0.99,
        eps: 1e-6,
        weight_decay: 0.05,
        mode: Mode::AdamL2,
    };
    let mut rng = Rng::new(42);
    let mut pa: Vec<f32> = (0..N_A).map(|_| rng.unit()).collect();
    let mut pb: Vec<f32> = (0..N_B).map(|_| 0.5 * rng.unit()).collect();
    let (mut ma, mut va) = (vec![0.0f32; N_A], vec![0.0f32; N_A]);
    let (mut mb, mut vb) = (vec![0.0f32; N_B], vec![0.0f32; N_B]);
    let mut out_a = vec![bf16::ZERO; N_A];
    let mut out_b = vec![f16::ZERO; N_B];
    let mut ref_a = RefGroup {
        hp: hp_a,
        p: pa.iter().map(|&x| f64::from(x)).collect(),
        m: vec![0.0; N_A],
        v: vec![0.0; N_A],
    };
    let mut ref_b = RefGroup {
        hp: hp_b,
        p: pb.iter().map(|&x| f64::from(x)).collect(),
        m: vec![0.0; N_B],
        v: vec![0.0; N_B],
    };
    let scaler = LossScalerConfig {
        init_scale: 1024.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 4,
        min_scale: 1.0,
        max_scale: 65536.0,
    };
    let mut ctrl = StepController::new(Some(MAX_NORM as f32), Some(scaler)).unwrap();
    let (mut ref_scale, mut ref_good, mut ref_t) = (1024.0f64, 0u32, 0i32);
    let (mut clipped, mut unclipped, mut skipped) = (0, 0, 0);

    for it in 0..ITERS {
        // Large gradients (clipped) on even iterations, small ones on odd.
        let amp = if it % 2 == 0 { 0.1 } else { 0.01 };
        let ls = ctrl.loss_scale();
        assert_eq!(
            f64::from(ls),
            ref_scale,
            "{label}: loss scale at iteration {it}"
        );
        let ga: Vec<f32> = (0..N_A).map(|_| amp * rng.unit() * ls).collect();
        let mut gb: Vec<f16> = (0..N_B)
            .map(|_| f16::from_f32(amp * rng.unit() * ls))
            .collect();
        if it == OVERFLOW_AT {
            gb[N_B / 2] = f16::INFINITY;
        }
        let raw_a: Vec<f64> = ga.iter().map(|&x| f64::from(x)).collect();
        let raw_b: Vec<f64> = gb.iter().map(|x| f64::from(x.to_f32())).collect();

        let decision = {
            let mut groups = [
                ParamGroup {
                    hp: hp_a,
                    master: &mut pa,
                    m: &mut ma,
                    v: &mut va,
                    grads: Grads::F32(&ga),
                    out: Some(ParamOut::Bf16(&mut out_a)),
                },
                ParamGroup {
                    hp: hp_b,
                    master: &mut pb,
                    m: &mut mb,
                    v: &mut vb,
                    grads: Grads::F16(&gb),
                    out: Some(ParamOut::F16(&mut out_b)),
                },
            ];
            opt.step_groups(&mut ctrl, &mut groups).unwrap()
        };

        // Reference decision.
        let sq: f64 = raw_a.iter().chain(&raw_b).map(|x| x * x).sum();
        if !sq.is_finite() {
            ref_scale = (ref_scale * 0.5).max(1.0);
            ref_good = 0;
            skipped += 1;
            assert_eq!(it, OVERFLOW_AT);
            assert!(
                matches!(decision, StepDecision::Skip { loss_scale } if f64::from(loss_scale) == ref_scale),
                "{label}: {decision:?}"
            );
        } else {
            let norm = sq.sqrt() / ref_scale;
            let clip = (MAX_NORM / (norm + 1e-6)).min(1.0);
            if clip < 1.0 {
                clipped += 1;
            } else {
                unclipped += 1;
            }
            ref_t += 1;
            let StepDecision::Apply {
                state, grad_norm, ..
            } = decision
            else {
                panic!("{label}: iteration {it} skipped: {decision:?}");
            };
            assert!((grad_norm - norm).abs() <= 1e-12 * norm, "{label}: norm");
            assert_eq!(state.step, ref_t as u64);
            ref_a.step(&raw_a, clip / ref_scale, ref_t);
            ref_b.step(&raw_b, clip / ref_scale, ref_t);
            ref_good += 1;
            if ref_good == 4 {
                ref_scale = (ref_scale * 2.0).min(65536.0);
                ref_good = 0;
            }
        }
        assert_eq!(ctrl.step(), ref_t as u64);

        for (name, x, r) in [
            ("master A", &pa, &ref_a.p),
            ("m A", &ma, &ref_a.m),
            ("v A", &va, &ref_a.v),
            ("master B", &pb, &ref_b.p),
            ("m B", &mb, &ref_b.m),
            ("v B", &vb, &ref_b.v),
        ] {
            if r.iter().all(|&x| x == 0.0) {
                assert!(x.iter().all(|&x| x == 0.0), "{label}: {name} moved");
                continue;
            }
            let e = rel_inf(x, r);
            assert!(
                e <= 1e-6,
                "{label}: iteration {it}: {name} relative error {e:e}"
            );
        }
        if ref_t > 0 {
            for i in 0..N_A {
                assert_eq!(out_a[i], bf16::from_f32(pa[i]), "{label}: bf16 out {i}");
            }
            for i in 0..N_B {
                assert_eq!(
                    out_b[i].to_bits(),
                    f16::from_f32(pb[i]).to_bits(),
                    "{label}: f16 out {i}"
                );
            }
        }
    }
    assert_eq!((skipped, ref_t), (1, (ITERS - 1) as i32));
    assert!(
        clipped > 0 && unclipped > 0,
        "clipping must be both on and off"
    );
    // Growth happened (4 clean steps before the overflow, then more after).
    assert!(ctrl.loss_scale() > 512.0);
}

#[test]
fn matches_f64_reference_with_clipping_decay_and_overflow_skip() {
    for (level, threads, opt) in common::optimizers(64) {
        run(&opt, &format!("{level:?} x{threads}"));
    }
    // The default block size (one block here), too.
    for (level, threads, opt) in common::optimizers(tidestore_optimizer::BLOCK_PARAMS_DEFAULT) {
        run(&opt, &format!("{level:?} x{threads} default block"));
    }
}

/// Reports the achieved error (run with `--nocapture`), so the margin under 1e-6 is known.
#[test]
fn reference_error_margin() {
    let opt = AdamW::new(tidestore_optimizer::CpuConfig::default()).unwrap();
    let hp = HyperParams::default();
    let mut rng = Rng::new(7);
    let n = 4096;
    let mut p: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut r = RefGroup {
        hp,
        p: p.iter().map(|&x| f64::from(x)).collect(),
        m: vec![0.0; n],
        v: vec![0.0; n],
    };
    let mut worst = [0.0f64; 3];
    for t in 1..=20 {
        let g: Vec<f32> = (0..n).map(|_| 0.01 * rng.unit()).collect();
        let raw: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        opt.step_slice(
            tidestore_optimizer::StepState::new(t),
            &hp,
            &mut p,
            &mut m,
            &mut v,
            Grads::F32(&g),
            None,
        )
        .unwrap();
        r.step(&raw, 1.0, t as i32);
        worst[0] = worst[0].max(rel_inf(&p, &r.p));
        worst[1] = worst[1].max(rel_inf(&m, &r.m));
        worst[2] = worst[2].max(rel_inf(&v, &r.v));
    }
    println!(
        "20 steps, worst relative error: master {:e}, m {:e}, v {:e}",
        worst[0], worst[1], worst[2]
    );
    assert!(worst.iter().all(|&e| e <= 1e-6));
}
