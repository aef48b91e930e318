//! Guards the layer-streamed trainer against computing anything but what candle's
//! ordinary full-graph autograd computes: a small LLaMA (grouped-query attention, an
//! untied head; and a tied one) streamed block by block through the store, with
//! recompute and the `sum(y · g)` surrogate, must give the same loss and every gradient
//! at step 1 as one candle graph over the same weights (relative 1e-5 of each tensor's
//! largest gradient), and 20 AdamW steps the same losses (relative 1e-5) as the
//! full-graph path through the same store and optimizer.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use tidestore_candle::{
    train_step, InMemory, Llama, ParamSource, ParamSpec, Precision, TideParams,
};
use tidestore_train::MicroBatchOrder::{self, Horizontal, Vertical};
use tidestore_train::{Overlap, StepDecision};

/// `init` in a new `TideParams` (the test config at `precision`, `overlap`), in a
/// temporary directory that lives as long as the first value.
fn opened(
    init: &[(ParamSpec, Vec<f32>)],
    precision: Precision,
    overlap: Overlap,
) -> (tempfile::TempDir, TideParams) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tide_config(dir.path(), precision);
    cfg.overlap = overlap;
    let p = TideParams::open(init, &cfg, &Device::Cpu).unwrap();
    (dir, p)
}

/// The largest difference of `got` from `want`, relative to `want`'s largest magnitude.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / scale
}

