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
use tidestore_train::{BlockGrads, BlockParams, Blocks, StepDecision, StepState, Upstream};

use crate::decoder::Mode;
use crate::error::{Error, Result};
use crate::llama::Llama;
use crate::source::{InMemory, ParamSource};
use crate::tide::TideParams;

/// One block's parameters, fetched as the block asks for them; the same tensor for the
/// same name within the block.
struct BlockSource<'a> {
    params: &'a mut dyn BlockParams<Llama>,
    backward: bool,
    /// What was handed out: (name, tensor).
    handed: Vec<(String, Tensor)>,
}

impl ParamSource for BlockSource<'_> {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        if let Some((_, t)) = self.handed.iter().find(|(n, _)| n == name) {
            return Ok(t.clone());
        }
        let t = self.params.fetch(name, self.backward)?;
        self.handed.push((name.to_string(), t.clone()));
        Ok(t)
    }
}

impl Blocks for Llama {
    type Tensor = Tensor;
    type Error = Error;

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
        let mut src = BlockSource {
            params,
            backward: false,
            handed: Vec::new(),
        };
        let y = self.block_in(block, &mut src, input, Mode::Fused)?.detach();
        // A GPU runs the block asynchronously: wait here, so that its time counts as
        // compute and not as the store's (whose next copy would wait for it).
        y.device().synchronize()?;
        Ok(y)
    }

    fn backward(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Tensor,
        upstream: Upstream<'_, Tensor>,
    ) -> Result<BlockGrads<Tensor>> {
        let mut src = BlockSource {
            params,
            backward: true,
            handed: Vec::new(),
        };
        let (input, mut grads, loss) = self.block_backward(block, &mut src, input, upstream)?;
        // Every trainable parameter handed out gets a gradient, in the order handed.
        let params = src
            .handed
            .into_iter()
            .filter(|(_, t)| t.is_variable())
            .map(|(name, t)| {
                let g = match grads.remove(&name) {
                    Some(g) => g,
                    None => t.zeros_like()?,
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

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a + b)?)
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

    fn put_grad(&mut self, name: &str, grad: &Tensor, first: bool, last: bool) -> Result<()> {
        // A contiguous f32 gradient in CPU memory goes to the store straight from candle's
        // buffer; anything else (a GPU tensor, a strided view) through one copy.
        let (storage, layout) = grad.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((from, to))) =
            (&*storage, layout.contiguous_offsets())
        {
            if let Ok(all) = cpu.as_slice::<f32>() {
                return self.put_grad_part(name, &all[from..to], first, last);
            }
        }
        drop(storage);
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
