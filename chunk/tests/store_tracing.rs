//! Guards against the store ignoring what the warm-up taught it: the trace becomes the
//! schedule, a changed access sequence is detected and re-traced, the tidal device
//! budget leaves room for the non-model memory traced around each moment and opens up
//! during the optimizer step, a moment whose chunks in use exceed its tide is reported,
//! and never-written tensors read as zeros.

mod common;

use common::*;
use tidestore_chunk::{ChunkError, ChunkStore, DType, ListKind, Place, TensorId, TensorState};

const CHUNK: u64 = 4096;

fn store(device: u64, dir: &tempfile::TempDir) -> ChunkStore {
    let layout = layout(2048, &[(2048, false); 8], DType::F16);
    let cfg = config(device, 10 * CHUNK, nvme_dir(dir, 4 * CHUNK));
    ChunkStore::open(layout, cfg, sim_device(16 * CHUNK)).unwrap()
}

fn touch(store: &mut ChunkStore, t: u32) -> Result<(), ChunkError> {
    let g = store.access(TensorId(t), ListKind::Params, Place::Device)?;
    store.release(g, TensorState::Hold)
}

#[test]
fn unwritten_tensors_read_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(4 * CHUNK, &dir);
    let g = s
        .access(TensorId(3), ListKind::Params, Place::Device)
        .unwrap();
    assert!(s.bytes(&g).unwrap().iter().all(|&b| b == 0));
    assert_eq!(s.read_f32(&g).unwrap(), vec![0.0; 2048]);
    let values: Vec<f32> = (0..2048).map(|i| i as f32 * 0.5).collect();
    s.write_f32(&g, &values).unwrap();
    s.release(g, TensorState::HoldAfterFwd).unwrap();
    assert_eq!(
        s.state(TensorId(3), ListKind::Params),
        Some(TensorState::HoldAfterFwd)
    );
    s.evict_device_all().unwrap();
    let g = s
        .access(TensorId(3), ListKind::Params, Place::Host)
        .unwrap();
    assert_eq!(s.read_f32(&g).unwrap(), values);
    // COMPUTE -> FREE is illegal; the tensor stays in COMPUTE and can be released.
    let e = s.release(g, TensorState::Free).unwrap_err();
    assert!(matches!(e, ChunkError::IllegalTransition { .. }), "{e}");
    s.release_tensor(TensorId(3), ListKind::Params, TensorState::Hold)
        .unwrap();
    assert!(s
        .read(TensorId(5), ListKind::Params)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn changed_sequence_is_retraced() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(3 * CHUNK, &dir);
    assert!(s.is_tracing());
    for t in 0..8 {
        touch(&mut s, t).unwrap();
    }
    s.end_iteration().unwrap();
    assert!(!s.is_tracing());
    assert_eq!(s.schedule().unwrap().len(), 16);
    for t in 0..8 {
        touch(&mut s, t).unwrap();
    }
    s.end_iteration().unwrap();
    assert_eq!(s.stats().divergences, 0);
    // Another sequence (a longer input, say): detected, and the next iteration traced.
    for t in [0, 2, 4, 6] {
        touch(&mut s, t).unwrap();
    }
    assert_eq!(s.stats().divergences, 1);
    s.end_iteration().unwrap();
    assert!(s.is_tracing());
    for t in [0, 2, 4, 6] {
        touch(&mut s, t).unwrap();
    }
    s.end_iteration().unwrap();
    assert_eq!(s.schedule().unwrap().len(), 8);
    assert_eq!(s.stats().traced_iterations, 2);
    // Ending early is a divergence too.
    touch(&mut s, 0).unwrap();
    s.end_iteration().unwrap();
    assert!(s.is_tracing());
}

#[test]
fn tidal_budget_follows_traced_non_model_memory_and_opens_for_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(8 * CHUNK, &dir);
    let activations = |t: u32| if t >= 4 { 10 * CHUNK } else { 0 };
    for t in 0..8 {
        s.report_non_model_bytes(activations(t));
        touch(&mut s, t).unwrap();
    }
    s.report_non_model_bytes(0);
    s.end_iteration().unwrap();
    let mut budgets = Vec::new();
    for t in 0..8 {
        s.report_non_model_bytes(activations(t));
        touch(&mut s, t).unwrap();
        budgets.push(s.device_budget_bytes());
        let u = s.usage();
        assert!(u.device.used_bytes <= u.device.capacity_bytes);
    }
    s.report_non_model_bytes(0);
    // Early moments: the activations of later moments are within the tidal window.
    assert!(budgets[7] <= 16 * CHUNK - 10 * CHUNK, "{budgets:?}");
    s.begin_optimizer_step().unwrap();
    assert_eq!(s.device_budget_bytes(), 16 * CHUNK);
    s.end_optimizer_step().unwrap();
    s.end_iteration().unwrap();
    assert_eq!(s.stats().divergences, 0);
}

