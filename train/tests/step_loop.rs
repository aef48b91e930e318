//! Guards the one step loop against giving anything but in-memory AdamW: every way it
//! can step a tensor (in place in the host pool, one chunk at a time through scratch
//! copies, on the simulated device; gradients over the 16-bit copy or in their own
//! fp32 tensors) and both overlap settings must leave master, M, V and the 16-bit
//! parameters bit-identical to `AdamW::step_slice` over plain vectors fed the same
//! gradients, for several steps, with chunks spilling to NVMe — with fp32, bf16 and int8
//! moments alike (`AdamW::step_moments` over plain buffers of the same stored bytes:
//! codes, padding and absmax of every int8 place, fp32 places of the small tensors). Also: stepping during
//! backward really happens before `finish`, and every misuse is a typed error.

use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, MomentForm, NvmeSource, Place, StoreConfig,
    TensorId, TensorSpec, TensorState,
};
use tidestore_io::IoConfig;
use tidestore_optimizer::half::bf16;
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HybridAdamW, HyperParams, Moments, OptimError, ParamOut, Q8Mut,
    StepDecision, StepState,
};
use tidestore_tiers::{Device, DeviceConfig};
use tidestore_train::{
    GradPlace, Overlap, StepConfig, StepLoop, StepPlace, StepTensor, TrainError,
};

const CHUNK_ELEMENTS: u64 = 16 * 1024;
/// Odd sizes, several tensors per chunk; an fp32 gradient of 8192 fills a chunk.
const SIZES: [usize; 6] = [3000, 5000, 8191, 7, 8192, 6001];
const STEPS: u64 = 4;

fn hp() -> HyperParams {
    HyperParams {
        lr: 1e-2,
        weight_decay: 0.1,
        ..HyperParams::default()
    }
}

fn cpu() -> AdamW {
    AdamW::new(CpuConfig {
        threads: 1,
        ..CpuConfig::default()
    })
    .expect("cpu adamw")
}

fn no_gpu() -> HybridAdamW {
    HybridAdamW::cpu_only(
        cpu(),
        OptimError::NoGpu {
            reason: "test".into(),
        },
    )
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Grad {
    /// bf16 gradients over the 16-bit copy.
    InParam16,
    /// fp32 gradients in the layout's `Grads` list; the 16-bit copy refreshed.
    GradsF32,
}

fn layout_with(grad: Grad, states: MomentForm) -> Layout {
    let specs = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| TensorSpec::new(format!("w{i}"), &[n], DType::BF16, true));
    let f32_grads = grad == Grad::GradsF32;
    let config = LayoutConfig::new(CHUNK_ELEMENTS)
        .with_moments(states)
        .with_grad_accumulation(f32_grads)
        .with_fp32_grads(f32_grads);
    Layout::new(config, specs).expect("layout")
}

/// A store whose host pool holds `host_buffers` whole chunks, over a real swap file.
fn store(dir: &tempfile::TempDir, grad: Grad, host_buffers: u64) -> ChunkStore {
    store_with(dir, grad, host_buffers, MomentForm::F32)
}

fn store_with(
    dir: &tempfile::TempDir,
    grad: Grad,
    host_buffers: u64,
    states: MomentForm,
) -> ChunkStore {
    store_sized(dir, grad, (host_buffers, 6), states)
}

/// As [`store_with`], with a device of `device_slots` whole chunks.
fn store_sized(
    dir: &tempfile::TempDir,
    grad: Grad,
    (host_buffers, device_slots): (u64, u64),
    states: MomentForm,
) -> ChunkStore {
    let slot = CHUNK_ELEMENTS * 4;
    let io = IoConfig {
        block_bytes: 16 * 1024,
        queue_depth: 8,
        ..IoConfig::default()
    };
    let nvme = NvmeSource::Dir {
        dir: dir.path().to_path_buf(),
        bytes: 64 * slot,
        io,
    };
    let cfg = StoreConfig::new(device_slots * slot, host_buffers * slot, nvme)
        .with_host_prefetch(16)
        .with_async_write_back(true)
        .with_working_set_chunks((host_buffers - 1).min(5) as u32);
    let device = Device::sim(&DeviceConfig::new(device_slots * slot)).expect("sim device");
    ChunkStore::open(layout_with(grad, states), cfg, device).expect("store")
}

