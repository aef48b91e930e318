//! Guards against the real store moving more bytes than its policy's plan: with equal
//! chunks, one device access at a time and no prefetch (the setting where the store and
//! `chunk::sim` see the same decisions), over random access sequences repeated for
//! three iterations after the warm-up and random device budgets:
//! - with `lifetime`, the bytes the store copies host->device and its evictions equal
//!   what the offline Belady computation (`sim::offline_belady`) predicts for the
//!   device tier, and equal `sim::simulate` with `Lifetime`; with `lru` and `fifo` they
//!   equal `simulate` with the same policy;
//! - device->host bytes are the evictions of changed chunks only: equal to the
//!   simulation's bytes out when every access writes, never more otherwise;
//! - `lifetime` never moves more bytes over the device link than `lru`.

mod common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use tidestore_chunk::{
    offline_belady, simulate, AccessTrace, ChunkStore, DType, Fifo, Horizon, Lifetime, ListKind,
    Lru, Place, PolicyKind, SimReport, StoreStats, TensorId, TensorState,
};

const CHUNK_ELEMENTS: u64 = 2048; // 4096-byte f16 chunks

/// Runs `seq` (tensor, writes?) through a store: warm-up, then `iters` measured
/// iterations from an empty device.
fn run_store(
    sizes: &[u64],
    seq: &[(usize, bool)],
    device_chunks: u64,
    policy: PolicyKind,
    iters: usize,
) -> (StoreStats, AccessTrace) {
    let tensors: Vec<(u64, bool)> = sizes.iter().map(|&n| (n, false)).collect();
    let layout = layout(CHUNK_ELEMENTS, &tensors, DType::F16);
    let chunks = layout.list_chunk_count(ListKind::Params);
    let dir = tempfile::tempdir().unwrap();
    let device = device_chunks.min(chunks) * 4096;
    let cfg = config(device, (chunks + 2) * 4096, nvme_dir(&dir, 2 * 4096))
        .with_policy(policy)
        .with_prefetch(0);
    let mut store = ChunkStore::open(layout, cfg, sim_device(device)).unwrap();
    let w = watch(&mut store);
    for t in 0..sizes.len() as u32 {
        let len = store
            .layout()
            .location(TensorId(t), ListKind::Params)
            .unwrap()
            .bytes();
        store
            .write(
                TensorId(t),
                ListKind::Params,
                &pattern(u64::from(t), len as usize),
            )
            .unwrap();
    }
    let iterate = |store: &mut ChunkStore| {
        for &(t, write) in seq {
            let g = store
                .access(TensorId(t as u32), ListKind::Params, Place::Device)
                .unwrap();
            if write {
                store.bytes_mut(&g).unwrap()[0] ^= 1;
            }
            store.release(g, TensorState::Hold).unwrap();
        }
        store.end_iteration().unwrap();
    };
    iterate(&mut store);
    store.evict_device_all().unwrap();
    store.reset_stats();
    for _ in 0..iters {
        iterate(&mut store);
    }
    let steps: Vec<_> = seq
        .iter()
        .map(|&(t, _)| {
            vec![
                store
                    .layout()
                    .location(TensorId(t as u32), ListKind::Params)
                    .unwrap()
                    .chunk,
            ]
        })
        .collect();
    let trace = AccessTrace::new(steps, store.layout().dense_chunk_bytes());
    assert!(w.lock().unwrap().violations.is_empty());
    (store.stats(), trace)
}

fn check(s: &StoreStats, r: &SimReport, all_write: bool) -> Result<(), TestCaseError> {
    prop_assert_eq!(s.host_to_device_bytes, r.bytes_in);
    prop_assert_eq!(s.device_evictions, r.evictions);
    prop_assert!(s.device_to_host_bytes <= r.bytes_out);
    if all_write {
        prop_assert_eq!(s.device_to_host_bytes, r.bytes_out);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn store_moves_what_the_offline_plan_predicts(
        sizes in prop::collection::vec(prop::sample::select(vec![512u64, 1024, 2048]), 2..12),
        seq in prop::collection::vec((0usize..64, any::<bool>()), 1..30),
        device_chunks in 1u64..8,
        all_write in any::<bool>(),
    ) {
        let seq: Vec<(usize, bool)> =
            seq.iter().map(|&(t, w)| (t % sizes.len(), w || all_write)).collect();
        const ITERS: usize = 3;
        let (life, trace) = run_store(&sizes, &seq, device_chunks, PolicyKind::Lifetime, ITERS);
        let chunks = trace.chunk_bytes.iter().filter(|&&b| b > 0).count() as u64;
        let cap = device_chunks.min(chunks) * 4096;
        let repeated = trace.repeat(ITERS);
        let opt = offline_belady(&repeated, cap).unwrap();
        check(&life, &opt, all_write)?;
        let sched = Arc::new(trace.schedule());
        let sim_life =
            simulate(&repeated, cap, &mut Lifetime::new(sched, Horizon::Cyclic), None).unwrap();
        prop_assert_eq!(sim_life.bytes_in, opt.bytes_in);

        let (lru, _) = run_store(&sizes, &seq, device_chunks, PolicyKind::Lru, ITERS);
        check(&lru, &simulate(&repeated, cap, &mut Lru::new(), None).unwrap(), all_write)?;
        let (fifo, _) = run_store(&sizes, &seq, device_chunks, PolicyKind::Fifo, ITERS);
        check(&fifo, &simulate(&repeated, cap, &mut Fifo::new(), None).unwrap(), all_write)?;

        prop_assert!(life.host_to_device_bytes <= lru.host_to_device_bytes);
        if all_write {
            prop_assert!(life.device_link_bytes() <= lru.device_link_bytes());
        }
    }
}
