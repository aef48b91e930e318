//! Guards against the chunk store losing or changing bytes while chunks move between
//! the simulated device, the pinned host pool and a real NVMe swap file, and against any
//! tier going over its budget at any move.
//!
//! Over random registrations (sizes, dtypes, trainable or frozen, so every list is
//! used), random access sequences repeated over several iterations (device and host
//! accesses, reads and writes, two tensors in use at once, then a changed sequence that
//! forces a re-trace), random budgets, every policy, with and without prefetch:
//! - every access sees exactly the bytes last written to that tensor (a distinct
//!   pattern per write), and every tensor reads back exactly at the end;
//! - at every move the hook sees every tier within its budget, and a prefetch never
//!   evicts a device chunk needed no later than the one it brings;
//! - the store's device-link counters equal the device's own;
//! - all of this with the host-tier prefetcher (NVMe -> host reads ahead of host
//!   accesses) and asynchronous write-backs on or off.

mod common;

use std::collections::HashMap;

use common::*;
use proptest::prelude::*;
use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, Place, PolicyKind, TensorId, TensorSpec,
    TensorState,
};

#[derive(Debug, Clone)]
struct Op {
    tensor: usize,
    list: usize,
    host: bool,
    write: bool,
    hold_over: bool,
}

fn op() -> impl Strategy<Value = Op> {
    (
        0usize..64,
        0usize..5,
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(tensor, list, host, write, hold_over)| Op {
            tensor,
            list,
            host,
            write,
            hold_over,
        })
}

#[derive(Debug, Clone)]
struct Case {
    tensors: Vec<(usize, u8, bool)>,
    extra_slots: u64,
    /// The gradient list: 0 none, 1 16-bit, 2 fp32.
    grads: u8,
    ops: Vec<Op>,
    changed: Vec<Op>,
    device_frac: f64,
    host_extra: u64,
    nvme_extra: u64,
    policy: usize,
    lookahead: u32,
    host_lookahead: u32,
    async_writes: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((1usize..3000, 0u8..3, any::<bool>()), 2..10),
        0u64..3000,
        0u8..3,
        prop::collection::vec(op(), 4..30),
        prop::collection::vec(op(), 1..10),
        0.0f64..1.0,
        0u64..6,
        0u64..4,
        0usize..3,
        (
            prop::sample::select(vec![0u32, 0, 2, 6]),
            prop::sample::select(vec![0u32, 3, 8, 24]),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                tensors,
                extra_slots,
                grads,
                ops,
                changed,
                device_frac,
                host_extra,
                nvme_extra,
                policy,
                (lookahead, host_lookahead, async_writes),
            )| Case {
                tensors,
                extra_slots,
                grads,
                ops,
                changed,
                device_frac,
                host_extra,
                nvme_extra,
                policy,
                lookahead,
                host_lookahead,
                async_writes,
            },
        )
}

fn build_layout(c: &Case) -> Layout {
    let specs: Vec<TensorSpec> = c
        .tensors
        .iter()
        .enumerate()
        .map(|(i, &(n, d, trainable))| {
            TensorSpec::new(format!("t{i}"), &[n], DType::ALL[d as usize], trainable)
        })
        .collect();
    let max_slots = specs
        .iter()
        .map(|s| {
            let n = s.elements().unwrap();
            if s.dtype == DType::F32 && !s.trainable {
                2 * n
            } else {
                n
            }
        })
        .max()
        .unwrap();
    Layout::new(
        LayoutConfig::new(max_slots + c.extra_slots)
            .with_grad_accumulation(c.grads > 0)
            .with_fp32_grads(c.grads == 2),
        specs,
    )
    .unwrap()
}

/// The store's invariants, as a test failure (checked after every operation).
fn verified(store: &ChunkStore) -> Result<(), TestCaseError> {
    store
        .verify()
        .map_err(|e| TestCaseError::fail(format!("verify: {e}")))
}