/// The plain-vector model of the same training; M and V as their stored bytes (in
/// f32-aligned buffers, `moment_bytes` long), of dtype `moments[i]`.
#[derive(Default)]
struct Reference {
    master: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    moments: Vec<DType>,
    moment_bytes: Vec<usize>,
    p16: Vec<Vec<bf16>>,
}

/// A tensor's stored moment bytes as the kernel's view (see `tidestore_chunk::moments`).
fn moments_view<'a>(m: &'a mut [u8], v: &'a mut [u8], dtype: DType, n: usize) -> Moments<'a> {
    fn q8(b: &mut [u8], n: usize) -> Q8Mut<'_> {
        let (codes, rest) = b.split_at_mut(n.next_multiple_of(4));
        Q8Mut {
            codes: &mut codes[..n],
            absmax: bytemuck::cast_slice_mut(&mut rest[..4 * n.div_ceil(256)]),
        }
    }
    match dtype {
        DType::F32 => Moments::F32 {
            m: bytemuck::cast_slice_mut(m),
            v: bytemuck::cast_slice_mut(v),
        },
        DType::BF16 => Moments::Bf16 {
            m: bytemuck::cast_slice_mut(m),
            v: bytemuck::cast_slice_mut(v),
        },
        DType::Q8 => Moments::Int8 {
            m: q8(m, n),
            v: q8(v, n),
        },
        DType::F16 => unreachable!("no f16 moments"),
    }
}

fn init(i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|k| ((k * 7 + i * 13) % 101) as f32 / 101.0 - 0.5)
        .collect()
}

/// The gradient of step `step` for tensor `i` at parameters `p16`: depends on the
/// parameters, so a wrong step shows in every later one.
fn gradient(step: u64, i: usize, p16: &[bf16]) -> Vec<f32> {
    p16.iter()
        .enumerate()
        .map(|(k, p)| {
            p.to_f32() * 0.5 + ((k as u64 * 31 + step * 17 + i as u64) % 13) as f32 * 1e-3
        })
        .collect()
}

fn write_initial(store: &mut ChunkStore, reference: &mut Reference) {
    for (i, &n) in SIZES.iter().enumerate() {
        let w = init(i, n);
        let p16: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
        let t = TensorId(i as u32);
        store
            .write(t, ListKind::Master, bytemuck::cast_slice(&w))
            .unwrap();
        store
            .write(t, ListKind::Params, bytemuck::cast_slice(&p16))
            .unwrap();
        reference.master.push(w);
        let loc = store.layout().location(t, ListKind::Momentum).unwrap();
        let bytes = loc.bytes() as usize;
        reference.m.push(vec![0.0; bytes.div_ceil(4)]);
        reference.v.push(vec![0.0; bytes.div_ceil(4)]);
        reference.moments.push(loc.dtype);
        reference.moment_bytes.push(bytes);
        reference.p16.push(p16);
    }
}

fn tensors(grad: Grad) -> Vec<StepTensor> {
    (0..SIZES.len())
        .map(|i| StepTensor {
            tensor: TensorId(i as u32),
            grad: match grad {
                Grad::InParam16 => GradPlace::InParam16,
                Grad::GradsF32 => GradPlace::InGrads {
                    write_param16: true,
                },
            },
        })
        .collect()
}

