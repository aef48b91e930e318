//! Data parallelism in the Rust trainer, with ranks as threads of this test over the
//! train crate's in-process group: two ranks, each training on its half of every batch,
//! must train as one rank on the whole batch — the same losses (the ranks' mean) and
//! weights to 1e-5 relative, fp32 — full and LoRA, a tied head, with and without
//! overlap, with clipping; each rank's store holds half of the optimizer state; the
//! collectives move the bytes Gemini's layout predicts.

mod common;

use std::time::Duration;

use candle_core::{Device, Tensor};
use common::*;
use tidestore_candle::{train_step, Llama, ParamSpec, Precision, TideParams};
use tidestore_train::ranks::local;
use tidestore_train::MicroBatchOrder::Vertical;
use tidestore_train::{Blocks, Overlap, OverlapStats, Ranks, SentBytes};

const STEPS: u64 = 5;

/// One way of training the model.
#[derive(Debug, Clone, Copy)]
struct Case {
    tie: bool,
    lora: bool,
    overlap: Overlap,
    clip: Option<f32>,
    /// bf16 compute (`Precision::Bf16`), else fp32.
    bf16: bool,
    /// Collectives in flight beside compute ([`Ranks::with_ahead`]).
    ahead: usize,
}

/// What one run gave: per step the loss (the ranks' mean), the weights at the end, and
/// per rank its trainer's counters and what its collectives sent.
type Counters = std::collections::BTreeMap<&'static str, u64>;

struct Run {
    losses: Vec<f32>,
    weights: Vec<Vec<f32>>,
    counters: Vec<Counters>,
    sent: Vec<SentBytes>,
    overlapped: Vec<OverlapStats>,
}

fn config(dir: &std::path::Path, case: Case) -> tidestore_candle::TideConfig {
    let precision = if case.bf16 {
        Precision::Bf16
    } else {
        Precision::F32
    };
    let mut cfg = tide_config(dir, precision);
    cfg.overlap = case.overlap;
    cfg.max_grad_norm = case.clip;
    cfg
}

/// Rank `rank` of `world` (`None`: the only one) trains `case` for [`STEPS`] steps,
/// each on its `1/world` of the batch's rows.
fn train_rank(
    model: &Llama,
    init: &[(ParamSpec, Vec<f32>)],
    case: Case,
    ranks: Option<Ranks>,
) -> (Vec<f32>, Vec<Vec<f32>>, Counters, SentBytes, OverlapStats) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), case);
    let specs: Vec<ParamSpec> = init.iter().map(|(s, _)| s.clone()).collect();
    let (rank, world) = ranks.as_ref().map_or((0, 1), |r| (r.rank(), r.world()));
    let mut p = match ranks.clone() {
        Some(r) => TideParams::open_sharded(&specs, &cfg, &Device::Cpu, r).unwrap(),
        None => TideParams::open_specs(&specs, &cfg, &Device::Cpu).unwrap(),
    };
    for (s, v) in init {
        p.set_param(&s.name, v).unwrap();
    }
    let data = batches();
    let losses = (0..STEPS)
        .map(|s| {
            let (x, y) = data.get(s, &Device::Cpu).unwrap();
            let rows = x.dim(0).unwrap() / world;
            let mine = |t: &Tensor| t.narrow(0, rank * rows, rows).unwrap();
            let step = train_step(&mut p, model, &[(mine(&x), mine(&y))], Vertical).unwrap();
            step.loss
        })
        .collect();
    // What the steps sent, before the weights are gathered to be compared.
    let sent = ranks.map(|r| r.sent()).unwrap_or_default();
    let overlapped = p.overlap_stats().unwrap_or_default();
    let weights = init
        .iter()
        .map(|(s, _)| p.values(&s.name).unwrap())
        .collect();
    (losses, weights, p.trainer().counters(), sent, overlapped)
}

