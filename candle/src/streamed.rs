//! [`Llama`] as [`Blocks`] for the train crate's layer-streamed driver
//! ([`tidestore_train::train_step`]: forward without a graph keeping block inputs,
//! recompute, gradients put as soon as final, micro-batches), and the two places its
//! parameters come from: the store ([`TideParams`]) or candle's memory
//! ([`InMemoryTraining`], the baseline of the same recompute).
//!
//! The candle side of a block's backward: the block is recomputed from its saved input
//! with what its backward reads kept, and the incoming gradient is propagated through
//! it by the hand-written backward of `crate::decoder` (candle's autograd zeroes and
//! adds a gradient buffer per graph node; see there). The result equals candle's
//! full-graph autograd on the same weights up to summation order (see
//! `tests/llama_streamed.rs`).

use candle_core::Tensor;
use tidestore_train::TensorState;
use tidestore_train::{BlockGrads, BlockParams, Blocks, Loan, StepDecision, StepState, Upstream};

use crate::decoder::{BlockBack, LayerSaved, Mode};
use crate::error::{Error, Result};
use crate::llama::Llama;
use crate::source::{InMemory, ParamSource};
use crate::tide::TideParams;

/// A parameter handed to a block: fetched into a tensor, or lent.
enum Handed {
    Fetched(Tensor),
    Lent(Loan),
}

impl Handed {
    /// Whether the block's backward gives this parameter's gradient.
    fn trains(&self) -> bool {
        match self {
            Handed::Fetched(t) => t.is_variable(),
            Handed::Lent(loan) => loan.trainable,
        }
    }
}

/// One block's parameters, fetched (or lent) as the block asks for them; the same
/// tensor for the same name within the block.
struct BlockSource<'a> {
    params: &'a mut dyn BlockParams<Llama>,
    backward: bool,
    /// What was handed out, in order: (name, what).
    handed: Vec<(String, Handed)>,
}

impl ParamSource for BlockSource<'_> {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        let found = self.handed.iter().find(|(n, _)| n == name);
        if let Some((_, Handed::Fetched(t))) = found {
            return Ok(t.clone());
        }
        let t = self.params.fetch(name, self.backward)?;
        self.handed
            .push((name.to_string(), Handed::Fetched(t.clone())));
        Ok(t)
    }

    fn lend(&mut self, name: &str) -> Result<Option<Loan>> {
        let found = self.handed.iter().find(|(n, _)| n == name);
        if let Some((_, Handed::Lent(l))) = found {
            return Ok(Some(l.clone()));
        }
        let loan = self.params.lend(name, self.backward)?;
        if let Some(l) = &loan {
            if !self.handed.iter().any(|(n, _)| n == name) {
                self.handed
                    .push((name.to_string(), Handed::Lent(l.clone())));
            }
        }
        Ok(loan)
    }

    fn lent(&self, loan: &Loan) -> Result<&[f32]> {
        self.params.lent(loan)
    }
}

impl Blocks for Llama {
    type Tensor = Tensor;
    type Error = Error;
    type Kept = KeptLayer;

    fn block_count(&self) -> usize {
        self.blocks()
    }

    fn block_params(&self, block: usize) -> Vec<String> {
        Llama::block_params(self, block)
            .into_iter()
            .map(|p| p.name)
            .collect()
    }

    fn forward(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Tensor,
    ) -> Result<Tensor> {
        // A layer's forward makes what its backward reads in any case; here it is dropped.
        Ok(self.forward_keeping(block, params, input)?.0)
    }

    /// A decoder layer keeps its forward's values (about 100 MB for a 2048-wide layer
    /// over 512 tokens); the embedding and the head keep nothing.
    fn forward_keeping(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Tensor,
    ) -> Result<(Tensor, Option<KeptLayer>)> {
        let mut src = BlockSource {
            params,
            backward: false,
            handed: Vec::new(),
        };
        let (y, kept) = if block == 0 || block + 1 >= self.blocks() {
            (self.block_in(block, &mut src, input, Mode::Fused)?, None)
        } else {
            let (y, saved) = self.layer_forward(block - 1, &mut src, input, Mode::Fused)?;
            (y, Some(KeptLayer(saved)))
        };
        let y = y.detach();
        // A GPU runs the block asynchronously: wait here, so that its time counts as
        // compute and not as the store's (whose next copy would wait for it).
        y.device().synchronize()?;
        Ok((y, kept))
    }

    fn backward_kept(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        kept: KeptLayer,
        upstream: Upstream<'_, Tensor>,
    ) -> Result<BlockGrads<Tensor>> {
        let Upstream::Grad(g) = upstream else {
            return Err(Error::BadParam {
                name: format!("block {block}"),
                reason: "a loss handed to a block that is not the head".into(),
            });
        };
        let device = g.device().clone();
        self.handing_grads(params, &device, |model, src| {
            model.layer_block_backward(block, src, &kept.0, g)
        })
    }

