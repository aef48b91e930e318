//! Guards against the simplest ways to lose bytes in the chunk store: a tensor written,
//! pushed through device, host and NVMe by a tight device and host budget, and read back.

mod common;

use common::*;
use tidestore_chunk::{ChunkStore, DType, ListKind, Place, PolicyKind, TensorId, TensorState};

#[test]
fn bytes_survive_all_three_tiers() {
    let dir = tempfile::tempdir().unwrap();
    // 8 tensors of 2048 f16 elements, one per chunk of 4096 bytes... param16 chunks are
    // 2 x 2048 = 4096 bytes; master/M/V chunks 8192 bytes.
    let tensors: Vec<(u64, bool)> = (0..8).map(|i| (2048, i % 2 == 0)).collect();
    let layout = layout(2048, &tensors, DType::F16);
    let slot = 8192u64;
    let cfg =
        config(2 * 8192, 3 * slot, nvme_dir(&dir, 64 * slot)).with_policy(PolicyKind::Lifetime);
    let mut store = ChunkStore::open(layout, cfg, sim_device(4 * 8192)).unwrap();
    let w = watch(&mut store);
    let lists = [ListKind::Params, ListKind::Master, ListKind::Momentum];
    let mut expect = std::collections::HashMap::new();
    for t in 0..8u32 {
        for list in lists {
            let Some(loc) = store.layout().location(TensorId(t), list) else {
                continue;
            };
            let data = pattern(u64::from(t) * 10 + list as u64, loc.bytes() as usize);
            store.write(TensorId(t), list, &data).unwrap();
            expect.insert((t, list), data);
        }
    }
    for iter in 0..4u64 {
        for t in 0..8u32 {
            for list in lists {
                if store.layout().location(TensorId(t), list).is_none() {
                    continue;
                }
                let place = if list == ListKind::Params {
                    Place::Device
                } else {
                    Place::Host
                };
                let g = store.access(TensorId(t), list, place).unwrap();
                assert_eq!(
                    store.bytes(&g).unwrap(),
                    &expect[&(t, list)][..],
                    "iter {iter} t{t} {list}"
                );
                let data = pattern(iter * 1000 + u64::from(t) * 10 + list as u64, g.len_bytes());
                store.bytes_mut(&g).unwrap().copy_from_slice(&data);
                expect.insert((t, list), data);
                store.release(g, TensorState::Hold).unwrap();
            }
        }
        store.end_iteration().unwrap();
    }
    for ((t, list), data) in &expect {
        assert_eq!(&store.read(TensorId(*t), *list).unwrap(), data);
    }
    let s = store.stats();
    eprintln!("{s}");
    let w = w.lock().unwrap();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    assert!(
        s.host_to_nvme_bytes > 0 && s.nvme_to_host_bytes > 0,
        "NVMe exercised"
    );
    assert!(s.device_to_host_bytes > 0, "write-backs exercised");
}

/// A chunk whose tensors all become FREE is discarded: its bytes are dead, so it is
/// neither written back nor read again, and its NVMe slot is freed. A chunk with one
/// tensor still held keeps every byte.
#[test]
fn a_chunk_of_free_tensors_is_discarded_unwritten() {
    let dir = tempfile::tempdir().unwrap();
    // Six trainable tensors, two per chunk: three master chunks of 8192 bytes, and a
    // host pool of two buffers, so one master chunk is on NVMe only.
    let tensors: Vec<(u64, bool)> = (0..6).map(|_| (1024, true)).collect();
    let layout = layout(2048, &tensors, DType::F16);
    let slot = 8192u64;
    let cfg = config(2 * slot, 2 * slot, nvme_dir(&dir, 16 * slot));
    let mut store = ChunkStore::open(layout, cfg, sim_device(4 * slot)).unwrap();
    let w = watch(&mut store);
    let master = |t: u32| (TensorId(t), ListKind::Master);
    for t in 0..6u32 {
        let bytes = store
            .layout()
            .location(TensorId(t), ListKind::Master)
            .unwrap();
        let data = pattern(u64::from(t), bytes.bytes() as usize);
        store.write(TensorId(t), ListKind::Master, &data).unwrap();
    }
    let chunk = |t: u32| {
        store
            .layout()
            .location(TensorId(t), ListKind::Master)
            .unwrap()
            .chunk
    };
    let (c0, c2) = (chunk(0), chunk(4));
    let on_nvme_only = store.residency(c0).unwrap();
    assert!(
        on_nvme_only.nvme && !on_nvme_only.host,
        "the first chunk was evicted to NVMe: {on_nvme_only:?}"
    );
    // One tensor of a chunk FREE: nothing is dropped.
    let (t, l) = master(0);
    store.set_state(t, l, TensorState::Free).unwrap();
    assert_eq!(store.stats().discarded_chunks, 0);
    assert_eq!(
        store.read(TensorId(1), ListKind::Master).unwrap(),
        pattern(1, 4096)
    );
    assert_eq!(
        store.read(TensorId(0), ListKind::Master).unwrap(),
        pattern(0, 4096)
    );

    // Both: the chunk is gone from every tier, its slot is free, and it is not read.
    let nvme_used = store.stats().nvme.used_bytes;
    let (t, l) = master(1);
    store.set_state(t, l, TensorState::Free).unwrap();
    let s = store.stats();
    assert_eq!(s.discarded_chunks, 1);
    assert_eq!(
        s.nvme.used_bytes,
        nvme_used - slot,
        "the NVMe slot was freed"
    );
    let r = store.residency(c0).unwrap();
    assert!(!r.device && !r.host && !r.nvme, "{r:?}");
    let reads = s.nvme_reads;
    let g = store
        .access(TensorId(0), ListKind::Master, Place::Host)
        .unwrap();
    let data = pattern(7, 4096);
    store.bytes_mut(&g).unwrap().copy_from_slice(&data);
    store.release(g, TensorState::Hold).unwrap();
    assert_eq!(store.read(TensorId(0), ListKind::Master).unwrap(), data);
    assert_eq!(store.stats().nvme_reads, reads, "a dead chunk is not read");

    // A chunk in the host pool: dropped there, never written.
    let written = store.stats().host_to_nvme_bytes;
    for t in [4, 5] {
        store
            .set_state(TensorId(t), ListKind::Master, TensorState::Free)
            .unwrap();
    }
    let r = store.residency(c2).unwrap();
    assert!(!r.device && !r.host && !r.nvme, "{r:?}");
    assert_eq!(
        store.stats().host_to_nvme_bytes,
        written,
        "nothing was written"
    );
    assert_eq!(store.stats().discarded_chunks, 2);
    // The held chunk in between kept its bytes through it all.
    assert_eq!(
        store.read(TensorId(2), ListKind::Master).unwrap(),
        pattern(2, 4096)
    );
    let w = w.lock().unwrap();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    assert!(w.kinds.contains(&tidestore_chunk::MoveKind::Discard));
}