/// Runs `STEPS` iterations through the loop and the reference side by side; checks the
/// 16-bit parameters every iteration and everything at the end. Returns how many tensor
/// steps overlapped backward (with [`Overlap::Forward`]: how many were made in a next
/// forward, the last step's completed at the end excluded).
fn train(place: StepPlace, overlap: Overlap, grad: Grad, host_buffers: u64) -> u64 {
    train_with(place, overlap, grad, host_buffers, MomentForm::F32)
}

fn train_with(
    place: StepPlace,
    overlap: Overlap,
    grad: Grad,
    host_buffers: u64,
    states: MomentForm,
) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    // Compact moments take less room: a smaller device keeps the device step spilling.
    let device_slots = if place == StepPlace::Device && states != MomentForm::F32 {
        4
    } else {
        6
    };
    let mut store = store_sized(&dir, grad, (host_buffers, device_slots), states);
    let mut reference = Reference::default();
    write_initial(&mut store, &mut reference);
    let cfg = StepConfig {
        hp: hp(),
        max_grad_norm: None,
        loss_scaler: None,
        place,
        overlap,
        check_finite: true,
    };
    let mut lp = StepLoop::new(&store, no_gpu(), tensors(grad), cfg).expect("step loop");
    let cpu = cpu();
    let mut observe = |_: &ChunkStore| {};
    for step in 1..=STEPS {
        // Forward: every 16-bit copy read on the device, equal to the reference's (with
        // `Overlap::Forward` once its step due from the last iteration is made).
        for (i, &n) in SIZES.iter().enumerate() {
            let t = TensorId(i as u32);
            let due = lp.step_deferred(&mut store, t, &mut observe).unwrap();
            // A tensor is stepped with the first of its group (its gradient's chunk).
            assert!(
                !due || (overlap == Overlap::Forward && step > 1),
                "step {step}: w{i}"
            );
            let g = store
                .access(TensorId(i as u32), ListKind::Params, Place::Device)
                .unwrap();
            let got: &[bf16] = bytemuck::cast_slice(store.bytes(&g).unwrap());
            assert_eq!(got.len(), n);
            assert!(
                got.iter()
                    .zip(&reference.p16[i])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step}: w{i}'s 16-bit copy differs from the reference"
            );
            store.release(g, TensorState::HoldAfterFwd).unwrap();
        }
        // Backward, last tensor first: gradients written, reported, stepped when ready.
        let mut grads: Vec<Vec<f32>> = vec![vec![]; SIZES.len()];
        for i in (0..SIZES.len()).rev() {
            let g32 = gradient(step, i, &reference.p16[i]);
            let sq: f64 = match grad {
                Grad::InParam16 => {
                    let g16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
                    let g = store
                        .access(TensorId(i as u32), ListKind::Params, Place::Device)
                        .unwrap();
                    store
                        .bytes_mut(&g)
                        .unwrap()
                        .copy_from_slice(bytemuck::cast_slice(&g16));
                    store.release(g, TensorState::HoldAfterBwd).unwrap();
                    grads[i] = g16.iter().map(|x| x.to_f32()).collect();
                    cpu.grad_sq_norm(Grads::Bf16(&g16))
                }
                Grad::GradsF32 => {
                    let t = TensorId(i as u32);
                    let g = store.access(t, ListKind::Grads, Place::Host).unwrap();
                    store
                        .bytes_mut(&g)
                        .unwrap()
                        .copy_from_slice(bytemuck::cast_slice(&g32));
                    store.release(g, TensorState::HoldAfterBwd).unwrap();
                    grads[i] = g32.clone();
                    cpu.grad_sq_norm(Grads::F32(&g32))
                }
            };
            lp.grad_ready(TensorId(i as u32), sq).unwrap();
            lp.step_ready(&mut store, None, &mut observe).unwrap();
        }
        let outcome = lp.finish(&mut store, &mut observe).unwrap();
        assert!(matches!(outcome.decision, StepDecision::Apply { .. }));
        store.end_iteration().unwrap();
        for (i, g) in grads.iter().enumerate() {
            let mb = reference.moment_bytes[i];
            let m = &mut bytemuck::cast_slice_mut(&mut reference.m[i][..])[..mb];
            let v = &mut bytemuck::cast_slice_mut(&mut reference.v[i][..])[..mb];
            cpu.step_moments(
                StepState::new(step),
                &hp(),
                &mut reference.master[i],
                moments_view(m, v, reference.moments[i], SIZES[i]),
                Grads::F32(g),
                Some(ParamOut::Bf16(&mut reference.p16[i])),
            )
            .unwrap();
        }
    }
    let in_forward = lp.stats().tensors_deferred;
    let completed = lp.complete_deferred(&mut store, &mut observe).unwrap();
    if overlap == Overlap::Forward {
        assert_eq!(completed, SIZES.len(), "the last step's tensors were due");
        assert_eq!(in_forward, (STEPS - 1) * SIZES.len() as u64);
    } else {
        assert_eq!((completed, in_forward), (0, 0));
    }
    assert_eq!(lp.deferred(), 0);
    for i in 0..SIZES.len() {
        let t = TensorId(i as u32);
        let mb = reference.moment_bytes[i];
        for (list, want) in [
            (ListKind::Master, &reference.master[i][..]),
            (ListKind::Momentum, &reference.m[i][..]),
            (ListKind::Variance, &reference.v[i][..]),
        ] {
            let got = store.read(t, list).unwrap();
            let want = bytemuck::cast_slice::<f32, u8>(want);
            let want = if list == ListKind::Master {
                want
            } else {
                &want[..mb]
            };
            assert!(
                got == want,
                "{place:?}/{overlap:?}/{grad:?}/{states}: w{i} {list} differs from the reference"
            );
        }
        let got = store.read(t, ListKind::Params).unwrap();
        assert!(got == bytemuck::cast_slice::<bf16, u8>(&reference.p16[i]));
    }
    assert!(
        store.stats().nvme.peak_bytes > 0 || host_buffers > 30,
        "the test meant chunks to spill to NVMe"
    );
    if grad == Grad::GradsF32 {
        // Every step consumed every gradient: each gradient chunk was discarded.
        let chunks = store.layout().list_chunk_count(ListKind::Grads);
        assert_eq!(store.stats().discarded_chunks, STEPS * chunks);
    }
    assert_eq!(lp.stats().steps_applied, STEPS);
    match overlap {
        Overlap::Forward => in_forward,
        Overlap::Off | Overlap::Backward => lp.stats().tensors_overlapped,
    }
}