    fn backward(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Tensor,
        upstream: Upstream<'_, Tensor>,
    ) -> Result<BlockGrads<Tensor>> {
        let device = input.device().clone();
        self.handing_grads(params, &device, |model, src| {
            model.block_backward(block, src, input, upstream)
        })
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a + b)?)
    }

    fn tensor_bytes(&self, t: &Tensor) -> u64 {
        crate::llama::tensor_bytes(t)
    }

    fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_device(&candle_core::Device::Cpu)?)
    }

    fn to_place_of(&self, t: &Tensor, like: &Tensor) -> Result<Tensor> {
        Ok(t.to_device(like.device())?)
    }

    fn kept_bytes(&self, kept: &KeptLayer) -> u64 {
        kept.0.bytes()
    }

    /// From the input's `(batch, time)` (tokens) or `(batch, time, hidden)`.
    fn working_bytes(&self, block: usize, input: &Tensor) -> u64 {
        match input.dims() {
            [b, t] | [b, t, _] => self.block_working_bytes(block, *b, *t),
            _ => 0,
        }
    }
}

/// A decoder layer's forward values, kept for a backward that follows at once
/// ([`Blocks::forward_keeping`]).
#[derive(Debug)]
pub struct KeptLayer(LayerSaved);

impl Llama {
    /// Runs `back` (a block's backward) with its parameters from `params`, then gives
    /// every trainable parameter it handed out a gradient, in the order handed (zeros
    /// for one that got none), and waits for a GPU's kernels (counted as compute).
    fn handing_grads(
        &self,
        params: &mut dyn BlockParams<Self>,
        device: &candle_core::Device,
        back: impl FnOnce(&Self, &mut BlockSource<'_>) -> Result<BlockBack>,
    ) -> Result<BlockGrads<Tensor>> {
        let mut src = BlockSource {
            params,
            backward: true,
            handed: Vec::new(),
        };
        let (input, mut grads, loss) = back(self, &mut src)?;
        // Every trainable parameter handed out gets a gradient, in the order handed.
        let params = src
            .handed
            .into_iter()
            .filter(|(_, h)| h.trains())
            .map(|(name, h)| {
                let g = match (grads.remove(&name), h) {
                    (Some(g), _) => g,
                    (None, Handed::Fetched(t)) => t.zeros_like()?,
                    (None, Handed::Lent(loan)) => {
                        Tensor::zeros(loan.shape, candle_core::DType::F32, device)?
                    }
                };
                Ok((name, g))
            })
            .collect::<Result<Vec<_>>>()?;
        // As in forward: a GPU's kernels finish here, counted as compute.
        if let Some(t) = input.as_ref().or(params.first().map(|(_, g)| g)) {
            t.device().synchronize()?;
        }
        Ok(BlockGrads {
            input,
            params,
            loss,
        })
    }
}

impl BlockParams<Llama> for TideParams {
    fn fetch(&mut self, name: &str, backward: bool) -> Result<Tensor> {
        let to = if backward {
            TensorState::HoldAfterBwd
        } else {
            TensorState::HoldAfterFwd
        };
        Ok(TideParams::fetch(self, name, backward, to)?.0)
    }

    fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>> {
        TideParams::lend(self, name, backward)
    }

    fn lent(&self, loan: &Loan) -> Result<&[f32]> {
        TideParams::lent(self, loan)
    }

    fn end_loans(&mut self) -> Result<()> {
        TideParams::end_loans(self)
    }

    fn step_early(&mut self) -> Result<()> {
        TideParams::step_early(self)
    }

    fn step_deferred(&mut self, names: &[String]) -> Result<()> {
        names
            .iter()
            .try_for_each(|n| TideParams::step_deferred(self, n))
    }

    fn put_grad(&mut self, name: &str, grad: &Tensor, first: bool, last: bool) -> Result<()> {
        self.put_grad_tensor(name, grad, first, last)
    }

    fn hold_activations(&mut self, bytes: u64) -> Result<()> {
        self.trainer_mut().hold_activations(bytes);
        Ok(())
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

impl BlockParams<Llama> for InMemoryTraining {
    fn fetch(&mut self, name: &str, backward: bool) -> Result<Tensor> {
        let t = self.mem.param(name)?;
        Ok(if backward && t.is_variable() {
            t
        } else {
            t.detach()
        })
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
            state: StepState::new(self.steps),
            grad_norm: f64::NAN,
            clip_coef: 1.0,
        })
    }
}
