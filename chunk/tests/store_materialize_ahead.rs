//! Guards against a dead chunk (one whose tensors all became FREE, e.g. a gradient chunk
//! after the step) waiting at the access that writes it again for an eviction made
//! there: once the iteration is followed, the host prefetcher gives it a buffer ahead
//! of that access, its victim written back while the caller works. Counted, not timed:
//! the move hook says why each dead chunk got its buffer.
//!
//! Each iteration, per tensor: its master copy read and changed in place (dirty, so
//! every victim is a write-back), then its 16-bit place written whole; after the last
//! tensor every 16-bit place is checked and set FREE, which discards its chunk. The host
//! pool holds four chunks of the twelve.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use tidestore_chunk::{
    ChunkStore, DType, ListKind, MoveEvent, MoveKind, MoveReason, Place, TensorId, TensorState,
};

const TENSORS: u32 = 6;
const ELEMENTS: u64 = 2048;

/// (iteration, whether the 16-bit chunk got its buffer from a prefetch) per
/// materialization of a 16-bit chunk.
type Seen = Arc<Mutex<Vec<(u32, bool)>>>;

fn iteration(store: &mut ChunkStore, it: u32) {
    for t in 0..TENSORS {
        let id = TensorId(t);
        let g = store.access(id, ListKind::Master, Place::Host).unwrap();
        store.bytes_mut(&g).unwrap()[0] ^= 1;
        store.release(g, TensorState::Hold).unwrap();
        let g = store.access(id, ListKind::Params, Place::Host).unwrap();
        let want = pattern(u64::from(it * TENSORS + t), (ELEMENTS * 2) as usize);
        store.bytes_mut(&g).unwrap().copy_from_slice(&want);
        store.release(g, TensorState::HoldAfterBwd).unwrap();
    }
    for t in 0..TENSORS {
        let want = pattern(u64::from(it * TENSORS + t), (ELEMENTS * 2) as usize);
        assert_eq!(store.read(TensorId(t), ListKind::Params).unwrap(), want);
        store
            .set_state(TensorId(t), ListKind::Params, TensorState::Free)
            .unwrap();
    }
    store.end_iteration().unwrap();
}

#[test]
fn a_dead_chunk_gets_its_buffer_ahead_of_the_access_that_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![(ELEMENTS, true); TENSORS as usize];
    let layout = layout(ELEMENTS, &tensors, DType::F16);
    let slot = ELEMENTS * 4; // an fp32 master chunk, the largest
    let cfg = config(2 * slot, 4 * slot, nvme_dir(&dir, 64 * slot));
    let mut store = ChunkStore::open(layout, cfg, sim_device(4 * slot)).unwrap();
    let params: Vec<_> = (0..TENSORS)
        .map(|t| {
            let loc = store.layout().location(TensorId(t), ListKind::Params);
            loc.unwrap().chunk
        })
        .collect();
    let seen: Seen = Arc::default();
    let iteration_now = Arc::new(Mutex::new(0u32));
    let (s2, it2) = (seen.clone(), iteration_now.clone());
    store.set_move_hook(Some(Box::new(move |e: &MoveEvent| {
        if e.kind == MoveKind::Materialize && params.contains(&e.chunk) {
            let ahead = matches!(e.reason, MoveReason::Prefetch { .. });
            s2.lock().unwrap().push((*it2.lock().unwrap(), ahead));
        }
    })));
    const ITERATIONS: u32 = 5;
    for it in 0..ITERATIONS {
        *iteration_now.lock().unwrap() = it;
        iteration(&mut store, it);
        store.verify().unwrap();
    }
    assert!(
        store.stats().nvme.peak_bytes > 0,
        "the master chunks were meant to spill"
    );
    let seen = seen.lock().unwrap();
    // The traced iteration materializes on demand; from the second (followed) on, the
    // prefetcher gives the dead chunks their buffers ahead.
    let ahead = seen.iter().filter(|&&(it, a)| it >= 2 && a).count();
    let followed = seen.iter().filter(|&&(it, _)| it >= 2).count();
    assert!(
        followed >= (ITERATIONS as usize - 2) * TENSORS as usize,
        "{seen:?}"
    );
    assert!(
        ahead * 2 >= followed,
        "{ahead} of {followed} dead chunks got their buffer ahead: {seen:?}"
    );
}