#[test]
fn host_in_place_equals_in_memory_adamw() {
    assert_eq!(train(StepPlace::Host, Overlap::Off, Grad::InParam16, 5), 0);
}

#[test]
fn host_copying_equals_in_memory_adamw() {
    // Four buffers: fewer than a tensor's four places plus one for loads.
    train(StepPlace::Host, Overlap::Off, Grad::InParam16, 4);
}

#[test]
fn device_step_on_the_simulation_equals_in_memory_adamw() {
    train(StepPlace::Device, Overlap::Off, Grad::InParam16, 4);
}

#[test]
fn fp32_gradient_list_equals_in_memory_adamw() {
    train(StepPlace::Host, Overlap::Off, Grad::GradsF32, 8);
    train(StepPlace::Host, Overlap::Off, Grad::GradsF32, 5);
}

#[test]
fn overlap_steps_during_backward_and_equals_off() {
    let overlapped = train(StepPlace::Host, Overlap::Backward, Grad::InParam16, 5);
    // The groups of the later chunks complete before backward ends.
    assert!(
        overlapped > 0,
        "no tensor was stepped during backward ({overlapped})"
    );
    let overlapped = train(StepPlace::Host, Overlap::Backward, Grad::GradsF32, 6);
    assert!(overlapped > 0);
}