fn step1_matches_full_graph(tie: bool, lora: bool) {
    let model = llama(tie, lora);
    let init = model.init(5);
    let (x, y) = batches().get(0, &Device::Cpu).unwrap();
    // One candle graph over every parameter.
    let mut mem = InMemory::new(&init, &Device::Cpu).unwrap();
    let logits = model.forward(&mut mem, &x).unwrap();
    let loss = Llama::loss(&logits, &y).unwrap();
    let want_loss = loss.to_scalar::<f32>().unwrap();
    let grads = loss.backward().unwrap();
    // The same weights, streamed through the store.
    let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
    let names = init
        .iter()
        .filter(|(s, _)| s.trainable)
        .map(|(s, _)| s.name.clone());
    let mut before_step = Through::new(&mut p, true);
    before_step.names = names.collect();
    let s = train_step(
        &mut before_step,
        &model,
        &[(x.clone(), y.clone())],
        Horizontal,
    )
    .unwrap();
    let mut stepped_grads = before_step.grads;
    let consumed = stepped_grads.keys().next().unwrap().clone();
    let after = p.grad_values(&consumed);
    assert!(
        after.is_err(),
        "{consumed}: a gradient read after the step consumed it"
    );
    let d = (s.loss - want_loss).abs() / want_loss;
    assert!(d <= 1e-6, "loss {} vs {want_loss}", s.loss);
    let mut worst = (0f32, String::new());
    for (spec, _) in init.iter().filter(|(s, _)| s.trainable) {
        let name = spec.name.clone();
        let t = mem.param(&name).unwrap();
        let want = grads
            .get(&t)
            .unwrap_or_else(|| panic!("no full-graph gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // Every parameter learns from step 1 (LoRA's A waits for B to leave zero).
        assert!(
            name.ends_with("lora_A.weight") || want.iter().any(|g| *g != 0.0),
            "{name} gets no gradient in the full graph"
        );
        let got = stepped_grads.remove(&name).unwrap();
        let r = rel(&got, &want);
        if r > worst.0 {
            worst = (r, name);
        }
    }
    eprintln!(
        "tie {tie} lora {lora}: worst gradient {:e} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0 <= 1e-5,
        "gradient of {} off by {:e}",
        worst.1,
        worst.0
    );
}

#[test]
fn step1_loss_and_every_gradient_equal_the_full_graph() {
    step1_matches_full_graph(false, false);
}

#[test]
fn a_tied_embedding_sums_its_two_gradients() {
    step1_matches_full_graph(true, false);
}

#[test]
fn lora_adapters_get_the_full_graph_gradients() {
    step1_matches_full_graph(false, true);
}

#[test]
fn twenty_streamed_steps_equal_full_graph_training() {
    let model = llama(false, false);
    let init = model.init(9);
    let data = batches();
    let run = |streamed: bool| -> Vec<f32> {
        let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
        (0..20)
            .map(|s| {
                let (x, y) = data.get(s, &Device::Cpu).unwrap();
                if streamed {
                    train_step(&mut p, &model, &[(x.clone(), y.clone())], Horizontal)
                        .unwrap()
                        .loss
                } else {
                    let logits = model.forward(&mut p, &x).unwrap();
                    let loss = Llama::loss(&logits, &y).unwrap();
                    p.backward(&loss).unwrap();
                    p.step().unwrap();
                    loss.to_scalar::<f32>().unwrap()
                }
            })
            .collect()
    };
    let want = run(false);
    let got = run(true);
    eprintln!("full graph: {want:?}\nstreamed:   {got:?}");
    let d = max_rel_diff(&want, &got);
    assert!(d <= 1e-5, "max relative loss difference {d:e}");
    assert!(
        want[19] < want[0] - 0.3,
        "it learns: {} -> {}",
        want[0],
        want[19]
    );
}

/// The head's backward a few rows of logits at a time (7 rows, so blocks cut across
/// sequences and the last is short) trains as it does with the whole micro-batch at
/// once: the same gradients summed in another order, so the losses agree within
/// rounding, with a tied embedding (the head's gradient joins the embedding's) and with
/// LoRA (the head frozen); and one block of every row is the whole micro-batch, bit for
/// bit.
#[test]
fn the_head_a_block_of_rows_at_a_time_trains_as_the_whole_micro_batch() {
    for (tie, lora) in [(false, false), (true, false), (false, true)] {
        let whole = llama(tie, lora);
        let init = whole.init(5);
        let data = batches();
        let run = |model: &Llama| -> Vec<f32> {
            let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
            (0..6)
                .map(|s| {
                    let (x, y) = data.get(s, &Device::Cpu).unwrap();
                    train_step(&mut p, model, &[(x, y)], Horizontal)
                        .unwrap()
                        .loss
                })
                .collect()
        };
        let want = run(&whole);
        let mut blocks = llama(tie, lora);
        blocks.set_head_chunk_rows(7);
        let got = run(&blocks);
        let mut one = llama(tie, lora);
        let (x, _) = data.get(0, &Device::Cpu).unwrap();
        one.set_head_chunk_rows(x.elem_count());
        let same = run(&one);
        eprintln!("tie {tie} lora {lora}\nwhole: {want:?}\n7 rows: {got:?}");
        assert!(
            got.iter().any(|l| !want.contains(l)) || lora,
            "blocks of 7 rows ran"
        );
        let d = max_rel_diff(&want, &got);
        assert!(
            d <= 1e-5,
            "tie {tie} lora {lora}: max relative loss difference {d:e}"
        );
        assert_eq!(want, same, "tie {tie} lora {lora}: one block is the whole");
    }
}

#[test]
fn two_micro_batches_equal_one_batch_of_both_in_either_order() {
    let model = llama(false, false);
    let init = model.init(3);
    let data = batches();
    let run = |split: bool, order: MicroBatchOrder| -> Vec<f32> {
        let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
        (0..5)
            .map(|s| {
                let (x, y) = data.get(s, &Device::Cpu).unwrap();
                let parts = if split {
                    let half = |t: &candle_core::Tensor, i: usize| t.narrow(0, 2 * i, 2).unwrap();
                    vec![(half(&x, 0), half(&y, 0)), (half(&x, 1), half(&y, 1))]
                } else {
                    vec![(x, y)]
                };
                train_step(&mut p, &model, &parts, order).unwrap().loss
            })
            .collect()
    };
    let one = run(false, Horizontal);
    let (horizontal, vertical) = (run(true, Horizontal), run(true, Vertical));
    eprintln!("one batch: {one:?}\ntwo parts: {horizontal:?}\nvertical: {vertical:?}");
    for (what, two) in [("horizontal", &horizontal), ("vertical", &vertical)] {
        let d = max_rel_diff(&one, two);
        assert!(d <= 1e-5, "{what}: max relative loss difference {d:e}");
    }
    // Without a tied parameter both orders sum each gradient in the same order.
    assert_eq!(horizontal, vertical);
}

#[test]
fn the_in_memory_baseline_of_the_same_recompute_equals_candle_full_graph() {
    use candle_nn::{Optimizer, ParamsAdamW};
    use tidestore_candle::streamed::InMemoryTraining;
    let model = llama(false, false);
    let init = model.init(4);
    let data = batches();
    let params = ParamsAdamW {
        lr: LR,
        beta1: BETAS.0,
        beta2: BETAS.1,
        eps: EPS,
        weight_decay: WD,
    };
    let mem = InMemory::new(&init, &Device::Cpu).unwrap();
    let mut opt = candle_nn::AdamW::new(mem.vars(), params.clone()).unwrap();
    let mut mem = mem;
    let mut streamed =
        InMemoryTraining::new(InMemory::new(&init, &Device::Cpu).unwrap(), params).unwrap();
    let (mut want, mut got) = (vec![], vec![]);
    for s in 0..5 {
        let (x, y) = data.get(s, &Device::Cpu).unwrap();
        let logits = model.forward(&mut mem, &x).unwrap();
        let loss = Llama::loss(&logits, &y).unwrap();
        opt.backward_step(&loss).unwrap();
        want.push(loss.to_scalar::<f32>().unwrap());
        got.push(
            train_step(&mut streamed, &model, &[(x, y)], Horizontal)
                .unwrap()
                .loss,
        );
    }
    eprintln!("full graph: {want:?}\nrecompute:  {got:?}");
    assert!(max_rel_diff(&want, &got) <= 1e-5);
}

/// The weights the store lends (read in place by the products and the embedding's
/// lookup, no candle copy) train exactly as copied ones: the same losses and the same
/// master weights after five steps, bit for bit, with a tied embedding and with LoRA
/// (frozen base weights lent, adapters too), micro-batches in either order.
#[test]
fn lent_weights_train_bit_for_bit_as_copied_ones() {
    for (tie, lora, order) in [
        (false, false, Vertical),
        (true, false, Horizontal),
        (false, true, Vertical),
    ] {
        let model = llama(tie, lora);
        let init = model.init(6);
        let data = batches();
        let run = |lend: bool| -> (Vec<u32>, Vec<Vec<f32>>, usize) {
            let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
            let mut through = Through::new(&mut p, lend);
            let losses = (0..5)
                .map(|s| {
                    let (x, y) = data.get(s, &Device::Cpu).unwrap();
                    let half = |t: &Tensor, i: usize| t.narrow(0, 2 * i, 2).unwrap();
                    let parts = [(half(&x, 0), half(&y, 0)), (half(&x, 1), half(&y, 1))];
                    let step = train_step(&mut through, &model, &parts, order);
                    step.unwrap().loss.to_bits()
                })
                .collect();
            let loans = through.loans;
            let values = init.iter().map(|(s, _)| p.values(&s.name).unwrap());
            (losses, values.collect(), loans)
        };
        let (fetched, lent) = (run(false), run(true));
        assert_eq!(fetched.0, lent.0, "tie {tie} lora {lora}: losses");
        assert!(fetched.1 == lent.1, "tie {tie} lora {lora}: weights differ");
        // Every matrix, each block's forward and backward: the embedding (twice), 7 per
        // layer and pass, the head once (in backward; tied, it is the embedding).
        let per_step = 2 + 3 * 7 * 2 + 1;
        let passes = if order == Vertical { 1 } else { 2 };
        assert_eq!(
            lent.2,
            5 * passes * per_step,
            "tie {tie} lora {lora}: loans"
        );
    }
}

/// What `TideParams` lends and what it refuses: f32 parameters on the CPU, trainable
/// only for backward; nothing in bf16 precision (compute reads a bf16 copy); a loan
/// read after its block's loans ended, or a step while loans are held, is an error.
#[test]
fn tide_params_lend_f32_on_the_cpu_and_keep_the_protocol() {
    let model = llama(false, false);
    let init = model.init(2);
    let name = "model.layers.0.mlp.up_proj.weight";
    let (_dir, mut p) = opened(&init, Precision::F32, Overlap::Off);
    let fwd = p
        .lend(name, false)
        .unwrap()
        .expect("f32 on the CPU is lent");
    let down = "model.layers.0.mlp.down_proj.weight";
    let bwd = p.lend(down, true).unwrap().expect("lent for backward");
    assert_eq!((fwd.trainable, bwd.trainable), (false, true));
    assert_eq!(
        (&fwd.shape[..], &bwd.shape[..]),
        (&[64, 32][..], &[32, 64][..])
    );
    let want = &init.iter().find(|(s, _)| s.name == name).unwrap().1;
    assert_eq!(p.lent(&fwd).unwrap(), &want[..]);
    p.put_grad(name, &vec![0.0; want.len()]).unwrap();
    assert!(p.step().is_err(), "a step while loans are held");
    p.end_loans().unwrap();
    assert!(p.lent(&fwd).is_err(), "a loan read after the loans ended");
    // Nor does an ended loan's id name the next block's loan.
    let next = p.lend(down, false).unwrap().expect("lent again");
    assert_ne!(next.id, fwd.id);
    assert!(p.lent(&fwd).is_err() && p.lent(&bwd).is_err());
    assert_eq!(p.lent(&next).unwrap().len(), 32 * 64);
    p.end_loans().unwrap();
    let (_dir, mut p) = opened(&init, Precision::Bf16, Overlap::Off);
    assert!(p.lend(name, false).unwrap().is_none(), "bf16: nothing lent");
}

/// With `Overlap::Backward` the driver has each parameter group stepped as soon as its
/// gradients are final, while backward goes on: the same losses and weights as the
/// step after backward, bit for bit (no clipping, so the decision is known up front),
/// with tensors stepped early in every step.
#[test]
fn stepping_during_backward_trains_bit_for_bit_as_after_it() {
    let model = llama(false, false);
    let init = model.init(8);
    let data = batches();
    let run = |overlap: Overlap| -> (Vec<u32>, Vec<Vec<f32>>, u64) {
        let (_dir, mut p) = opened(&init, Precision::F32, overlap);
        let losses = (0..4)
            .map(|s| {
                let (x, y) = data.get(s, &Device::Cpu).unwrap();
                let step = train_step(&mut p, &model, &[(x, y)], Vertical).unwrap();
                step.loss.to_bits()
            })
            .collect();
        let early = p.trainer().step_loop().stats().tensors_overlapped;
        let values = init.iter().map(|(s, _)| p.values(&s.name).unwrap());
        (losses, values.collect(), early)
    };
    let (after, during) = (run(Overlap::Off), run(Overlap::Backward));
    assert_eq!(after.0, during.0, "losses");
    assert!(after.1 == during.1, "weights differ");
    assert_eq!(after.2, 0);
    // Every gradient is whole and final when its block puts it (untied, one
    // micro-batch): each tensor is stepped from candle's buffer inside backward.
    assert_eq!(
        during.2,
        4 * init.len() as u64,
        "not every tensor was stepped during backward"
    );
}

/// With `Overlap::Forward` the step is decided after backward — here clipped every
/// step, at a learning rate that changes from step to step — and each tensor is
/// stepped in the next forward right before its block: the same losses and weights as
/// the step after backward, bit for bit, with a tied embedding and two micro-batches.
/// The last step's updates are made when the weights are read. The store traces the
/// second iteration (the first has no step in its forward) and follows it after.
#[test]
fn stepping_in_the_next_forward_trains_bit_for_bit_as_after_backward() {
    let model = llama(true, false);
    let init = model.init(12);
    let data = batches();
    const STEPS: u64 = 5;
    let run = |overlap: Overlap| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = tide_config(dir.path(), Precision::F32);
        cfg.overlap = overlap;
        cfg.max_grad_norm = Some(0.05);
        let mut p = TideParams::open(&init, &cfg, &Device::Cpu).unwrap();
        let mut clipped = 0;
        let losses: Vec<u32> = (0..STEPS)
            .map(|s| {
                p.set_lr(1e-3 / (1.0 + s as f32)).unwrap();
                let (x, y) = data.get(s, &Device::Cpu).unwrap();
                let half = |t: &Tensor, i: usize| t.narrow(0, 2 * i, 2).unwrap();
                let parts = [(half(&x, 0), half(&y, 0)), (half(&x, 1), half(&y, 1))];
                let step = train_step(&mut p, &model, &parts, Vertical).unwrap();
                if let StepDecision::Apply { clip_coef, .. } = step.decision {
                    clipped += usize::from(clip_coef < 1.0);
                }
                step.loss.to_bits()
            })
            .collect();
        let in_forward = p.trainer().step_loop().stats().tensors_deferred;
        let due = p.trainer().step_loop().deferred();
        let st = p.stats();
        let trace = (st.traced_iterations, st.divergences);
        let values: Vec<Vec<f32>> = init
            .iter()
            .map(|(s, _)| p.values(&s.name).unwrap())
            .collect();
        (losses, values, clipped, in_forward, due, trace)
    };
    let (after, next) = (run(Overlap::Off), run(Overlap::Forward));
    assert_eq!(after.0, next.0, "losses");
    assert!(after.1 == next.1, "weights differ");
    assert_eq!(
        after.2, STEPS as usize,
        "every step was meant to be clipped"
    );
    assert_eq!(next.2, after.2);
    let trainable = init.iter().filter(|(s, _)| s.trainable).count();
    assert_eq!((after.3, after.4), (0, 0));
    assert_eq!(
        next.3,
        (STEPS - 1) * trainable as u64,
        "steps made in a forward"
    );
    assert_eq!(
        next.4, trainable,
        "the last step was due until the weights were read"
    );
    assert_eq!(after.5, (1, 0), "off: one traced iteration, followed since");
    assert_eq!(
        next.5,
        (2, 0),
        "forward: the second iteration traced, followed since"
    );
}
