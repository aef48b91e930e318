//! A front end's own memory in the step (what `tidestore.AdamW` uses so that a step
//! copies nothing in or out):
//! - `Trainer::resident_master`: the fp32 master copy a front end makes its own tensor's
//!   memory. It is handed out only where nothing can move it, it is what the steps
//!   update in place, and compute reads from the host pool once one is out, so it holds
//!   the master's values after any number of steps and a checkpoint load.
//!   A pool that holds every chunk beside the simulated device is not pinned.
//! - `Trainer::step_given`: the gradients handed to the step and read where they are.
//!   It trains bit for bit as `put_grad` + `step` (clipping included), skips a
//!   non-finite step leaving everything as it was, falls back to copying where the
//!   store steps through scratch, and refuses a wrong hand-over before changing
//!   anything.
//! - `TrainerConfig::check_finite` off: no norm taken, every step applied (a NaN
//!   gradient's element becomes NaN, as in torch), the same steps otherwise; refused
//!   with clipping.

mod common;

use tidestore_train::{
    Budget, DeviceChoice, HyperParams, ParamSpec, Precision, Resident, TensorState, TrainError,
    Trainer, TrainerConfig, Values,
};

const SHAPES: [&[usize]; 3] = [&[300, 70], &[70], &[12000]];

fn config(dir: &std::path::Path, host_budget: Budget) -> TrainerConfig {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.1), dir);
    cfg.max_grad_norm = Some(0.5);
    cfg.device = DeviceChoice::Sim;
    cfg.chunk_elements = Some(32768); // two chunks a list
    cfg.host_budget = host_budget;
    cfg.optimizer_threads = 2;
    cfg
}

fn open(dir: &std::path::Path, host_budget: Budget) -> Trainer {
    open_as(dir, host_budget, Precision::F32)
}

fn open_as(dir: &std::path::Path, host_budget: Budget, precision: Precision) -> Trainer {
    let mut cfg = config(dir, host_budget);
    cfg.precision = precision;
    open_with(&cfg)
}

fn open_with(cfg: &TrainerConfig) -> Trainer {
    common::pattern_trainer(cfg, &SHAPES)
}

/// The values at a resident master's address.
fn at(r: Resident) -> Vec<f32> {
    // SAFETY: `resident_master` promises `len` initialised f32 at `addr` for the
    // trainer's life, and every trainer this reads from is alive and not stepping.
    unsafe { std::slice::from_raw_parts(r.addr as *const f32, r.len) }.to_vec()
}

/// Step `k`'s gradients, one per parameter.
fn grads(k: usize) -> Vec<Vec<f32>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .map(|j| ((j * 5 + 3 * k + i) % 11) as f32 * 0.03 - 0.15)
                .collect()
        })
        .collect()
}

fn step(t: &mut Trainer, k: usize) {
    for (i, g) in grads(k).iter().enumerate() {
        t.put_grad(i, Values::F32(g), true, true).unwrap();
    }
    t.step(&mut |_| {}).unwrap();
}

fn step_given(t: &mut Trainer, g: &[Vec<f32>]) -> Result<(), TrainError> {
    let given: Vec<Option<Values<'_>>> = g.iter().map(|g| Some(Values::F32(g))).collect();
    t.step_given(&given, &mut |_| {}).map(|_| ())
}

fn state(t: &mut Trainer) -> Vec<Vec<u32>> {
    common::state_bits(t)
}

#[test]
fn a_resident_master_is_stepped_in_place_and_never_moves() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), Budget::AllChunks);
    // Nothing leaves a pool that holds every chunk beside the simulated device: it is not
    // pinned, so chunks never made (the gradients given below) cost no memory.
    assert!(!t.store().host_pinned());
    let resident: Vec<Resident> = (0..SHAPES.len())
        .map(|i| {
            t.resident_master(i)
                .unwrap()
                .expect("every chunk fits the host pool")
        })
        .collect();
    // Asking for compute on the device changes nothing now: a fetch would otherwise
    // take the chunk to the device tier.
    t.set_compute_on_device(true);
    for k in 0..4 {
        step(&mut t, k);
        let fetched = t.fetch(1, TensorState::HoldAfterFwd).unwrap();
        assert_eq!(
            fetched,
            at(resident[1]),
            "step {k}: compute read another copy"
        );
    }
    for (i, r) in resident.iter().enumerate() {
        assert_eq!(
            at(*r),
            t.values(i).unwrap(),
            "p{i}: the master moved or was copied"
        );
        assert_eq!(
            t.resident_master(i).unwrap(),
            Some(*r),
            "p{i}'s address changed"
        );
    }
    assert_eq!(t.counters()["host_evictions"], 0);

    // A checkpoint loaded lands in the same memory.
    let ckpt = dir.path().join("c.safetensors");
    t.save(&ckpt, Default::default()).unwrap();
    let saved = at(resident[0]);
    step(&mut t, 9);
    assert_ne!(at(resident[0]), saved, "the step changed nothing");
    t.load(&ckpt).unwrap();
    assert_eq!(
        at(resident[0]),
        saved,
        "the load did not reach the resident memory"
    );
}

