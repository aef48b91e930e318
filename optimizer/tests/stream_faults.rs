//! Guards against an I/O failure in the middle of a streamed step leaving a silently
//! inconsistent optimizer: a write that fails (EIO, or ENOSPC once the device is full)
//! must surface as the typed `OptimError::Io` naming the io error; the optimizer must
//! then refuse every step and save (`OptimError::Poisoned`) — some groups hold the new
//! step, others the old — and loading the last checkpoint over a fresh swap file must
//! continue bit-identically to a run that never failed. Reads that fail (EIO) poison the
//! step the same way and the checkpoint reloads into the same optimizer.

mod stream_common;

use stream_common::*;
use tidestore_io::{FaultConfig, IoError};
use tidestore_optimizer::stream::{MasterPlace, StreamingOptimizer};
use tidestore_optimizer::OptimError;

const END: u64 = 12;

fn budget() -> u64 {
    let (_, per_group) =
        StreamingOptimizer::ring_bytes_for(&groups(), &cfg(MasterPlace::Nvme, 1 << 40));
    per_group as u64 * 3
}

/// Runs with checkpoints after every good step until the injected fault; returns the
/// step whose write failed. Then reloads over a fresh swap and finishes; compares.
fn fault_then_recover(faults: FaultConfig, expect: fn(&IoError) -> bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    let master = MasterPlace::Nvme;
    let mut opt = StreamingOptimizer::new(
        cpu(),
        groups(),
        mem_swap(master, faults),
        cfg(master, budget()),
    )
    .unwrap();
    opt.initialize(init_master)
        .expect("the fault must come after initialisation");
    let mut ctrl = controller();
    let mut outs = Outs::new();
    opt.save_checkpoint(&path, &ctrl).unwrap();
    let mut failed_at = None;
    for it in 1..=END {
        match stream_step(&mut opt, &mut ctrl, &mut outs, it, None) {
            Ok(_) => opt.save_checkpoint(&path, &ctrl).unwrap(),
            Err(e) => {
                match &e {
                    OptimError::Io {
                        source,
                        during,
                        group,
                    } => {
                        assert!(expect(source.get()), "unexpected io error {e}");
                        eprintln!("step {it}: {during} of group {group} failed: {source}");
                    }
                    other => panic!("expected OptimError::Io, got {other}"),
                }
                failed_at = Some(it);
                break;
            }
        }
    }
    let failed_at = failed_at.expect("the fault was injected within the run");
    assert!(
        failed_at >= 2,
        "fault should hit mid-run, hit at step {failed_at}"
    );
    assert!(opt.is_poisoned());
    let e = stream_step(&mut opt, &mut ctrl, &mut outs, failed_at + 1, None).unwrap_err();
    assert!(matches!(e, OptimError::Poisoned { .. }), "{e}");
    assert!(matches!(
        opt.save_checkpoint(&path, &ctrl),
        Err(OptimError::Poisoned { .. })
    ));
    let mut scratch = vec![0.0; LENS[0]];
    assert!(matches!(
        opt.read_group(0, &mut scratch, &mut [], &mut []),
        Err(OptimError::Poisoned { .. })
    ));
    drop(opt);

    // Reload the last good checkpoint over a fresh swap file and finish the run.
    let mut ctrl2 = controller();
    let mut opt2 = StreamingOptimizer::from_checkpoint(
        cpu(),
        groups(),
        mem_swap(master, FaultConfig::none()),
        cfg(master, budget()),
        &path,
        &mut ctrl2,
    )
    .unwrap();
    assert_eq!(opt2.step_count(), failed_at - 1);
    let mut outs2 = Outs::new();
    for it in failed_at..=END {
        stream_step(&mut opt2, &mut ctrl2, &mut outs2, it, None).unwrap();
    }
    let mut r = Reference::new();
    for it in 1..=END {
        r.step(it, None);
    }
    assert_same_state(&mut opt2, &r);
    assert_eq!(outs2.bits(), r.outs.bits());
}

/// Bytes the swap file writes per step (every group's arrays, rounded to 4096).
fn step_write_bytes() -> u64 {
    LENS.iter()
        .map(|&l| tidestore_io::align_up(l * 4) as u64 * 3)
        .sum()
}

#[test]
fn enospc_mid_stream_poisons_and_the_checkpoint_restores() {
    // Format + initialisation write about one step's worth; the device fills up in the
    // middle of the fourth step.
    let faults = FaultConfig {
        enospc_after_bytes: Some(step_write_bytes() * 4 + step_write_bytes() / 2),
        ..FaultConfig::seeded(1)
    };
    fault_then_recover(faults, |e| matches!(e, IoError::NoSpace { .. }));
}

#[test]
fn eio_on_a_write_mid_stream_poisons_and_the_checkpoint_restores() {
    // Seeded: find a seed whose first EIO falls after initialisation (deterministic).
    let seed = (0..200)
        .find(|&s| {
            let f = FaultConfig {
                eio_write_rate: 0.01,
                ..FaultConfig::seeded(s)
            };
            let mut opt = StreamingOptimizer::new(
                cpu(),
                groups(),
                mem_swap(MasterPlace::Nvme, f),
                cfg(MasterPlace::Nvme, budget()),
            )
            .unwrap();
            if opt.initialize(init_master).is_err() {
                return false;
            }
            let mut ctrl = controller();
            let mut outs = Outs::new();
            stream_step(&mut opt, &mut ctrl, &mut outs, 1, None).is_ok()
        })
        .expect("some seed leaves initialisation and step 1 alone");
    let faults = FaultConfig {
        eio_write_rate: 0.01,
        ..FaultConfig::seeded(seed)
    };
    fault_then_recover(faults, |e| matches!(e, IoError::Device { .. }));
}

#[test]
fn eio_on_a_read_poisons_and_reloads_into_the_same_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    let faults = FaultConfig {
        eio_read_rate: 0.05,
        ..FaultConfig::seeded(3)
    };
    let mut opt = StreamingOptimizer::new(
        cpu(),
        groups(),
        mem_swap(MasterPlace::Nvme, faults),
        cfg(MasterPlace::Nvme, budget()),
    )
    .unwrap();
    opt.initialize(init_master).unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    let ckpt_ctrl = ctrl.clone();
    // Save needs reads too; the initial state is saved from a clean twin instead.
    let mut twin = StreamingOptimizer::new(
        cpu(),
        groups(),
        mem_swap(MasterPlace::Nvme, FaultConfig::none()),
        cfg(MasterPlace::Nvme, budget()),
    )
    .unwrap();
    twin.initialize(init_master).unwrap();
    twin.save_checkpoint(&path, &ckpt_ctrl).unwrap();
    let mut err = None;
    for it in 1..=END {
        if let Err(e) = stream_step(&mut opt, &mut ctrl, &mut outs, it, None) {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("a read failed within the run");
    match &e {
        OptimError::Io { source, .. } => {
            assert!(matches!(source.get(), IoError::Device { .. }), "{e}")
        }
        other => panic!("expected Io, got {other}"),
    }
    assert!(opt.is_poisoned());
    assert!(
        !opt.swap().is_poisoned(),
        "failed reads do not poison the swap file"
    );
    opt.load_checkpoint(&path, &mut ctrl).unwrap();
    assert!(!opt.is_poisoned());
    assert_eq!(opt.step_count(), 0);
    assert_eq!(ctrl.step(), 0);
}
