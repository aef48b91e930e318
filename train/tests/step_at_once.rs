//! `Trainer::step_with_grad`: a whole, final gradient handed over with the step
//! overlapped with backward (`Overlap::Backward`, in place in the host pool) is stepped
//! at once, read where the caller holds it: its `Grads` place is never written (no copy,
//! no pool room, nothing spilled to NVMe). Guards:
//! - the tensor is stepped inside the call, before any `step_ready` or `step`;
//! - four steps train bit for bit as `Overlap::Off`, with a host pool that holds every
//!   chunk and with one that spills to NVMe;
//! - a non-finite gradient is not stepped: it goes into its place, and the step is
//!   skipped (when it came first) or refused (when others were already stepped), as
//!   before;
//! - bf16 precision (a 16-bit copy to write) keeps the gradient's place.

mod common;

use tidestore_train::{
    Budget, DeviceChoice, HyperParams, Overlap, Precision, StepDecision, TensorState, TrainError,
    Trainer, TrainerConfig, Values,
};

const SHAPES: [&[usize]; 3] = [&[300, 70], &[70], &[12000]];

fn config(dir: &std::path::Path, overlap: Overlap, host: Budget) -> TrainerConfig {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.1), dir);
    cfg.max_grad_norm = None;
    cfg.overlap = overlap;
    cfg.device = DeviceChoice::Sim;
    cfg.chunk_elements = Some(32768); // two chunks a list
    cfg.device_budget = Budget::AllChunks;
    cfg.host_budget = host;
    cfg.optimizer_threads = 2;
    cfg.precision = Precision::F32;
    cfg
}

/// Step `k`'s gradient of parameter `i` (of `n` elements).
fn grad(k: usize, i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| ((j * 5 + 3 * k + i) % 11) as f32 * 0.03 - 0.15)
        .collect()
}

/// Forward and backward reads, each gradient handed over whole (last parameter first;
/// put where it cannot be stepped at once), then the step; `f(t, i)` runs after each.
fn iteration(t: &mut Trainer, k: usize, mut f: impl FnMut(&mut Trainer, usize)) {
    for i in 0..SHAPES.len() {
        t.fetch(i, TensorState::HoldAfterFwd).unwrap();
    }
    for i in (0..SHAPES.len()).rev() {
        t.fetch(i, TensorState::HoldAfterBwd).unwrap();
        let g = grad(k, i, t.spec(i).unwrap().elements());
        hand(t, i, &g);
        f(t, i);
    }
    t.step(&mut |_| {}).unwrap();
}

/// `g` stepped at once where the trainer can, else put; whether it was stepped.
fn hand(t: &mut Trainer, i: usize, g: &[f32]) -> bool {
    let stepped = t.step_with_grad(i, Values::F32(g)).unwrap();
    if !stepped {
        t.put_grad(i, Values::F32(g), true, true).unwrap();
    }
    stepped
}

#[test]
fn a_whole_gradient_is_stepped_inside_step_with_grad() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = common::pattern_trainer(
        &config(dir.path(), Overlap::Backward, Budget::AllChunks),
        &SHAPES,
    );
    assert!(t.step_loop().steps_given_now());
    for k in 0..2 {
        iteration(&mut t, k, |t, i| {
            let stepped = t.step_loop().stats().tensors_stepped;
            let done = (SHAPES.len() * k + SHAPES.len() - i) as u64;
            assert_eq!(stepped, done, "step {k}: p{i} not stepped at once");
            assert!(t.grad_reported(i).unwrap());
        });
    }
    // Two steps of three tensors, every one of them stepped at once.
    assert_eq!(t.step_loop().stats().tensors_overlapped, 6);
    assert_eq!(t.step_count(), 2);
}

#[test]
fn stepping_at_once_trains_bit_for_bit_as_after_backward() {
    for host in [Budget::AllChunks, Budget::Chunks(5)] {
        let run = |overlap: Overlap| {
            let dir = tempfile::tempdir().unwrap();
            let mut t = common::pattern_trainer(&config(dir.path(), overlap, host), &SHAPES);
            for k in 0..4 {
                iteration(&mut t, k, |_, _| {});
            }
            let read = t.counters()["nvme_read_bytes"];
            (common::state_bits(&mut t), t.step_loop().stats(), read)
        };
        let (after, during) = (run(Overlap::Off), run(Overlap::Backward));
        assert!(after.0 == during.0, "{host:?}: master, M or V differ");
        assert_eq!(after.1.tensors_overlapped, 0);
        assert_eq!(during.1.tensors_overlapped, 12, "{host:?}");
        assert_eq!(during.1.tensors_stepped, 12, "{host:?}");
        if host == Budget::Chunks(5) {
            assert!(after.2 > 0, "the small pool was meant to spill to NVMe");
        }
    }
}

#[test]
fn a_non_finite_gradient_is_not_stepped_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), Overlap::Backward, Budget::AllChunks);
    // First: nothing is stepped, and the step is skipped.
    let mut t = common::pattern_trainer(&cfg, &SHAPES);
    let start = common::state_bits(&mut t);
    let mut bad = grad(0, 2, 12000);
    bad[17] = f32::NAN;
    assert!(!hand(&mut t, 2, &bad), "a non-finite gradient was stepped");
    assert!(!t.step_loop().steps_given_now());
    for i in [1, 0] {
        let g = grad(0, i, t.spec(i).unwrap().elements());
        assert!(!hand(&mut t, i, &g), "stepped after a non-finite gradient");
    }
    assert_eq!(t.step_loop().stats().tensors_overlapped, 0);
    let outcome = t.step(&mut |_| {}).unwrap();
    assert!(
        matches!(outcome.decision, StepDecision::Skip { .. }),
        "{outcome:?}"
    );
    assert!(
        common::state_bits(&mut t) == start,
        "a skipped step changed the state"
    );
    drop(t);
    // After others were stepped: half made, the loop poisoned, naming why.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), Overlap::Backward, Budget::AllChunks);
    let mut t = common::pattern_trainer(&cfg, &SHAPES);
    assert!(hand(&mut t, 2, &grad(0, 2, 12000)));
    let mut bad = grad(0, 1, 70);
    bad[3] = f32::INFINITY;
    assert!(!hand(&mut t, 1, &bad));
    assert!(!hand(&mut t, 0, &grad(0, 0, 21000)));
    assert_eq!(t.step_loop().stats().tensors_overlapped, 1);
    match t.step(&mut |_| {}) {
        Err(TrainError::Poisoned { reason }) => assert!(reason.contains("non-finite"), "{reason}"),
        other => panic!("expected a poisoned loop, got {other:?}"),
    }
    assert!(t.step_loop().is_poisoned());
}

#[test]
fn bf16_precision_keeps_the_gradients_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Overlap::Backward, Budget::AllChunks);
    cfg.precision = Precision::Bf16;
    let mut t = common::pattern_trainer(&cfg, &SHAPES);
    assert!(!t.step_loop().steps_given_now());
    iteration(&mut t, 0, |t, _| {
        assert_eq!(
            t.step_loop().stats().tensors_stepped,
            0,
            "stepped at once in bf16"
        );
    });
    assert_eq!(t.step_count(), 1);
}
