//! The swap file's tests: layout checks, random chunk traces against a model (in
//! memory and in a file), reopening, corruption, bad headers, the clean marker, torn
//! headers, typed errors, slot quarantine, overlapping requests and compression.

use super::format::{
    Header, Layout, DATA_ALIGN_BYTES, HEADER_COPIES, HEADER_PAGE_BYTES, H_GENERATION, H_VERSION,
};
use super::*;
use crate::buffer::align_up;
use crate::config::IoConfig;
use crate::error::IoError;
use crate::memory::{FaultConfig, MemoryBackend};
use proptest::prelude::*;

const SLOT_BYTES: usize = 64 << 10;

fn mem_swap(slot_count: u32, compression: Compression) -> SwapFile {
    let capacity = Layout::new(SLOT_BYTES as u64, slot_count as u64)
        .unwrap()
        .file_bytes();
    let backend = MemoryBackend::new(capacity, 16, FaultConfig::none());
    let engine = Engine::new(Box::new(backend), 16 << 10, true).unwrap();
    SwapFile::with_engine(engine, SLOT_BYTES, slot_count, compression).unwrap()
}

fn file_cfg() -> IoConfig {
    IoConfig {
        block_bytes: 32 << 10,
        queue_depth: 8,
        ..IoConfig::default()
    }
}

/// `len` bytes of a deterministic pattern in a buffer of `cap` bytes.
fn filled(seed: u64, len: usize, cap: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::new_zeroed(cap.max(len)).unwrap();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in buf[..len].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    buf
}

/// fp32 values with shared exponents: compresses after shuffling.
fn floats(seed: u64, len: usize) -> AlignedBuf {
    let mut buf = filled(seed, len, len);
    for w in buf[..len].chunks_exact_mut(4) {
        let m = u32::from_le_bytes([w[0], w[1], w[2], 0]) >> 9;
        let v = 1e-3f32 * (1.0 + m as f32 / (1u32 << 15) as f32);
        w.copy_from_slice(&v.to_le_bytes());
    }
    buf
}

fn read_back(swap: &mut SwapFile, chunk: u64) -> Result<Vec<u8>> {
    let buf = AlignedBuf::new_zeroed(swap.slot_bytes()).unwrap();
    let (res, buf) = swap.read_chunk(chunk, buf);
    res.map(|len| buf[..len].to_vec())
}

#[test]
fn layout_is_aligned_and_checked() {
    let l = Layout::new(8192, 1000).unwrap();
    assert_eq!(l.data_offset % DATA_ALIGN_BYTES, 0);
    assert_eq!(l.map_offset(1) % 4096, 0);
    assert!(l.map_offset(1) + l.map_bytes <= l.data_offset);
    assert_eq!(l.slot_offset(3), l.data_offset + 3 * 8192);
    for (bytes, count, key) in [
        (1000, 4, "chunk.size"),
        (0, 4, "chunk.size"),
        (4096, 0, "nvme.size"),
    ] {
        match Layout::new(bytes, count) {
            Err(IoError::Config { key: k, .. }) => assert_eq!(k, key),
            other => panic!("expected a config error, got {other:?}"),
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Write {
        chunk: u64,
        len: usize,
        floats: bool,
    },
    Remove {
        chunk: u64,
    },
    Flush,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u64..12, 1usize..=SLOT_BYTES, any::<bool>())
            .prop_map(|(chunk, len, floats)| Step::Write { chunk, len, floats }),
        1 => (0u64..12).prop_map(|chunk| Step::Remove { chunk }),
        1 => Just(Step::Flush),
    ]
}

