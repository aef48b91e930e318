//! Guards against a store that starts training with budgets that cannot work: a device
//! budget below one access's chunk, a host pool that cannot stage a chunk, a model
//! larger than host + NVMe. Each is refused at open, before the host pool or the swap
//! file exists, with the bytes needed and available in the error.

mod common;

use common::*;
use tidestore_chunk::{ChunkError, ChunkStore, DType};
use tidestore_tiers::TierKind;

fn layout8() -> tidestore_chunk::Layout {
    // 8 frozen f16 tensors of 2048 elements: 8 param16 chunks of 4096 bytes.
    layout(2048, &[(2048, false); 8], DType::F16)
}

#[test]
fn device_budget_below_one_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(4095, 4 * 4096, nvme_dir(&dir, 16 * 4096));
    let e = ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap_err();
    assert_eq!(
        e,
        ChunkError::BudgetTooSmall {
            tier: TierKind::Device,
            what: "the largest chunk (one access)",
            needed_bytes: 4096,
            available_bytes: 4095,
            short_bytes: 1,
        }
    );
    assert!(e.to_string().contains("needs 4096 bytes"), "{e}");
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "no swap file made"
    );
}

#[test]
fn device_budget_below_the_working_set() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(2 * 4096, 8 * 4096, nvme_dir(&dir, 16 * 4096)).with_working_set_chunks(3);
    let e = ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap_err();
    assert!(
        matches!(
            e,
            ChunkError::BudgetTooSmall {
                tier: TierKind::Device,
                needed_bytes: 12288,
                available_bytes: 8192,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn host_pool_cannot_stage() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(4 * 4096, 4096 + 100, nvme_dir(&dir, 16 * 4096));
    let e = ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap_err();
    assert_eq!(
        e,
        ChunkError::BudgetTooSmall {
            tier: TierKind::Host,
            what: "the chunks one moment may use on the host plus one staging buffer",
            needed_bytes: 8192,
            available_bytes: 4196,
            short_bytes: 3996,
        }
    );
}

#[test]
fn model_larger_than_host_plus_nvme() {
    let dir = tempfile::tempdir().unwrap();
    // 8 chunks + 1 staging slot = 9 slots; host 3 + NVMe 5 = 8.
    let cfg = config(4 * 4096, 3 * 4096, nvme_dir(&dir, 5 * 4096));
    let e = ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap_err();
    assert_eq!(
        e,
        ChunkError::ModelTooLarge {
            chunks: 8,
            slot_bytes: 4096,
            needed_bytes: 9 * 4096,
            host_bytes: 3 * 4096,
            nvme_bytes: 5 * 4096,
            available_bytes: 8 * 4096,
            short_bytes: 4096,
        }
    );
    let msg = e.to_string();
    assert!(msg.contains("36864") && msg.contains("32768"), "{msg}");
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "no swap file made"
    );
    // One more NVMe slot and it opens.
    let cfg = config(4 * 4096, 3 * 4096, nvme_dir(&dir, 6 * 4096));
    ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap();
}

#[test]
fn device_budget_above_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(1 << 21, 4 * 4096, nvme_dir(&dir, 16 * 4096));
    let e = ChunkStore::open(layout8(), cfg, sim_device(1 << 20)).unwrap_err();
    assert!(
        matches!(
            e,
            ChunkError::Config {
                key: "store.device_budget",
                ..
            }
        ),
        "{e}"
    );
}
