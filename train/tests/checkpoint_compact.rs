//! Guards against checkpoints that change compact Adam moments (bf16, or int8 codes with
//! their absmax) on the way to disk and back, and against loading a checkpoint of one
//! state type into a store of another as if the bytes meant the same thing: that must be
//! an error naming both forms, never a silent reinterpretation.

mod common;

use common::*;
use tidestore_chunk::{DType, Layout, LayoutConfig, ListKind, MomentForm, TensorSpec};
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

fn layout_of(states: MomentForm) -> Layout {
    Layout::new(LayoutConfig::new(8192).with_moments(states), specs()).expect("layout")
}

#[test]
fn compact_moments_round_trip_bit_identically() {
    for states in [MomentForm::BF16, MomentForm::Int8] {
        let dir = tempfile::tempdir().unwrap();
        let mut a = open_store(&dir.path().join("a"), layout_of(states));
        let t = a.layout().tensor_id("embed.weight").unwrap();
        let want = if states == MomentForm::Int8 {
            DType::Q8
        } else {
            DType::BF16
        };
        let loc = a.layout().location(t, ListKind::Momentum).unwrap();
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
        (MomentForm::F32, MomentForm::Int8),
        (MomentForm::Int8, MomentForm::F32),
        (MomentForm::BF16, MomentForm::Int8),
        (MomentForm::F32, MomentForm::BF16),
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

mod resume {
    //! A run stopped after a checkpoint and resumed in a fresh store ends bit-identical
    //! to one that never stopped, with bf16 and int8 moments (the host step loop, NVMe
    //! spills, gradients written over the 16-bit copies).

    use super::*;
    use half::bf16;
    use tidestore_chunk::{ChunkStore, Place, TensorId, TensorState};
    use tidestore_optimizer::{AdamW, CpuConfig, Grads, HybridAdamW, HyperParams, OptimError};
    use tidestore_train::{GradPlace, Overlap, StepConfig, StepLoop, StepPlace, StepTensor};

    fn step_loop(store: &ChunkStore) -> StepLoop {
        let cpu = AdamW::new(CpuConfig {
            threads: 1,
            ..CpuConfig::default()
        })
        .unwrap();
        let opt = HybridAdamW::cpu_only(
            cpu,
            OptimError::NoGpu {
                reason: "test".into(),
            },
        );
        let tensors = all_tensors(store)
            .into_iter()
            .filter(|&t| store.layout().tensor(t).unwrap().trainable)
            .map(|tensor| StepTensor {
                tensor,
                grad: GradPlace::InParam16,
            })
            .collect();
        let cfg = StepConfig {
            hp: HyperParams {
                lr: 1e-2,
                weight_decay: 0.1,
                ..HyperParams::default()
            },
            max_grad_norm: Some(1.0),
            loss_scaler: None,
            place: StepPlace::Host,
            overlap: Overlap::Off,
            check_finite: true,
        };
        StepLoop::new(store, opt, tensors, cfg).unwrap()
    }

    /// One iteration: a gradient from the 16-bit parameters and the step number, written
    /// over them (bf16), then the step.
    fn iteration(store: &mut ChunkStore, lp: &mut StepLoop, step: u64) {
        let cpu = AdamW::new(CpuConfig::default()).unwrap();
        let ids: Vec<TensorId> = all_tensors(store)
            .into_iter()
            .filter(|&t| store.layout().tensor(t).unwrap().trainable)
            .collect();
        for &t in ids.iter().rev() {
            let g = store.access(t, ListKind::Params, Place::Host).unwrap();
            let bytes = store.bytes_mut(&g).unwrap();
            let p: Vec<bf16> = bytemuck::cast_slice::<u8, bf16>(bytes).to_vec();
            let grad: Vec<bf16> = p
                .iter()
                .enumerate()
                .map(|(k, x)| {
                    let noise = ((k as u64 * 31 + step * 17 + u64::from(t.0)) % 13) as f32;
                    bf16::from_f32(x.to_f32() * 0.5 + noise * 1e-3)
                })
                .collect();
            bytes.copy_from_slice(bytemuck::cast_slice(&grad));
            store.release(g, TensorState::HoldAfterBwd).unwrap();
            lp.grad_ready(t, cpu.grad_sq_norm(Grads::Bf16(&grad)))
                .unwrap();
        }
        let mut observe = |_: &ChunkStore| {};
        lp.finish(store, &mut observe).unwrap();
        store.end_iteration().unwrap();
    }

    #[test]
    fn resumed_run_is_bit_identical_with_compact_moments() {
        for states in [MomentForm::BF16, MomentForm::Int8] {
            let dir = tempfile::tempdir().unwrap();
            // The run that never stops.
            let mut a = open_store(&dir.path().join("a"), layout_of(states));
            fill_params(&mut a);
            let mut la = step_loop(&a);
            for step in 1..=6 {
                iteration(&mut a, &mut la, step);
            }
            // Stopped after step 3, resumed from the checkpoint in a fresh store.
            let mut b = open_store(&dir.path().join("b"), layout_of(states));
            fill_params(&mut b);
            let mut lb = step_loop(&b);
            for step in 1..=3 {
                iteration(&mut b, &mut lb, step);
            }
            let path = dir.path().join("ckpt.safetensors");
            let tensors = all_tensors(&b);
            let st = tidestore_train::CheckpointState {
                controller: lb.controller_state(),
                metadata: Default::default(),
            };
            checkpoint::save(&mut b, &tensors, &st, &path).unwrap();
            drop(lb);
            drop(b);
            let mut c = open_store(&dir.path().join("c"), layout_of(states));
            let got = checkpoint::load(&mut c, &tensors, &path).unwrap();
            let mut lc = step_loop(&c);
            lc.restore(got.controller).unwrap();
            for step in 4..=6 {
                iteration(&mut c, &mut lc, step);
            }
            assert_eq!(
                snapshot(&mut c),
                snapshot(&mut a),
                "{states}: resumed == uninterrupted"
            );
        }
    }

    /// Deterministic parameters (master and 16-bit copy), zero moments.
    fn fill_params(store: &mut ChunkStore) {
        for t in all_tensors(store) {
            let spec = store.layout().tensor(t).unwrap().clone();
            let n: usize = spec.shape.iter().product();
            let w: Vec<f32> = (0..n)
                .map(|k| ((k * 7 + t.0 as usize * 13) % 101) as f32 / 101.0 - 0.5)
                .collect();
            if spec.trainable {
                store
                    .write(t, ListKind::Master, bytemuck::cast_slice(&w))
                    .unwrap();
            }
            let loc = store.layout().location(t, ListKind::Params).unwrap();
            let p16: Vec<u8> = match loc.dtype {
                DType::F32 => bytemuck::cast_slice(&w).to_vec(),
                _ => {
                    let b: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
                    bytemuck::cast_slice(&b).to_vec()
                }
            };
            store.write(t, ListKind::Params, &p16).unwrap();
        }
    }
}
