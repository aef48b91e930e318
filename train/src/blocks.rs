//! The layer-streamed block driver: a model as a sequence of blocks ([`Blocks`]),
//! trained one step at a time with activation recompute, its parameters fetched from
//! where they live ([`BlockParams`]: the store through a [`crate::Trainer`], or a
//! framework's memory for a baseline) right before a block runs. It knows no framework:
//! the framework's tensors are an associated type, and the framework's side computes a
//! block's forward and its vector-Jacobian product.
//!
//! One step of [`train_step`]:
//! 1. **Forward**, block by block: the block runs from its input without a graph; only
//!    its input is kept (the activation checkpoint).
//! 2. **Head**: the last block (final norm, output head, loss) is differentiated from
//!    its saved input; the loss is scaled by the micro-batch count.
//! 3. **Backward**, blocks in reverse: each block is recomputed from its saved input and
//!    the incoming gradient is propagated through it, giving its parameters' gradients
//!    and its input's. A parameter's gradient goes to [`BlockParams::put_grad`] as soon
//!    as it is final: after the earliest block that uses it (a parameter used by several
//!    blocks, a tied embedding, is summed over them first, with [`Blocks::add`]).
//! 4. **Step**: [`BlockParams::step`], after the last micro-batch.
//!
//! With several micro-batches (gradient accumulation), steps 1–3 run for each: the
//! first micro-batch's gradients replace what the store holds, later ones are added to
//! it, and the gradient is final after the last micro-batch.
//!
//! Block inputs stay in the framework's memory (`batch · time · hidden` each, one per
//! block); they are not spilled to the store.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tidestore_optimizer::StepDecision;

use crate::error::TrainError;

/// What the block after this one asks of its backward.
#[derive(Debug, Clone, Copy)]
pub enum Upstream<'a, T> {
    /// The last block: its output is the logits; the loss against `targets`, times
    /// `scale`, is what is differentiated.
    Loss {
        /// The targets of the micro-batch.
        targets: &'a T,
        /// The loss's factor (one over the micro-batch count).
        scale: f64,
    },
    /// The gradient of the loss with respect to the block's output.
    Grad(&'a T),
}

/// What one block's backward gives.
#[derive(Debug)]
pub struct BlockGrads<T> {
    /// The gradient with respect to the block's input (`None` for the first block,
    /// whose input is tokens).
    pub input: Option<T>,
    /// The gradients of the block's trainable parameters, by name (a parameter the
    /// block fetched but did not use gets zeros).
    pub params: Vec<(String, T)>,
    /// The unscaled loss, from the last block.
    pub loss: Option<f32>,
}

/// A model as blocks, computed by a framework.
pub trait Blocks {
    /// The framework's tensor: activations, parameters handed to a block, gradients.
    type Tensor: Clone;
    /// The framework's error; the driver's own errors convert into it.
    type Error: From<TrainError>;

    /// How many blocks (the last one computes the loss).
    fn block_count(&self) -> usize;

    /// The names of the parameters block `block` uses.
    fn block_params(&self, block: usize) -> Vec<String>;

    /// Block `block` from `input`, without a graph.
    fn forward(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Self::Tensor,
    ) -> Result<Self::Tensor, Self::Error>;

    /// Block `block` recomputed from its saved `input` and differentiated against
    /// `upstream`.
    fn backward(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Self::Tensor,
        upstream: Upstream<'_, Self::Tensor>,
    ) -> Result<BlockGrads<Self::Tensor>, Self::Error>;

    /// `a + b`: a tied parameter's gradients of two blocks summed.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, Self::Error>;
}

/// Where a block's parameters come from and where their gradients go.
pub trait BlockParams<B: Blocks + ?Sized> {
    /// Parameter `name` for the block about to run. `backward`: the use is backward's
    /// recompute, and a trainable parameter comes back as something the framework
    /// differentiates.
    fn fetch(&mut self, name: &str, backward: bool) -> Result<B::Tensor, B::Error>;

    /// One micro-batch's part of `name`'s gradient: the `first` replaces, later ones
    /// add; after the `last` the gradient is final.
    fn put_grad(
        &mut self,
        name: &str,
        grad: &B::Tensor,
        first: bool,
        last: bool,
    ) -> Result<(), B::Error>;

    /// The optimizer step, after the last micro-batch.
    fn step(&mut self) -> Result<StepDecision, B::Error>;
}

/// Where the time of one step went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The blocks' forward, recompute and backward.
    pub compute: Duration,
    /// Getting parameters and putting gradients (waits for chunks included).
    pub store: Duration,
    /// The optimizer step (its chunk I/O included).
    pub optimizer: Duration,
}

/// What [`train_step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamedStep {
    /// The mean loss over the micro-batches, before the step.
    pub loss: f32,
    /// The optimizer's decision.
    pub decision: StepDecision,
    /// Where the time went.
    pub times: StepTimes,
}

/// `params` with the time of every fetch and gradient put added to `store`.
struct Timed<'a, P: ?Sized> {
    params: &'a mut P,
    store: Duration,
}

