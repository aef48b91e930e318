//! `Overlap::Forward`: the step is decided at `step()` and each tensor is updated at its
//! next use. Two trainers, one with the step made at once (`Off`), one deferred, run
//! the same iterations (clipping on, a learning rate changed between steps, a
//! checkpoint in the middle) with small chunks, a host pool of a few of them and the
//! rest on the swap file: what every forward fetches must be equal bit for bit, and so
//! must every parameter, master copy and moment at the end, in f32 (gradients in companions) and bf16 (gradients over
//! the 16-bit parameters, which the next forward reads).

use tidestore_train::{
    Budget, DeviceChoice, HyperParams, MomentForm, Overlap, ParamSpec, Precision, TensorState,
    TrainError, Trainer, TrainerConfig,
};

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("embed", &[40, 16], true),
        ParamSpec::new("frozen", &[16, 16], false),
        ParamSpec::new("a", &[16, 48], true),
        ParamSpec::new("b", &[48, 16], true),
        ParamSpec::new("norm", &[16], true),
        ParamSpec::new("head", &[40, 16], true),
    ]
}

fn open(dir: &std::path::Path, precision: Precision, overlap: Overlap) -> Trainer {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.01), dir);
    cfg.precision = precision;
    cfg.overlap = overlap;
    cfg.max_grad_norm = Some(0.5);
    cfg.chunk_elements = Some(2048);
    cfg.device = DeviceChoice::Sim;
    cfg.device_budget = Budget::Chunks(4);
    cfg.host_budget = Budget::Chunks(5);
    cfg.moments = MomentForm::Int8;
    let mut t = Trainer::open(&specs(), &cfg).unwrap();
    for (i, s) in specs().iter().enumerate() {
        let n = s.elements();
        let v: Vec<f32> = (0..n)
            .map(|k| ((k * 7 + i * 13) % 29) as f32 * 0.03 - 0.4)
            .collect();
        t.set_values(i, &v).unwrap();
    }
    t
}

/// One iteration: every parameter fetched in order (forward), then a gradient that
/// depends on what was fetched for every trainable one, in reverse (backward), then the
/// step. Returns what forward fetched, as bits.
fn iteration(t: &mut Trainer, step: usize) -> Vec<Vec<u32>> {
    let mut seen = Vec::new();
    for i in 0..t.len() {
        seen.push(t.fetch(i, TensorState::HoldAfterFwd).unwrap());
    }
    for i in (0..t.len()).rev() {
        if !t.spec(i).unwrap().trainable {
            continue;
        }
        let g: Vec<f32> = seen[i]
            .iter()
            .enumerate()
            .map(|(k, p)| p * 0.5 + ((k + step * 3) % 11) as f32 * 0.01 - 0.05)
            .collect();
        t.put_grad(i, tidestore_train::Values::F32(&g), true, true)
            .unwrap();
    }
    t.step(&mut |_| ()).unwrap();
    seen.into_iter()
        .map(|v| v.into_iter().map(f32::to_bits).collect())
        .collect()
}

fn state(t: &mut Trainer) -> Vec<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    (0..t.len())
        .map(|i| {
            let values = bits(t.values(i).unwrap());
            if !t.spec(i).unwrap().trainable {
                return (values, Vec::new(), Vec::new());
            }
            let (m, v) = t.moments(i).unwrap();
            (values, bits(m), bits(v))
        })
        .collect()
}

