//! Guards against a host access waiting for a copy from the device that the host
//! prefetcher could have started ahead: a chunk that compute wrote on the device (a
//! gradient, or an fp32 master that compute reads there) and the CPU step then reads in
//! the host pool. Once the iteration is followed, the prefetcher copies each such chunk
//! into a free buffer while the caller works, and the step's access finds it there.
//! Counted, not timed.
//!
//! Each iteration: every tensor's 16-bit place written on the device (a backward pass),
//! then read and checked in the host pool, tensor by tensor (a step). The device holds
//! every chunk; the host pool holds three.

mod common;

use common::*;
use tidestore_chunk::{ChunkStore, DType, ListKind, Place, TensorId, TensorState};

const TENSORS: u32 = 6;
const ELEMENTS: u64 = 2048;
const ITERATIONS: u32 = 5;

fn want(it: u32, t: u32) -> Vec<u8> {
    pattern(u64::from(it * TENSORS + t), (ELEMENTS * 2) as usize)
}

fn iteration(store: &mut ChunkStore, it: u32) {
    for t in (0..TENSORS).rev() {
        let g = store
            .access(TensorId(t), ListKind::Params, Place::Device)
            .unwrap();
        store.bytes_mut(&g).unwrap().copy_from_slice(&want(it, t));
        store.release(g, TensorState::HoldAfterBwd).unwrap();
    }
    for t in 0..TENSORS {
        let g = store
            .access(TensorId(t), ListKind::Params, Place::Host)
            .unwrap();
        assert!(
            store.bytes(&g).unwrap() == &want(it, t)[..],
            "tensor {t} does not hold what the device wrote in iteration {it}"
        );
        store.release(g, TensorState::Hold).unwrap();
    }
    store.end_iteration().unwrap();
}

#[test]
fn a_chunk_the_device_wrote_is_copied_to_the_host_ahead_of_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![(ELEMENTS, true); TENSORS as usize];
    let layout = layout(ELEMENTS, &tensors, DType::F16);
    let slot = ELEMENTS * 4; // an fp32 master chunk, the largest
    let chunks = u64::from(TENSORS) * 4;
    let cfg =
        config(chunks * slot, 3 * slot, nvme_dir(&dir, 2 * chunks * slot)).with_host_prefetch(4);
    let mut store = ChunkStore::open(layout, cfg, sim_device(chunks * slot)).unwrap();
    let w = watch(&mut store);
    for it in 0..ITERATIONS {
        if it == 2 {
            store.reset_stats();
        }
        iteration(&mut store, it);
        store.verify().unwrap();
    }
    let s = store.stats();
    let steps = u64::from((ITERATIONS - 2) * TENSORS);
    assert!(
        s.device_to_host_copies >= steps,
        "every step's chunk comes from the device: {s}"
    );
    assert!(
        s.host_prefetch_hits >= steps - u64::from(ITERATIONS - 2),
        "the followed iterations' step accesses found their chunks copied ahead \
         (all but at most the first of each step): {s}"
    );
    let w = w.lock().unwrap();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
}
