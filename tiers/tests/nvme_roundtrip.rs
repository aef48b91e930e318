//! Guards against chunks lost or changed on the NVMe tier and against it going over its
//! budget: chunks written (sync and async) read back byte for byte, a full file is the
//! tier's typed OverBudget error, and the budget counts whole slots.

use tidestore_io::compress::Compression;
use tidestore_io::{AlignedBuf, IoConfig, Op};
use tidestore_tiers::{NvmeTier, TierError, TierKind};

const SLOT: usize = 64 * 1024;

fn pattern(chunk: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(chunk * 7) as u8)
        .collect()
}

fn tier(dir: &tempfile::TempDir, slots: u32) -> NvmeTier {
    let cfg = IoConfig {
        block_bytes: 16 * 1024,
        ..IoConfig::default()
    };
    NvmeTier::open_or_create(
        &dir.path().join("swap"),
        SLOT,
        slots,
        &cfg,
        Compression::Off,
    )
    .unwrap()
}

#[test]
fn chunks_round_trip_sync_and_async() {
    let dir = tempfile::tempdir().unwrap();
    let mut nvme = tier(&dir, 8);
    assert_eq!(nvme.budget().capacity_bytes(), 8 * SLOT as u64);

    // Synchronous.
    let len = SLOT - 1000;
    let mut buf = AlignedBuf::new_zeroed(SLOT).unwrap();
    buf[..len].copy_from_slice(&pattern(1, len));
    let (r, buf) = nvme.write_chunk(1, buf, len);
    r.unwrap();
    assert_eq!(nvme.budget().used_bytes(), SLOT as u64);
    let mut buf = buf;
    buf.fill(0);
    let (r, buf) = nvme.read_chunk(1, buf);
    assert_eq!(r.unwrap(), len);
    assert_eq!(&buf[..len], &pattern(1, len)[..]);

    // Several in flight.
    for chunk in 10..15u64 {
        let mut b = AlignedBuf::new_zeroed(SLOT).unwrap();
        b.copy_from_slice(&pattern(chunk, SLOT));
        nvme.submit_write(chunk, b, SLOT);
    }
    let mut written = 0;
    while let Some(c) = nvme.wait() {
        assert_eq!(c.op, Op::Write);
        c.result.unwrap();
        written += 1;
    }
    assert_eq!(written, 5);
    for chunk in 10..15u64 {
        nvme.submit_read(chunk, AlignedBuf::new_zeroed(SLOT).unwrap());
    }
    let mut read = 0;
    while let Some(c) = nvme.wait() {
        c.result.unwrap();
        assert_eq!(c.len_bytes, SLOT);
        assert_eq!(&c.buf[..SLOT], &pattern(c.chunk, SLOT)[..]);
        read += 1;
    }
    assert_eq!(read, 5);
    let b = nvme.budget();
    assert_eq!(b.used_bytes(), 6 * SLOT as u64);
    assert_eq!(b.peak_bytes(), 6 * SLOT as u64);
    let links = nvme.link_stats();
    assert_eq!(links.writes, 6);
    assert_eq!(links.reads, 6);
    assert_eq!(links.host_to_nvme_bytes, (len + 5 * SLOT) as u64);
    nvme.flush().unwrap();

    nvme.remove(1).unwrap();
    assert!(!nvme.contains(1));
    assert_eq!(nvme.budget().used_bytes(), 5 * SLOT as u64);
    let (r, _) = nvme.read_chunk(1, AlignedBuf::new_zeroed(SLOT).unwrap());
    assert!(matches!(
        r,
        Err(TierError::UnknownChunk {
            tier: TierKind::Nvme,
            chunk: 1
        })
    ));
}

#[test]
fn full_file_is_over_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut nvme = tier(&dir, 2);
    for chunk in 0..2u64 {
        let (r, _) = nvme.write_chunk(chunk, AlignedBuf::new_zeroed(SLOT).unwrap(), SLOT);
        r.unwrap();
    }
    // Rewriting a stored chunk keeps its slot.
    let (r, _) = nvme.write_chunk(1, AlignedBuf::new_zeroed(SLOT).unwrap(), SLOT);
    r.unwrap();
    let (r, _) = nvme.write_chunk(9, AlignedBuf::new_zeroed(SLOT).unwrap(), SLOT);
    match r {
        Err(TierError::OverBudget {
            tier: TierKind::Nvme,
            needed_bytes,
            free_bytes: 0,
            capacity_bytes,
        }) => {
            assert_eq!(needed_bytes, SLOT as u64);
            assert_eq!(capacity_bytes, 2 * SLOT as u64);
        }
        other => panic!("expected OverBudget, got {other:?}"),
    }
    let b = nvme.budget();
    assert!(b.used_bytes() <= b.capacity_bytes());
}
