//! Helpers shared by the store's integration tests.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, MoveEvent, MoveKind, MoveReason, NvmeSource,
    StoreConfig, TensorSpec,
};
use tidestore_io::IoConfig;
use tidestore_tiers::{Device, DeviceConfig};

/// A simulated device of `total_bytes` (its budget starts at all of it).
pub fn sim_device(total_bytes: u64) -> Device {
    Device::sim(&DeviceConfig::new(total_bytes)).expect("simulated device")
}

/// Small blocks, so tiny chunks still go through the real engine.
pub fn io_cfg() -> IoConfig {
    IoConfig {
        block_bytes: 16 * 1024,
        queue_depth: 8,
        threads: 2,
        ..IoConfig::default()
    }
}

pub fn nvme_dir(dir: &tempfile::TempDir, bytes: u64) -> NvmeSource {
    NvmeSource::Dir {
        dir: dir.path().to_path_buf(),
        bytes,
        io: io_cfg(),
    }
}

/// Distinct bytes per (tensor, list, version).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `n` tensors of the given element counts, f16, trainable per flag.
pub fn layout(chunk_elements: u64, tensors: &[(u64, bool)], dtype: DType) -> Layout {
    Layout::new(
        LayoutConfig::new(chunk_elements),
        tensors.iter().enumerate().map(|(i, &(n, trainable))| {
            TensorSpec::new(format!("t{i}"), &[n as usize], dtype, trainable)
        }),
    )
    .expect("layout")
}

/// Everything a move hook saw that breaks a rule, plus counts.
#[derive(Debug, Default)]
pub struct Watch {
    pub moves: u64,
    pub violations: Vec<String>,
    pub kinds: Vec<MoveKind>,
}

/// A hook that records every move and checks, at each one, that every tier is within
/// its budget and that a prefetch (device or host tier) never evicted a chunk needed
/// sooner than (or as soon as) the chunk it brings.
pub fn watch(store: &mut ChunkStore) -> Arc<Mutex<Watch>> {
    let w = Arc::new(Mutex::new(Watch::default()));
    let w2 = w.clone();
    store.set_move_hook(Some(Box::new(move |e: &MoveEvent| {
        let mut w = w2.lock().unwrap();
        w.moves += 1;
        if w.kinds.len() < 100_000 {
            w.kinds.push(e.kind);
        }
        for (name, u) in [
            ("device", e.usage.device),
            ("host", e.usage.host),
            ("nvme", e.usage.nvme),
        ] {
            if u.used_bytes > u.capacity_bytes {
                w.violations.push(format!(
                    "{name} over budget after {:?} of {}: {} > {}",
                    e.kind, e.chunk, u.used_bytes, u.capacity_bytes
                ));
            }
        }
        if let MoveReason::Prefetch {
            needed_at,
            victim_next_use,
            for_chunk,
        } = e.reason
        {
            if matches!(
                e.kind,
                MoveKind::DropDevice
                    | MoveKind::DeviceToHost
                    | MoveKind::DropHost
                    | MoveKind::HostToNvme
            )
                && e.chunk != for_chunk
                && victim_next_use <= needed_at
            {
                w.violations.push(format!(
                    "prefetch of {for_chunk} (needed at {needed_at}) evicted {} needed at {victim_next_use}",
                    e.chunk
                ));
            }
        }
    })));
    w
}

pub fn config(device: u64, host: u64, nvme: NvmeSource) -> StoreConfig {
    StoreConfig::new(device, host, nvme)
}
