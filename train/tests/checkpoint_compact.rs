//! Guards against checkpoints that change compact Adam moments (bf16, or int8 codes with
//! their absmax) on the way to disk and back, and against loading a checkpoint of one
//! state type into a store of another as if the bytes meant the same thing: that must be
//! an error naming both forms, never a silent reinterpretation.

mod common;

use common::*;
use tidestore_chunk::{DType, Layout, LayoutConfig, ListKind, MomentStates, TensorSpec};
use tidestore_train::checkpoint;
use tidestore_train::TrainError;

/// Tensors over and under the int8 threshold (4096), odd lengths, several chunks.
fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed.weight", &[64, 100], DType::BF16, true),
        TensorSpec::new("layers.0.b", &[33], DType::BF16, true),
        TensorSpec::new("layers.0.w", &[4101], DType::F32, true),
        TensorSpec::new("norm.frozen", &[8, 16], DType::F32, false),
        TensorSpec::new("head.weight", &[2, 2500], DType::BF16, true),
    ]
}

fn layout_of(states: MomentStates) -> Layout {
    Layout::new(LayoutConfig::new(8192).with_moments(states), specs()).expect("layout")
}

#[test]
fn compact_moments_round_trip_bit_identically() {
    for states in [MomentStates::Bf16, MomentStates::Int8] {
        let dir = tempfile::tempdir().unwrap();
        let mut a = open_store(&dir.path().join("a"), layout_of(states));
        let t = a.layout().tensor_id("embed.weight").unwrap();
        let want = if states == MomentStates::Int8 {
            DType::Q8
        } else {
            DType::BF16
        };
        let loc = a.layout().location(t, ListKind::MomentumF32).unwrap();
        assert_eq!(loc.dtype, want, "{states}: the big tensor's M form");
        fill(&mut a, 5);
        let saved = snapshot(&mut a);
        let path = dir.path().join("ckpt.safetensors");
        let tensors = all_tensors(&a);
        checkpoint::save(&mut a, &tensors, &state(9), &path).unwrap();
        let mut b = open_store(&dir.path().join("b"), layout_of(states));
        fill(&mut b, 6);
        assert_eq!(checkpoint::load(&mut b, &tensors, &path).unwrap(), state(9));
        assert_eq!(snapshot(&mut b), saved, "{states}: every byte is back");
        // The file holds the moments as stored: bf16 elements, or the place's bytes.
        let (_, read) =
            checkpoint::read_tensors(&path, |n| n == "optimizer.exp_avg.embed.weight").unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].dtype, want);
        assert_eq!(read[0].bytes.len() as u64, loc.bytes());
    }
}

#[test]
fn another_state_type_is_refused_naming_both() {
    for (from, to) in [
        (MomentStates::F32, MomentStates::Int8),
        (MomentStates::Int8, MomentStates::F32),
        (MomentStates::Bf16, MomentStates::Int8),
        (MomentStates::F32, MomentStates::Bf16),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut a = open_store(&dir.path().join("a"), layout_of(from));
        fill(&mut a, 7);
        let path = dir.path().join("ckpt.safetensors");
        let tensors = all_tensors(&a);
        checkpoint::save(&mut a, &tensors, &state(3), &path).unwrap();
        let mut b = open_store(&dir.path().join("b"), layout_of(to));
        let err = checkpoint::load(&mut b, &tensors, &path).unwrap_err();
        match &err {
            TrainError::CheckpointMismatch {
                expected, found, ..
            } => {
                assert_ne!(expected, found, "{from} -> {to}");
            }
            other => panic!("{from} -> {to}: {other}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("exp_avg"),
            "{from} -> {to}: names the moment: {text}"
        );
    }
}
