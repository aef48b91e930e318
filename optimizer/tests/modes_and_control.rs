//! Guards against: Adam-L2 and AdamW being confused or mixed (decay fed into the moments
//! in AdamW mode, or applied outside them in L2 mode); loss scaling that steps on an
//! overflow, advances the step count on a skip, or grows at the wrong time; gradient
//! accumulation that is not a plain fp32 sum; length errors that do not say which slice.

mod common;

use half::{bf16, f16};
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HyperParams, LossScalerConfig, Mode, OptimError, StepController,
    StepDecision, StepState,
};

fn opt() -> AdamW {
    AdamW::new(CpuConfig::default()).unwrap()
}

fn hp(mode: Mode, wd: f32) -> HyperParams {
    HyperParams {
        lr: 1e-2,
        weight_decay: wd,
        mode,
        ..HyperParams::default()
    }
}

/// `steps` steps of `o` with `hp` and gradient `g` every time, from `p0` and zero
/// moments: the new (p, m, v).
fn stepped(
    o: &AdamW,
    hp: &HyperParams,
    p0: &[f32],
    g: &[f32],
    steps: u64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = p0.len();
    let (mut p, mut m, mut v) = (p0.to_vec(), vec![0.0; n], vec![0.0; n]);
    for t in 1..=steps {
        let state = StepState::new(t);
        o.step_slice(state, hp, &mut p, &mut m, &mut v, Grads::F32(g), None)
            .unwrap();
    }
    (p, m, v)
}

/// With zero gradients, AdamW only shrinks p by `1 - lr*wd` and leaves M and V at zero;
/// Adam-L2 feeds `wd*p` into the moments, so the first step moves p by about `lr`
/// towards zero (the normalised update of a gradient `wd*p` is ~sign(p)).
#[test]
fn zero_grad_decay_differs_as_defined() {
    let n = 100;
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 - 49.5) / 10.0).collect();
    let g = vec![0.0f32; n];
    let o = opt();

    let (p, m, v) = stepped(&o, &hp(Mode::AdamW, 0.1), &p0, &g, 1);
    for i in 0..n {
        let want = f64::from(p0[i]) * (1.0 - 1e-2 * 0.1);
        assert!(
            (f64::from(p[i]) - want).abs() <= 1e-7 * want.abs().max(1.0),
            "AdamW p[{i}]"
        );
        assert_eq!(
            (m[i], v[i]),
            (0.0, 0.0),
            "AdamW moments must not see the decay"
        );
    }

    let (p, m, v) = stepped(&o, &hp(Mode::AdamL2, 0.1), &p0, &g, 1);
    // The hyper-parameters are f32: 1 - beta is taken from the f32 betas.
    let (b1, b2) = (f64::from(0.9f32), f64::from(0.999f32));
    for i in 0..n {
        let g = f64::from(0.1f32) * f64::from(p0[i]);
        assert!(
            (f64::from(m[i]) - (1.0 - b1) * g).abs() <= 1e-7 * g.abs(),
            "L2 m[{i}]"
        );
        assert!(
            (f64::from(v[i]) - (1.0 - b2) * g * g).abs() <= 1e-6 * g * g,
            "L2 v[{i}]"
        );
        // Step 1: m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) ~ sign(p).
        let want = f64::from(p0[i]) - 1e-2 * g / (g.abs() + 1e-8);
        assert!(
            (f64::from(p[i]) - want).abs() <= 1e-6,
            "L2 p[{i}]: {} vs {want}",
            p[i]
        );
    }
}

/// Without weight decay the two modes are the same update, bit for bit.
#[test]
fn modes_agree_without_decay() {
    let mut rng = common::Rng::new(5);
    let n = 1000;
    let p0: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.unit() * 1e-2).collect();
    let o = opt();
    let run = |mode| stepped(&o, &hp(mode, 0.0), &p0, &g, 3);
    assert_eq!(run(Mode::AdamW), run(Mode::AdamL2));
}

/// With decay, L2 changes the moments (AdamW does not), and the parameters differ.
#[test]
fn modes_differ_with_decay() {
    let mut rng = common::Rng::new(6);
    let n = 1000;
    let p0: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.unit() * 1e-2).collect();
    let o = opt();
    let run = |mode, wd| stepped(&o, &hp(mode, wd), &p0, &g, 1);
    let (_, m_plain, _) = run(Mode::AdamW, 0.0);
    let (pw, mw, _) = run(Mode::AdamW, 0.5);
    let (pl, ml, _) = run(Mode::AdamL2, 0.5);
    assert_eq!(mw, m_plain, "AdamW: decay never reaches M");
    assert_ne!(ml, m_plain, "L2: decay enters M");
    assert_ne!(pw, pl);
}

