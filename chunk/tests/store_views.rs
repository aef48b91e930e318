//! Several mutable views at once ([`ChunkStore::views_mut`]): disjoint views of
//! tensors in one chunk and in several, writes through them read back exactly, and
//! overlapping requests (the same tensor twice) are refused with
//! [`ChunkError::OverlappingViews`].

mod common;

use common::*;
use tidestore_chunk::{ChunkError, ChunkStore, DType, ListKind, Place, TensorId, TensorState};

fn store(dir: &tempfile::TempDir) -> ChunkStore {
    // Four f32 tensors of 1000 elements, two per 2048-element chunk.
    let layout = layout(2048, &[(1000, true); 4], DType::F32);
    let slot = 2048 * 4;
    let cfg = config(8 * slot, 16 * slot, nvme_dir(dir, 32 * slot)).with_working_set_chunks(4);
    ChunkStore::open(layout, cfg, sim_device(8 * slot)).unwrap()
}

#[test]
fn disjoint_views_in_one_chunk_and_several() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir);
    let ids: Vec<TensorId> = (0..4).map(TensorId).collect();
    let a = s.access(ids[0], ListKind::Master, Place::Host).unwrap();
    let b = s.access(ids[1], ListKind::Master, Place::Host).unwrap();
    let c = s.access(ids[2], ListKind::Master, Place::Host).unwrap();
    let m = s.access(ids[0], ListKind::Momentum, Place::Host).unwrap();
    assert_eq!(a.chunk(), b.chunk(), "two tensors share a chunk");
    assert_ne!(a.chunk(), c.chunk());
    {
        let views = s.views_mut(&[&c, &a, &m, &b]).unwrap();
        assert_eq!(views.len(), 4);
        for (k, v) in views.into_iter().enumerate() {
            assert_eq!(v.len(), 4000);
            v.fill(k as u8 + 1);
        }
    }
    for (g, k) in [(&c, 1u8), (&a, 2), (&m, 3), (&b, 4)] {
        assert!(s.bytes(g).unwrap().iter().all(|&x| x == k));
    }
    for g in [a, b, c, m] {
        s.release(g, TensorState::Hold).unwrap();
    }
    s.sync().unwrap();
    assert_eq!(s.read(ids[1], ListKind::Master).unwrap(), vec![4u8; 4000]);
    assert_eq!(s.read(ids[0], ListKind::Momentum).unwrap(), vec![3u8; 4000]);
}

#[test]
fn overlapping_views_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir);
    let a = s
        .access(TensorId(0), ListKind::Master, Place::Host)
        .unwrap();
    let b = s
        .access(TensorId(1), ListKind::Master, Place::Host)
        .unwrap();
    let err = s.views_mut(&[&a, &b, &a]).unwrap_err();
    assert!(
        matches!(err, ChunkError::OverlappingViews { ref first, ref second, .. }
            if first == "t0" && second == "t0"),
        "{err}"
    );
    // A released guard gives no view: it is stale.
    s.release(b, TensorState::Hold).unwrap();
    let b = s
        .access(TensorId(1), ListKind::Master, Place::Host)
        .unwrap();
    s.release_tensor(TensorId(1), ListKind::Master, TensorState::Hold)
        .unwrap();
    assert!(matches!(
        s.views_mut(&[&a, &b]),
        Err(ChunkError::StaleGuard { .. })
    ));
    // Device views (simulated device memory) work the same.
    s.release(a, TensorState::Hold).unwrap();
    let d0 = s
        .access(TensorId(0), ListKind::Params, Place::Device)
        .unwrap();
    let d1 = s
        .access(TensorId(1), ListKind::Params, Place::Device)
        .unwrap();
    {
        let (views, mut pump) = s.views_mut_with_io(&[&d1, &d0]).unwrap();
        pump.poll();
        assert_eq!(views.iter().map(|v| v.len()).sum::<usize>(), 4000);
    }
    assert!(matches!(
        s.views_mut(&[&d0, &d0]),
        Err(ChunkError::OverlappingViews { .. })
    ));
    s.release(d0, TensorState::Hold).unwrap();
    s.release(d1, TensorState::Hold).unwrap();
}

#[test]
fn tensor_views_name_where_each_tensor_is() {
    use tidestore_chunk::TensorViewMut;
    use tidestore_tiers::DeviceViewMut;
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir);
    let h = s
        .access(TensorId(2), ListKind::Master, Place::Host)
        .unwrap();
    let d0 = s
        .access(TensorId(0), ListKind::Params, Place::Device)
        .unwrap();
    let d1 = s
        .access(TensorId(1), ListKind::Params, Place::Device)
        .unwrap();
    {
        let (views, _pump) = s.tensor_views_mut_with_io(&[&d1, &h, &d0]).unwrap();
        for (fill, (k, v)) in (5u8..).zip(views.into_iter().enumerate()) {
            let bytes = match (k, v) {
                (1, TensorViewMut::Host(b)) => b,
                (0 | 2, TensorViewMut::Device(DeviceViewMut::Host(b))) => b,
                (k, v) => panic!("view {k} is in the wrong place: {v:?}"),
            };
            bytes.fill(fill);
        }
    }
    assert!(s.bytes(&d1).unwrap().iter().all(|&x| x == 5));
    assert!(s.bytes(&h).unwrap().iter().all(|&x| x == 6));
    assert!(s.bytes(&d0).unwrap().iter().all(|&x| x == 7));
    assert!(matches!(
        s.tensor_views_mut_with_io(&[&d0, &h, &d0]),
        Err(ChunkError::OverlappingViews { .. })
    ));
    for g in [h, d0, d1] {
        s.release(g, TensorState::Hold).unwrap();
    }
    s.sync().unwrap();
    assert!(s
        .read(TensorId(0), ListKind::Params)
        .unwrap()
        .iter()
        .all(|&x| x == 7));
}
