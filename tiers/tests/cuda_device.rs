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
        let mut buf = host.try_take(chunk).unwrap();
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
        let out = host.try_take(c.chunk).unwrap();
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
