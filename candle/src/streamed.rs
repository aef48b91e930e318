//! Layer-streamed training with recompute: the store is the only home of the
//! parameters, and candle holds one block's parameters (and one block's graph) at a
//! time.
//!
//! One step of [`train_step`]:
//! 1. **Forward**, block by block: each parameter of the block is accessed where the
//!    store puts it, copied into a plain candle tensor and released; the block runs
//!    without a graph; only its input is kept (the activation checkpoint).
//! 2. **Head**: the last block (final norm, output head, loss) runs with a graph from
//!    its saved input as a variable; its backward gives the head's parameter gradients
//!    and the gradient of its input.
//! 3. **Backward**, blocks in reverse: the block's parameters are accessed again (as
//!    variables where trainable), the block is recomputed from its saved input (a
//!    variable), and the incoming gradient `g` is propagated through it with the
//!    surrogate `sum(y · g)` (`g` a constant: its gradient with respect to the block's
//!    inputs and parameters is exactly the vector-Jacobian product, since candle has no
//!    API for an upstream gradient). Each parameter's gradient goes into the store as
//!    soon as it is final (a parameter used by several blocks, a tied embedding, is
//!    summed over them first) and the step loop is told; the input's gradient goes on.
//! 4. **Step**: [`TideParams::step`] (tidestore's one step loop).
//!
//! With several micro-batches (gradient accumulation), steps 1–3 run for each with the
//! loss divided by their number, the first micro-batch's gradients replacing the
//! store's and the others' added to them (`Precision::F32`); the step loop hears of a
//! gradient after the last micro-batch.
//!
//! Block inputs are kept in host memory as candle tensors (`batch · time · hidden` f32
//! each, `layers + 1` of them); they are not spilled to the store.
//!
//! The result equals candle's full-graph autograd on the same weights up to the
//! summation order of the surrogate (see `tests/llama_streamed.rs`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{Tensor, Var};
use tidestore_chunk::TensorState;
use tidestore_optimizer::StepDecision;

use crate::error::{Error, Result};
use crate::llama::Llama;
use crate::source::InMemory;
use crate::source::ParamSource;
use crate::tide::TideParams;

/// Where the streamed trainer gets a block's parameters and puts their gradients: the
/// store ([`TideParams`]), or candle's memory ([`InMemoryTraining`], the baseline of the
/// same recompute).
pub trait StreamedParams {
    /// Parameter `name` for the block about to run: a variable when `as_var` and the
    /// parameter is trainable (its gradient is wanted), a plain tensor otherwise; with
    /// whether it is a variable. `backward`: the use is backward's recompute.
    fn fetch(&mut self, name: &str, as_var: bool, backward: bool) -> Result<(Tensor, bool)>;
    /// One micro-batch's part of `name`'s gradient: the first replaces, later ones add;
    /// after the `last` the gradient is final.
    fn put_grad(&mut self, name: &str, grad: &Tensor, first: bool, last: bool) -> Result<()>;
    /// The optimizer step, after the last micro-batch.
    fn step(&mut self) -> Result<StepDecision>;
}

impl StreamedParams for TideParams {
    fn fetch(&mut self, name: &str, as_var: bool, backward: bool) -> Result<(Tensor, bool)> {
        let to = if backward {
            TensorState::HoldAfterBwd
        } else {
            TensorState::HoldAfterFwd
        };
        TideParams::fetch(self, name, as_var, to)
    }

    fn put_grad(&mut self, name: &str, grad: &Tensor, first: bool, last: bool) -> Result<()> {
        let values = grad.flatten_all()?.to_vec1::<f32>()?;
        self.put_grad_part(name, &values, first, last)
    }

    fn step(&mut self) -> Result<StepDecision> {
        TideParams::step(self)
    }
}

/// Every parameter in candle memory, stepped by candle's AdamW: what the streamed
/// trainer's overhead is measured against (the same blocks, the same recompute, no
/// store).
pub struct InMemoryTraining {
    mem: InMemory,
    opt: candle_nn::AdamW,
    grads: candle_core::backprop::GradStore,
    steps: u64,
}

impl std::fmt::Debug for InMemoryTraining {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryTraining")
            .field("steps", &self.steps)
            .finish()
    }
}

