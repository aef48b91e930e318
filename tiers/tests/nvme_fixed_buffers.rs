//! Guards against the host pool's registration with the NVMe tier's io engine going
//! wrong: once the host tier's pool is registered, chunks written from and read into its
//! buffers go out as io_uring fixed-buffer operations (no page pinning per request) and
//! still round-trip byte for byte; buffers from elsewhere keep working as plain requests;
//! and `io.fixed_buffers = false` registers nothing. Where io_uring is unavailable the
//! fixed-path checks are skipped with a printed reason.

use tidestore_io::compress::Compression;
use tidestore_io::{AlignedBuf, BackendKind, IoConfig};
use tidestore_tiers::{Device, DeviceConfig, HostTier, NvmeTier};

const SLOT: usize = 64 * 1024;

fn pattern(chunk: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(chunk * 7 + 3) as u8)
        .collect()
}

fn tiers(dir: &tempfile::TempDir, fixed_buffers: bool) -> (HostTier, NvmeTier) {
    let device = Device::sim(&DeviceConfig::new(1 << 20)).unwrap();
    let host = HostTier::new(4 * SLOT as u64, SLOT, &device).unwrap();
    let cfg = IoConfig {
        block_bytes: 16 * 1024,
        fixed_buffers,
        ..IoConfig::default()
    };
    let nvme = NvmeTier::open_or_create(&dir.path().join("swap"), SLOT, 8, &cfg, Compression::Off)
        .unwrap();
    (host, nvme)
}

/// Writes chunks 0..3 from pool buffers (two at once), reads them back into pool buffers
/// and a heap buffer, and checks every byte.
fn round_trip(host: &HostTier, nvme: &mut NvmeTier) {
    for chunk in 0..3u64 {
        let mut buf = host.try_take(chunk, SLOT as u64).unwrap();
        buf[..SLOT].copy_from_slice(&pattern(chunk, SLOT));
        nvme.submit_write(chunk, buf, SLOT);
    }
    while let Some(c) = nvme.wait() {
        c.result.unwrap();
    }
    for chunk in 0..2u64 {
        let mut buf = host.try_take(chunk, SLOT as u64).unwrap();
        buf.fill(0);
        nvme.submit_read(chunk, buf);
    }
    while let Some(c) = nvme.wait() {
        c.result.unwrap();
        assert!(
            c.buf[..SLOT] == pattern(c.chunk, SLOT)[..],
            "chunk {}",
            c.chunk
        );
    }
    let (r, buf) = nvme.read_chunk(2, AlignedBuf::new_zeroed(SLOT).unwrap());
    assert_eq!(r.unwrap(), SLOT);
    assert!(
        buf[..SLOT] == pattern(2, SLOT)[..],
        "chunk 2 into a heap buffer"
    );
}

#[test]
fn registered_pool_buffers_go_out_as_fixed_operations() {
    let dir = tempfile::tempdir().unwrap();
    let (host, mut nvme) = tiers(&dir, true);
    let registered = nvme.register_pool(host.pool()).unwrap();
    let kind = nvme.with_swap_file(|f| f.engine().kind());
    if kind != BackendKind::IoUring {
        println!("skipped: io_uring unavailable here ({kind} engine)");
        return;
    }
    if !registered {
        println!("skipped: the kernel refused to register the pool (RLIMIT_MEMLOCK?)");
        return;
    }
    assert_eq!(nvme.with_swap_file(|f| f.engine().ops_fixed()), 0);
    round_trip(&host, &mut nvme);
    // 5 pool-buffer requests of 4 blocks each; the heap-buffer read is plain.
    assert_eq!(nvme.with_swap_file(|f| f.engine().ops_fixed()), 5 * 4);
}

#[test]
fn with_fixed_buffers_off_nothing_is_registered() {
    let dir = tempfile::tempdir().unwrap();
    let (host, mut nvme) = tiers(&dir, false);
    assert!(!nvme.register_pool(host.pool()).unwrap());
    round_trip(&host, &mut nvme);
    assert_eq!(nvme.with_swap_file(|f| f.engine().ops_fixed()), 0);
}
