//! Guards the CUDA backend where a GPU exists: bytes round-trip exactly through the copy
//! stream with several copies in flight from a pinned host pool, and memory info is
//! sane. Without a driver or GPU (or without the `cuda` feature) it prints why it is
//! skipped and passes.

use tidestore_tiers::{Device, DeviceConfig, DeviceView, HostTier, TierError};

fn cuda_or_skip(budget_bytes: u64) -> Option<Device> {
    match Device::cuda(&DeviceConfig::new(budget_bytes)) {
        Ok(d) => Some(d),
        Err(TierError::NoGpu { reason }) => {
            println!("skipped: no CUDA driver: {reason}");
            None
        }
        Err(TierError::NotCompiledWithCuda) => {
            println!("skipped: no CUDA driver: built without the `cuda` feature");
            None
        }
        Err(e) => panic!("opening the GPU failed: {e}"),
    }
}

#[test]
fn cuda_round_trip_from_pinned_pool() {
    const CHUNK: usize = 4 << 20;
    const N: u64 = 6;
    let Some(mut dev) = cuda_or_skip(N * CHUNK as u64) else {
        return;
    };
    let host = HostTier::new(2 * N * CHUNK as u64, CHUNK, &dev).unwrap();
    assert!(host.is_pinned());
    let info = dev.mem_info().unwrap();
    assert!(info.free_bytes <= info.total_bytes);
    let _ = dev.non_model_bytes().unwrap();

    let mut ids = Vec::new();
    for chunk in 0..N {
        let mut buf = host.try_take(chunk, CHUNK as u64).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i as u64 ^ chunk.wrapping_mul(131)) as u8;
        }
        let mem = dev.alloc(chunk, CHUNK).unwrap();
        assert!(matches!(mem.view(), DeviceView::Cuda(_)));
        ids.push(dev.copy_to_device(chunk, buf, mem, CHUNK));
    }
    let mut back = Vec::new();
    for id in ids {
        let c = dev.wait_copy_id(id).unwrap();
        c.result.unwrap();
        let out = host.try_take(c.chunk, CHUNK as u64).unwrap();
        back.push(dev.copy_to_host(c.chunk, c.mem, out, CHUNK));
        host.give_back(c.host);
    }
    dev.synchronize().unwrap();
    for id in back {
        let c = dev.wait_copy_id(id).unwrap();
        c.result.unwrap();
        for (i, b) in c.host[..CHUNK].iter().enumerate() {
            assert_eq!(*b, (i as u64 ^ c.chunk.wrapping_mul(131)) as u8);
        }
    }
    assert_eq!(dev.budget().used_bytes(), 0);
    assert_eq!(dev.link_stats().host_to_device_bytes, N * CHUNK as u64);
}

/// On a GPU: chunk memory is blocks of the slab (no driver allocation per chunk, so the
/// driver's free memory does not move and the measured non-model memory neither, for
/// chunk sizes that are not multiples of the 2 MiB granularity), reported non-model
/// memory adds to what is measured, and copies in both directions at once (two copy
/// streams) keep their bytes.
#[test]
fn cuda_chunks_live_in_the_slab_and_non_model_memory_holds_still() {
    const CHUNK: usize = (3 << 20) + 1000; // not a multiple of 2 MiB, nor of a page
    const N: u64 = 4;
    let Some(mut dev) = cuda_or_skip(2 * N * (4 << 20)) else {
        return;
    };
    let (base, slab) = (dev.slab_base_addr(), dev.slab_bytes());
    let free_before = dev.mem_info().unwrap().free_bytes;
    let non_model_before = dev.non_model_bytes().unwrap();
    let mut mems = Vec::new();
    for chunk in 0..N {
        let mem = dev.alloc(chunk, CHUNK).unwrap();
        let DeviceView::Cuda(span) = mem.view() else {
            panic!("CUDA memory expected")
        };
        assert!(span.ptr() >= base && span.ptr() + CHUNK as u64 <= base + slab);
        mems.push(mem);
        assert_eq!(dev.non_model_bytes().unwrap(), non_model_before);
    }
    assert_eq!(dev.slab_stats().overflow_allocs, 0);
    dev.report_non_model_bytes(12345);
    assert_eq!(dev.non_model_bytes().unwrap(), non_model_before + 12345);
    dev.report_non_model_bytes(0);
    // Both directions in flight at once.
    let pattern = |chunk: u64, i: usize| (i as u64 ^ chunk.wrapping_mul(77)) as u8;
    let mut ids = Vec::new();
    for (chunk, mem) in mems.drain(..).enumerate() {
        let chunk = chunk as u64;
        let mut buf = tidestore_io::AlignedBuf::new_zeroed(CHUNK).unwrap();
        for (i, b) in buf[..CHUNK].iter_mut().enumerate() {
            *b = pattern(chunk, i);
        }
        ids.push(dev.copy_to_device(chunk, buf, mem, CHUNK));
    }
    let mut back = Vec::new();
    for id in ids {
        let c = dev.wait_copy_id(id).unwrap();
        c.result.unwrap();
        let out = tidestore_io::AlignedBuf::new_zeroed(CHUNK).unwrap();
        back.push(dev.copy_to_host(c.chunk, c.mem, out, CHUNK));
    }
    for id in back {
        let c = dev.wait_copy_id(id).unwrap();
        c.result.unwrap();
        assert!(c.host[..CHUNK]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(c.chunk, i)));
    }
    assert_eq!(dev.budget().used_bytes(), 0);
    let free_after = dev.mem_info().unwrap().free_bytes;
    assert_eq!(
        free_after, free_before,
        "chunk moves changed the device's free memory"
    );
}
