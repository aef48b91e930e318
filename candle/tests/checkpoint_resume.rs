//! Guards against a checkpoint that loses training state: N steps, save, a fresh store
//! (its own swap file, parameters from another seed) loaded from the checkpoint, M more
//! steps, must end exactly where N + M uninterrupted steps end — every parameter's
//! values, Adam M and V bit for bit, the step count, and the last M losses. Batches
//! depend only on the step, so nothing else may differ. Run in `F32` mode (the fp32
//! gradients are not state and must not be in the file), in `Bf16` mode
//! (forward reads the bf16 copy, which must come back too) and with LoRA (frozen base
//! tensors in the file). Also guards against a second checkpoint format creeping back:
//! the file is the train crate's, `read_params` reads it, and a damaged file is refused
//! naming the file and the tensor, before anything changes.

mod common;

use std::path::Path;
use tidestore_train::MomentForm;

use common::*;
use tidestore_candle::{checkpoint, Error, Gpt, Precision, TideParams};
use tidestore_train::checkpoint::read_tensors;
use tidestore_train::{TrainError, CHECKPOINT_FORMAT};

const FIRST: u64 = 8;
const MORE: u64 = 8;

/// Every parameter's values and (trainable) moments, as bits.
type Snapshot = Vec<(String, Vec<u32>, Option<(Vec<u32>, Vec<u32>)>)>;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn snapshot(p: &mut TideParams) -> Snapshot {
    let specs: Vec<_> = p.specs().cloned().collect();
    specs
        .iter()
        .map(|s| {
            let values = bits(&p.values(&s.name).unwrap());
            let moments = s.trainable.then(|| {
                let (m, v) = p.moments(&s.name).unwrap();
                (bits(&m), bits(&v))
            });
            (s.name.clone(), values, moments)
        })
        .collect()
}

fn resume_is_bit_identical(model: &Gpt, precision: Precision) {
    resume_is_bit_identical_with(model, precision, MomentForm::F32);
}

fn resume_is_bit_identical_with(model: &Gpt, precision: Precision, moments: MomentForm) {
    let open_tide = |model: &Gpt, seed: u64, dir: &Path, precision: Precision| {
        open_tide_with(model, seed, dir, precision, moments)
    };
    let end = FIRST + MORE;
    let d0 = tempfile::tempdir().unwrap();
    let mut p = open_tide(model, 0, d0.path(), precision);
    let full = train_tide(model, &mut p, 0, end);
    let full_state = snapshot(&mut p);
    assert_eq!(p.step_count(), end);
    drop(p);

    let d1 = tempfile::tempdir().unwrap();
    let ckpt = d1.path().join("ckpt.safetensors");
    let mut p = open_tide(model, 0, d1.path(), precision);
    let first = train_tide(model, &mut p, 0, FIRST);
    checkpoint::save(&mut p, &ckpt).unwrap();
    check_file(&mut p, &ckpt);
    drop(p);

    let d2 = tempfile::tempdir().unwrap();
    // Another seed: everything must come from the checkpoint.
    let mut p = open_tide(model, 99, d2.path(), precision);
    checkpoint::load(&mut p, &ckpt).unwrap();
    assert_eq!(p.step_count(), FIRST);
    let rest = train_tide(model, &mut p, FIRST, end);
    assert_eq!(p.step_count(), end);
    eprintln!("{precision:?} full   : {full:?}\n{precision:?} resumed: {first:?} + {rest:?}");
    assert_eq!(&full[..FIRST as usize], &first[..]);
    assert_eq!(&full[FIRST as usize..], &rest[..]);
    let resumed_state = snapshot(&mut p);
    for (a, b) in full_state.iter().zip(&resumed_state) {
        assert_eq!(a.0, b.0);
        assert!(a.1 == b.1, "{precision:?}: values of `{}` differ", a.0);
        assert!(a.2 == b.2, "{precision:?}: moments of `{}` differ", a.0);
    }
    assert_eq!(full_state.len(), resumed_state.len());
}

/// The file is the train crate's format, holds every parameter and no gradient, and
/// `read_params` gives back the values `p` holds.
fn check_file(p: &mut TideParams, ckpt: &Path) {
    let (state, tensors) = read_tensors(ckpt, |_| true).unwrap();
    assert_eq!(state.controller.step, p.step_count());
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    assert!(
        names.iter().all(|n| !n.contains("grad")),
        "no gradient in the file: {names:?}"
    );
    let header = std::fs::read(ckpt).unwrap();
    let text = String::from_utf8_lossy(&header[..header.len().min(1 << 16)]);
    assert!(
        text.contains(CHECKPOINT_FORMAT),
        "tagged {CHECKPOINT_FORMAT}"
    );

    let read = checkpoint::read_params(ckpt).unwrap();
    let specs: Vec<_> = p.specs().cloned().collect();
    assert_eq!(read.len(), specs.len(), "one entry per parameter");
    for s in &specs {
        let want = bits(&p.values(&s.name).unwrap());
        assert!(bits(&read[&s.name]) == want, "read_params of `{}`", s.name);
        if s.trainable {
            let master = format!("optimizer.master.{}", s.name);
            assert!(names.contains(&master.as_str()), "{master}");
            assert!(names.contains(&format!("optimizer.exp_avg_sq.{}", s.name).as_str()));
        }
        assert!(names.contains(&s.name.as_str()), "{}", s.name);
    }
}

