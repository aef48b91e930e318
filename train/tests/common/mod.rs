//! Helpers shared by the train crate's integration tests: small stores over a real swap
//! file, with host budgets small enough that chunks spill to NVMe.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, NvmeSource, StoreConfig, TensorId,
    TensorSpec,
};
use tidestore_io::IoConfig;
use tidestore_optimizer::{ControllerState, LossScalerState};
use tidestore_tiers::{Device, DeviceConfig};
use tidestore_train::checkpoint::CHECKPOINT_LISTS;
use tidestore_train::{CheckpointState, ParamSpec, Trainer, TrainerConfig};

/// Slots per chunk of the test layouts.
pub const CHUNK_ELEMENTS: u64 = 1024;

/// A model of mixed tensors over several chunks: trainable bf16 and fp32 tensors (the
/// fp32 one gets a bf16 compute copy and a master), an odd-length one, a frozen fp32
/// tensor (kept fp32 in Params) and a frozen f16 one.
pub fn mixed_specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed.weight", &[16, 64], DType::BF16, true),
        TensorSpec::new("layers.0.w", &[32, 32], DType::F32, true),
        TensorSpec::new("layers.0.b", &[33], DType::BF16, true),
        TensorSpec::new("norm.frozen", &[8, 16], DType::F32, false),
        TensorSpec::new("rope.frozen", &[100], DType::F16, false),
        TensorSpec::new("head.weight", &[2, 256], DType::BF16, true),
    ]
}

pub fn layout(specs: Vec<TensorSpec>) -> Layout {
    Layout::new(LayoutConfig::new(CHUNK_ELEMENTS), specs).expect("layout")
}

/// Small blocks, so tiny chunks still go through the real I/O engine.
pub fn io_cfg() -> IoConfig {
    IoConfig {
        block_bytes: 16 * 1024,
        queue_depth: 8,
        threads: 2,
        ..IoConfig::default()
    }
}

/// A store over a swap file in `dir` whose device and host tiers hold two chunks each
/// (the largest chunk, fp32): everything else lives on NVMe.
pub fn open_store(dir: &Path, layout: Layout) -> ChunkStore {
    std::fs::create_dir_all(dir).unwrap();
    let slot = layout.chunk_bytes(ListKind::Master);
    let nvme = NvmeSource::Dir {
        dir: dir.to_path_buf(),
        bytes: 64 * slot,
        io: io_cfg(),
    };
    let cfg = StoreConfig::new(2 * slot, 2 * slot, nvme);
    let device = Device::sim(&DeviceConfig::new(2 * slot)).expect("simulated device");
    ChunkStore::open(layout, cfg, device).expect("store")
}

/// Distinct bytes per seed.
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

/// Every tensor of the store.
pub fn all_tensors(store: &ChunkStore) -> Vec<TensorId> {
    (0..store.layout().tensors().len() as u32)
        .map(TensorId)
        .collect()
}

/// Writes distinct bytes (from `seed`) into every checkpointed list of every tensor.
pub fn fill(store: &mut ChunkStore, seed: u64) {
    for t in all_tensors(store) {
        for list in CHECKPOINT_LISTS {
            if let Some(loc) = store.layout().location(t, list) {
                let s = seed ^ (u64::from(t.0) << 8) ^ list as u64;
                store
                    .write(t, list, &pattern(s, loc.bytes() as usize))
                    .unwrap();
            }
        }
    }
}

/// Every checkpointed list of every tensor, as bytes.
pub fn snapshot(store: &mut ChunkStore) -> BTreeMap<(u32, ListKind), Vec<u8>> {
    let mut out = BTreeMap::new();
    for t in all_tensors(store) {
        for list in CHECKPOINT_LISTS {
            if store.layout().location(t, list).is_some() {
                out.insert((t.0, list), store.read(t, list).unwrap());
            }
        }
    }
    out
}

pub fn state(step: u64) -> CheckpointState {
    CheckpointState {
        controller: ControllerState {
            step,
            loss_scaler: Some(LossScalerState {
                scale: 32768.0,
                good_steps: 17,
            }),
        },
        metadata: BTreeMap::from([
            ("data.cursor".to_string(), "123456".to_string()),
            ("run".to_string(), "test \"quoted\" ünïcode".to_string()),
        ]),
    }
}

pub mod hf;

/// A trainer opened with `cfg` over trainable parameters `p0`, `p1`, ... of `shapes`,
/// their values set to a fixed pattern.
pub fn pattern_trainer(cfg: &TrainerConfig, shapes: &[&[usize]]) -> Trainer {
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("p{i}"), s, true))
        .collect();
    let mut t = Trainer::open(&specs, cfg).unwrap();
    for (i, shape) in shapes.iter().enumerate() {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|k| ((k * 7 + i) % 13) as f32 * 0.1 - 0.6)
            .collect();
        t.set_values(i, &v).unwrap();
    }
    t
}

/// Every trainable parameter's master, M and V, bit for bit.
pub fn state_bits(t: &mut Trainer) -> Vec<Vec<u32>> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    (0..t.len())
        .flat_map(|i| {
            let (m, v) = t.moments(i).unwrap();
            [bits(t.values(i).unwrap()), bits(m), bits(v)]
        })
        .collect()
}
