//! Guards against a swap file that hands back wrong bytes when the device misbehaves.
//!
//! Every scenario runs the swap file over the in-memory backend with its seeded fault
//! injector (EIO, short and interrupted transfers, ENOSPC, bits flipped on read or in
//! storage, completions out of order) and checks the one rule that matters: a read either
//! returns exactly the bytes last written, or a typed error. A flipped bit must surface as
//! `Corrupt`; a failed write poisons the file for writes but leaves earlier chunks
//! readable.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use proptest::prelude::*;
use tidestore_io::compress::Compression;
use tidestore_io::swapfile::SwapFile;
use tidestore_io::{align_up, AlignedBuf, Engine, FaultConfig, IoError, MemoryBackend, Op};

const SLOT_BYTES: usize = 64 << 10;
const SLOT_COUNT: u32 = 12;
/// Bytes a fresh swap file of `SLOT_COUNT` slots writes before any chunk: two header
/// pages and two one-page maps.
const FORMAT_BYTES: u64 = 4 * 4096;

fn swap_over(
    faults: FaultConfig,
    compression: Compression,
) -> (
    SwapFile,
    std::sync::Arc<tidestore_io::memory::FaultCounters>,
) {
    let backend = MemoryBackend::new(64 << 20, 16, faults);
    let counters = backend.counters();
    let engine = Engine::new(Box::new(backend), 8192, true).unwrap();
    let swap = SwapFile::with_engine(engine, SLOT_BYTES, SLOT_COUNT, compression).unwrap();
    (swap, counters)
}