#[test]
fn a_master_the_host_pool_cannot_keep_is_not_handed_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), Budget::Chunks(5));
    assert!(
        t.store().host_pinned(),
        "a pool that spills to NVMe is pinned"
    );
    assert_eq!(t.resident_master(0).unwrap(), None);
    // Nothing changed: the trainer still trains.
    step(&mut t, 0);
}

#[test]
fn given_gradients_train_bit_for_bit_as_put_ones() {
    // Read in place all in RAM and with state on NVMe; copied in where the step writes
    // bf16 parameters.
    for (precision, budget) in [
        (Precision::F32, Budget::AllChunks),
        (Precision::F32, Budget::Chunks(5)),
        (Precision::Bf16, Budget::AllChunks),
    ] {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut put = open_as(da.path(), budget, precision);
        let mut given = open_as(db.path(), budget, precision);
        for k in 0..4 {
            step(&mut put, k);
            step_given(&mut given, &grads(k)).unwrap();
        }
        assert_eq!(
            state(&mut put),
            state(&mut given),
            "{precision:?}, {budget:?}"
        );
        let read = |t: &Trainer| t.counters()["nvme_read_bytes"];
        assert_eq!(read(&put) > 0, budget != Budget::AllChunks);
        // Read in place, the gradient chunks are never made, nor dropped after a step;
        // copied in (bf16), they are as with put_grad.
        let dropped = |t: &Trainer| t.stats().discarded_chunks;
        match precision {
            Precision::F32 => assert_eq!((dropped(&given), dropped(&put) > 0), (0, true)),
            Precision::Bf16 => assert_eq!(dropped(&given), dropped(&put)),
        }
        assert_eq!(put.step_count(), given.step_count());
    }
}

#[test]
fn a_non_finite_given_gradient_skips_the_step_and_a_bad_hand_over_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), Budget::AllChunks);
    step_given(&mut t, &grads(0)).unwrap();
    let before = state(&mut t);

    let mut nan = grads(1);
    nan[2][7] = f32::NAN;
    step_given(&mut t, &nan).unwrap();
    assert_eq!(state(&mut t), before, "a skipped step changed the state");
    assert_eq!(t.step_count(), 1);

    let mut short = grads(1);
    short[1].pop();
    let e = step_given(&mut t, &short).unwrap_err();
    assert!(e.to_string().contains("p1"), "{e}");
    let e = step_given(&mut t, &grads(1)[..2]).unwrap_err();
    assert!(e.to_string().contains("2 gradients given for 3"), "{e}");
    let g = grads(1);
    t.put_grad(0, Values::F32(&g[0]), true, true).unwrap();
    let e = step_given(&mut t, &g).unwrap_err();
    assert!(e.to_string().contains("`p0` was put"), "{e}");
    assert_eq!(
        state(&mut t),
        before,
        "a refused hand-over changed the state"
    );

    // The put gradient is still counted: a step without the rest is abandoned (the
    // iteration dropped, nothing stepped) and the next whole one goes on.
    let e = t.step(&mut |_| {}).unwrap_err();
    assert!(
        e.to_string().contains("`p1` was given") && e.to_string().contains("abandoned"),
        "{e}"
    );
    assert_eq!(state(&mut t), before, "an abandoned step changed the state");
    assert!(
        !t.grad_reported(0).unwrap(),
        "the abandoned iteration's report was kept"
    );
    for (i, g) in g.iter().enumerate() {
        t.put_grad(i, Values::F32(g), true, true).unwrap();
    }
    t.step(&mut |_| {}).unwrap();
    assert_eq!(t.step_count(), 2);
}