/// `case` on `world` ranks (1: without a group).
fn run(case: Case, world: usize) -> Run {
    let model = llama(case.tie, case.lora);
    let init = model.init(21);
    if world == 1 {
        let (losses, weights, counters, sent, overlapped) = train_rank(&model, &init, case, None);
        return Run {
            losses,
            weights,
            counters: vec![counters],
            sent: vec![sent],
            overlapped: vec![overlapped],
        };
    }
    let group = local::group(world, Duration::from_secs(60));
    let per_rank: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                let (model, init) = (&model, &init);
                s.spawn(move || {
                    let ranks = Ranks::new(Box::new(g)).unwrap().with_ahead(case.ahead);
                    train_rank(model, init, case, Some(ranks))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let steps = per_rank[0].0.len();
    let losses = (0..steps)
        .map(|k| per_rank.iter().map(|r| r.0[k]).sum::<f32>() / world as f32)
        .collect();
    // Every rank gathers the same whole weights.
    for r in &per_rank[1..] {
        assert!(r.1 == per_rank[0].1, "the ranks' weights differ");
    }
    Run {
        losses,
        weights: per_rank[0].1.clone(),
        counters: per_rank.iter().map(|r| r.2.clone()).collect(),
        sent: per_rank.iter().map(|r| r.3).collect(),
        overlapped: per_rank.iter().map(|r| r.4).collect(),
    }
}

/// Two ranks against one with the doubled batch: losses and weights within 1e-5.
fn two_ranks_equal_one(case: Case) -> (Run, Run) {
    let (one, two) = (run(case, 1), run(case, 2));
    eprintln!(
        "{case:?}\n one rank:  {:?}\n two ranks: {:?}",
        one.losses, two.losses
    );
    // fp32: the 1e-5 on the losses; bf16 (16-bit parameters and gradients):
    // 1e-3, its bound for mixed precision.
    let (loss_tol, weight_tol) = if case.bf16 {
        (1e-3, 1e-2)
    } else {
        (1e-5, 1e-4)
    };
    let d = max_rel_diff(&one.losses, &two.losses);
    assert!(
        d <= loss_tol,
        "{case:?}: max relative loss difference {d:e}"
    );
    for (a, b) in one.weights.iter().zip(&two.weights) {
        let d = max_rel_diff(a, b);
        assert!(
            d <= weight_tol,
            "{case:?}: max relative weight difference {d:e}"
        );
    }
    assert!(
        one.losses[STEPS as usize - 1] < one.losses[0],
        "{case:?}: it learns"
    );
    (one, two)
}

const FULL: Case = Case {
    tie: false,
    lora: false,
    overlap: Overlap::Off,
    clip: None,
    bf16: false,
    ahead: 8,
};

/// Bytes one rank sends into a ring collective of a parameter of `n` elements over two
/// ranks: the other rank's shard.
fn ring(n: usize) -> u64 {
    (n.div_ceil(2) * 4) as u64
}

#[test]
fn two_ranks_train_the_full_model_as_one_with_the_doubled_batch() {
    let (one, two) = two_ranks_equal_one(FULL);
    let model = llama(false, false);
    let init = model.init(21);
    // Each rank keeps half of master, M and V (each tensor's shard, within a page of
    // page rounding per tensor).
    for key in ["master_bytes", "m_bytes", "v_bytes"] {
        let whole = one.counters[0][key];
        for c in &two.counters {
            let half = c[key] as f64 / whole as f64;
            let slack = (init.len() * 4096) as f64 / whole as f64;
            assert!(
                (0.5..=0.5 + slack).contains(&half),
                "{key}: a rank keeps {} of one rank's {whole}",
                c[key]
            );
            eprintln!("{key}: one rank {whole}, a rank of two {}", c[key]);
        }
    }
    // The collectives, as the layout predicts, and one norm summed a step.
    let (gathers, gradients) = predicted(&model, &init);
    for sent in &two.sent {
        eprintln!("sent per rank: {sent:?}");
        assert_eq!(sent.all_gather, STEPS * gathers);
        assert_eq!(sent.reduce_scatter, STEPS * gradients);
        assert_eq!(sent.all_reduce, STEPS * 8);
    }
}

/// What one rank sends per step, as the layout predicts: each block's parameters
/// gathered for its forward and again for backward's recompute (the head block,
/// differentiated from its saved input, only for backward), in fp32; each gradient
/// reduce-scattered once, in fp32. (Bytes of gathers, of reduce-scatters.)
fn predicted(model: &Llama, init: &[(ParamSpec, Vec<f32>)]) -> (u64, u64) {
    let size: std::collections::HashMap<&str, usize> = init
        .iter()
        .map(|(s, _)| (s.name.as_str(), s.elements()))
        .collect();
    let blocks = Blocks::block_count(model);
    let block_bytes = |b: usize| -> u64 {
        let names = Blocks::block_params(model, b);
        names.iter().map(|n| ring(size[n.as_str()])).sum()
    };
    let gathers =
        (0..blocks - 1).map(block_bytes).sum::<u64>() + (0..blocks).map(block_bytes).sum::<u64>();
    (gathers, size.values().map(|&n| ring(n)).sum())
}

/// In bf16 precision the trained parameters' 16-bit copies cross as 16 bits: half of
/// the fp32 gathers' bytes (every parameter of the full model trains); gradients are
/// still reduced in fp32.
#[test]
fn two_ranks_in_bf16_gather_the_16_bit_parameters() {
    let (_, two) = two_ranks_equal_one(Case { bf16: true, ..FULL });
    let model = llama(false, false);
    let (gathers, gradients) = predicted(&model, &model.init(21));
    for sent in &two.sent {
        assert_eq!(sent.all_gather, STEPS * gathers / 2);
        assert_eq!(sent.reduce_scatter, STEPS * gradients);
    }
}

#[test]
fn two_ranks_train_lora_and_a_tied_head_as_one() {
    let (_, two) = two_ranks_equal_one(Case { lora: true, ..FULL });
    let model = llama(false, true);
    let trained: u64 = model
        .init(21)
        .iter()
        .filter(|(s, _)| s.trainable)
        .map(|(s, _)| ring(s.elements()))
        .sum();
    // Only the adapters' gradients cross.
    assert_eq!(two.sent[0].reduce_scatter, STEPS * trained);
    two_ranks_equal_one(Case { tie: true, ..FULL });
}

#[test]
fn two_ranks_equal_one_with_overlap_and_clipping() {
    let (_, two) = two_ranks_equal_one(Case {
        overlap: Overlap::Backward,
        ..FULL
    });
    // Each rank stepped its shards during backward, as each gradient's reduce-scatter
    // made it final.
    for c in &two.counters {
        assert!(c["tensors_overlapped"] > 0, "{c:?}");
    }
    // Clipped every step from the norm summed over the ranks, stepped in the next
    // forward.
    let (_, two) = two_ranks_equal_one(Case {
        clip: Some(0.05),
        overlap: Overlap::Forward,
        ..FULL
    });
    for c in &two.counters {
        assert!(c["tensors_deferred"] > 0, "{c:?}");
    }
}

/// The collectives run beside compute — every fetch after an iteration's first served
/// by an all-gather started ahead, gradients reduce-scattered behind — and train
/// exactly as when each waits at its call: the same losses and weights, to the bit, and
/// the same bytes. Full and LoRA (frozen parameters are gathered too, no gradient).
#[test]
fn collectives_overlapped_with_compute_train_as_waiting_at_each() {
    for case in [FULL, Case { lora: true, ..FULL }] {
        let waiting = run(Case { ahead: 0, ..case }, 2);
        let ahead = run(case, 2);
        assert_eq!(ahead.losses, waiting.losses, "{case:?}");
        assert_eq!(ahead.weights, waiting.weights, "{case:?}");
        assert_eq!(ahead.sent, waiting.sent, "{case:?}");
        for (w, a) in waiting.overlapped.iter().zip(&ahead.overlapped) {
            eprintln!("{case:?}\n waiting: {w:?}\n ahead:   {a:?}");
            assert_eq!((w.gathers_ahead, w.scatters_behind), (0, 0));
            let fetches = w.gathers_at_call;
            assert_eq!(a.gathers_ahead + a.gathers_at_call, fetches);
            // Step 1 learns the order; each later step gathers its first fetch at the
            // call and the rest ahead.
            let per_step = fetches / STEPS;
            assert_eq!(a.gathers_ahead, (STEPS - 1) * (per_step - 1));
            assert_eq!(a.gathers_discarded, 0);
            assert!(a.scatters_behind > 0);
        }
    }
}

#[test]
fn ranks_that_register_different_models_are_refused_naming_the_difference() {
    use tidestore_train::Collective;
    let group = local::group(2, Duration::from_secs(20));
    let errs: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    // Rank 1 adds LoRA adapters the other does not have.
                    let model = llama(false, g.rank() == 1);
                    let specs: Vec<ParamSpec> = model.init(1).into_iter().map(|(s, _)| s).collect();
                    let dir = tempfile::tempdir().unwrap();
                    let ranks = Ranks::new(Box::new(g)).unwrap();
                    let cfg = config(dir.path(), FULL);
                    TideParams::open_sharded(&specs, &cfg, &Device::Cpu, ranks)
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errs {
        assert!(
            e.contains("rank 1 differs from rank 0: parameters = "),
            "{e}"
        );
    }
}

/// A value that must not be exported is found by each rank in its own shard: every rank
/// names the same first one (its index in the whole tensor), and nothing is gathered.
#[test]
fn ranks_find_the_first_bad_value_in_their_shards_without_a_gather() {
    let model = llama(false, false);
    let init = model.init(3);
    // The largest parameter, with bad values in both halves: the first must win.
    let (spec, values) = init.iter().max_by_key(|(s, _)| s.elements()).unwrap();
    let n = spec.elements();
    let mut poisoned = values.clone();
    let (early, late) = (n / 2 - 3, n - 1);
    poisoned[late] = f32::NAN;
    poisoned[early] = f32::INFINITY;
    let bad = |v: f32| !v.is_finite();
    let group = local::group(2, Duration::from_secs(20));
    let found: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                let (init, spec, poisoned) = (&init, spec, &poisoned);
                s.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let ranks = Ranks::new(Box::new(g)).unwrap();
                    let specs: Vec<ParamSpec> = init.iter().map(|(s, _)| s.clone()).collect();
                    let cfg = config(dir.path(), FULL);
                    let mut p = TideParams::open_sharded(&specs, &cfg, &Device::Cpu, ranks.clone())
                        .unwrap();
                    for (s, v) in init {
                        p.set_param(&s.name, v).unwrap();
                    }
                    let before = ranks.sent().all_gather;
                    let clean = p.first_value_where(&spec.name, bad).unwrap();
                    p.set_param(&spec.name, poisoned).unwrap();
                    let found = p.first_value_where(&spec.name, bad).unwrap();
                    (clean, found, ranks.sent().all_gather - before)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (clean, found, gathered) in found {
        assert_eq!(clean, None);
        assert_eq!(found, Some((early, f32::INFINITY)));
        assert_eq!(gathered, 0, "the check gathered weights");
    }
    // One rank: the same answer from the whole tensor.
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<ParamSpec> = init.iter().map(|(s, _)| s.clone()).collect();
    let mut p = TideParams::open_specs(&specs, &config(dir.path(), FULL), &Device::Cpu).unwrap();
    p.set_param(&spec.name, &poisoned).unwrap();
    assert_eq!(
        p.first_value_where(&spec.name, bad).unwrap(),
        Some((early, f32::INFINITY))
    );
}
