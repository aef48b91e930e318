//! Guards against a checkpoint that loses training state: 10 steps, save, a fresh store
//! (its own swap file) loaded from the checkpoint, 10 more steps, must reproduce the
//! last 10 losses of 20 uninterrupted steps. Master, M, V and the step count are all
//! restored exactly and batches depend only on the step, so the curves are identical
//! (asserted bit for bit).

mod common;

use common::*;
use tidestore_candle::{checkpoint, Precision};

#[test]
fn resume_continues_the_same_loss_curve() {
    let model = gpt(None);
    let d0 = tempfile::tempdir().unwrap();
    let mut p = open_tide(&model, 5, d0.path(), Precision::F32);
    let full = train_tide(&model, &mut p, 0, 20);
    drop(p);

    let d1 = tempfile::tempdir().unwrap();
    let ckpt = d1.path().join("ckpt.safetensors");
    let mut p = open_tide(&model, 5, d1.path(), Precision::F32);
    let first = train_tide(&model, &mut p, 0, 10);
    checkpoint::save(&mut p, &ckpt).unwrap();
    drop(p);

    let d2 = tempfile::tempdir().unwrap();
    // Another seed: everything must come from the checkpoint.
    let mut p = open_tide(&model, 99, d2.path(), Precision::F32);
    checkpoint::load(&mut p, &ckpt).unwrap();
    assert_eq!(p.step_count(), 10);
    let rest = train_tide(&model, &mut p, 10, 20);
    eprintln!("full   : {full:?}\nresumed: {first:?} + {rest:?}");
    assert_eq!(&full[..10], &first[..]);
    assert_eq!(&full[10..], &rest[..]);
}
