//! A GPT-style training trace through the real chunk store: the simulated device, a real
//! pinned host pool and a real NVMe swap file in a temp dir.
//!
//! Model: 24 layers, hidden 512, vocabulary 8192 (4 row blocks), 512 positions, fp16,
//! trainable; laid out with the searched chunk size (64 KiB I/O blocks). One iteration:
//! forward over the tensors in model order (device access, read-only, release to
//! HOLD_AFTER_FWD), then backward in reverse (device access; the gradient is written
//! into the parameter's space, so the chunk changes on the device; release to
//! HOLD_AFTER_BWD). The host pool holds a quarter of the param16 bytes; NVMe the rest.
//!
//! For device budgets of 25, 50 and 75 % of the param16 bytes and the policies
//! `lifetime`, `lru`, `fifo` (no prefetch) and `lifetime` with 8 moments of prefetch:
//! one traced warm-up iteration, then every chunk off the device and the counters reset,
//! then two measured iterations. Printed: bytes per link and direction, device
//! evictions, stall time, prefetch hits, and what `chunk::sim` predicts for the device
//! tier (bytes loaded host->device) on the same two iterations.
//!
//! Run: `cargo run --release -p tidestore-chunk --example store_trace`

use std::sync::Arc;

use tidestore_chunk::{
    gpt_trace, offline_belady, simulate, ChunkStore, Fifo, GptShape, Horizon, LayoutConfig,
    Lifetime, ListKind, Lru, NvmeSource, Place, PolicyKind, SearchConfig, StoreConfig, TensorId,
    TensorState,
};
use tidestore_tiers::{Device, DeviceConfig};

const GIB: f64 = (1u64 << 30) as f64;
const MEASURED: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = GptShape {
        layers: 24,
        hidden: 512,
        vocab: 8192,
        positions: 512,
        ffn_mult: 4,
        dtype: tidestore_chunk::DType::F16,
        trainable: true,
        vocab_shards: 4,
    };
    let gpt = gpt_trace(
        &shape,
        LayoutConfig::new(1),
        &SearchConfig::new(1 << 16),
        false,
    )?;
    let layout = gpt.layout;
    let n = layout.tensors().len() as u32;
    let chunk_bytes = layout.chunk_bytes(ListKind::Params);
    let param16 = layout.list_bytes(ListKind::Params);
    println!(
        "model: {} layers, {} tensors; {} param16 chunks of {:.2} MiB = {:.3} GiB \
         (waste {:.2} %)",
        shape.layers,
        n,
        layout.list_chunk_count(ListKind::Params),
        chunk_bytes as f64 / (1 << 20) as f64,
        param16 as f64 / GIB,
        100.0 * gpt.search.chosen.waste_fraction
    );
    // Only the param16 list is used: a frozen-optimizer view of fwd+bwd. The store
    // needs the layout's other lists to exist only if they are accessed; keep them (the
    // host + NVMe check counts them).
    let total_chunks = layout
        .dense_chunk_bytes()
        .iter()
        .filter(|&&b| b > 0)
        .count() as u64;
    let slot = tidestore_io::align_up(layout.chunk_bytes(ListKind::Master) as usize) as u64;
    let repeated = gpt.iteration.repeat(MEASURED);
    let schedule = Arc::new(gpt.iteration.schedule());
    println!(
        "trace: {} moments per iteration (forward + backward), {} measured iterations after \
         a traced warm-up\n",
        gpt.iteration.len(),
        MEASURED
    );
    println!(
        "{:>4} {:>6} {:>12} | {:>7} {:>7} {:>7} {:>7} | {:>6} {:>9} {:>8} | {:>9}",
        "dev%",
        "GiB",
        "policy",
        "h->d",
        "d->h",
        "nvme->h",
        "h->nvme",
        "evict",
        "stall ms",
        "pf hits",
        "sim h->d"
    );
    for pct in [25u64, 50, 75] {
        let device_bytes = param16 * pct / 100;
        let device_bytes = device_bytes / 4096 * 4096;
        let host_bytes = (param16 / 4).max(4 * slot);
        for (name, policy, lookahead) in [
            ("lifetime", PolicyKind::Lifetime, 0u32),
            ("lru", PolicyKind::Lru, 0),
            ("fifo", PolicyKind::Fifo, 0),
            ("lifetime+pf", PolicyKind::Lifetime, 8),
        ] {
            let dir = tempfile::tempdir()?;
            let nvme_bytes = (total_chunks + 2) * slot;
            let cfg = StoreConfig::new(
                device_bytes,
                host_bytes,
                NvmeSource::Dir {
                    dir: dir.path().to_path_buf(),
                    bytes: nvme_bytes,
                    io: tidestore_io::IoConfig::default(),
                },
            )
            .with_policy(policy)
            .with_prefetch(lookahead);
            let device = Device::sim(&DeviceConfig::new(device_bytes))?;
            let mut store = ChunkStore::open(layout.clone(), cfg, device)?;
            for iteration in 0..=MEASURED {
                for t in 0..n {
                    let g = store.access(TensorId(t), ListKind::Params, Place::Device)?;
                    std::hint::black_box(store.bytes(&g)?.first());
                    store.release(g, TensorState::HoldAfterFwd)?;
                }
                for t in (0..n).rev() {
                    let g = store.access(TensorId(t), ListKind::Params, Place::Device)?;
                    // The gradient lands in the parameter's space.
                    if let Some(b) = store.bytes_mut(&g)?.first_mut() {
                        *b = b.wrapping_add(1);
                    }
                    store.release(g, TensorState::HoldAfterBwd)?;
                }
                store.end_iteration()?;
                if iteration == 0 {
                    store.evict_device_all()?;
                    store.reset_stats();
                }
            }
            store.sync()?;
            let s = store.stats();
            let predicted = match name {
                "lru" => simulate(&repeated, device_bytes, &mut Lru::new(), None)?,
                "fifo" => simulate(&repeated, device_bytes, &mut Fifo::new(), None)?,
                _ => {
                    let life = simulate(
                        &repeated,
                        device_bytes,
                        &mut Lifetime::new(schedule.clone(), Horizon::Cyclic),
                        None,
                    )?;
                    debug_assert_eq!(
                        life.bytes_in,
                        offline_belady(&repeated, device_bytes)?.bytes_in
                    );
                    life
                }
            };
            println!(
                "{:>3}% {:>6.3} {:>12} | {:>7.3} {:>7.3} {:>7.3} {:>7.3} | {:>6} {:>9.1} {:>8} | {:>9.3}{}",
                pct,
                device_bytes as f64 / GIB,
                name,
                s.host_to_device_bytes as f64 / GIB,
                s.device_to_host_bytes as f64 / GIB,
                s.nvme_to_host_bytes as f64 / GIB,
                s.host_to_nvme_bytes as f64 / GIB,
                s.device_evictions,
                s.stall_ns as f64 / 1e6,
                s.prefetch_hits,
                predicted.bytes_in as f64 / GIB,
                if lookahead > 0 { " (demand-only sim)" } else { "" }
            );
        }
    }
    println!("\nGiB moved per link over the measured iterations; peaks never exceed budgets.");
    Ok(())
}