impl InMemoryTraining {
    /// `mem`'s parameters trained by candle's AdamW with `params`.
    pub fn new(mem: InMemory, params: candle_nn::ParamsAdamW) -> Result<Self> {
        use candle_nn::Optimizer;
        let opt = candle_nn::AdamW::new(mem.vars(), params)?;
        Ok(InMemoryTraining {
            mem,
            opt,
            grads: Default::default(),
            steps: 0,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &InMemory {
        &self.mem
    }
}

impl StreamedParams for InMemoryTraining {
    fn fetch(&mut self, name: &str, as_var: bool, _backward: bool) -> Result<(Tensor, bool)> {
        let t = self.mem.param(name)?;
        let var = as_var && t.is_variable();
        Ok(if var { (t, true) } else { (t.detach(), false) })
    }

    fn put_grad(&mut self, name: &str, grad: &Tensor, first: bool, _last: bool) -> Result<()> {
        let t = self.mem.param(name)?;
        let g = match self.grads.remove(&t) {
            Some(earlier) if !first => (earlier + grad)?,
            _ => grad.clone(),
        };
        self.grads.insert(&t, g);
        Ok(())
    }

    fn step(&mut self) -> Result<StepDecision> {
        use candle_nn::Optimizer;
        self.opt.step(&self.grads)?;
        self.grads = Default::default();
        self.steps += 1;
        Ok(StepDecision::Apply {
            state: tidestore_optimizer::StepState::new(self.steps),
            grad_norm: f64::NAN,
            clip_coef: 1.0,
        })
    }
}

/// Where the time of one step went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Candle's forward, recompute and backward.
    pub compute: Duration,
    /// Getting parameters out of the store and gradients into it (waits for chunks
    /// included).
    pub store: Duration,
    /// The optimizer step (its chunk I/O included).
    pub optimizer: Duration,
}

/// What [`train_step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamedStep {
    /// The mean cross-entropy over the micro-batches, before the step.
    pub loss: f32,
    /// The optimizer's decision.
    pub decision: StepDecision,
    /// Where the time went.
    pub times: StepTimes,
}

/// One block's parameters, fetched from the store as the block asks for them.
struct BlockSource<'a, P: StreamedParams + ?Sized> {
    params: &'a mut P,
    vars: bool,
    /// What was handed out: (name, tensor, is a variable).
    handed: Vec<(String, Tensor, bool)>,
    store_time: &'a mut Duration,
}

impl<P: StreamedParams + ?Sized> ParamSource for BlockSource<'_, P> {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        if let Some((_, t, _)) = self.handed.iter().find(|(n, _, _)| n == name) {
            return Ok(t.clone());
        }
        let started = Instant::now();
        let (t, var) = self.params.fetch(name, self.vars, self.vars)?;
        *self.store_time += started.elapsed();
        self.handed.push((name.to_string(), t.clone(), var));
        Ok(t)
    }
}

/// The earliest block each parameter is used in: its gradient is final after that
/// block's backward.
fn first_use(model: &Llama) -> HashMap<String, usize> {
    let mut first = HashMap::new();
    for b in (0..model.blocks()).rev() {
        for p in model.block_params(b) {
            first.insert(p.name, b);
        }
    }
    first
}

/// Gradients of one block's backward, summed into `pending` for parameters used by an
/// earlier block too, and written to the store for the others.
#[allow(clippy::too_many_arguments)]
fn put_block_grads<P: StreamedParams + ?Sized>(
    params: &mut P,
    grads: &candle_core::backprop::GradStore,
    handed: Vec<(String, Tensor, bool)>,
    block: usize,
    first: &HashMap<String, usize>,
    pending: &mut HashMap<String, Tensor>,
    (first_part, last_part): (bool, bool),
    store_time: &mut Duration,
) -> Result<()> {
    for (name, t, var) in handed {
        if !var {
            continue;
        }
        let g = match grads.get(&t) {
            Some(g) => g.clone(),
            None => t.zeros_like()?,
        };
        let g = match pending.remove(&name) {
            Some(earlier) => (earlier + g)?,
            None => g,
        };
        if first.get(&name).is_some_and(|&b| b < block) {
            pending.insert(name, g);
            continue;
        }
        let started = Instant::now();
        params.put_grad(&name, &g, first_part, last_part)?;
        *store_time += started.elapsed();
    }
    Ok(())
}