fn deferred_equals_immediate(precision: Precision) {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut now = open(da.path(), precision, Overlap::Off);
    let mut later = open(db.path(), precision, Overlap::Forward);
    for step in 1..=6 {
        if step == 5 {
            now.set_lr(3e-3).unwrap();
            later.set_lr(3e-3).unwrap();
        }
        assert_eq!(
            iteration(&mut now, step),
            iteration(&mut later, step),
            "{precision:?}: forward {step} read other parameters"
        );
        if step == 3 {
            // A checkpoint makes the deferred steps first.
            let ckpt = db.path().join("step3.ckpt");
            later.save(&ckpt, Default::default()).unwrap();
            assert!(!later
                .step_loop()
                .is_deferred(later.store().layout().tensor_id("a").unwrap()));
        }
        let deferred = later.step_loop().stats().tensors_deferred;
        assert!(
            deferred > 0 || step == 1,
            "step {step}: nothing was deferred"
        );
    }
    assert!(later.stats().nvme_reads > 0, "everything stayed in memory");
    // `state` reads every tensor, which makes the last step's deferred updates.
    assert_eq!(
        state(&mut now),
        state(&mut later),
        "{precision:?}: the end states differ"
    );
    assert_eq!(now.step_loop().stats().tensors_deferred, 0);
    assert_eq!(
        now.step_loop().stats().steps_applied,
        later.step_loop().stats().steps_applied
    );
}

#[test]
fn deferred_steps_equal_immediate_ones_in_f32() {
    deferred_equals_immediate(Precision::F32);
}

#[test]
fn deferred_steps_equal_immediate_ones_in_bf16() {
    deferred_equals_immediate(Precision::Bf16);
}

#[test]
fn the_deferred_step_waits_for_the_next_use_and_uses_its_own_learning_rate() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut now = open(da.path(), Precision::F32, Overlap::Off);
    let mut later = open(db.path(), Precision::F32, Overlap::Forward);
    iteration(&mut now, 1);
    iteration(&mut later, 1);
    let a = later.store().layout().tensor_id("a").unwrap();
    assert!(
        later.step_loop().is_deferred(a),
        "step() made the update at once"
    );
    assert_eq!(later.step_loop().stats().tensors_deferred, 0);
    // A learning rate set after the step does not reach its deferred updates.
    later.set_lr(1.0).unwrap();
    let fetched = later.fetch(2, TensorState::HoldAfterFwd).unwrap();
    assert!(!later.step_loop().is_deferred(a));
    // `a` is the second trainable tensor: the first one was stepped before it, the
    // ones after it still wait.
    assert_eq!(later.step_loop().stats().tensors_deferred, 2);
    let head = later.store().layout().tensor_id("head").unwrap();
    assert!(later.step_loop().is_deferred(head));
    assert_eq!(fetched, now.values(2).unwrap());
    later.settle_all().unwrap();
    assert!(!later.step_loop().is_deferred(head));
    assert_eq!(later.values(5).unwrap(), now.values(5).unwrap());
}

#[test]
fn a_gradient_written_over_a_waiting_update_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let mut t = open(d.path(), Precision::F32, Overlap::Forward);
    iteration(&mut t, 1);
    // A front end that wrote the gradient into the store itself reports it while the
    // last step's update of that tensor still waits: refused, naming the tensor.
    let e = t.grad_written(2, 1.0).unwrap_err();
    match e {
        TrainError::Protocol(msg) => assert!(msg.contains("`a`"), "{msg}"),
        e => panic!("another error: {e}"),
    }
    // Through put_grad the update is made first.
    let g = vec![0.25; 16 * 48];
    t.put_grad(2, tidestore_train::Values::F32(&g), true, true)
        .unwrap();
}

#[test]
fn the_store_traces_the_deferred_order_once_and_then_follows_it() {
    let d = tempfile::tempdir().unwrap();
    let mut t = open(d.path(), Precision::F32, Overlap::Forward);
    for step in 1..=5 {
        iteration(&mut t, step);
    }
    let s = t.stats();
    // The first iteration has no deferred updates, the second is the first with them:
    // both are traced, and every later one follows the second's schedule.
    assert_eq!((s.traced_iterations, s.divergences), (2, 0), "{s:?}");
    assert_eq!(s.iterations, 5);
    // The updates that wait at the end are made outside any forward: an iteration of
    // their own, traced, not a divergence.
    t.retrace();
    t.settle_all().unwrap();
    t.end_iteration().unwrap();
    assert_eq!(t.stats().divergences, 0);
}