/// Apply `steps` to `swap` and to a model; every read must equal the model.
fn run_model(swap: &mut SwapFile, steps: &[Step]) -> std::result::Result<(), TestCaseError> {
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        match *s {
            Step::Write {
                chunk,
                len,
                floats: f,
            } => {
                let buf = if f {
                    floats(i as u64, align_up(len))
                } else {
                    filled(i as u64, len, len)
                };
                let before = buf[..len].to_vec();
                let full = !model.contains_key(&chunk) && model.len() == swap.slot_count() as usize;
                let (res, buf) = swap.write_chunk(chunk, buf, len);
                prop_assert_eq!(
                    &buf[..len],
                    &before[..],
                    "write changed the caller's buffer"
                );
                if full {
                    let is_full = matches!(res, Err(IoError::SwapFull { .. }));
                    prop_assert!(is_full, "expected SwapFull, got {:?}", res);
                } else {
                    prop_assert!(res.is_ok(), "write failed: {:?}", res);
                    model.insert(chunk, before);
                }
            }
            Step::Remove { chunk } => {
                let res = swap.remove(chunk);
                prop_assert_eq!(res.is_ok(), model.remove(&chunk).is_some());
            }
            Step::Flush => swap.flush().unwrap(),
        }
    }
    for chunk in 0..12u64 {
        match model.get(&chunk) {
            Some(want) => {
                prop_assert_eq!(swap.len_of(chunk), Some(want.len()));
                let got = read_back(swap, chunk).unwrap();
                prop_assert!(got == *want, "chunk {} differs", chunk);
            }
            None => {
                prop_assert!(!swap.contains(chunk));
                let unknown = matches!(read_back(swap, chunk), Err(IoError::UnknownChunk { .. }));
                prop_assert!(unknown);
            }
        }
    }
    prop_assert_eq!(swap.len(), model.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_chunks_round_trip_in_memory(
        steps in proptest::collection::vec(step(), 1..40),
        compressed in any::<bool>(),
    ) {
        let compression = if compressed { Compression::FP32 } else { Compression::Off };
        let mut swap = mem_swap(6, compression);
        run_model(&mut swap, &steps)?;
    }

    #[test]
    fn random_chunks_round_trip_in_a_file(
        steps in proptest::collection::vec(step(), 1..30),
        compressed in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let compression = if compressed { Compression::FP32 } else { Compression::Off };
        let path = dir.path().join("swap");
        let mut swap = SwapFile::create(&path, SLOT_BYTES, 6, &file_cfg(), compression).unwrap();
        run_model(&mut swap, &steps)?;
    }
}

#[test]
fn reopen_finds_every_chunk_in_the_same_slot_and_the_file_does_not_grow() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut want = HashMap::new();
    let file_bytes;
    {
        let mut swap =
            SwapFile::create(&path, SLOT_BYTES, 8, &file_cfg(), Compression::FP32).unwrap();
        for chunk in 0..6u64 {
            let len = 4096 * (chunk as usize + 1) + 17;
            let buf = if chunk % 2 == 0 {
                floats(chunk, align_up(len))
            } else {
                filled(chunk, len, len)
            };
            want.insert(chunk, buf[..len].to_vec());
            let (res, _) = swap.write_chunk(chunk * 100, buf, len);
            res.unwrap();
        }
        swap.flush().unwrap();
        file_bytes = std::fs::metadata(&path).unwrap().len();
        assert_eq!(file_bytes, swap.file_bytes());
    }
    let slots: Vec<(u64, u32)>;
    {
        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        assert_eq!(swap.compression(), Compression::FP32);
        assert_eq!(swap.len(), 6);
        for (&chunk, bytes) in &want {
            assert_eq!(read_back(&mut swap, chunk * 100).unwrap(), *bytes);
        }
        slots = swap.chunks().collect();
        // Change the set: drop one, add one, overwrite one; persisted on drop.
        swap.remove(100).unwrap();
        want.remove(&1);
        let (res, _) = swap.write_chunk(700, filled(7, 5000, 5000), 5000);
        res.unwrap();
        want.insert(7, filled(7, 5000, 5000)[..5000].to_vec());
        let (res, _) = swap.write_chunk(200, filled(9, 9000, 9000), 9000);
        res.unwrap();
        want.insert(2, filled(9, 9000, 9000)[..9000].to_vec());
    }
    let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
    assert_eq!(swap.len(), want.len());
    for (&chunk, bytes) in &want {
        assert_eq!(
            read_back(&mut swap, chunk * 100).unwrap(),
            *bytes,
            "chunk {chunk}"
        );
    }
    for (chunk, slot) in slots {
        if chunk != 100 {
            assert_eq!(swap.slot_of(chunk), Some(slot), "chunk {chunk} moved");
        }
    }
    drop(swap);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), file_bytes);
    // Opening with the same shape works; another shape is refused.
    SwapFile::open_or_create(&path, SLOT_BYTES, 8, &file_cfg(), Compression::FP32).unwrap();
    assert!(matches!(
        SwapFile::open_or_create(&path, SLOT_BYTES, 9, &file_cfg(), Compression::FP32),
        Err(IoError::BadHeader { .. })
    ));
}

