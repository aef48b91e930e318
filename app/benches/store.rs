//! Benchmark of the chunk store's hot path: `access` + `release` of a tensor whose chunk
//! is already on the (simulated) device, following a traced schedule.
//!
//! Setup: 16 frozen f16 tensors of 64 Ki elements, one per 128 KiB chunk, a device
//! budget that holds all of them, a real swap file in a temp dir. One warm-up iteration
//! (access + release of each tensor) is traced; each timed call is then one access +
//! release of the next tensor on the schedule (and `end_iteration` after the last), so
//! the store follows its schedule exactly as in training: follower check, tide, policy
//! notification, the prefetcher's look-ahead scan, state transitions.

use std::hint::black_box;

use criterion::Criterion;
use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, NvmeSource, Place, PolicyKind, StoreConfig,
    TensorId, TensorSpec, TensorState,
};
use tidestore_tiers::{Device, DeviceConfig};

const TENSORS: u32 = 16;
const ELEMENTS: usize = 64 * 1024;

pub fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let layout = Layout::new(
        LayoutConfig::new(ELEMENTS as u64),
        (0..TENSORS).map(|i| TensorSpec::new(format!("t{i}"), &[ELEMENTS], DType::F16, false)),
    )
    .expect("layout");
    let chunk = 2 * ELEMENTS as u64;
    let device_bytes = u64::from(TENSORS) * chunk;
    let cfg = StoreConfig::new(
        device_bytes,
        4 * chunk,
        NvmeSource::Dir {
            dir: dir.path().to_path_buf(),
            bytes: u64::from(TENSORS) * chunk,
            io: tidestore_io::IoConfig::default(),
        },
    )
    .with_policy(PolicyKind::Lifetime);
    let device = Device::sim(&DeviceConfig::new(device_bytes)).expect("sim device");
    let mut store = ChunkStore::open(layout, cfg, device).expect("store");
    for _ in 0..2 {
        for t in 0..TENSORS {
            let g = store
                .access(TensorId(t), ListKind::Params, Place::Device)
                .expect("access");
            store.release(g, TensorState::Hold).expect("release");
        }
        store.end_iteration().expect("end iteration");
    }
    store.reset_stats();
    let mut next = 0u32;
    c.bench_function("store/access_release_resident", |b| {
        b.iter(|| {
            let g = store
                .access(TensorId(next), ListKind::Params, Place::Device)
                .expect("access");
            black_box(g.len_bytes());
            store.release(g, TensorState::Hold).expect("release");
            next += 1;
            if next == TENSORS {
                next = 0;
                store.end_iteration().expect("end iteration");
            }
        })
    });
    let s = store.stats();
    assert_eq!(s.divergences, 0, "the bench must follow its schedule");
    assert_eq!(s.demand_loads, 0, "every access must hit");
}