/// Each tensor's step made in the next forward, right before its 16-bit copy is read:
/// every host path and the device step, both gradient places, equal to in-memory
/// AdamW as the step after backward is.
#[test]
fn overlap_forward_steps_in_the_next_forward_and_equals_off() {
    let deferred = (STEPS - 1) * SIZES.len() as u64;
    for (place, grad, buffers) in [
        (StepPlace::Host, Grad::InParam16, 5),
        (StepPlace::Host, Grad::InParam16, 4),
        (StepPlace::Host, Grad::GradsF32, 6),
        (StepPlace::Device, Grad::InParam16, 4),
    ] {
        let made = train(place, Overlap::Forward, grad, buffers);
        assert_eq!(made, deferred, "{place:?}/{grad:?}/{buffers}");
    }
}

/// With `Overlap::Forward` a due tensor takes no new gradient before its step is made,
/// a decision with clipping defers as one without, `restore` drops what is due, and the
/// loop's step count and decision are those of the step after backward.
#[test]
fn due_steps_refuse_a_new_gradient_and_restore_drops_them() {
    let (_d, mut store, lp) = small_loop(Overlap::Forward, Some(1e-3));
    let mut lp = lp.unwrap();
    let mut observe = |_: &ChunkStore| {};
    for i in (0..SIZES.len()).rev() {
        lp.grad_ready(TensorId(i as u32), 1.0).unwrap();
    }
    let outcome = lp.finish(&mut store, &mut observe).unwrap();
    match outcome.decision {
        StepDecision::Apply { clip_coef, .. } => assert!(clip_coef < 1.0, "{clip_coef}"),
        other => panic!("expected an applied, clipped step, got {other:?}"),
    }
    assert_eq!((lp.step_count(), lp.deferred()), (1, SIZES.len()));
    assert_eq!(lp.stats().tensors_stepped, 0, "nothing stepped at finish");
    match lp.grad_ready(TensorId(2), 1.0) {
        Err(TrainError::Protocol(msg)) => assert!(msg.contains("w2"), "{msg}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(lp
        .step_deferred(&mut store, TensorId(2), &mut observe)
        .unwrap());
    assert!(!lp
        .step_deferred(&mut store, TensorId(2), &mut observe)
        .unwrap());
    // w2's group (the tensors whose gradients share its chunk) was stepped with it.
    let group = lp.stats().tensors_deferred as usize;
    assert!(group >= 1 && lp.deferred() == SIZES.len() - group);
    let state = lp.controller_state();
    lp.restore(state).unwrap();
    assert_eq!(lp.deferred(), 0, "restore drops the due steps");
    assert_eq!(lp.complete_deferred(&mut store, &mut observe).unwrap(), 0);
    lp.grad_ready(TensorId(0), 1.0).unwrap();
}

fn small_loop(
    overlap: Overlap,
    max_grad_norm: Option<f32>,
) -> (tempfile::TempDir, ChunkStore, Result<StepLoop, TrainError>) {
    small_loop_with(overlap, max_grad_norm, Grad::InParam16)
}

fn small_loop_with(
    overlap: Overlap,
    max_grad_norm: Option<f32>,
    grad: Grad,
) -> (tempfile::TempDir, ChunkStore, Result<StepLoop, TrainError>) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir, grad, 7);
    let cfg = StepConfig {
        hp: hp(),
        max_grad_norm,
        loss_scaler: None,
        place: StepPlace::Host,
        overlap,
        check_finite: true,
    };
    let lp = StepLoop::new(&store, no_gpu(), tensors(grad), cfg);
    (dir, store, lp)
}

