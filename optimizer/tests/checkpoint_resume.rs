//! Guards against a checkpoint that does not restore the exact training state: save at
//! step k, load (into a new optimizer over a fresh swap file, or back into the same one),
//! continue, and every bit of master, M, V, the 16-bit outputs, the step count and the
//! loss scaler must equal an uninterrupted run. Also guards against a damaged or
//! half-written checkpoint being accepted: a flipped byte, a truncation, a file of
//! another shape are typed errors, and saving leaves no temp file behind.

mod stream_common;

use stream_common::*;
use tidestore_io::FaultConfig;
use tidestore_optimizer::stream::{MasterPlace, StreamingOptimizer};
use tidestore_optimizer::OptimError;

const SAVE_AT: u64 = 4;
const END: u64 = 9;
const OVERFLOW_AT: Option<u64> = Some(6);

fn budget(master: MasterPlace) -> u64 {
    let (_, per_group) = StreamingOptimizer::ring_bytes_for(&groups(), &cfg(master, 1 << 40));
    per_group as u64 * 3
}

fn new_opt(master: MasterPlace) -> StreamingOptimizer {
    StreamingOptimizer::new(
        cpu(),
        groups(),
        mem_swap(master, FaultConfig::none()),
        cfg(master, budget(master)),
    )
    .unwrap()
}

#[test]
fn save_load_continue_is_bit_identical_to_an_uninterrupted_run() {
    for master in [MasterPlace::Nvme, MasterPlace::Host] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("opt.safetensors");
        let mut r = Reference::new();
        for it in 1..=END {
            r.step(it, OVERFLOW_AT);
        }

        let mut a = new_opt(master);
        a.initialize(init_master).unwrap();
        let mut ctrl = controller();
        let mut outs = Outs::new();
        for it in 1..=SAVE_AT {
            stream_step(&mut a, &mut ctrl, &mut outs, it, OVERFLOW_AT).unwrap();
        }
        a.save_checkpoint(&path, &ctrl).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp file left: {names:?}");

        // A valid safetensors file any reader accepts, with the documented names.
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 3 * LENS.len());
        assert_eq!(st.tensor("group.000003.v").unwrap().shape(), &[LENS[3]]);

        // Keep going in `a`, then roll it back and go again: same bits.
        for it in SAVE_AT + 1..=END {
            stream_step(&mut a, &mut ctrl, &mut outs, it, OVERFLOW_AT).unwrap();
        }
        assert_same_state(&mut a, &r);
        a.load_checkpoint(&path, &mut ctrl).unwrap();
        assert_eq!(a.step_count(), ctrl.step());
        for it in SAVE_AT + 1..=END {
            stream_step(&mut a, &mut ctrl, &mut outs, it, OVERFLOW_AT).unwrap();
        }
        assert_same_state(&mut a, &r);
        assert_eq!(ctrl.loss_scale(), r.ctrl.loss_scale());

        // A new optimizer over a fresh swap file, with a fresh controller.
        let mut ctrl_b = controller();
        let mut b = StreamingOptimizer::from_checkpoint(
            cpu(),
            groups(),
            mem_swap(master, FaultConfig::none()),
            cfg(master, budget(master)),
            &path,
            &mut ctrl_b,
        )
        .unwrap();
        assert_eq!(ctrl_b.state().step, SAVE_AT);
        let mut outs_b = Outs::new();
        for it in SAVE_AT + 1..=END {
            stream_step(&mut b, &mut ctrl_b, &mut outs_b, it, OVERFLOW_AT).unwrap();
        }
        assert_same_state(&mut b, &r);
        assert_eq!(outs_b.bits(), r.outs.bits());
        assert_eq!(ctrl_b.state(), r.ctrl.state());
    }
}

#[test]
fn damaged_checkpoints_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    let mut a = new_opt(MasterPlace::Nvme);
    a.initialize(init_master).unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    stream_step(&mut a, &mut ctrl, &mut outs, 1, None).unwrap();
    a.save_checkpoint(&path, &ctrl).unwrap();
    // Overwriting is atomic too: save again over it.
    stream_step(&mut a, &mut ctrl, &mut outs, 2, None).unwrap();
    a.save_checkpoint(&path, &ctrl).unwrap();
    let good = std::fs::read(&path).unwrap();

    let bad = dir.path().join("bad.safetensors");
    // One flipped bit in the data.
    let mut flipped = good.clone();
    let at = flipped.len() - 1000;
    flipped[at] ^= 0x10;
    std::fs::write(&bad, &flipped).unwrap();
    let mut ctrl2 = controller();
    let e = a.load_checkpoint(&bad, &mut ctrl2).unwrap_err();
    assert!(matches!(e, OptimError::Checkpoint { .. }), "{e}");
    assert!(e.to_string().contains("checksum"), "{e}");
    // Truncated (a half-written file that was never renamed would look like this).
    std::fs::write(&bad, &good[..good.len() / 2]).unwrap();
    let e = a.load_checkpoint(&bad, &mut ctrl2).unwrap_err();
    assert!(matches!(e, OptimError::Checkpoint { .. }), "{e}");
    // Not a checkpoint at all.
    std::fs::write(&bad, b"hello").unwrap();
    assert!(matches!(
        a.load_checkpoint(&bad, &mut ctrl2),
        Err(OptimError::Checkpoint { .. })
    ));
    // Nothing changed: still at step 2, controller untouched.
    assert_eq!(a.step_count(), 2);
    assert_eq!(ctrl2.step(), 0);
    // Another shape.
    let mut other_groups = groups();
    other_groups.pop();
    let (slot_bytes, _) = StreamingOptimizer::swap_shape(&groups(), MasterPlace::Nvme);
    let _ = slot_bytes;
    let mut c = StreamingOptimizer::new(
        cpu(),
        other_groups,
        mem_swap(MasterPlace::Nvme, FaultConfig::none()),
        cfg(MasterPlace::Nvme, budget(MasterPlace::Nvme)),
    )
    .unwrap();
    let e = c.load_checkpoint(&path, &mut ctrl2).unwrap_err();
    assert!(e.to_string().contains("groups"), "{e}");
}