#[test]
fn a_file_written_by_one_engine_reads_back_through_another() {
    use crate::config::EngineChoice;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let threads = IoConfig {
        engine: EngineChoice::ThreadPool,
        ..file_cfg()
    };
    {
        let mut swap = SwapFile::create(&path, SLOT_BYTES, 4, &threads, Compression::BF16).unwrap();
        assert_eq!(swap.engine().kind(), crate::BackendKind::ThreadPool);
        for chunk in 0..4u64 {
            let (res, _) = swap.write_chunk(
                chunk,
                floats(chunk, SLOT_BYTES),
                SLOT_BYTES - 4096 * chunk as usize,
            );
            res.unwrap();
        }
    }
    let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
    for chunk in 0..4u64 {
        let len = SLOT_BYTES - 4096 * chunk as usize;
        assert_eq!(
            read_back(&mut swap, chunk).unwrap(),
            floats(chunk, SLOT_BYTES)[..len].to_vec()
        );
    }
}

#[test]
fn a_flipped_byte_in_the_file_is_corrupt_on_read() {
    use std::os::unix::fs::FileExt;
    for compression in [Compression::Off, Compression::FP32] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let (slot, offset) = {
            let mut swap =
                SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), compression).unwrap();
            let (res, _) = swap.write_chunk(1, floats(1, 20_000), 20_000);
            res.unwrap();
            let (res, _) = swap.write_chunk(42, floats(2, 30_000), 30_000);
            res.unwrap();
            swap.flush().unwrap();
            let slot = swap.slot_of(42).unwrap();
            (slot, swap.slot_offset_bytes(slot))
        };
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(b"garbage", offset + 100).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        match read_back(&mut swap, 42) {
            Err(IoError::Corrupt {
                chunk: 42,
                slot: s,
                expected,
                found,
            }) => {
                assert_eq!(s, slot);
                assert_ne!(expected, found);
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
        assert_eq!(
            read_back(&mut swap, 1).unwrap(),
            floats(1, 20_000)[..20_000].to_vec()
        );
    }
}

fn bad_header_reason(r: Result<SwapFile>) -> String {
    match r {
        Err(IoError::BadHeader { reason, .. }) => reason,
        other => panic!("expected BadHeader, got {other:?}"),
    }
}

#[test]
fn files_that_are_not_ours_or_too_small_are_bad_headers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    drop(SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap());
    let full_bytes = std::fs::metadata(&path).unwrap().len();

    // Too small for the slots its header claims.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(full_bytes - SLOT_BYTES as u64).unwrap();
    let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
    assert!(reason.contains("too small"), "{reason}");

    // Too small for a header at all.
    f.set_len(100).unwrap();
    let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
    assert!(reason.contains("too small"), "{reason}");

    // Not ours.
    let other = dir.path().join("other");
    std::fs::write(&other, vec![7u8; 3 << 20]).unwrap();
    let reason = bad_header_reason(SwapFile::open(&other, &file_cfg()));
    assert!(reason.contains("magic"), "{reason}");

    // Another version in both copies.
    use std::os::unix::fs::FileExt;
    drop(f);
    std::fs::remove_file(&path).unwrap();
    drop(SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    for copy in 0..2u64 {
        f.write_all_at(&99u32.to_le_bytes(), copy * 4096 + H_VERSION as u64)
            .unwrap();
    }
    let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
    assert!(reason.contains("version 99"), "{reason}");
}

/// The newest valid header on disk, read past the lock (as a crashed process
/// leaves it).
fn header_on_disk(path: &Path) -> Header {
    let bytes = std::fs::read(path).unwrap();
    (0..HEADER_COPIES as usize)
        .filter_map(|c| Header::decode(&bytes[c * HEADER_PAGE_BYTES..]).ok())
        .max_by_key(|h| h.generation)
        .unwrap()
}