/// One training step of `model` over `batches` (micro-batches of inputs → targets,
/// `(batch, time)` u32), layer-streamed through the store (see the module doc).
pub fn train_step<P: StreamedParams + ?Sized>(
    params: &mut P,
    model: &Llama,
    batches: &[(Tensor, Tensor)],
) -> Result<StreamedStep> {
    let started = Instant::now();
    let mut store_time = Duration::ZERO;
    let first = first_use(model);
    let parts = batches.len();
    if parts == 0 {
        return Err(Error::BadParam {
            name: "batches".into(),
            reason: "a step needs at least one micro-batch".into(),
        });
    }
    let mut loss_sum = 0.0;
    for (k, (tokens, targets)) in batches.iter().enumerate() {
        let flags = (k == 0, k + 1 == parts);
        let scale = 1.0 / parts as f64;
        loss_sum += micro_batch(
            params,
            model,
            tokens,
            targets,
            scale,
            flags,
            &first,
            &mut store_time,
        )?;
    }
    let compute_and_store = started.elapsed();
    let step_started = Instant::now();
    let decision = params.step()?;
    let optimizer = step_started.elapsed();
    Ok(StreamedStep {
        loss: loss_sum / parts as f32,
        decision,
        times: StepTimes {
            compute: compute_and_store.saturating_sub(store_time),
            store: store_time,
            optimizer,
        },
    })
}

/// Forward and backward of one micro-batch (loss scaled by `scale`), its gradients put
/// into the store; returns its unscaled loss.
#[allow(clippy::too_many_arguments)]
fn micro_batch<P: StreamedParams + ?Sized>(
    params: &mut P,
    model: &Llama,
    tokens: &Tensor,
    targets: &Tensor,
    scale: f64,
    flags: (bool, bool),
    first: &HashMap<String, usize>,
    store_time: &mut Duration,
) -> Result<f32> {
    let head = model.blocks() - 1;
    // Forward: no graph; the block inputs are the checkpoints.
    let mut inputs = Vec::with_capacity(model.blocks());
    let mut x = tokens.clone();
    for b in 0..head {
        let mut src = BlockSource {
            params: &mut *params,
            vars: false,
            handed: Vec::new(),
            store_time: &mut *store_time,
        };
        let y = model.block(b, &mut src, &x)?.detach();
        inputs.push(std::mem::replace(&mut x, y));
    }
    // The head with a graph, then every block in reverse.
    let mut pending = HashMap::new();
    let mut loss_value = None;
    let mut upstream: Option<Tensor> = None;
    for b in (0..=head).rev() {
        let input = if b == head {
            x.clone()
        } else {
            inputs[b].clone()
        };
        let input_var = if b > 0 {
            Some(Var::from_tensor(&input)?)
        } else {
            None
        };
        let xin = input_var.as_ref().map_or(&input, |v| v.as_tensor());
        let mut src = BlockSource {
            params: &mut *params,
            vars: true,
            handed: Vec::new(),
            store_time: &mut *store_time,
        };
        let y = model.block(b, &mut src, xin)?;
        let handed = std::mem::take(&mut src.handed);
        let objective = match &upstream {
            None => {
                let loss = Llama::loss(&y, targets)?;
                loss_value = Some(loss.to_scalar::<f32>()?);
                (loss * scale)?
            }
            Some(g) => (y * g)?.sum_all()?,
        };
        let grads = objective.backward()?;
        put_block_grads(
            params,
            &grads,
            handed,
            b,
            first,
            &mut pending,
            flags,
            store_time,
        )?;
        upstream = match xin_grad(&grads, input_var.as_ref()) {
            Some(g) => Some(g.detach()),
            None if b > 0 => {
                return Err(Error::BadParam {
                    name: format!("block {b}"),
                    reason: "its output does not depend on its input".into(),
                })
            }
            None => None,
        };
    }
    if let Some(name) = pending.keys().next() {
        return Err(Error::BadParam {
            name: name.clone(),
            reason: "a gradient was left pending after the first block (store bug)".into(),
        });
    }
    loss_value.ok_or_else(|| Error::BadParam {
        name: "head".into(),
        reason: "the model has no head block".into(),
    })
}

fn xin_grad(grads: &candle_core::backprop::GradStore, input: Option<&Var>) -> Option<Tensor> {
    input.and_then(|v| grads.get(v.as_tensor()).cloned())
}
