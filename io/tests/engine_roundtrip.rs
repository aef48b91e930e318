//! Guards against the engine losing or changing bytes: random chunk sizes at random
//! aligned offsets, many in flight at once, round-trip byte-exact on every engine
//! (io_uring, thread pool, in-memory), with block sizes and queue depths smaller and
//! larger than the chunks.

use proptest::prelude::*;
use tidestore_io::{
    AlignedBuf, BackendKind, BufferPool, Engine, EngineChoice, FaultConfig, IoConfig, IoRequest,
    MemoryBackend, Op, ALIGN_BYTES,
};

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Open a real-file engine of the given kind, or say why not.
fn file_engine(
    kind: EngineChoice,
    dir: &std::path::Path,
    block_bytes: usize,
    queue_depth: u32,
) -> Option<Engine> {
    let cfg = IoConfig {
        engine: kind,
        block_bytes,
        queue_depth,
        ..IoConfig::default()
    };
    match Engine::open(&dir.join("data"), &cfg, true) {
        Ok(e) => Some(e),
        Err(e) => {
            println!("skipped {kind:?}: {e}");
            None
        }
    }
}

/// Write `chunks` (len, slot) all at once, then read them all back at once, and compare.
fn roundtrip(
    engine: &mut Engine,
    pool: Option<&BufferPool>,
    chunks: &[(usize, u64)],
    slot_bytes: u64,
) {
    let take = |len: usize| match pool {
        Some(p) => p.try_take().expect("pool sized for the test"),
        None => AlignedBuf::new_zeroed(len).unwrap(),
    };
    for (i, &(len, slot)) in chunks.iter().enumerate() {
        let mut buf = take(len);
        fill(&mut buf[..len], i as u64 + 1);
        engine.submit(IoRequest {
            op: Op::Write,
            offset_bytes: slot * slot_bytes,
            len_bytes: len,
            buf,
            user_data: i as u64,
        });
    }
    let mut seen = vec![false; chunks.len()];
    while let Some(c) = engine.wait() {
        c.result.expect("write");
        assert!(
            !std::mem::replace(&mut seen[c.user_data as usize], true),
            "completed twice"
        );
    }
    assert!(seen.iter().all(|&s| s), "every write completes");
    for (i, &(len, slot)) in chunks.iter().enumerate() {
        let mut buf = take(len);
        buf.fill(0xAA);
        engine.submit(IoRequest {
            op: Op::Read,
            offset_bytes: slot * slot_bytes,
            len_bytes: len,
            buf,
            user_data: i as u64,
        });
    }
    let mut expect = Vec::new();
    while let Some(c) = engine.wait() {
        c.result.expect("read");
        let (len, _) = chunks[c.user_data as usize];
        expect.resize(len, 0);
        fill(&mut expect, c.user_data + 1);
        assert!(
            c.buf[..len] == expect[..],
            "chunk {} read back different bytes",
            c.user_data
        );
    }
}

/// Distinct slots with a random aligned length each.
fn chunk_plan() -> impl Strategy<Value = (Vec<(usize, u64)>, usize, u32)> {
    let slot_pages = 40usize;
    (
        proptest::collection::btree_set(0u64..64, 1..12),
        proptest::collection::vec(1usize..=slot_pages, 12),
        prop_oneof![Just(4096usize), Just(16384), Just(65536), Just(1 << 20)],
        1u32..16,
    )
        .prop_map(move |(slots, pages, block, depth)| {
            let chunks = slots
                .into_iter()
                .zip(pages)
                .map(|(s, p)| (p * ALIGN_BYTES, s))
                .collect();
            (chunks, block, depth)
        })
}

const SLOT_BYTES: u64 = 40 * ALIGN_BYTES as u64;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn memory_engine_roundtrips((chunks, block, depth) in chunk_plan()) {
        let backend = MemoryBackend::new(64 * SLOT_BYTES, depth as usize, FaultConfig::none());
        let mut engine = Engine::new(Box::new(backend), block, true).unwrap();
        roundtrip(&mut engine, None, &chunks, SLOT_BYTES);
    }

    #[test]
    fn thread_pool_engine_roundtrips((chunks, block, depth) in chunk_plan()) {
        let dir = tempfile::tempdir().unwrap();
        let mut engine = file_engine(EngineChoice::ThreadPool, dir.path(), block, depth).unwrap();
        prop_assert_eq!(engine.kind(), BackendKind::ThreadPool);
        roundtrip(&mut engine, None, &chunks, SLOT_BYTES);
    }

    #[test]
    fn io_uring_engine_roundtrips((chunks, block, depth) in chunk_plan(), fixed in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let Some(mut engine) = file_engine(EngineChoice::IoUring, dir.path(), block, depth) else {
            return Ok(());
        };
        prop_assert_eq!(engine.kind(), BackendKind::IoUring);
        let pool = BufferPool::new(SLOT_BYTES as usize, chunks.len()).unwrap();
        if fixed {
            engine.register_pool(&pool).unwrap();
        }
        roundtrip(&mut engine, Some(&pool), &chunks, SLOT_BYTES);
    }
}

#[test]
fn forcing_threads_selects_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let engine = file_engine(EngineChoice::ThreadPool, dir.path(), 1 << 20, 8).unwrap();
    assert_eq!(engine.kind(), BackendKind::ThreadPool);
}

#[test]
fn malformed_requests_complete_with_typed_errors_and_return_the_buffer() {
    let backend = MemoryBackend::new(1 << 20, 4, FaultConfig::none());
    let mut engine = Engine::new(Box::new(backend), 4096, true).unwrap();
    let cases = [(100u64, 4096usize), (0, 100), (0, 0), (0, 8192 * 2)];
    for (offset, len) in cases {
        let buf = AlignedBuf::new_zeroed(8192).unwrap();
        let (res, buf) = engine.read_at(offset, buf, len);
        assert!(
            matches!(res, Err(tidestore_io::IoError::InvalidRequest { .. })),
            "offset {offset} len {len}: {res:?}"
        );
        assert_eq!(buf.capacity(), 8192);
    }
}

#[test]
fn reading_past_the_end_is_an_eof_error_not_zeros() {
    let backend = MemoryBackend::new(1 << 20, 4, FaultConfig::none());
    let mut engine = Engine::new(Box::new(backend), 4096, true).unwrap();
    let (res, buf) = engine.write_at(0, AlignedBuf::new_zeroed(8192).unwrap(), 8192);
    res.unwrap();
    let (res, _) = engine.read_at(4096, buf, 8192);
    match res {
        Err(tidestore_io::IoError::UnexpectedEof {
            op: Op::Read,
            offset_bytes,
            remaining_bytes,
        }) => {
            assert_eq!(offset_bytes, 8192);
            assert_eq!(remaining_bytes, 4096);
        }
        other => panic!("expected UnexpectedEof, got {other:?}"),
    }
}