/// Guards against a crash after a clean close being taken as clean: the marker must
/// be off on disk before the first change reaches the file, flushed or not.
#[test]
fn the_clean_marker_is_cleared_on_disk_before_the_first_change() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut swap = SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap();
    assert_eq!(swap.layout_fingerprint(), None);
    assert!(!swap.is_clean());
    swap.set_layout_fingerprint(Some(0xfeed)).unwrap();
    let (res, _) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
    res.unwrap();
    swap.mark_clean().unwrap();
    let h = header_on_disk(&path);
    assert!(h.clean);
    assert_eq!(h.fingerprint, Some(0xfeed));
    drop(swap);

    let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
    assert!(swap.is_clean());
    assert_eq!(swap.layout_fingerprint(), Some(0xfeed));
    // Reads change nothing.
    assert_eq!(
        read_back(&mut swap, 1).unwrap(),
        filled(1, 4096, 4096)[..].to_vec()
    );
    assert!(header_on_disk(&path).clean);
    // A write, not flushed: the header on disk already says not clean.
    let (res, _) = swap.write_chunk(2, filled(2, 4096, 4096), 4096);
    res.unwrap();
    assert!(!swap.is_clean());
    assert!(!header_on_disk(&path).clean);
    swap.mark_clean().unwrap();
    // A removal and a new fingerprint clear it too.
    swap.remove(2).unwrap();
    assert!(!header_on_disk(&path).clean);
    swap.mark_clean().unwrap();
    swap.set_layout_fingerprint(Some(7)).unwrap();
    assert!(!header_on_disk(&path).clean);
    drop(swap);
    let swap = SwapFile::open(&path, &file_cfg()).unwrap();
    assert!(!swap.is_clean());
    assert_eq!(swap.layout_fingerprint(), Some(7));
}

#[test]
fn a_torn_newest_header_falls_back_to_the_previous_flush() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut swap = SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap();
    let (res, _) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
    res.unwrap();
    swap.flush().unwrap(); // generation 2, copy 0
    let (res, _) = swap.write_chunk(2, filled(2, 4096, 4096), 4096);
    res.unwrap();
    swap.flush().unwrap(); // generation 3, copy 1
    drop(swap);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xff; 8], 4096 + H_GENERATION as u64 - 4)
        .unwrap();
    drop(f);
    let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
    assert!(swap.contains(1));
    assert!(!swap.contains(2), "chunk 2 was only in the torn copy");
    assert_eq!(
        read_back(&mut swap, 1).unwrap(),
        filled(1, 4096, 4096)[..4096].to_vec()
    );
}

