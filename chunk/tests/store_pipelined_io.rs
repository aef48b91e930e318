//! Guards against the store's NVMe transfers running one at a time when the host pool
//! is full of changed chunks, as in a CPU optimizer step over state that lives on NVMe:
//! every new row of chunks (master, M, V) needs the previous row written back first,
//! and the reads must not wait for each write-back in turn. The host prefetcher evicts
//! the whole previous row at once (asynchronous write-backs) and queues the next row's
//! reads for the buffers those writes give back, so several writes and reads are in
//! flight together; a demand load still goes before queued prefetches.
//!
//! Each iteration reads the 16-bit chunks on the device (a forward pass), then steps
//! every row in the host pool. Checked: every access sees exactly the bytes last written
//! (rows are rewritten every step), every tier stays within budget at every move, the prefetcher brought the rows
//! (hits, reads queued behind write-backs), and more than two NVMe requests were in
//! flight at once.

mod common;

use common::*;
use tidestore_chunk::{
    ChunkStore, DType, Guard, Layout, LayoutConfig, ListKind, NvmeSource, Place, StoreConfig,
    StoreStats, TensorId, TensorSpec, TensorState,
};
use tidestore_io::IoConfig;

/// fp32 elements per chunk: 64 KiB fp32 chunks, four blocks of the test engine each.
const CHUNK_ELEMENTS: u64 = 16 * 1024;
const ROWS: u32 = 6;
const LISTS: [ListKind; 4] = [
    ListKind::Params,
    ListKind::Master,
    ListKind::Momentum,
    ListKind::Variance,
];

/// `ROWS` trainable tensors, one per chunk row.
fn layout() -> Layout {
    Layout::new(
        LayoutConfig::new(CHUNK_ELEMENTS),
        (0..ROWS).map(|i| {
            TensorSpec::new(
                format!("w{i}"),
                &[CHUNK_ELEMENTS as usize],
                DType::BF16,
                true,
            )
        }),
    )
    .expect("layout")
}

/// A store whose host pool holds one row (four chunks) plus `spare` buffers, with the
/// host prefetcher and asynchronous write-backs on, over a real swap file.
fn store(dir: &tempfile::TempDir, spare: u64, async_writes: bool) -> ChunkStore {
    let slot = CHUNK_ELEMENTS * 4;
    let io = IoConfig {
        block_bytes: 16 * 1024,
        queue_depth: 8,
        ..IoConfig::default()
    };
    let nvme = NvmeSource::Dir {
        dir: dir.path().to_path_buf(),
        bytes: 4 * u64::from(ROWS) * slot,
        io,
    };
    let cfg = StoreConfig::new(4 * slot, (4 + spare) * slot, nvme)
        .with_host_prefetch(10)
        .with_async_write_back(async_writes)
        .with_working_set_chunks(4);
    ChunkStore::open(layout(), cfg, sim_device(4 * slot)).expect("store")
}

/// What a tensor of list `list` holds after `version` steps.
fn bytes_of(row: u32, list: ListKind, version: u64, len: usize) -> Vec<u8> {
    pattern(
        (u64::from(row) << 40) ^ ((list as u64) << 32) ^ version,
        len,
    )
}

