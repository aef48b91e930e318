//! Guards against faults turning into wrong bytes or lost buffers: under seeded EIO,
//! EINTR/EAGAIN, short transfers, ENOSPC, reordering and latency, every request completes
//! exactly once, with its buffer, and is either Ok with exactly the right bytes or a typed
//! error naming the op and the offset. (Flipped bits are invisible to the engine by
//! design; the swap file's checksum catches them, see swapfile_faults.rs.)

use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;
use tidestore_io::{AlignedBuf, Engine, FaultConfig, IoError, IoRequest, MemoryBackend, Op};

const CHUNK: usize = 64 * 1024;
const CHUNKS: u64 = 16;

fn pattern(chunk: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + chunk * 7 + (i >> 9) as u64) as u8)
        .collect()
}

fn engine_with(
    faults: FaultConfig,
    depth: usize,
) -> (Engine, std::sync::Arc<tidestore_io::memory::FaultCounters>) {
    let backend = MemoryBackend::new(CHUNKS * CHUNK as u64, depth, faults);
    let counters = backend.counters();
    (
        Engine::new(Box::new(backend), 16 * 1024, false).unwrap(),
        counters,
    )
}

/// Write every chunk, then read them all back, under `faults`.
fn check_writes_then_reads(faults: FaultConfig) {
    let (mut engine, _) = engine_with(faults, 8);
    let mut good_writes = vec![false; CHUNKS as usize];
    for c in 0..CHUNKS {
        let mut buf = AlignedBuf::new_zeroed(CHUNK).unwrap();
        buf[..CHUNK].copy_from_slice(&pattern(c, CHUNK));
        engine.submit(IoRequest {
            op: Op::Write,
            offset_bytes: c * CHUNK as u64,
            len_bytes: CHUNK,
            buf,
            user_data: c,
        });
    }
    let mut completions = 0;
    while let Some(done) = engine.wait() {
        completions += 1;
        match done.result {
            Ok(()) => good_writes[done.user_data as usize] = true,
            Err(e) => assert_typed(&e, Op::Write),
        }
        assert_eq!(done.buf.capacity(), CHUNK);
    }
    assert_eq!(completions, CHUNKS);
    for c in 0..CHUNKS {
        let buf = AlignedBuf::new_zeroed(CHUNK).unwrap();
        engine.submit(IoRequest {
            op: Op::Read,
            offset_bytes: c * CHUNK as u64,
            len_bytes: CHUNK,
            buf,
            user_data: c,
        });
    }
    let mut completions = 0;
    while let Some(done) = engine.wait() {
        completions += 1;
        match done.result {
            Ok(()) => {
                // A write that failed may have left part of the chunk behind; only chunks
                // whose write succeeded have a known content.
                if good_writes[done.user_data as usize] {
                    assert!(
                        done.buf[..CHUNK] == pattern(done.user_data, CHUNK)[..],
                        "wrong bytes in chunk {}",
                        done.user_data
                    );
                }
            }
            Err(e) => assert_typed(&e, Op::Read),
        }
    }
    assert_eq!(completions, CHUNKS);
}