#[test]
fn creating_needs_a_writable_directory_and_a_new_path() {
    let missing = Path::new("/nonexistent/tidestore/swap");
    match SwapFile::create(missing, SLOT_BYTES, 4, &file_cfg(), Compression::Off) {
        Err(IoError::Config { key, reason }) => {
            assert_eq!(key, "nvme.dir");
            assert!(reason.contains("/nonexistent/tidestore"), "{reason}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    drop(SwapFile::create(&path, SLOT_BYTES, 2, &file_cfg(), Compression::Off).unwrap());
    assert!(matches!(
        SwapFile::create(&path, SLOT_BYTES, 2, &file_cfg(), Compression::Off),
        Err(IoError::Setup { .. })
    ));
    assert!(matches!(
        SwapFile::create(
            &dir.path().join("x"),
            5000,
            2,
            &file_cfg(),
            Compression::Off
        ),
        Err(IoError::Config {
            key: "chunk.size",
            ..
        })
    ));
}

#[test]
fn a_device_too_small_for_the_slots_is_no_space() {
    let backend = MemoryBackend::new(2 << 20, 8, FaultConfig::none());
    let engine = Engine::new(Box::new(backend), 16 << 10, true).unwrap();
    assert!(matches!(
        SwapFile::with_engine(engine, 1 << 20, 4, Compression::Off),
        Err(IoError::NoSpace { .. })
    ));
}

#[test]
fn bad_requests_get_typed_errors() {
    let mut swap = mem_swap(2, Compression::Off);
    let (res, buf) = swap.write_chunk(1, filled(1, 8192, SLOT_BYTES * 2), SLOT_BYTES + 1);
    assert!(matches!(res, Err(IoError::ChunkTooLarge { chunk: 1, .. })));
    let (res, buf) = swap.write_chunk(1, buf, 0);
    assert!(matches!(res, Err(IoError::InvalidRequest { .. })));
    let (res, buf) = swap.read_chunk(9, buf);
    assert!(matches!(res, Err(IoError::UnknownChunk { chunk: 9 })));
    let (res, buf) = swap.write_chunk(1, buf, 100);
    res.unwrap();
    let (res, buf) = swap.write_chunk(2, buf, 100);
    res.unwrap();
    let (res, buf) = swap.write_chunk(3, buf, 100);
    assert!(matches!(res, Err(IoError::SwapFull { chunk: 3, slots: 2 })));
    let (res, _) = swap.read_chunk(1, AlignedBuf::new_zeroed(100).unwrap());
    assert_eq!(res.unwrap(), 100);
    // A removed chunk's slot is reused when nothing else is free.
    swap.remove(2).unwrap();
    assert!(matches!(
        swap.remove(2),
        Err(IoError::UnknownChunk { chunk: 2 })
    ));
    let (res, _) = swap.write_chunk(3, buf, 100);
    res.unwrap();
    assert_eq!(swap.free_slots(), 0);
}

#[test]
fn removed_slots_wait_for_a_flush_while_others_are_free() {
    let mut swap = mem_swap(3, Compression::Off);
    let (res, buf) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
    res.unwrap();
    let slot = swap.slot_of(1).unwrap();
    swap.remove(1).unwrap();
    let (res, buf) = swap.write_chunk(2, buf, 4096);
    res.unwrap();
    assert_ne!(swap.slot_of(2), Some(slot));
    swap.flush().unwrap();
    swap.remove(2).unwrap();
    let (res, _) = swap.write_chunk(3, buf, 4096);
    res.unwrap();
    assert_eq!(
        swap.slot_of(3),
        Some(slot),
        "lowest free slot after the flush"
    );
}

#[test]
fn async_requests_overlap_and_one_per_chunk_is_in_flight() {
    let mut swap = mem_swap(8, Compression::FP32);
    for chunk in 0..8u64 {
        let len = 10_000 + chunk as usize * 3000;
        swap.submit_write(chunk, floats(chunk, align_up(len)), len);
    }
    // A second request on a chunk whose write is in flight (the last one: earlier
    // ones may have finished while waiting for an image buffer) is refused at once.
    swap.submit_read(7, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
    let mut writes = 0;
    let mut refused = 0;
    while let Some(c) = swap.wait() {
        match c.op {
            Op::Write => {
                c.result.unwrap();
                assert_eq!(
                    &c.buf[..c.len_bytes],
                    &floats(c.chunk, align_up(c.len_bytes))[..c.len_bytes]
                );
                writes += 1;
            }
            Op::Read => {
                assert!(
                    matches!(c.result, Err(IoError::InvalidRequest { .. })),
                    "{:?}",
                    c.result
                );
                refused += 1;
            }
        }
    }
    assert_eq!((writes, refused), (8, 1));
    assert_eq!(swap.outstanding(), 0);
    for chunk in 0..8u64 {
        swap.submit_read(chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
    }
    let mut reads = 0;
    while let Some(c) = swap.poll().or_else(|| swap.wait()) {
        c.result.unwrap();
        let len = 10_000 + c.chunk as usize * 3000;
        assert_eq!(c.len_bytes, len);
        assert_eq!(&c.buf[..len], &floats(c.chunk, align_up(len))[..len]);
        reads += 1;
    }
    assert_eq!(reads, 8);
}

#[test]
fn compression_shrinks_structured_data_and_stores_noise_raw() {
    let mut swap = mem_swap(4, Compression::FP32);
    let len = SLOT_BYTES - 100;
    let (res, _) = swap.write_chunk(1, floats(1, SLOT_BYTES), len);
    res.unwrap();
    let stored = swap.stored_bytes_of(1).unwrap();
    assert!(stored < len * 85 / 100, "stored {stored} of {len}");
    let (res, _) = swap.write_chunk(2, filled(2, len, SLOT_BYTES), len);
    res.unwrap();
    assert_eq!(swap.stored_bytes_of(2), Some(len), "noise is stored raw");
    assert_eq!(
        read_back(&mut swap, 1).unwrap(),
        floats(1, SLOT_BYTES)[..len].to_vec()
    );
    assert_eq!(
        read_back(&mut swap, 2).unwrap(),
        filled(2, len, SLOT_BYTES)[..len].to_vec()
    );
}