/// On a GPU the slab holds the chunks and everything else (the context, activations)
/// lives beside it: non-model memory is subtracted from the device's total, never from
/// the slab. (Subtracting it from the slab gave a CUDA context larger than the budget a
/// device budget of zero.)
#[test]
fn non_model_memory_beside_the_slab_leaves_the_budget_alone() {
    let dir = tempfile::tempdir().unwrap();
    let layout = layout(2048, &[(2048, false); 8], DType::F16);
    let cfg = config(8 * CHUNK, 10 * CHUNK, nvme_dir(&dir, 4 * CHUNK));
    let mut dev = tidestore_tiers::DeviceConfig::new(8 * CHUNK);
    dev.sim_total_bytes = Some(64 * CHUNK);
    dev.slab_bytes = Some(16 * CHUNK);
    let device = tidestore_tiers::Device::sim(&dev).unwrap();
    let mut s = ChunkStore::open(layout, cfg, device).unwrap();
    // 40 chunks' worth beside a 16-chunk slab on a 64-chunk device: the budget holds.
    s.report_non_model_bytes(40 * CHUNK);
    for t in 0..8 {
        touch(&mut s, t).unwrap();
        assert_eq!(s.device_budget_bytes(), 8 * CHUNK);
    }
    // 60 chunks' worth leaves the chunks 4: the tide follows the device, not the slab.
    s.report_non_model_bytes(60 * CHUNK);
    touch(&mut s, 0).unwrap();
    assert_eq!(s.device_budget_bytes(), 4 * CHUNK);
    // The step may use the whole slab, never more.
    s.report_non_model_bytes(0);
    s.end_iteration().unwrap();
    s.begin_optimizer_step().unwrap();
    assert_eq!(s.device_budget_bytes(), 16 * CHUNK);
    s.end_optimizer_step().unwrap();
}

/// Non-model memory above the trace re-traces only where it cuts the chunks' budget: on
/// a GPU far larger than the slab, the allocator's growth by a few MiB (seen on an H100
/// every iteration) kept the store from ever following its schedule.
#[test]
fn non_model_growth_beside_a_slab_that_still_fits_is_no_divergence() {
    let dir = tempfile::tempdir().unwrap();
    let layout = layout(2048, &[(2048, false); 8], DType::F16);
    let mut cfg = config(8 * CHUNK, 10 * CHUNK, nvme_dir(&dir, 4 * CHUNK));
    cfg.non_model_slack_bytes = CHUNK;
    let mut dev = tidestore_tiers::DeviceConfig::new(8 * CHUNK);
    dev.sim_total_bytes = Some(64 * CHUNK);
    dev.slab_bytes = Some(16 * CHUNK);
    let device = tidestore_tiers::Device::sim(&dev).unwrap();
    let mut s = ChunkStore::open(layout, cfg, device).unwrap();
    let iteration = |s: &mut ChunkStore, non_model: u64| {
        s.report_non_model_bytes(non_model);
        for t in 0..8 {
            touch(s, t).unwrap();
        }
        s.end_iteration().unwrap();
    };
    iteration(&mut s, 10 * CHUNK);
    // 20 chunks beside the slab on a 64-chunk device: the budget of 8 is untouched.
    iteration(&mut s, 20 * CHUNK);
    assert_eq!(s.stats().divergences, 0);
    assert!(!s.is_tracing());
    // 60 chunks leave 4: that cuts the budget, and the store re-traces.
    iteration(&mut s, 60 * CHUNK);
    assert_eq!(s.stats().divergences, 1);
}

#[test]
fn traced_working_set_above_the_tide_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let layout = layout(2048, &[(2048, false); 8], DType::F16);
    let cfg = config(8 * CHUNK, 10 * CHUNK, nvme_dir(&dir, 4 * CHUNK)).with_working_set_chunks(3);
    let mut s = ChunkStore::open(layout, cfg, sim_device(16 * CHUNK)).unwrap();
    // Three chunks in use at once while 14 chunks' worth of activations come later in
    // the window: after the trace, that moment's tide (16 - 14 = 2 chunks) is too small.
    let a = s
        .access(TensorId(0), ListKind::Params, Place::Device)
        .unwrap();
    let b = s
        .access(TensorId(1), ListKind::Params, Place::Device)
        .unwrap();
    let c = s
        .access(TensorId(2), ListKind::Params, Place::Device)
        .unwrap();
    for g in [a, b, c] {
        s.release(g, TensorState::Hold).unwrap();
    }
    s.report_non_model_bytes(14 * CHUNK);
    touch(&mut s, 3).unwrap();
    let e = s.end_iteration().unwrap_err();
    assert!(
        matches!(e, ChunkError::WorkingSetTooLarge { needed_bytes, capacity_bytes, .. }
            if needed_bytes == 3 * CHUNK && capacity_bytes == 2 * CHUNK),
        "{e}"
    );
}