/// One training-like iteration: a forward pass reading every row's 16-bit chunk on the
/// device, then an optimizer-like step: each row's four chunks accessed in the host pool
/// at once, checked against `version`, and rewritten as `version + 1`.
fn step(store: &mut ChunkStore, version: u64) {
    for row in 0..ROWS {
        let g = store
            .access(TensorId(row), ListKind::Params, Place::Device)
            .expect("forward access");
        let len = g.len_bytes();
        assert!(
            store.bytes(&g).unwrap() == &bytes_of(row, ListKind::Params, version, len)[..],
            "row {row} param16 on the device does not hold version {version}"
        );
        store.release(g, TensorState::HoldAfterFwd).unwrap();
    }
    for row in 0..ROWS {
        let t = TensorId(row);
        let guards: Vec<Guard> = LISTS
            .iter()
            .map(|&l| store.access(t, l, Place::Host).expect("access"))
            .collect();
        for (g, &list) in guards.iter().zip(&LISTS) {
            let len = g.len_bytes();
            assert!(
                store.bytes(g).unwrap() == &bytes_of(row, list, version, len)[..],
                "row {row} {list:?} does not hold version {version}"
            );
        }
        {
            let refs: Vec<&Guard> = guards.iter().collect();
            let views = store.views_mut(&refs).expect("views");
            for (v, &list) in views.into_iter().zip(&LISTS) {
                let len = v.len();
                v.copy_from_slice(&bytes_of(row, list, version + 1, len));
            }
        }
        for g in guards {
            store.release(g, TensorState::Hold).unwrap();
        }
    }
    store.end_iteration().unwrap();
}

/// Writes version 0 and runs `steps` steps (the first traced); returns the stats of the
/// steps after the first two (the schedule followed, the pool in its steady state).
fn run(store: &mut ChunkStore, steps: u64) -> StoreStats {
    for row in 0..ROWS {
        for list in LISTS {
            let len = store
                .layout()
                .location(TensorId(row), list)
                .unwrap()
                .bytes() as usize;
            store
                .write(TensorId(row), list, &bytes_of(row, list, 0, len))
                .unwrap();
        }
    }
    let w = watch(store);
    for v in 0..steps {
        if v == 2 {
            store.reset_stats();
        }
        step(store, v);
    }
    store.sync().unwrap();
    for row in 0..ROWS {
        for list in LISTS {
            let len = store
                .layout()
                .location(TensorId(row), list)
                .unwrap()
                .bytes() as usize;
            assert!(
                store.read(TensorId(row), list).unwrap() == bytes_of(row, list, steps, len),
                "row {row} {list:?} lost its last step"
            );
        }
    }
    let w = w.lock().unwrap();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    store.stats()
}

#[test]
fn write_backs_and_the_next_rows_reads_are_in_flight_together() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = store(&dir, 3, true);
    let s = run(&mut store, 6);
    eprintln!("{s}");
    assert!(
        s.nvme_writes > 0 && s.nvme_reads > 0,
        "rows go through NVMe"
    );
    assert!(
        s.queued_reads > 0,
        "the next row's reads wait in the queue for write-backs' buffers"
    );
    assert!(
        s.host_prefetch_hits >= 2 * u64::from(ROWS),
        "rows were brought by the prefetcher, not by demand loads: {s}"
    );
    assert!(
        s.nvme_in_flight_max > 2,
        "write-backs and reads overlap (at most {} in flight)",
        s.nvme_in_flight_max
    );
    // The host pool is registered with the swap file's engine: chunk transfers use
    // fixed buffers wherever io_uring is there to take them.
    let (kind, ops_fixed) = store
        .nvme()
        .with_swap_file(|f| (f.engine().kind(), f.engine().ops_fixed()));
    if kind == tidestore_io::BackendKind::IoUring {
        assert!(ops_fixed > 0, "chunk transfers went out as plain requests");
    } else {
        println!("fixed buffers not checked: {kind} engine");
    }
}

#[test]
fn with_synchronous_write_backs_nothing_is_queued_and_bytes_stay_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = store(&dir, 3, false);
    let s = run(&mut store, 5);
    assert_eq!(
        s.queued_reads, 0,
        "a synchronous write-back frees its buffer at once"
    );
    assert_eq!(s.async_writes, 0);
    assert!(s.nvme_writes > 0 && s.nvme_reads > 0);
}

#[test]
fn a_pool_with_no_spare_buffer_still_steps_exactly() {
    // One row in use and a single spare buffer: queued reads are owed the buffers of the
    // write-backs, demand loads must take precedence, and nothing deadlocks.
    let dir = tempfile::tempdir().unwrap();
    let mut store = store(&dir, 1, true);
    run(&mut store, 5);
}
