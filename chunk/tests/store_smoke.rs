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