#[test]
fn overlap_with_clipping_is_refused_naming_the_key() {
    let (_d, _s, lp) = small_loop(Overlap::Backward, Some(1.0));
    match lp {
        Err(TrainError::Config { key, reason }) => {
            assert_eq!(key, "optimizer.overlap");
            assert!(reason.contains("clipping"), "{reason}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let (_d, mut store, lp) = small_loop(Overlap::Off, Some(1.0));
    let mut lp = lp.unwrap();
    let mut observe = |_: &ChunkStore| {};
    // Unknown tensor; reported twice; finish before every gradient.
    assert!(matches!(
        lp.grad_ready(TensorId(99), 0.0),
        Err(TrainError::Protocol(_))
    ));
    lp.grad_ready(TensorId(0), 1.0).unwrap();
    assert!(matches!(
        lp.grad_ready(TensorId(0), 1.0),
        Err(TrainError::Protocol(_))
    ));
    match lp.finish(&mut store, &mut observe) {
        Err(TrainError::Protocol(msg)) => {
            assert!(msg.contains("w1") && msg.contains("abandoned"), "{msg}")
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    // Nothing was stepped: the iteration was dropped, and a whole one steps.
    assert!(!lp.is_poisoned());
    for i in 0..SIZES.len() {
        lp.grad_ready(TensorId(i as u32), 1.0).unwrap();
    }
    lp.finish(&mut store, &mut observe).unwrap();
    assert_eq!(lp.step_count(), 1);
    // A tensor listed twice; a frozen tensor (no master/M/V).
    let cfg = StepConfig {
        hp: hp(),
        max_grad_norm: None,
        loss_scaler: None,
        place: StepPlace::Host,
        overlap: Overlap::Off,
        check_finite: true,
    };
    let twice = vec![tensors(Grad::InParam16)[0]; 2];
    assert!(matches!(
        StepLoop::new(&store, no_gpu(), twice, cfg),
        Err(TrainError::Tensor { .. })
    ));
}

/// Writes every gradient as backward leaves it (`grad`'s place), one of them non-finite,
/// and finishes the step: it is skipped, and master and the 16-bit copy are as they were
/// (a gradient over the 16-bit copy is gone: the copy is the master's again). Returns
/// the store.
fn skip_a_step(grad: Grad) -> (tempfile::TempDir, ChunkStore) {
    let (d, mut store, lp) = small_loop_with(Overlap::Off, None, grad);
    let mut lp = lp.unwrap();
    let mut reference = Reference::default();
    write_initial(&mut store, &mut reference);
    let mut observe = |_: &ChunkStore| {};
    let (list, place) = match grad {
        Grad::InParam16 => (ListKind::Params, Place::Device),
        Grad::GradsF32 => (ListKind::Grads, Place::Host),
    };
    for i in (0..SIZES.len()).rev() {
        let t = TensorId(i as u32);
        let g = store.access(t, list, place).unwrap();
        store.bytes_mut(&g).unwrap().fill(0x5a);
        store.release(g, TensorState::HoldAfterBwd).unwrap();
        let sq = if i == 2 { f64::INFINITY } else { 1.0 };
        lp.grad_ready(t, sq).unwrap();
    }
    let outcome = lp.finish(&mut store, &mut observe).unwrap();
    assert!(matches!(outcome.decision, StepDecision::Skip { .. }));
    assert_eq!(lp.step_count(), 0);
    for i in 0..SIZES.len() {
        let t = TensorId(i as u32);
        let got = store.read(t, ListKind::Master).unwrap();
        assert!(got == bytemuck::cast_slice::<f32, u8>(&reference.master[i]));
        let got = store.read(t, ListKind::Params).unwrap();
        assert!(
            got == bytemuck::cast_slice::<bf16, u8>(&reference.p16[i]),
            "w{i}: a skipped step left the gradient in the 16-bit copy"
        );
    }
    (d, store)
}

#[test]
fn a_non_finite_gradient_skips_the_step_and_changes_nothing() {
    skip_a_step(Grad::InParam16);
}

/// The same with fp32 gradients of their own: the 16-bit copy is cast again from the
/// unchanged master, and every gradient is consumed unread — its chunks discarded.
#[test]
fn a_skipped_step_drops_fp32_gradients_and_changes_nothing() {
    let (_d, store) = skip_a_step(Grad::GradsF32);
    for i in 0..SIZES.len() {
        let t = TensorId(i as u32);
        assert_eq!(store.state(t, ListKind::Grads), Some(TensorState::Free));
    }
    let grad_chunks = store.layout().list_chunk_count(ListKind::Grads);
    assert_eq!(store.stats().discarded_chunks, grad_chunks);
}

/// A step that some tensors took during backward and the rest cannot (a non-finite
/// gradient after them, a gradient that never came) is half made: the loop is poisoned,
/// refuses every call naming why, and `restore` (after a checkpoint) lifts it.
#[test]
fn a_half_made_overlapped_step_poisons_the_loop_until_restore() {
    for missing in [false, true] {
        let (_d, mut store, lp) = small_loop(Overlap::Backward, None);
        let mut lp = lp.unwrap();
        let mut observe = |_: &ChunkStore| {};
        let state = lp.controller_state();
        // w5 and w4 fill the last chunks: their groups complete and are stepped.
        for i in (0..SIZES.len()).rev() {
            let sq = if i == 0 { f64::NAN } else { 1.0 };
            if !(missing && i == 0) {
                lp.grad_ready(TensorId(i as u32), sq).unwrap();
            }
            lp.step_ready(&mut store, None, &mut observe).unwrap();
        }
        assert!(lp.stats().tensors_overlapped > 0);
        let want = if missing {
            "gradient of `w0` was reported"
        } else {
            "non-finite"
        };
        match lp.finish(&mut store, &mut observe) {
            Err(TrainError::Poisoned { reason }) => {
                assert!(
                    reason.contains(want) && reason.contains("stepped during backward"),
                    "{reason}"
                )
            }
            other => panic!("expected a poisoned loop, got {other:?}"),
        }
        assert!(lp.is_poisoned());
        assert!(matches!(
            lp.grad_ready(TensorId(0), 1.0),
            Err(TrainError::Poisoned { .. })
        ));
        lp.restore(state).unwrap();
        for i in (0..SIZES.len()).rev() {
            lp.grad_ready(TensorId(i as u32), 1.0).unwrap();
        }
        lp.finish(&mut store, &mut observe).unwrap();
        assert_eq!(lp.step_count(), 1);
    }
}

/// Every host path with bf16 and int8 moments (int8: the small tensors keep fp32 places;
/// the others, odd lengths included, codes + absmax).
#[test]
fn compact_moments_equal_in_memory_adamw_on_every_host_path() {
    for states in [MomentForm::BF16, MomentForm::Int8] {
        assert_eq!(
            train_with(StepPlace::Host, Overlap::Off, Grad::InParam16, 4, states),
            0
        );
        train_with(StepPlace::Host, Overlap::Off, Grad::InParam16, 3, states);
        train_with(StepPlace::Host, Overlap::Off, Grad::GradsF32, 6, states);
        train_with(StepPlace::Host, Overlap::Off, Grad::GradsF32, 4, states);
        let overlapped = train_with(
            StepPlace::Host,
            Overlap::Backward,
            Grad::InParam16,
            4,
            states,
        );
        assert!(overlapped > 0, "{states}: nothing stepped during backward");
    }
}

/// The device step with bf16 and int8 moments on the simulated device: the compact
/// places accessed on the device and stepped there by the CPU kernel give the bits of
/// the in-memory reference (on a GPU the compact kernels run; the optimizer's
/// `device_compact` test checks those against the CPU).
#[test]
fn compact_moments_on_the_device_step_equal_in_memory_adamw() {
    for states in [MomentForm::BF16, MomentForm::Int8] {
        train_with(StepPlace::Device, Overlap::Off, Grad::InParam16, 3, states);
        train_with(StepPlace::Device, Overlap::Off, Grad::GradsF32, 3, states);
    }
}