/// A trainer without clipping, with `check_finite` as given (off needs clipping off).
fn open_unclipped(dir: &std::path::Path, check_finite: bool) -> Trainer {
    let mut cfg = config(dir, Budget::AllChunks);
    cfg.max_grad_norm = None;
    cfg.check_finite = check_finite;
    open_with(&cfg)
}

#[test]
fn without_the_finiteness_check_every_step_is_applied_as_torch_applies_it() {
    // Finite gradients: the same steps as with the check (clipping off in both).
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut unchecked = open_unclipped(da.path(), false);
    let mut checked = open_unclipped(db.path(), true);
    for k in 0..3 {
        step_given(&mut unchecked, &grads(k)).unwrap();
        step_given(&mut checked, &grads(k)).unwrap();
    }
    assert_eq!(state(&mut unchecked), state(&mut checked));
    // No norm was taken: none is reported.
    assert!(unchecked.step_loop().stats().grad_norm.is_nan());
    assert!(checked.step_loop().stats().grad_norm > 0.0);

    // A NaN gradient is applied (where the check skips the step): the element's
    // master, M and V become NaN, as torch.optim.AdamW's would; the others step.
    let mut nan = grads(3);
    nan[2][7] = f32::NAN;
    step_given(&mut unchecked, &nan).unwrap();
    assert_eq!(unchecked.step_count(), 4);
    let p2 = unchecked.values(2).unwrap();
    assert!(p2[7].is_nan() && p2[8].is_finite());
    let (m, v) = unchecked.moments(2).unwrap();
    assert!(m[7].is_nan() && v[7].is_nan());
}

#[test]
fn the_finiteness_check_cannot_be_off_with_clipping() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Budget::AllChunks);
    cfg.check_finite = false; // config() clips at 0.5
    let specs = [ParamSpec::new("p0", &[10], true)];
    let Err(e) = Trainer::open(&specs, &cfg) else {
        panic!("check_finite off with clipping was accepted");
    };
    assert!(
        matches!(&e, TrainError::Config { key: "optimizer.check_finite", reason }
            if reason.contains("max_grad_norm")),
        "{e}"
    );
}

/// bf16: a gradient is written over its parameter's 16-bit copy. An iteration dropped
/// after some were — a step without the rest, a backward that raised half way
/// (`Trainer::abandon_iteration`) — casts those copies anew from the master, so the
/// next forward reads parameters, not gradients; the whole iteration after it steps as
/// the first would have.
#[test]
fn an_abandoned_iteration_leaves_bf16_parameters_not_gradients() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut t = open_as(da.path(), Budget::AllChunks, Precision::Bf16);
    let mut clean = open_as(db.path(), Budget::AllChunks, Precision::Bf16);
    let params = |t: &mut Trainer| -> Vec<Vec<f32>> {
        (0..SHAPES.len())
            .map(|i| t.fetch(i, TensorState::HoldAfterFwd).unwrap())
            .collect()
    };
    let before = params(&mut t);
    let g = grads(0);
    t.put_grad(0, Values::F32(&g[0]), true, true).unwrap();
    assert_ne!(
        params(&mut t)[0],
        before[0],
        "the gradient lies over the copy"
    );
    let e = t.step(&mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("abandoned"), "{e}");
    assert_eq!(
        params(&mut t),
        before,
        "a missing gradient left gradients as weights"
    );
    t.put_grad(1, Values::F32(&g[1]), true, true).unwrap();
    t.put_grad(2, Values::F32(&g[2]), true, true).unwrap();
    t.abandon_iteration("a backward raised").unwrap();
    assert_eq!(
        params(&mut t),
        before,
        "a dropped iteration left gradients as weights"
    );
    assert!(!t.grad_reported(1).unwrap());
    for tr in [&mut t, &mut clean] {
        for (i, g) in g.iter().enumerate() {
            tr.put_grad(i, Values::F32(g), true, true).unwrap();
        }
        tr.step(&mut |_| {}).unwrap();
    }
    assert_eq!(state(&mut t), state(&mut clean));
    assert_eq!(params(&mut t), params(&mut clean));
}
