//! Guards against bytes lost or changed on the host↔device path, and against buffers not
//! coming back: the simulated device must round-trip every byte through asynchronous
//! copies with several in flight, hand both ends back in each completion (with its id),
//! keep completions in submission order, and refuse malformed copies with their buffers.

use std::time::Duration;

use tidestore_io::{AlignedBuf, BufferPool};
use tidestore_tiers::{
    CopyDir, Device, DeviceConfig, DeviceKind, DeviceView, HostTier, TierError, TierKind,
};

const CHUNK: usize = 64 * 1024 + 100; // not a multiple of 4096 on purpose

fn pattern(chunk: u64, len: usize) -> Vec<u8> {
    let mut x = chunk.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sim(budget_bytes: u64, depth: usize, link: Option<u64>) -> Device {
    let mut cfg = DeviceConfig::new(budget_bytes);
    cfg.copy_queue_depth = depth;
    cfg.sim_link_bytes_per_s = link;
    Device::sim(&cfg).unwrap()
}

#[test]
fn round_trip_with_many_in_flight() {
    const N: u64 = 12;
    let mut dev = sim(N * 128 * 1024, 4, None);
    let pool = BufferPool::new(CHUNK, N as usize).unwrap();
    let mut ids = Vec::new();
    for chunk in 0..N {
        let mut host = pool.try_take().unwrap();
        host[..CHUNK].copy_from_slice(&pattern(chunk, CHUNK));
        let mem = dev.alloc(chunk, CHUNK).unwrap();
        ids.push(dev.copy_to_device(chunk, host, mem, CHUNK));
    }
    // Completions come in submission order, each with its id and both ends.
    let mut mems = Vec::new();
    for (chunk, id) in ids.iter().enumerate() {
        let c = dev.wait_copy().expect("a completion per copy");
        assert_eq!(c.id, *id);
        assert_eq!(c.chunk, chunk as u64);
        assert_eq!(c.dir, CopyDir::HostToDevice);
        c.result.unwrap();
        match c.mem.view() {
            DeviceView::Host(bytes) => assert_eq!(bytes, &pattern(chunk as u64, CHUNK)[..]),
            DeviceView::Cuda(_) => panic!("simulated memory gave a device pointer"),
        }
        let mut host = c.host;
        host.fill(0);
        mems.push((c.mem, host));
    }
    assert!(dev.wait_copy().is_none());
    // And back, all submitted before any is waited for.
    let mut back = Vec::new();
    for (mem, host) in mems {
        let chunk = mem.chunk();
        back.push((chunk, dev.copy_to_host(chunk, mem, host, CHUNK)));
    }
    // Wait out of order by id: the others stay queued.
    for (chunk, id) in back.into_iter().rev() {
        let c = dev.wait_copy_id(id).expect("outstanding");
        c.result.unwrap();
        assert_eq!(c.dir, CopyDir::DeviceToHost);
        assert_eq!(&c.host[..CHUNK], &pattern(chunk, CHUNK)[..]);
    }
    assert_eq!(dev.copies_outstanding(), 0);
    let links = dev.link_stats();
    assert_eq!(links.host_to_device_copies, N);
    assert_eq!(links.device_to_host_copies, N);
    assert_eq!(links.host_to_device_bytes, N * CHUNK as u64);
    assert_eq!(links.device_to_host_bytes, N * CHUNK as u64);
    assert_eq!(links.failed_copies, 0);
    // Every buffer came back to its pool, and every allocation was freed.
    assert_eq!(pool.available(), N as usize);
    assert_eq!(dev.budget().used_bytes(), 0);
}

#[test]
fn completions_arrive_asynchronously() {
    // 1 MiB at 50 MiB/s takes 20 ms: the submit must return long before.
    let mut dev = sim(1 << 20, 2, Some(50 << 20));
    let host = AlignedBuf::new_zeroed(1 << 20).unwrap();
    let mem = dev.alloc(7, 1 << 20).unwrap();
    let id = dev.copy_to_device(7, host, mem, 1 << 20);
    assert!(dev.poll_copy().is_none(), "the copy finished inside submit");
    assert_eq!(dev.copies_outstanding(), 1);
    let mut got = None;
    for _ in 0..200 {
        if let Some(c) = dev.poll_copy() {
            got = Some(c);
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let c = got.expect("completion arrived without waiting");
    assert_eq!(c.id, id);
    c.result.unwrap();
}

#[test]
fn synchronize_finishes_everything_and_keeps_completions() {
    let mut dev = sim(8 << 20, 3, Some(500 << 20));
    for chunk in 0..8u64 {
        let host = AlignedBuf::new_zeroed(1 << 20).unwrap();
        let mem = dev.alloc(chunk, 1 << 20).unwrap();
        dev.copy_to_device(chunk, host, mem, 1 << 20);
    }
    dev.synchronize().unwrap();
    let mut n = 0;
    while let Some(c) = dev.poll_copy() {
        c.result.unwrap();
        n += 1;
    }
    assert_eq!(n, 8);
}

#[test]
fn malformed_copies_complete_with_their_buffers() {
    let mut dev = sim(1 << 20, 2, None);
    let other = sim(1 << 20, 2, None);
    // Longer than the device memory.
    let mem = dev.alloc(1, 4096).unwrap();
    let id = dev.copy_to_device(1, AlignedBuf::new_zeroed(8192).unwrap(), mem, 8192);
    let c = dev.wait_copy_id(id).unwrap();
    assert!(matches!(
        c.result,
        Err(TierError::TooLarge {
            tier: TierKind::Device,
            ..
        })
    ));
    assert_eq!(c.host.capacity(), 8192);
    assert_eq!(c.mem.bytes(), 4096);
    // Memory of another device.
    let foreign = other.alloc(2, 4096).unwrap();
    let id = dev.copy_to_host(2, foreign, AlignedBuf::new_zeroed(4096).unwrap(), 4096);
    let c = dev.wait_copy_id(id).unwrap();
    assert!(matches!(c.result, Err(TierError::BadCopy { .. })));
    assert_eq!(dev.link_stats().failed_copies, 0, "refused before starting");
}

#[test]
fn allocation_over_budget_is_typed() {
    let dev = sim(3 * 4096, 1, None);
    let _a = dev.alloc(1, 8192).unwrap();
    match dev.alloc(2, 5000) {
        Err(TierError::OverBudget {
            tier: TierKind::Device,
            needed_bytes: 8192,
            free_bytes: 4096,
            capacity_bytes: 12288,
        }) => {}
        other => panic!("expected OverBudget, got {other:?}"),
    }
    assert!(matches!(dev.alloc(3, 0), Err(TierError::ZeroBytes { .. })));
}

#[test]
fn non_model_memory_limits_the_simulated_device() {
    let mut cfg = DeviceConfig::new(8 * 4096);
    cfg.sim_total_bytes = Some(10 * 4096);
    let mut dev = Device::sim(&cfg).unwrap();
    dev.report_non_model_bytes(6 * 4096);
    assert_eq!(dev.non_model_bytes().unwrap(), 6 * 4096);
    let _a = dev.alloc(1, 4 * 4096).unwrap();
    let info = dev.mem_info().unwrap();
    assert_eq!(info.total_bytes, 10 * 4096);
    assert_eq!(info.free_bytes, 0);
    // The budget has room, the device has not.
    match dev.alloc(2, 4096) {
        Err(TierError::DeviceOutOfMemory { free_bytes: 0, .. }) => {}
        other => panic!("expected DeviceOutOfMemory, got {other:?}"),
    }
    assert_eq!(dev.budget().used_bytes(), 4 * 4096);
    // A budget over the device is refused.
    assert!(matches!(
        dev.set_budget_capacity(11 * 4096),
        Err(TierError::BudgetExceedsDevice { .. })
    ));
}

#[test]
fn auto_without_gpu_is_the_simulation() {
    let dev = Device::auto(&DeviceConfig::new(1 << 20)).unwrap();
    // Where a GPU and the `cuda` feature exist this is a real device; both are fine.
    if dev.kind() == DeviceKind::Sim {
        assert_eq!(dev.budget().capacity_bytes(), 1 << 20);
    }
}

#[test]
fn host_tier_buffers_round_trip_through_the_device() {
    let mut dev = sim(4 << 20, 4, None);
    let host = HostTier::new(4 * CHUNK as u64 + 100, CHUNK, &dev).unwrap();
    assert!(!host.is_pinned(), "nothing to pin in the simulation");
    let mut buf = host.try_take(1, CHUNK as u64).unwrap();
    buf[..CHUNK].copy_from_slice(&pattern(1, CHUNK));
    let mem = dev.alloc(1, CHUNK).unwrap();
    let id = dev.copy_to_device(1, buf, mem, CHUNK);
    let c = dev.wait_copy_id(id).unwrap();
    c.result.unwrap();
    let mut buf = c.host;
    buf.fill(0xAA);
    let id = dev.copy_to_host(1, c.mem, buf, CHUNK);
    let c = dev.wait_copy_id(id).unwrap();
    c.result.unwrap();
    assert_eq!(&c.host[..CHUNK], &pattern(1, CHUNK)[..]);
    host.give_back(c.host);
    assert_eq!(host.available(), host.buffers());
}

/// The simulated device has a copy worker per direction, as a GPU has a copy stream (and
/// engine) per direction: an eviction's device-to-host copy runs while a prefetch's
/// host-to-device copy does, each at the full link rate, instead of after it.
#[test]
fn copies_in_opposite_directions_overlap() {
    const LEN: usize = 4 << 20;
    const RATE: u64 = 50 << 20; // 50 MiB/s: each copy takes 80 ms
    let mut dev = sim(2 * LEN as u64, 4, Some(RATE));
    let evicted = dev.alloc(1, LEN).unwrap();
    let fetched = dev.alloc(2, LEN).unwrap();
    let start = std::time::Instant::now();
    let out = dev.copy_to_host(1, evicted, AlignedBuf::new_zeroed(LEN).unwrap(), LEN);
    let inc = dev.copy_to_device(2, AlignedBuf::new_zeroed(LEN).unwrap(), fetched, LEN);
    // Completions still come back in submission order.
    let first = dev.wait_copy().unwrap();
    let second = dev.wait_copy().unwrap();
    let elapsed = start.elapsed();
    assert_eq!((first.id, second.id), (out, inc));
    first.result.unwrap();
    second.result.unwrap();
    let one = Duration::from_secs_f64(LEN as f64 / RATE as f64);
    assert!(elapsed >= one, "{elapsed:?}: faster than the link");
    assert!(
        elapsed < one.mul_f64(1.6),
        "{elapsed:?}: the two directions ran one after the other ({one:?} each)"
    );
}
