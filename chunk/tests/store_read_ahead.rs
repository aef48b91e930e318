//! Guards against the store leaving the disk idle while frozen weights stream from NVMe
//! to the device (LoRA on a model larger than the host pool). Counted, not timed: the
//! swap file sits on an in-memory device that hands completions back only to a caller
//! that waits, so requests pile up unless the store keeps them coming, and nothing a
//! slow or fast machine does changes the counts.
//!
//! Checked over followed iterations of a forward pass (every tensor read on the device,
//! in order): the reads in flight reach the engine's queue depth (`io.queue_depth`,
//! the depth the config allows); every chunk read from NVMe was started by a prefetch
//! at an earlier moment than the access that needed it, none by that access; and every
//! access sees the bytes written.

mod common;

use common::*;
use tidestore_chunk::{ChunkStore, DType, ListKind, NvmeSource, Place, TensorId, TensorState};
use tidestore_io::{Compression, Engine, FaultConfig, MemoryBackend, SwapFile};
use tidestore_tiers::NvmeTier;

/// bf16 elements per chunk: 64 KiB chunks, four pieces of the engine's 16 KiB blocks.
const CHUNK_ELEMENTS: u64 = 32 * 1024;
const CHUNK_BYTES: u64 = CHUNK_ELEMENTS * 2;
const TENSORS: u32 = 16;
const QUEUE_DEPTH: usize = 8;
const BLOCK_BYTES: usize = 16 * 1024;

/// `TENSORS` frozen one-chunk tensors; a device of 3 chunks, a host pool of 6; the
/// device prefetcher looks one tensor ahead (its window counts the device's accesses),
/// the host's `host_lookahead`.
fn store(host_lookahead: u32) -> ChunkStore {
    let layout = layout(
        CHUNK_ELEMENTS,
        &vec![(CHUNK_ELEMENTS, false); TENSORS as usize],
        DType::BF16,
    );
    let faults = FaultConfig {
        hold_until_wait: true,
        ..FaultConfig::none()
    };
    let backend = MemoryBackend::new(64 << 20, QUEUE_DEPTH, faults);
    let engine = Engine::new(Box::new(backend), BLOCK_BYTES, true).expect("engine");
    let swap = SwapFile::with_engine(engine, CHUNK_BYTES as usize, 2 * TENSORS, Compression::Off)
        .expect("swap file");
    let tier = NvmeTier::from_swap_file(swap);
    let cfg = config(
        3 * CHUNK_BYTES,
        6 * CHUNK_BYTES,
        NvmeSource::Tier(Box::new(tier)),
    )
    .with_prefetch(1)
    .with_host_prefetch(host_lookahead)
    .with_working_set_chunks(1);
    ChunkStore::open(layout, cfg, sim_device(3 * CHUNK_BYTES)).expect("store")
}

fn bytes_of(t: u32) -> Vec<u8> {
    pattern(u64::from(t) + 1, CHUNK_BYTES as usize)
}

/// One forward pass; returns the most pieces seen in flight right after an access.
fn forward(store: &mut ChunkStore) -> usize {
    let mut most = 0;
    for t in 0..TENSORS {
        let g = store
            .access(TensorId(t), ListKind::Params, Place::Device)
            .expect("access");
        most = most.max(
            store
                .nvme()
                .with_swap_file(|f| f.engine().pieces_in_flight()),
        );
        assert!(
            store.bytes(&g).expect("bytes") == &bytes_of(t)[..],
            "tensor {t} does not hold what was written"
        );
        store.release(g, TensorState::Hold).expect("release");
    }
    store.end_iteration().expect("end iteration");
    most
}

/// Writes every tensor (most land on NVMe: the pool holds 6 of 16), traces one forward
/// pass, follows one, then three more; returns the most pieces in flight and the stats
/// of the last three.
fn run(host_lookahead: u32) -> (usize, tidestore_chunk::StoreStats) {
    let mut store = store(host_lookahead);
    for t in 0..TENSORS {
        store
            .write(TensorId(t), ListKind::Params, &bytes_of(t))
            .expect("write");
    }
    // Traced, then one followed pass: its first access has nothing read ahead (the
    // traced pass plans no prefetch), from then on the schedule wraps around.
    forward(&mut store);
    forward(&mut store);
    store.reset_stats();
    let most = (0..3).map(|_| forward(&mut store)).max().unwrap_or(0);
    (most, store.stats())
}

#[test]
fn forward_keeps_the_queue_full_and_reads_ahead_of_every_access() {
    let (most, s) = run(16);
    assert!(s.nvme_reads > 0, "the weights stream from NVMe: {s}");
    assert_eq!(
        most, QUEUE_DEPTH,
        "reads in flight reach io.queue_depth during forward: {s}"
    );
    assert_eq!(
        s.nvme_reads_on_demand, 0,
        "no chunk is read by the access that needs it: {s}"
    );
    assert!(
        s.nvme_reads_ahead >= s.nvme_reads,
        "every chunk read ({}) was started ahead and then used ({} used): {s}",
        s.nvme_reads,
        s.nvme_reads_ahead
    );
    assert!(
        s.nvme_read_lead_min >= 2,
        "each read started at least one access before its own (lead {} moments): {s}",
        s.nvme_read_lead_min
    );
}

#[test]
fn without_host_read_ahead_the_device_prefetch_alone_leaves_the_queue_short() {
    // The control: the device's prefetcher alone (one tensor ahead) keeps one chunk's
    // pieces in flight, half the queue. This is what the test above would see if the
    // host tier stopped reading ahead for the device.
    let (most, s) = run(0);
    assert!(
        most < QUEUE_DEPTH,
        "one chunk ahead cannot fill the queue ({most} in flight): {s}"
    );
}