fn run(c: Case) -> Result<tidestore_chunk::StoreStats, TestCaseError> {
    let layout = build_layout(&c);
    let mut places: Vec<(TensorId, ListKind)> = Vec::new();
    for t in 0..layout.tensors().len() as u32 {
        for list in ListKind::ALL {
            if layout.location(TensorId(t), list).is_some() {
                places.push((TensorId(t), list));
            }
        }
    }
    let sizes: Vec<u64> = layout
        .dense_chunk_bytes()
        .into_iter()
        .filter(|&b| b > 0)
        .collect();
    let aligned = |b: u64| b.div_ceil(4096) * 4096;
    let mut sorted: Vec<u64> = sizes.iter().map(|&b| aligned(b)).collect();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let slot = sorted[0];
    let chunks = sizes.len() as u64;
    let working_set: u64 = sorted.iter().take(2).sum();
    let all: u64 = sorted.iter().sum();
    let device = working_set + ((all - working_set) as f64 * c.device_frac) as u64;
    let host_slots = 3 + c.host_extra.min(chunks);
    let nvme_slots = (chunks + 1).saturating_sub(host_slots) + c.nvme_extra;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(device, host_slots * slot, nvme_dir(&dir, nvme_slots * slot))
        .with_policy(PolicyKind::ALL[c.policy])
        .with_prefetch(c.lookahead)
        .with_host_prefetch(c.host_lookahead)
        .with_async_write_back(c.async_writes)
        .with_working_set_chunks(2);
    let mut store = ChunkStore::open(layout, cfg, sim_device(device)).unwrap();
    let w = watch(&mut store);
    verified(&store)?;

    let mut expect: HashMap<(TensorId, ListKind), Vec<u8>> = HashMap::new();
    let mut version = 0u64;
    // Half the tensors get initial bytes; the rest must read as zeros.
    for (i, &(t, list)) in places.iter().enumerate() {
        let len = store.layout().location(t, list).unwrap().bytes() as usize;
        if i % 2 == 0 {
            version += 1;
            let data = pattern(version, len);
            store.write(t, list, &data).unwrap();
            verified(&store)?;
            expect.insert((t, list), data);
        } else {
            expect.insert((t, list), vec![0; len]);
        }
    }
    let mut iterations: Vec<&[Op]> = vec![&c.ops; 3];
    iterations.push(&c.changed);
    iterations.push(&c.ops);
    iterations.push(&c.ops);
    for ops in iterations {
        let mut held: Option<tidestore_chunk::Guard> = None;
        for o in ops {
            let (t, list) = places[(o.tensor + 7 * o.list) % places.len()];
            let place = if o.host { Place::Host } else { Place::Device };
            let chunk = store.layout().location(t, list).unwrap().chunk;
            // A chunk is in use on one tier at a time, and a tensor once.
            let conflict = held.as_ref().is_some_and(|h| {
                (h.tensor(), h.list()) == (t, list) || (h.chunk() == chunk && h.place() != place)
            });
            if conflict {
                let h = held.take().unwrap();
                store.release(h, TensorState::Hold).unwrap();
                verified(&store)?;
            }
            let g = store.access(t, list, place).unwrap();
            verified(&store)?;
            prop_assert_eq!(
                store.bytes(&g).unwrap(),
                &expect[&(t, list)][..],
                "{:?}",
                (t, list)
            );
            if o.write {
                version += 1;
                let data = pattern(version, g.len_bytes());
                store.bytes_mut(&g).unwrap().copy_from_slice(&data);
                verified(&store)?;
                expect.insert((t, list), data);
            }
            if let Some(h) = held.take() {
                store.release(h, TensorState::Hold).unwrap();
                verified(&store)?;
            }
            if o.hold_over {
                held = Some(g);
            } else {
                store.release(g, TensorState::Hold).unwrap();
                verified(&store)?;
            }
        }
        if let Some(h) = held.take() {
            store.release(h, TensorState::Hold).unwrap();
            verified(&store)?;
        }
        let _ = store.end_iteration();
        verified(&store)?;
    }
    store.sync().unwrap();
    verified(&store)?;
    for (&(t, list), data) in &expect {
        prop_assert_eq!(&store.read(t, list).unwrap(), data, "{:?}", (t, list));
        verified(&store)?;
    }
    let s = store.stats();
    let links = store.device().link_stats();
    prop_assert_eq!(s.host_to_device_bytes, links.host_to_device_bytes);
    prop_assert_eq!(s.device_to_host_bytes, links.device_to_host_bytes);
    prop_assert!(s.traced_iterations >= 1);
    let w = w.lock().unwrap();
    prop_assert!(w.violations.is_empty(), "{:?}", w.violations);
    Ok(s)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn bytes_survive_any_moves_within_budgets(c in case()) {
        run(c)?;
    }
}

/// The same with budgets so tight that NVMe holds most chunks: every access moves.
#[test]
fn tight_budgets_exercise_every_tier() {
    let c = Case {
        tensors: (0..12)
            .map(|i| (1500 + 100 * i, (i % 3) as u8, i % 4 != 0))
            .collect(),
        extra_slots: 0,
        grads: 2,
        ops: (0..40)
            .map(|i| Op {
                tensor: i * 5,
                list: i % 5,
                host: i % 3 == 0,
                write: i % 2 == 0,
                hold_over: i % 4 == 1,
            })
            .collect(),
        changed: vec![Op {
            tensor: 1,
            list: 0,
            host: false,
            write: true,
            hold_over: false,
        }],
        device_frac: 0.0,
        host_extra: 0,
        nvme_extra: 0,
        policy: 0,
        lookahead: 4,
        host_lookahead: 0,
        async_writes: false,
    };
    let s = run(c).unwrap();
    eprintln!("{s}");
    assert!(
        s.host_to_nvme_bytes > 0 && s.nvme_to_host_bytes > 0,
        "NVMe used"
    );
    assert!(
        s.device_to_host_bytes > 0 && s.device_clean_evictions > 0,
        "write-backs and clean drops"
    );
    assert!(s.prefetch_loads > 0 && s.prefetch_hits > 0, "prefetch used");
    assert!(s.divergences >= 1 && s.traced_iterations >= 2, "re-traced");
}

/// Host accesses over chunks that mostly live on NVMe, with the host prefetcher and
/// asynchronous write-backs on: bytes exact, budgets held, host prefetches used.
#[test]
fn host_prefetch_and_async_write_backs_on_tight_budgets() {
    let c = Case {
        tensors: (0..12)
            .map(|i| (1500 + 100 * i, (i % 3) as u8, i % 4 != 0))
            .collect(),
        extra_slots: 0,
        grads: 0,
        ops: (0..40)
            .map(|i| Op {
                tensor: i * 3,
                list: i % 5,
                host: i % 5 != 0,
                write: i % 2 == 0,
                hold_over: i % 4 == 1,
            })
            .collect(),
        changed: vec![Op {
            tensor: 1,
            list: 0,
            host: true,
            write: true,
            hold_over: false,
        }],
        device_frac: 0.0,
        host_extra: 2,
        nvme_extra: 0,
        policy: 0,
        lookahead: 4,
        host_lookahead: 16,
        async_writes: true,
    };
    let s = run(c).unwrap();
    eprintln!("{s}");
    assert!(s.host_prefetch_loads > 0, "host prefetch used");
    assert!(s.host_prefetch_hits > 0, "host prefetch hits counted");
    assert!(s.async_writes > 0, "asynchronous write-backs used");
    assert!(s.host_to_nvme_bytes > 0 && s.nvme_to_host_bytes > 0);
}
