//! Bytes moved by the `lifetime`, `lru` and `fifo` policies on a GPT-style trace.
//!
//! GPT-2 XL (48 layers, hidden 1600, fp16, full fine-tuning; embedding and head
//! registered as 8 vocabulary row blocks so that the 154 MiB embedding does not force
//! chunks that large) is laid out with the searched chunk size (1 MiB I/O blocks). Two
//! traces, each replayed for three iterations:
//! - `fwd+bwd`: forward over the layers then backward in reverse, one moment per tensor
//!   access, using the tensor's Params chunk; budgets are shares of the Params bytes.
//! - `fwd+bwd+step`: the same, then the optimizer step, one moment per chunk group
//!   (param16, master, M, V chunks together); budgets are shares of all four lists.
//!
//! Each policy runs with and without prefetch (16 moments of look-ahead, at most 1 GiB
//! of chunks ahead). `lifetime`
//! knows one traced iteration (cyclic horizon); the offline Belady figure sees the
//! whole trace. Bytes moved = bytes loaded + bytes evicted.
//!
//! Run: `cargo run --release -p tidestore-chunk --example policy_bytes`

use std::sync::Arc;

use tidestore_chunk::{
    gpt_trace, offline_belady, simulate, EvictionPolicy, Fifo, GptShape, Horizon, LayoutConfig,
    Lifetime, ListKind, Lru, Prefetch, PrefetchPlanner, SearchConfig,
};

const GIB: f64 = (1u64 << 30) as f64;
const ITERATIONS: usize = 3;
const LOOKAHEAD_MOMENTS: u32 = 16;
const LOOKAHEAD_BYTES_MAX: u64 = 1 << 30;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = GptShape::gpt2_xl().with_vocab_shards(8);
    for optimizer_step in [false, true] {
        let gpt = gpt_trace(
            &shape,
            LayoutConfig::new(1),
            &SearchConfig::new(1 << 20),
            optimizer_step,
        )?;
        let layout = &gpt.layout;
        let s = &gpt.search;
        let chunk_bytes = layout.chunk_bytes(ListKind::Params);
        if !optimizer_step {
            let params: u64 = layout
                .tensors()
                .iter()
                .map(|t| t.elements().unwrap_or(0))
                .sum();
            println!(
                "model: GPT-2 XL-like, {} layers, {} tensors, {:.2} B parameters",
                shape.layers,
                layout.tensors().len(),
                params as f64 / 1e9
            );
            println!(
                "chunk search: {} candidates in [{}, {}] elements (step {}); chosen {} elements \
                 = {:.1} MiB per param16 chunk; waste {:.3} GiB ({:.2} %) over all lists",
                s.candidates_considered,
                s.min_elements,
                s.max_elements,
                s.step_elements,
                s.chosen.chunk_elements,
                chunk_bytes as f64 / (1 << 20) as f64,
                s.chosen.waste_bytes as f64 / GIB,
                100.0 * s.chosen.waste_fraction
            );
            println!(
                "chunks per list: {}; param16 {:.2} GiB, all lists {:.2} GiB",
                layout.chunks_per_list(),
                layout.list_bytes(ListKind::Params) as f64 / GIB,
                layout.total_bytes() as f64 / GIB
            );
        }
        let (name, whole) = if optimizer_step {
            ("fwd+bwd+step", layout.total_bytes())
        } else {
            ("fwd+bwd", layout.list_bytes(ListKind::Params))
        };
        let trace = gpt.iteration.repeat(ITERATIONS);
        let schedule = Arc::new(gpt.iteration.schedule());
        println!();
        println!(
            "trace {name}: {} moments per iteration x {ITERATIONS} iterations; GiB moved \
             (GiB loaded on demand, for +pf)",
            gpt.iteration.len()
        );
        println!(
            "{:>7} {:>7} | {:>8} {:>8} {:>8} | {:>12} {:>12} {:>12} | {:>8}",
            "budget",
            "GiB",
            "lifetime",
            "lru",
            "fifo",
            "lifetime+pf",
            "lru+pf",
            "fifo+pf",
            "belady"
        );
        for pct in [25u64, 50, 75] {
            let budget = whole * pct / 100;
            let mut row = Vec::new();
            for prefetch in [false, true] {
                for policy_name in ["lifetime", "lru", "fifo"] {
                    let mut policy: Box<dyn EvictionPolicy> = match policy_name {
                        "lifetime" => Box::new(Lifetime::new(schedule.clone(), Horizon::Cyclic)),
                        "lru" => Box::new(Lru::new()),
                        _ => Box::new(Fifo::new()),
                    };
                    let pf = prefetch.then_some(Prefetch {
                        schedule: &schedule,
                        planner: PrefetchPlanner::new(LOOKAHEAD_MOMENTS, Horizon::Cyclic)
                            .with_lookahead_bytes_max(LOOKAHEAD_BYTES_MAX),
                    });
                    let r = simulate(&trace, budget, policy.as_mut(), pf)?;
                    let moved = r.bytes_moved() as f64 / GIB;
                    row.push(if prefetch {
                        format!("{moved:.1} ({:.1})", r.demand_bytes_in as f64 / GIB)
                    } else {
                        format!("{moved:.1}")
                    });
                }
            }
            let opt = offline_belady(&trace, budget)?;
            println!(
                "{:>6}% {:>7.2} | {:>8} {:>8} {:>8} | {:>12} {:>12} {:>12} | {:>8.1}",
                pct,
                budget as f64 / GIB,
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                row[5],
                opt.bytes_moved() as f64 / GIB
            );
        }
    }
    Ok(())
}