#[test]
fn resume_is_bit_identical_in_f32() {
    resume_is_bit_identical(&gpt(None), Precision::F32);
}

#[test]
fn resume_is_bit_identical_in_bf16() {
    resume_is_bit_identical(&gpt(None), Precision::Bf16);
}

#[test]
fn resume_is_bit_identical_with_bf16_and_int8_moments() {
    resume_is_bit_identical_with(&gpt(None), Precision::Bf16, MomentForm::BF16);
    resume_is_bit_identical_with(&gpt(None), Precision::Bf16, MomentForm::Int8);
}

#[test]
fn resume_is_bit_identical_with_lora() {
    resume_is_bit_identical(&gpt(Some(4)), Precision::F32);
}

#[test]
fn a_damaged_checkpoint_is_refused_naming_file_and_tensor() {
    let model = gpt(None);
    let d1 = tempfile::tempdir().unwrap();
    let ckpt = d1.path().join("ckpt.safetensors");
    let mut p = open_tide(&model, 0, d1.path(), Precision::F32);
    train_tide(&model, &mut p, 0, 2);
    checkpoint::save(&mut p, &ckpt).unwrap();
    let name = p.specs().find(|s| s.trainable).unwrap().name.clone();
    let target = format!("optimizer.exp_avg.{name}");
    drop(p);

    let mut bytes = std::fs::read(&ckpt).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let (a, _) = meta.info(&target).unwrap().data_offsets;
    bytes[8 + n + a] ^= 0x40;
    let bad = d1.path().join("bad.safetensors");
    std::fs::write(&bad, bytes).unwrap();

    let d2 = tempfile::tempdir().unwrap();
    let mut q = open_tide(&model, 5, d2.path(), Precision::F32);
    let before = snapshot(&mut q);
    let err = checkpoint::load(&mut q, &bad).expect_err("a damaged file loaded");
    let msg = err.to_string();
    assert!(
        msg.contains(&bad.display().to_string()),
        "names the file: {msg}"
    );
    assert!(msg.contains(&target), "names the tensor: {msg}");
    match err {
        Error::Train(TrainError::CheckpointChecksum { tensor, .. }) => assert_eq!(tensor, target),
        other => panic!("expected a checksum error, got {other}"),
    }
    assert!(snapshot(&mut q) == before, "a refused file changed nothing");
    assert_eq!(q.step_count(), 0);
    assert!(
        checkpoint::read_params(&bad).is_ok(),
        "M is not a parameter"
    );
}

#[test]
fn save_between_backward_and_step_is_refused() {
    let model = gpt(None);
    let d = tempfile::tempdir().unwrap();
    let ckpt = d.path().join("ckpt.safetensors");
    let mut p = open_tide(&model, 0, d.path(), Precision::Bf16);
    let (x, y) = batches().get(0, &candle_core::Device::Cpu).unwrap();
    let loss = model.loss(&mut p, &x, &y).unwrap();
    assert!(
        matches!(
            checkpoint::load(&mut p, &ckpt),
            Err(Error::Checkpoint { .. })
        ),
        "load during a forward pass"
    );
    p.backward(&loss).unwrap();
    match checkpoint::save(&mut p, &ckpt) {
        Err(Error::Checkpoint { path, reason }) => {
            assert_eq!(path, ckpt);
            assert!(reason.contains("step first"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(!ckpt.exists());
    p.step().unwrap();
    checkpoint::save(&mut p, &ckpt).unwrap();
}

#[test]
fn a_checkpoint_of_the_other_precision_is_refused() {
    let model = gpt(None);
    let d1 = tempfile::tempdir().unwrap();
    let ckpt = d1.path().join("ckpt.safetensors");
    let mut p = open_tide(&model, 0, d1.path(), Precision::F32);
    train_tide(&model, &mut p, 0, 1);
    checkpoint::save(&mut p, &ckpt).unwrap();
    drop(p);
    let d2 = tempfile::tempdir().unwrap();
    let mut q = open_tide(&model, 5, d2.path(), Precision::Bf16);
    let before = snapshot(&mut q);
    match checkpoint::load(&mut q, &ckpt) {
        Err(Error::Train(TrainError::CheckpointPrecision {
            path,
            found,
            expected,
        })) => {
            assert_eq!(path, ckpt);
            assert_eq!((found.as_str(), expected), ("f32", "bf16"));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(snapshot(&mut q) == before, "a refused file changed nothing");
}