impl<B: Blocks + ?Sized, P: BlockParams<B> + ?Sized> BlockParams<B> for Timed<'_, P> {
    fn fetch(&mut self, name: &str, backward: bool) -> Result<B::Tensor, B::Error> {
        let started = Instant::now();
        let t = self.params.fetch(name, backward);
        self.store += started.elapsed();
        t
    }

    fn put_grad(
        &mut self,
        name: &str,
        grad: &B::Tensor,
        first: bool,
        last: bool,
    ) -> Result<(), B::Error> {
        let started = Instant::now();
        let r = self.params.put_grad(name, grad, first, last);
        self.store += started.elapsed();
        r
    }

    fn step(&mut self) -> Result<StepDecision, B::Error> {
        self.params.step()
    }
}

/// The earliest block each parameter is used in: its gradient is final after that
/// block's backward.
fn first_use<B: Blocks + ?Sized>(model: &B) -> HashMap<String, usize> {
    let mut first = HashMap::new();
    for b in (0..model.block_count()).rev() {
        for name in model.block_params(b) {
            first.insert(name, b);
        }
    }
    first
}

/// One training step of `model` over `batches` (micro-batches of inputs and targets),
/// layer-streamed through `params` (see the module doc).
pub fn train_step<B, P>(
    params: &mut P,
    model: &B,
    batches: &[(B::Tensor, B::Tensor)],
) -> Result<StreamedStep, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B> + ?Sized,
{
    if batches.is_empty() {
        return Err(TrainError::Config {
            key: "batches",
            reason: "a step needs at least one micro-batch".into(),
        }
        .into());
    }
    if model.block_count() == 0 {
        return Err(TrainError::Protocol("the model has no blocks".into()).into());
    }
    let started = Instant::now();
    let first = first_use(model);
    let mut timed = Timed {
        params,
        store: Duration::ZERO,
    };
    let parts = batches.len();
    let mut loss_sum = 0.0;
    for (k, (tokens, targets)) in batches.iter().enumerate() {
        let part = Part {
            first: k == 0,
            last: k + 1 == parts,
            scale: 1.0 / parts as f64,
        };
        loss_sum += micro_batch(&mut timed, model, tokens, targets, part, &first)?;
    }
    let compute_and_store = started.elapsed();
    let step_started = Instant::now();
    let decision = timed.params.step()?;
    Ok(StreamedStep {
        loss: loss_sum / parts as f32,
        decision,
        times: StepTimes {
            compute: compute_and_store.saturating_sub(timed.store),
            store: timed.store,
            optimizer: step_started.elapsed(),
        },
    })
}

/// Which micro-batch of the step, and its loss factor.
#[derive(Debug, Clone, Copy)]
struct Part {
    first: bool,
    last: bool,
    scale: f64,
}

/// Forward and backward of one micro-batch, its gradients put; returns its unscaled
/// loss.
fn micro_batch<B, P>(
    params: &mut P,
    model: &B,
    tokens: &B::Tensor,
    targets: &B::Tensor,
    part: Part,
    first: &HashMap<String, usize>,
) -> Result<f32, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B>,
{
    let head = model.block_count() - 1;
    // Forward: no graph; the block inputs are the checkpoints.
    let mut inputs = Vec::with_capacity(head + 1);
    inputs.push(tokens.clone());
    for b in 0..head {
        let y = model.forward(b, params, &inputs[b])?;
        inputs.push(y);
    }
    // The head from its saved input, then every block in reverse.
    let mut pending: HashMap<String, B::Tensor> = HashMap::new();
    let mut loss = None;
    let mut upstream: Option<B::Tensor> = None;
    for b in (0..=head).rev() {
        let input = inputs.pop().ok_or_else(|| {
            TrainError::Protocol(format!("block {b}: its saved input is missing"))
        })?;
        let up = match &upstream {
            None => Upstream::Loss {
                targets,
                scale: part.scale,
            },
            Some(g) => Upstream::Grad(g),
        };
        let grads = model.backward(b, params, &input, up)?;
        if b == head {
            loss = grads.loss;
        }
        put_block_grads(params, model, grads.params, b, first, &mut pending, part)?;
        upstream = match grads.input {
            Some(g) => Some(g),
            None if b > 0 => {
                return Err(TrainError::Protocol(format!(
                    "block {b}: its output does not depend on its input"
                ))
                .into())
            }
            None => None,
        };
    }
    if let Some(name) = pending.keys().next() {
        return Err(TrainError::Protocol(format!(
            "the gradient of `{name}` was left pending after the first block"
        ))
        .into());
    }
    loss.ok_or_else(|| TrainError::Protocol("the last block gave no loss".into()).into())
}

/// Gradients of one block's backward: summed into `pending` for parameters an earlier
/// block uses too, put for the others.
fn put_block_grads<B, P>(
    params: &mut P,
    model: &B,
    grads: Vec<(String, B::Tensor)>,
    block: usize,
    first: &HashMap<String, usize>,
    pending: &mut HashMap<String, B::Tensor>,
    part: Part,
) -> Result<(), B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B>,
{
    for (name, g) in grads {
        let g = match pending.remove(&name) {
            Some(earlier) => model.add(&earlier, &g)?,
            None => g,
        };
        if first.get(&name).is_some_and(|&b| b < block) {
            pending.insert(name, g);
            continue;
        }
        params.put_grad(&name, &g, part.first, part.last)?;
    }
    Ok(())
}
