//! Guards against the step loop going on after a failed step. An NVMe read that fails
//! (EIO) while the step loads a tensor's chunks leaves the optimizer step half made:
//! some tensors hold step n and others step n - 1. The loop must then refuse every call
//! with `TrainError::Poisoned` (naming what failed) instead of stepping on, and
//! `restore()` — after a checkpoint is loaded — must lift it.

use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, NvmeSource, Place, StoreConfig, TensorId,
    TensorSpec, TensorState,
};
use tidestore_io::{Compression, Engine, FaultConfig, MemoryBackend, SwapFile};
use tidestore_optimizer::half::bf16;
use tidestore_optimizer::{AdamW, ControllerState, CpuConfig, HybridAdamW, OptimError};
use tidestore_tiers::{Device, DeviceConfig, NvmeTier};
use tidestore_train::{
    GradPlace, Overlap, StepConfig, StepLoop, StepPlace, StepTensor, TrainError,
};

const CHUNK_ELEMENTS: u64 = 4096;
const TENSORS: u32 = 8;

/// A store of `TENSORS` one-chunk tensors whose host pool holds one step's chunks (plus
/// one), over a swap file on a memory device that fails reads at `eio_read_rate`.
fn store(seed: u64, eio_read_rate: f64) -> ChunkStore {
    let layout = Layout::new(
        LayoutConfig::new(CHUNK_ELEMENTS),
        (0..TENSORS).map(|i| {
            TensorSpec::new(
                format!("w{i}"),
                &[CHUNK_ELEMENTS as usize],
                DType::BF16,
                true,
            )
        }),
    )
    .unwrap();
    let slot = (CHUNK_ELEMENTS * 4) as usize;
    let faults = FaultConfig {
        seed,
        eio_read_rate,
        ..FaultConfig::none()
    };
    let backend = MemoryBackend::new(64 << 20, 8, faults);
    let engine = Engine::new(Box::new(backend), 4096, true).unwrap();
    let swap = SwapFile::with_engine(engine, slot, 64, Compression::Off).unwrap();
    let tier = NvmeTier::from_swap_file(swap);
    let cfg = StoreConfig::new(
        4 * slot as u64,
        5 * slot as u64,
        NvmeSource::Tier(Box::new(tier)),
    )
    .with_working_set_chunks(4);
    let device = Device::sim(&DeviceConfig::new(4 * slot as u64)).unwrap();
    ChunkStore::open(layout, cfg, device).unwrap()
}

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
    let tensors = (0..TENSORS)
        .map(|i| StepTensor {
            tensor: TensorId(i),
            grad: GradPlace::InParam16,
        })
        .collect();
    let cfg = StepConfig {
        hp: Default::default(),
        max_grad_norm: None,
        loss_scaler: None,
        place: StepPlace::Host,
        overlap: Overlap::Off,
        check_finite: true,
    };
    StepLoop::new(store, opt, tensors, cfg).unwrap()
}

/// Backward: every gradient written over its 16-bit copy and reported.
fn backward(store: &mut ChunkStore, lp: &mut StepLoop) -> Result<(), TrainError> {
    let g16 = vec![bf16::from_f32(1e-3); CHUNK_ELEMENTS as usize];
    for i in (0..TENSORS).rev() {
        let g = store.access(TensorId(i), ListKind::Params, Place::Device)?;
        store
            .bytes_mut(&g)?
            .copy_from_slice(bytemuck::cast_slice(&g16));
        store.release(g, TensorState::HoldAfterBwd)?;
        lp.grad_ready(TensorId(i), 1.0)?;
    }
    Ok(())
}

/// Trains until a fault; the error `finish` returned, if the fault hit the step.
fn train_until_a_fault(store: &mut ChunkStore, lp: &mut StepLoop) -> Option<TrainError> {
    let mut observe = |_: &ChunkStore| {};
    for _ in 0..100 {
        if let Err(e) = backward(store, lp) {
            // A fault outside the step (backward's own loads) poisons nothing.
            assert!(!lp.is_poisoned(), "{e}");
            return None;
        }
        match lp.finish(store, &mut observe) {
            Ok(_) => store.end_iteration().ok()?,
            Err(e) => return Some(e),
        }
    }
    None
}

#[test]
fn a_failed_read_in_the_step_poisons_the_loop_until_restore() {
    let mut step_faults = 0;
    for seed in 0..40 {
        let mut store = store(seed, 0.02);
        let mut lp = step_loop(&store);
        let Some(e) = train_until_a_fault(&mut store, &mut lp) else {
            continue;
        };
        step_faults += 1;
        assert!(lp.is_poisoned(), "seed {seed}: the loop went on after: {e}");
        // Every later call is refused, naming what failed.
        match lp.grad_ready(TensorId(0), 1.0) {
            Err(TrainError::Poisoned { reason }) => {
                assert!(reason.contains("stepping `w"), "{reason}")
            }
            other => panic!("expected Poisoned, got {other:?}"),
        }
        assert!(matches!(
            lp.finish(&mut store, &mut |_| {}),
            Err(TrainError::Poisoned { .. })
        ));
        // restore() (after a checkpoint load) lifts it.
        lp.restore(ControllerState {
            step: 3,
            loss_scaler: None,
        })
        .unwrap();
        assert!(!lp.is_poisoned());
        assert_eq!(lp.step_count(), 3);
    }
    assert!(step_faults > 0, "no seed put a read fault inside a step");
}
