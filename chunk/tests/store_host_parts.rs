//! Guards against the host pool holding a whole largest-chunk buffer for every chunk:
//! 16-bit parameter chunks are half the size of the fp32 master chunks that size the
//! pool's buffers, so a pool of five buffers holds all eight 16-bit chunks and one
//! master chunk at once — after the traced iteration nothing is read from NVMe again.
//! With one buffer per chunk the same pool held five and read the rest every iteration.

mod common;

use common::*;
use tidestore_chunk::{ChunkStore, DType, ListKind, Place, TensorId, TensorState};

const CHUNK_ELEMENTS: u64 = 16 * 1024;
/// The largest chunk (fp32 master): the pool's buffer.
const BUF_BYTES: u64 = CHUNK_ELEMENTS * 4;
const TENSORS: u32 = 8;

fn store(dir: &tempfile::TempDir) -> ChunkStore {
    let layout = layout(
        CHUNK_ELEMENTS,
        &vec![(CHUNK_ELEMENTS, true); TENSORS as usize],
        DType::BF16,
    );
    let cfg = config(
        BUF_BYTES,
        5 * BUF_BYTES,
        nvme_dir(dir, 4 * TENSORS as u64 * BUF_BYTES),
    )
    .with_working_set_chunks(1);
    ChunkStore::open(layout, cfg, sim_device(BUF_BYTES)).expect("store")
}

fn bytes_of(t: u32, list: ListKind) -> Vec<u8> {
    let len = match list {
        ListKind::Params => CHUNK_ELEMENTS * 2,
        _ => CHUNK_ELEMENTS * 4,
    };
    pattern(u64::from(t) * 8 + list as u64, len as usize)
}

/// Every tensor's 16-bit parameters and tensor 0's master, on the host, checked.
fn iteration(store: &mut ChunkStore) {
    let master = (TensorId(0), ListKind::Master);
    let params = (0..TENSORS).map(|t| (TensorId(t), ListKind::Params));
    for (t, list) in std::iter::once(master).chain(params) {
        let g = store.access(t, list, Place::Host).expect("access");
        assert!(
            store.bytes(&g).expect("bytes") == &bytes_of(t.0, list)[..],
            "{t:?} {list} does not hold what was written"
        );
        store.release(g, TensorState::Hold).expect("release");
    }
    store.end_iteration().expect("end iteration");
}

#[test]
fn half_size_chunks_share_buffers_and_stay_in_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = store(&dir);
    let w = watch(&mut store);
    store
        .write(
            TensorId(0),
            ListKind::Master,
            &bytes_of(0, ListKind::Master),
        )
        .expect("write master");
    for t in 0..TENSORS {
        store
            .write(
                TensorId(t),
                ListKind::Params,
                &bytes_of(t, ListKind::Params),
            )
            .expect("write params");
    }
    store.end_iteration().expect("end iteration");
    iteration(&mut store);
    let warm = store.stats();
    for _ in 0..3 {
        iteration(&mut store);
    }
    let after = store.stats();
    assert_eq!(
        after.nvme_reads, warm.nvme_reads,
        "the pool of five buffers should hold eight half-size chunks and a whole one"
    );
    assert!(after.hits > warm.hits);
    let host = store.stats().host;
    assert!(
        host.peak_bytes <= 5 * BUF_BYTES,
        "host pool over its budget: {host:?}"
    );
    assert_eq!(w.lock().unwrap().violations, Vec::<String>::new());
}

/// Guards against the host prefetcher planning by bytes in a pool that serves sizes:
/// free parts of half-size (16-bit) chunks add up to a whole buffer's bytes, but an fp32
/// master chunk needs a whole buffer. Planned by bytes, its read ahead was refused by
/// the pool and it was read on demand, the caller waiting; planned by buffers and parts
/// ([`tidestore_chunk::PoolRoom`]), the prefetcher evicts what frees a whole buffer and
/// every read starts ahead of its access.
#[test]
fn whole_chunks_are_read_ahead_when_the_free_bytes_sit_in_parts() {
    const GROUPS: u32 = 6;
    // Two tensors per chunk, each used twice in a row (as a step uses its group's
    // chunks for each of its tensors).
    const PER_GROUP: u32 = 2;
    let half = CHUNK_ELEMENTS / u64::from(PER_GROUP);
    let dir = tempfile::tempdir().unwrap();
    let layout = layout(
        CHUNK_ELEMENTS,
        &vec![(half, true); (GROUPS * PER_GROUP) as usize],
        DType::BF16,
    );
    let cfg = config(
        BUF_BYTES,
        4 * BUF_BYTES,
        nvme_dir(&dir, 4 * GROUPS as u64 * BUF_BYTES),
    )
    .with_working_set_chunks(1)
    // Two groups ahead: a window shorter than the iteration leaves victims to evict.
    .with_host_prefetch(16);
    let mut store = ChunkStore::open(layout, cfg, sim_device(BUF_BYTES)).expect("store");
    let w = watch(&mut store);
    let bytes = |t: u32, list: ListKind| {
        let width = if list == ListKind::Params { 2 } else { 4 };
        pattern(u64::from(t) * 8 + list as u64, (half * width) as usize)
    };
    let lists = [ListKind::Params, ListKind::Master];
    for t in 0..GROUPS * PER_GROUP {
        for list in lists {
            store
                .write(TensorId(t), list, &bytes(t, list))
                .expect("write");
        }
    }
    store.end_iteration().expect("end iteration");
    // Each group's 16-bit chunk (half a buffer) and its master (a whole one), tensor by
    // tensor: nine buffers of chunks through a pool of four.
    let iteration = |store: &mut ChunkStore| {
        for t in 0..GROUPS * PER_GROUP {
            for list in lists {
                let g = store
                    .access(TensorId(t), list, Place::Host)
                    .expect("access");
                assert!(
                    store.bytes(&g).expect("bytes") == &bytes(t, list)[..],
                    "{t} {list} does not hold what was written"
                );
                store.release(g, TensorState::Hold).expect("release");
            }
        }
        store.end_iteration().expect("end iteration");
    };
    iteration(&mut store);
    iteration(&mut store);
    let warm = store.stats();
    for _ in 0..4 {
        iteration(&mut store);
    }
    let after = store.stats();
    let reads = after.nvme_reads - warm.nvme_reads;
    let ahead = after.nvme_reads_ahead - warm.nvme_reads_ahead;
    let on_demand = after.nvme_reads_on_demand - warm.nvme_reads_on_demand;
    assert!(reads > 0, "the pool holds every chunk: nothing is tested");
    assert_eq!(
        (on_demand, ahead),
        (0, reads),
        "every NVMe read should start ahead of its access ({reads} reads)"
    );
    assert_eq!(w.lock().unwrap().violations, Vec::<String>::new());
}