fn assert_typed(e: &IoError, op_expected: Op) {
    match e {
        IoError::Device {
            op,
            offset_bytes,
            len_bytes,
            ..
        } => {
            assert_eq!(*op, op_expected);
            assert!(*offset_bytes < CHUNKS * CHUNK as u64 && *len_bytes > 0);
        }
        IoError::NoSpace { .. } => assert_eq!(op_expected, Op::Write),
        IoError::UnexpectedEof { op, .. } => assert_eq!(*op, op_expected),
        other => panic!("untyped or unexpected error: {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn faults_give_typed_errors_or_exact_bytes(
        seed in any::<u64>(),
        eio in 0.0f64..0.2,
        transient in 0.0f64..0.3,
        short in 0.0f64..0.5,
        reorder in any::<bool>(),
    ) {
        let faults = FaultConfig {
            eio_read_rate: eio,
            eio_write_rate: eio / 2.0,
            transient_rate: transient,
            short_rate: short,
            reorder,
            ..FaultConfig::seeded(seed)
        };
        check_writes_then_reads(faults);
    }
}

#[test]
fn short_transfers_and_transient_errors_are_retried_to_success() {
    let faults = FaultConfig {
        transient_rate: 0.3,
        short_rate: 0.5,
        reorder: true,
        latency_max: Duration::from_micros(50),
        ..FaultConfig::seeded(7)
    };
    let (mut engine, counters) = engine_with(faults, 4);
    for c in 0..CHUNKS {
        let mut buf = AlignedBuf::new_zeroed(CHUNK).unwrap();
        buf[..CHUNK].copy_from_slice(&pattern(c, CHUNK));
        let (res, _) = engine.write_at(c * CHUNK as u64, buf, CHUNK);
        res.expect("retries hide short and transient faults");
    }
    for c in 0..CHUNKS {
        let (res, buf) = engine.read_at(
            c * CHUNK as u64,
            AlignedBuf::new_zeroed(CHUNK).unwrap(),
            CHUNK,
        );
        res.expect("retries hide short and transient faults");
        assert!(buf[..CHUNK] == pattern(c, CHUNK)[..]);
    }
    assert!(
        counters.short.load(Ordering::Relaxed) > 10,
        "short transfers were injected"
    );
    assert!(
        counters.transient.load(Ordering::Relaxed) > 10,
        "transient errors were injected"
    );
}

#[test]
fn eio_is_reported_with_op_offset_and_length() {
    let faults = FaultConfig {
        eio_read_rate: 1.0,
        ..FaultConfig::seeded(1)
    };
    let (mut engine, _) = engine_with(faults, 4);
    let (res, buf) = engine.write_at(0, AlignedBuf::new_zeroed(CHUNK).unwrap(), CHUNK);
    res.unwrap();
    let (res, _) = engine.read_at(0, buf, CHUNK);
    match res {
        Err(IoError::Device {
            op: Op::Read,
            offset_bytes: 0,
            len_bytes,
            source,
        }) => {
            assert_eq!(len_bytes, 16 * 1024, "one block-size piece failed first");
            assert_eq!(source.raw_os_error(), Some(libc::EIO));
        }
        other => panic!("expected EIO, got {other:?}"),
    }
}

#[test]
fn enospc_mid_write_is_typed_and_earlier_chunks_survive() {
    let faults = FaultConfig {
        enospc_after_bytes: Some(3 * CHUNK as u64 + 1000),
        ..FaultConfig::seeded(3)
    };
    let (mut engine, counters) = engine_with(faults, 8);
    let mut results = Vec::new();
    for c in 0..5 {
        let mut buf = AlignedBuf::new_zeroed(CHUNK).unwrap();
        buf[..CHUNK].copy_from_slice(&pattern(c, CHUNK));
        let (res, _) = engine.write_at(c * CHUNK as u64, buf, CHUNK);
        results.push(res);
    }
    assert!(results[..3].iter().all(Result::is_ok));
    assert!(
        matches!(results[3], Err(IoError::NoSpace { .. })),
        "{:?}",
        results[3]
    );
    assert!(
        matches!(results[4], Err(IoError::NoSpace { .. })),
        "{:?}",
        results[4]
    );
    assert!(counters.enospc.load(Ordering::Relaxed) >= 2);
    for c in 0..3 {
        let (res, buf) = engine.read_at(
            c * CHUNK as u64,
            AlignedBuf::new_zeroed(CHUNK).unwrap(),
            CHUNK,
        );
        res.unwrap();
        assert!(
            buf[..CHUNK] == pattern(c, CHUNK)[..],
            "chunk {c} written before ENOSPC is intact"
        );
    }
}