#[test]
fn loss_scaler_skips_backs_off_and_grows() {
    let cfg = LossScalerConfig {
        init_scale: 8.0,
        growth_interval: 2,
        ..LossScalerConfig::default()
    };
    let mut c = StepController::new(None, Some(cfg)).unwrap();
    // Overflow: skip, step count unchanged, scale halved.
    assert_eq!(
        c.decide(f64::INFINITY),
        StepDecision::Skip { loss_scale: 4.0 }
    );
    assert_eq!(c.decide(f64::NAN), StepDecision::Skip { loss_scale: 2.0 });
    assert_eq!(c.step(), 0);
    // Two clean steps: the second one grows the scale afterwards.
    let StepDecision::Apply { state, .. } = c.decide(4.0 * 4.0) else {
        panic!()
    };
    assert_eq!(
        (state.step, state.grad_scale, c.loss_scale()),
        (1, 0.5, 2.0)
    );
    let StepDecision::Apply { state, .. } = c.decide(1.0) else {
        panic!()
    };
    assert_eq!(
        (state.step, state.grad_scale, c.loss_scale()),
        (2, 0.5, 4.0)
    );
    // Checkpoint state round-trips as plain numbers.
    let s = c.state();
    let mut d = StepController::new(None, Some(cfg)).unwrap();
    d.restore(s).unwrap();
    assert_eq!(d.state(), s);
    assert_eq!(d, c);
    // Backoff never goes below min_scale.
    for _ in 0..10 {
        c.decide(f64::INFINITY);
    }
    assert_eq!(c.loss_scale(), 1.0);
}

#[test]
fn clipping_scale_folds_into_grad_scale() {
    let mut c = StepController::new(Some(1.0), None).unwrap();
    let StepDecision::Apply {
        state,
        grad_norm,
        clip_coef,
    } = c.decide(16.0)
    else {
        panic!()
    };
    assert_eq!(grad_norm, 4.0);
    assert!((clip_coef - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
    assert_eq!(state.grad_scale, clip_coef as f32);
    let StepDecision::Apply {
        state, clip_coef, ..
    } = c.decide(0.25)
    else {
        panic!()
    };
    assert_eq!((clip_coef, state.grad_scale, state.step), (1.0, 1.0, 2));
}

#[test]
fn accumulate_sums_micro_batches_in_fp32() {
    let o = opt();
    let n = 1037;
    let a: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32 * 0.25)).collect();
    let b: Vec<bf16> = (0..n).map(|i| bf16::from_f32(-(i as f32))).collect();
    let c: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let mut acc = vec![0.0f32; n];
    o.accumulate(&mut acc, Grads::F16(&a), 1.0).unwrap();
    o.accumulate(&mut acc, Grads::Bf16(&b), 1.0).unwrap();
    o.accumulate(&mut acc, Grads::F32(&c), 2.0).unwrap();
    for i in 0..n {
        let want = a[i].to_f32() + b[i].to_f32() + 2.0 * c[i];
        assert_eq!(acc[i], want, "acc[{i}]");
    }
}

#[test]
fn errors_name_the_slice() {
    let o = opt();
    let (mut p, mut m, mut v) = (vec![0.0; 10], vec![0.0; 10], vec![0.0; 9]);
    let g = vec![0.0f32; 10];
    let e = o
        .step_slice(
            StepState::new(1),
            &HyperParams::default(),
            &mut p,
            &mut m,
            &mut v,
            Grads::F32(&g),
            None,
        )
        .unwrap_err();
    assert_eq!(
        e,
        OptimError::LengthMismatch {
            slice: "v",
            len: 9,
            reference: "master",
            expected: 10
        }
    );
    assert_eq!(
        e.to_string(),
        "slice `v` has 9 elements but `master` has 10"
    );
    let mut v = vec![0.0; 10];
    let mut out = vec![bf16::ZERO; 11];
    let e = o
        .step_slice(
            StepState::new(1),
            &HyperParams::default(),
            &mut p,
            &mut m,
            &mut v,
            Grads::F32(&g),
            Some(tidestore_optimizer::ParamOut::Bf16(&mut out)),
        )
        .unwrap_err();
    assert!(matches!(
        e,
        OptimError::LengthMismatch {
            slice: "out",
            len: 11,
            ..
        }
    ));
    let bad = HyperParams {
        beta2: 1.0,
        ..HyperParams::default()
    };
    let e = o
        .step_slice(
            StepState::new(1),
            &bad,
            &mut p,
            &mut m,
            &mut v,
            Grads::F32(&g),
            None,
        )
        .unwrap_err();
    assert!(matches!(e, OptimError::InvalidParam { name: "beta2", .. }));
    let e = o
        .step_slice(
            StepState::new(0),
            &HyperParams::default(),
            &mut p,
            &mut m,
            &mut v,
            Grads::F32(&g),
            None,
        )
        .unwrap_err();
    assert!(matches!(e, OptimError::InvalidParam { name: "step", .. }));
}
