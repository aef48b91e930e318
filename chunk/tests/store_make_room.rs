//! Guards against the device's one make-room loop confusing its two callers: a load
//! that cannot fit beside the chunks in use is refused (`WorkingSetTooLarge`, the
//! tensor's state and every copy as they were), while a falling tide over chunks in use
//! is held above its target rather than refused; once the chunks are released, the
//! tide evicts them and the load goes through.

mod common;

use common::*;
use tidestore_chunk::{ChunkError, ChunkStore, DType, ListKind, Place, TensorId, TensorState};

const CHUNK: u64 = 4096; // one f16 tensor of 2048 elements per chunk

#[test]
fn a_load_is_refused_where_a_falling_tide_is_held() {
    let dir = tempfile::tempdir().unwrap();
    let layout = layout(2048, &[(2048, false); 4], DType::F16);
    let cfg = config(2 * CHUNK, 4 * CHUNK, nvme_dir(&dir, 16 * CHUNK));
    let mut store = ChunkStore::open(layout, cfg, sim_device(4 * CHUNK)).unwrap();
    let params = ListKind::Params;
    let g0 = store.access(TensorId(0), params, Place::Device).unwrap();
    let g1 = store.access(TensorId(1), params, Place::Device).unwrap();
    store.verify().unwrap();

    // The non-model memory leaves room for one chunk: the tide falls below the two in
    // use and is held there; the load finds no victim and is refused.
    store.report_non_model_bytes(3 * CHUNK);
    let err = store
        .access(TensorId(2), params, Place::Device)
        .unwrap_err();
    assert!(
        matches!(err, ChunkError::WorkingSetTooLarge { capacity_bytes, .. } if capacity_bytes == 2 * CHUNK),
        "{err:?}"
    );
    assert_eq!(store.device_budget_bytes(), 2 * CHUNK, "the tide is held");
    assert_eq!(store.state(TensorId(2), params), Some(TensorState::Free));
    let c2 = store.layout().location(TensorId(2), params).unwrap().chunk;
    assert!(!store.residency(c2).unwrap().device);
    store.verify().unwrap();

    // Released, the chunks may go: the tide falls to its target, evicting one, and the
    // load evicts the other.
    store.release(g0, TensorState::Hold).unwrap();
    store.release(g1, TensorState::Hold).unwrap();
    let g2 = store.access(TensorId(2), params, Place::Device).unwrap();
    assert_eq!(store.device_budget_bytes(), CHUNK);
    assert!(store.residency(c2).unwrap().device);
    store.verify().unwrap();
    store.release(g2, TensorState::Hold).unwrap();
    store.verify().unwrap();
}
