//! Guards against a checksum that does not describe the bytes moved: the engine folds
//! each piece of a checksummed request into a running crc32c as the pieces complete (out
//! of order, short, retried), and the swap file trusts that value to verify every read.
//! A checksum taken over the wrong bytes, in the wrong order, or over bytes a piece still
//! in flight is writing would either hide corruption or report good chunks as corrupt.
//! Every case here compares the engine's value with `crc32c` of the bytes themselves.

use proptest::prelude::*;
use tidestore_io::{AlignedBuf, Engine, FaultConfig, IoError, IoRequest, MemoryBackend, Op};

const BLOCK: usize = 16 * 1024;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(131)
                .wrapping_add(seed.wrapping_mul(17))
                .wrapping_add((i >> 11) as u64) as u8
        })
        .collect()
}

fn engine(faults: FaultConfig, file_bytes: u64, depth: usize) -> Engine {
    let backend = MemoryBackend::new(file_bytes, depth, faults);
    Engine::new(Box::new(backend), BLOCK, false).unwrap()
}

fn request(op: Op, offset_bytes: u64, buf: AlignedBuf, len_bytes: usize, tag: u64) -> IoRequest {
    IoRequest {
        op,
        offset_bytes,
        len_bytes,
        buf,
        user_data: tag,
    }
}

#[test]
fn checksums_of_writes_and_reads_match_the_bytes() {
    // Several multi-piece requests in flight at once, pieces completing in any order.
    let mut faults = FaultConfig::seeded(11);
    faults.reorder = true;
    let chunk = 10 * BLOCK + 4096;
    let count = 6u64;
    let mut e = engine(faults, count * chunk as u64, 4);
    for c in 0..count {
        let mut buf = AlignedBuf::new_zeroed(chunk).unwrap();
        buf[..chunk].copy_from_slice(&pattern(c, chunk));
        e.submit_checksummed(request(Op::Write, c * chunk as u64, buf, chunk, c), chunk);
    }
    let mut seen = 0;
    while let Some(done) = e.wait() {
        done.result.unwrap();
        let want = crc32c::crc32c(&pattern(done.user_data, chunk));
        assert_eq!(done.crc32c, Some(want), "write {}", done.user_data);
        seen += 1;
    }
    assert_eq!(seen, count);
    for c in 0..count {
        let buf = AlignedBuf::new_zeroed(chunk).unwrap();
        e.submit_checksummed(request(Op::Read, c * chunk as u64, buf, chunk, c), chunk);
    }
    while let Some(done) = e.wait() {
        done.result.unwrap();
        let crc = crc32c::crc32c(&done.buf[..chunk]);
        assert_eq!(done.crc32c, Some(crc), "read {}", done.user_data);
        assert_eq!(crc, crc32c::crc32c(&pattern(done.user_data, chunk)));
    }
}

#[test]
fn a_checksum_covers_only_the_prefix_asked_for() {
    let mut e = engine(FaultConfig::none(), 1 << 20, 8);
    let len = 5 * BLOCK;
    let data = pattern(3, len);
    let mut buf = AlignedBuf::new_zeroed(len).unwrap();
    buf[..len].copy_from_slice(&data);
    // Ends inside the third piece.
    let prefix = 2 * BLOCK + 1234;
    e.submit_checksummed(request(Op::Write, 0, buf, len, 1), prefix);
    let done = e.wait().unwrap();
    done.result.unwrap();
    assert_eq!(done.crc32c, Some(crc32c::crc32c(&data[..prefix])));
    // Zero bytes: the checksum of nothing.
    let buf = AlignedBuf::new_zeroed(len).unwrap();
    e.submit_checksummed(request(Op::Read, 0, buf, len, 2), 0);
    let done = e.wait().unwrap();
    done.result.unwrap();
    assert_eq!(done.crc32c, Some(0));
    // A plain request has none.
    let buf = AlignedBuf::new_zeroed(len).unwrap();
    e.submit(request(Op::Read, 0, buf, len, 3));
    assert_eq!(e.wait().unwrap().crc32c, None);
}

#[test]
fn a_checksum_longer_than_the_request_is_refused() {
    let mut e = engine(FaultConfig::none(), 1 << 20, 8);
    let buf = AlignedBuf::new_zeroed(2 * BLOCK).unwrap();
    e.submit_checksummed(request(Op::Read, 0, buf, BLOCK, 9), BLOCK + 1);
    let done = e.wait().unwrap();
    assert!(
        matches!(done.result, Err(IoError::InvalidRequest { .. })),
        "{:?}",
        done.result
    );
    assert_eq!(done.crc32c, None);
    assert_eq!(done.buf.capacity(), 2 * BLOCK);
}

#[test]
fn a_failed_request_has_no_checksum() {
    let mut faults = FaultConfig::seeded(5);
    faults.eio_read_rate = 1.0;
    let mut e = engine(faults, 1 << 20, 8);
    let buf = AlignedBuf::new_zeroed(4 * BLOCK).unwrap();
    e.submit_checksummed(request(Op::Read, 0, buf, 4 * BLOCK, 1), 4 * BLOCK);
    let done = e.wait().unwrap();
    assert!(
        matches!(done.result, Err(IoError::Device { .. })),
        "{:?}",
        done.result
    );
    assert_eq!(done.crc32c, None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Short transfers, retries and reordering split pieces at arbitrary bytes; the
    /// checksum of every successful request is still the checksum of its bytes.
    #[test]
    fn checksums_survive_short_and_retried_pieces(
        seed in any::<u64>(),
        blocks in 1usize..12,
        tail_pages in 0usize..4,
        prefix_cut in 0usize..4096,
        depth in 1usize..6,
    ) {
        let mut faults = FaultConfig::seeded(seed);
        faults.short_rate = 0.4;
        faults.transient_rate = 0.2;
        faults.reorder = true;
        let len = blocks * BLOCK + tail_pages * 4096;
        let prefix = len.saturating_sub(prefix_cut);
        let mut e = engine(faults, 4 * len as u64, depth);
        let data: Vec<Vec<u8>> = (0..3u64).map(|c| pattern(seed ^ c, len)).collect();
        for (c, d) in data.iter().enumerate() {
            let mut buf = AlignedBuf::new_zeroed(len).unwrap();
            buf[..len].copy_from_slice(d);
            e.submit_checksummed(
                request(Op::Write, (c * len) as u64, buf, len, c as u64),
                prefix,
            );
        }
        while let Some(done) = e.wait() {
            prop_assert!(done.result.is_ok(), "{:?}", done.result);
            let d = &data[done.user_data as usize];
            prop_assert_eq!(done.crc32c, Some(crc32c::crc32c(&d[..prefix])));
        }
        for c in 0..3usize {
            let buf = AlignedBuf::new_zeroed(len).unwrap();
            e.submit_checksummed(request(Op::Read, (c * len) as u64, buf, len, c as u64), prefix);
        }
        while let Some(done) = e.wait() {
            prop_assert!(done.result.is_ok(), "{:?}", done.result);
            let d = &data[done.user_data as usize];
            prop_assert!(done.buf[..len] == d[..]);
            prop_assert_eq!(done.crc32c, Some(crc32c::crc32c(&d[..prefix])));
        }
    }
}