/// Deterministic contents of version `version` of `chunk`: fp32-like words (so the
/// compressed path is exercised) with noise in the low bytes.
fn contents(chunk: u64, version: u64, len: usize) -> Vec<u8> {
    let mut x = (chunk << 32 ^ version).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = 1e-2f32 * (1.0 + (x >> 41) as f32 / (1u64 << 23) as f32);
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn buf_with(bytes: &[u8]) -> AlignedBuf {
    let mut buf = AlignedBuf::new_zeroed(align_up(bytes.len())).unwrap();
    buf[..bytes.len()].copy_from_slice(bytes);
    buf
}

fn len_of(chunk: u64, version: u64) -> usize {
    1 + ((chunk * 7919 + version * 104_729) as usize % SLOT_BYTES)
}

/// What a read may legitimately fail with under injected faults.
fn is_expected_read_error(e: &IoError) -> bool {
    matches!(
        e,
        IoError::Corrupt { .. } | IoError::Device { .. } | IoError::UnexpectedEof { .. }
    )
}

/// Write every chunk once (faults may hit), then read everything back asynchronously for
/// `rounds`, checking each result against the model. Returns (good reads, corrupt reads).
fn exercise(
    faults: FaultConfig,
    compression: Compression,
    rounds: usize,
) -> (
    usize,
    usize,
    std::sync::Arc<tidestore_io::memory::FaultCounters>,
) {
    let (mut swap, counters) = swap_over(faults, compression);
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut poisoned = false;
    for chunk in 0..SLOT_COUNT as u64 {
        let bytes = contents(chunk, 0, len_of(chunk, 0));
        let (res, buf) = swap.write_chunk(chunk, buf_with(&bytes), bytes.len());
        assert_eq!(
            &buf[..bytes.len()],
            &bytes[..],
            "a write changed the caller's buffer"
        );
        match res {
            Ok(()) => {
                assert!(!poisoned, "a write succeeded on a poisoned file");
                model.insert(chunk, bytes);
            }
            Err(IoError::Poisoned { .. }) => assert!(poisoned),
            Err(e @ (IoError::Device { .. } | IoError::NoSpace { .. })) => {
                assert!(!poisoned, "first failure should be the device's, got {e}");
                poisoned = true;
                assert!(swap.is_poisoned());
            }
            Err(e) => panic!("unexpected write error: {e}"),
        }
    }
    let mut good = 0;
    let mut corrupt = 0;
    for _ in 0..rounds {
        for chunk in 0..SLOT_COUNT as u64 {
            swap.submit_read(chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
        }
        while let Some(c) = swap.wait() {
            assert_eq!(c.op, Op::Read);
            match (model.get(&c.chunk), c.result) {
                (Some(want), Ok(())) => {
                    assert_eq!(c.len_bytes, want.len());
                    assert!(
                        c.buf[..c.len_bytes] == want[..],
                        "chunk {} read back wrong bytes",
                        c.chunk
                    );
                    good += 1;
                }
                (Some(_), Err(e)) => {
                    assert!(
                        is_expected_read_error(&e),
                        "chunk {}: unexpected read error {e}",
                        c.chunk
                    );
                    if matches!(e, IoError::Corrupt { .. }) {
                        corrupt += 1;
                    }
                }
                (None, Err(IoError::UnknownChunk { .. })) => {}
                (None, other) => panic!("chunk {} was never written, read gave {other:?}", c.chunk),
            }
        }
    }
    (good, corrupt, counters)
}

#[test]
fn read_faults_give_typed_errors_or_exact_bytes() {
    for compression in [Compression::Off, Compression::FP32] {
        let faults = FaultConfig {
            eio_read_rate: 0.01,
            transient_rate: 0.05,
            short_rate: 0.2,
            bitflip_read_rate: 0.02,
            reorder: true,
            ..FaultConfig::seeded(7)
        };
        let (good, corrupt, counters) = exercise(faults, compression, 20);
        assert!(good > 0);
        assert!(corrupt > 0, "bit flips on read must surface as Corrupt");
        assert!(counters.bitflip_read.load(Ordering::Relaxed) > 0);
        assert!(counters.short.load(Ordering::Relaxed) > 0);
        assert!(counters.transient.load(Ordering::Relaxed) > 0);
    }
}

#[test]
fn bits_flipped_in_storage_are_caught_by_the_checksum() {
    for compression in [Compression::Off, Compression::FP32] {
        let faults = FaultConfig {
            bitflip_write_rate: 0.2,
            ..FaultConfig::seeded(11)
        };
        let (good, corrupt, counters) = exercise(faults, compression, 2);
        let flips = counters.bitflip_write.load(Ordering::Relaxed);
        assert!(flips > 0);
        assert!(good > 0);
        // A flip in a chunk (not in the header) is persistent: read twice, caught twice.
        assert!(corrupt > 0, "{flips} stored flips, none caught");
    }
}

#[test]
fn a_failed_write_poisons_writes_but_earlier_chunks_stay_readable() {
    let faults = FaultConfig {
        eio_write_rate: 0.02,
        ..FaultConfig::seeded(3)
    };
    // The format writes must get through; a seed whose first failure hits a chunk.
    let (mut swap, counters) = swap_over(faults, Compression::Off);
    let mut written = Vec::new();
    let mut failed = None;
    for chunk in 0..200u64 {
        let bytes = contents(chunk % 12, chunk, 20_000);
        let (res, _) = swap.write_chunk(chunk % 12, buf_with(&bytes), bytes.len());
        match res {
            Ok(()) => written.push((chunk % 12, bytes)),
            Err(IoError::Device { op: Op::Write, .. }) => {
                failed = Some(chunk % 12);
                break;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    let failed = failed.expect("an EIO was injected");
    assert!(counters.eio.load(Ordering::Relaxed) > 0);
    assert!(swap.is_poisoned());
    let (res, _) = swap.write_chunk(99, buf_with(&[1; 10]), 10);
    assert!(matches!(res, Err(IoError::Poisoned { .. })));
    assert!(matches!(swap.flush(), Err(IoError::Poisoned { .. })));
    // The chunk whose write failed is gone; every other keeps its last good version.
    assert!(!swap.contains(failed));
    let mut last: HashMap<u64, Vec<u8>> = HashMap::new();
    for (chunk, bytes) in written {
        last.insert(chunk, bytes);
    }
    last.remove(&failed);
    for (chunk, bytes) in &last {
        let (res, buf) = swap.read_chunk(*chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
        assert_eq!(res.unwrap(), bytes.len());
        assert!(buf[..bytes.len()] == bytes[..], "chunk {chunk}");
    }
}

#[test]
fn no_space_mid_write_keeps_earlier_chunks_and_poisons_the_file() {
    for compression in [Compression::Off, Compression::FP32] {
        let chunk_bytes = SLOT_BYTES;
        let faults = FaultConfig {
            // Three whole chunks fit, the fourth runs out halfway.
            enospc_after_bytes: Some(
                FORMAT_BYTES + 3 * chunk_bytes as u64 + chunk_bytes as u64 / 2,
            ),
            short_rate: 0.1,
            ..FaultConfig::seeded(5)
        };
        let (mut swap, _) = swap_over(faults, compression);
        let noise = |chunk: u64| {
            // Incompressible, so compressed and raw runs write the same amount.
            let mut x = chunk.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
            (0..chunk_bytes)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 32) as u8
                })
                .collect::<Vec<u8>>()
        };
        for chunk in 0..3u64 {
            let (res, _) = swap.write_chunk(chunk, buf_with(&noise(chunk)), chunk_bytes);
            res.unwrap();
        }
        let (res, _) = swap.write_chunk(3, buf_with(&noise(3)), chunk_bytes);
        assert!(matches!(res, Err(IoError::NoSpace { .. })), "{res:?}");
        let (res, _) = swap.write_chunk(4, buf_with(&noise(4)), chunk_bytes);
        assert!(matches!(res, Err(IoError::Poisoned { .. })), "{res:?}");
        // Overwriting an intact chunk is refused too, so it stays intact.
        let (res, _) = swap.write_chunk(0, buf_with(&noise(9)), chunk_bytes);
        assert!(matches!(res, Err(IoError::Poisoned { .. })), "{res:?}");
        assert!(!swap.contains(3));
        for chunk in 0..3u64 {
            let (res, buf) = swap.read_chunk(chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
            assert_eq!(res.unwrap(), chunk_bytes);
            assert!(buf[..chunk_bytes] == noise(chunk)[..], "chunk {chunk}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any mix of faults, any seed: never wrong bytes.
    #[test]
    fn any_faults_never_give_wrong_bytes(
        seed in any::<u64>(),
        eio in 0.0f64..0.02,
        transient in 0.0f64..0.1,
        short in 0.0f64..0.3,
        flip_read in 0.0f64..0.05,
        flip_write in 0.0f64..0.02,
        reorder in any::<bool>(),
        compressed in any::<bool>(),
    ) {
        let faults = FaultConfig {
            eio_read_rate: eio,
            eio_write_rate: eio / 4.0,
            transient_rate: transient,
            short_rate: short,
            bitflip_read_rate: flip_read,
            bitflip_write_rate: flip_write,
            reorder,
            ..FaultConfig::seeded(seed)
        };
        let compression = if compressed { Compression::FP32 } else { Compression::Off };
        // `with_engine` itself may fail when a fault hits the format: a typed error.
        let backend = MemoryBackend::new(64 << 20, 16, faults.clone());
        let engine = Engine::new(Box::new(backend), 8192, true).unwrap();
        match SwapFile::with_engine(engine, SLOT_BYTES, SLOT_COUNT, compression) {
            Ok(swap) => drop(swap),
            Err(e) => {
                let typed = matches!(e, IoError::Device { .. } | IoError::UnexpectedEof { .. });
                prop_assert!(typed, "format failed with {}", e);
                return Ok(());
            }
        }
        exercise(faults, compression, 3);
    }
}

#[test]
fn a_failed_sync_poisons_writes_but_earlier_chunks_stay_readable() {
    // Formatting the file syncs once; the first flush after it fails.
    let faults = FaultConfig {
        sync_eio_after: Some(1),
        ..FaultConfig::seeded(11)
    };
    let (mut swap, _) = swap_over(faults, Compression::Off);
    let data = contents(1, 0, SLOT_BYTES);
    let (res, _) = swap.write_chunk(1, buf_with(&data), data.len());
    res.unwrap();
    let err = swap.flush().expect_err("the sync fails");
    assert!(matches!(err, IoError::Device { .. }), "{err:?}");
    assert!(swap.is_poisoned());
    let (res, _) = swap.write_chunk(2, buf_with(&data), data.len());
    assert!(matches!(res, Err(IoError::Poisoned { .. })), "{res:?}");
    assert!(matches!(swap.flush(), Err(IoError::Poisoned { .. })));
    let (res, buf) = swap.read_chunk(1, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
    assert_eq!(res.unwrap(), data.len());
    assert!(buf[..data.len()] == data[..]);
}

/// Regression: a finished asynchronous read left in the ready queue must never be handed
/// to a later synchronous request that happens to reuse its slab index.
#[test]
fn sync_requests_never_receive_a_queued_async_completion() {
    let (mut swap, _) = swap_over(FaultConfig::none(), Compression::Off);
    for chunk in 1..=4u64 {
        let data = contents(chunk, 0, len_of(chunk, 0));
        let (res, _) = swap.write_chunk(chunk, buf_with(&data), data.len());
        res.unwrap();
    }
    // Two asynchronous reads, completed by a flush (which waits for everything in
    // flight) but not yet collected: their slab indices are free again.
    swap.submit_read(1, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
    swap.submit_read(2, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
    swap.flush().unwrap();
    for chunk in 3..=4u64 {
        let (res, buf) = swap.read_chunk(chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
        let expect = contents(chunk, 0, len_of(chunk, 0));
        assert_eq!(res.unwrap(), expect.len(), "chunk {chunk}");
        assert!(
            buf[..expect.len()] == expect[..],
            "chunk {chunk} got another request's bytes"
        );
    }
    let c = swap
        .wait()
        .expect("the async read is still to be collected");
    assert_eq!(c.chunk, 1);
    let expect = contents(1, 0, len_of(1, 0));
    c.result.unwrap();
    assert!(c.buf[..expect.len()] == expect[..]);
}
