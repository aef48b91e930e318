//! What a framework implements to be trained by the layer-streamed driver
//! (`super::driver`): a model as [`Blocks`] of its tensors, the source of their
//! parameters and sink of their gradients ([`BlockParams`]), and how a step's
//! micro-batches meet the blocks ([`BlockSchedule`]); what a step gives back
//! ([`StreamedStep`]).

use std::time::Duration;

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

/// A parameter lent to the block about to run ([`BlockParams::lend`]): its fp32
/// elements stay in the source's memory and are read there ([`BlockParams::lent`])
/// until the driver ends the block's loans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loan {
    /// The source's number for it, valid until its loans end.
    pub id: usize,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// Whether the block's backward gives its gradient (a trainable parameter lent for
    /// backward's recompute).
    pub trainable: bool,
}

/// A model as blocks, computed by a framework.
pub trait Blocks {
    /// The framework's tensor: activations, parameters handed to a block, gradients.
    type Tensor: Clone;
    /// The framework's error; the driver's own errors convert into it.
    type Error: From<TrainError>;
    /// What a block's forward keeps for a backward that follows it at once (its
    /// activations; see [`Blocks::forward_keeping`]).
    type Kept;

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

    /// [`Blocks::forward`], keeping what the block's backward reads where the model can:
    /// the driver asks it of the last block before the loss, whose backward comes right
    /// after the loss block's and would otherwise recompute this forward. Memory: one
    /// block's activations for one micro-batch. The default keeps nothing.
    fn forward_keeping(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        input: &Self::Tensor,
    ) -> Result<Keeping<Self>, Self::Error> {
        Ok((self.forward(block, params, input)?, None))
    }

    /// Block `block` differentiated against `upstream` from what its
    /// [`Blocks::forward_keeping`] kept, without recomputing it: the same gradients as
    /// [`Blocks::backward`] from the block's input. Called only with a `kept` that
    /// method gave.
    fn backward_kept(
        &self,
        block: usize,
        params: &mut dyn BlockParams<Self>,
        kept: Self::Kept,
        upstream: Upstream<'_, Self::Tensor>,
    ) -> Result<BlockGrads<Self::Tensor>, Self::Error> {
        let _ = (params, kept, upstream);
        Err(TrainError::Protocol(format!("block {block}: nothing was kept by its forward")).into())
    }

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

    /// The bytes `t`'s elements take.
    fn tensor_bytes(&self, t: &Self::Tensor) -> u64;

    /// `t` copied to host memory, for a saved input that waits there
    /// ([`SavedInputs::Host`]). The default: `t` itself (a framework computing there).
    fn to_host(&self, t: &Self::Tensor) -> Result<Self::Tensor, Self::Error> {
        Ok(t.clone())
    }

    /// `t` copied to where `like` is (where the blocks compute). The default: `t`
    /// itself.
    fn to_place_of(
        &self,
        t: &Self::Tensor,
        like: &Self::Tensor,
    ) -> Result<Self::Tensor, Self::Error> {
        let _ = like;
        Ok(t.clone())
    }

    /// The bytes a [`Blocks::forward_keeping`] kept take. The default: none.
    fn kept_bytes(&self, kept: &Self::Kept) -> u64 {
        let _ = kept;
        0
    }

    /// What one micro-batch's forward or backward of block `block` from `input`
    /// allocates at once beyond its input and what the driver holds (its intermediates,
    /// its output, its parameters' gradients): an estimate the framework's side makes
    /// from the shapes. The default: none.
    fn working_bytes(&self, block: usize, input: &Self::Tensor) -> u64 {
        let _ = (block, input);
        0
    }
}

/// A block's output and what its forward kept ([`Blocks::forward_keeping`]).
pub type Keeping<B> = (<B as Blocks>::Tensor, Option<<B as Blocks>::Kept>);

/// Where a block's parameters come from and where their gradients go.
pub trait BlockParams<B: Blocks + ?Sized> {
    /// Parameter `name` for the block about to run. `backward`: the use is backward's
    /// recompute, and a trainable parameter comes back as something the framework
    /// differentiates.
    fn fetch(&mut self, name: &str, backward: bool) -> Result<B::Tensor, B::Error>;

    /// Parameter `name` lent to the block about to run instead of copied: its fp32
    /// elements where the source keeps them, read with [`BlockParams::lent`] and held
    /// there until [`BlockParams::end_loans`], which the driver calls once the block is
    /// done with every micro-batch. `None` where the source does not lend this one (the
    /// block then fetches it); `backward` as in [`BlockParams::fetch`]. The default
    /// lends nothing.
    fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>, B::Error> {
        let _ = (name, backward);
        Ok(None)
    }

    /// The elements of `loan`, a loan not yet ended.
    fn lent(&self, loan: &Loan) -> Result<&[f32], B::Error> {
        Err(TrainError::Protocol(format!("loan {} was not made by this source", loan.id)).into())
    }

    /// Ends every loan: the lent memory may move again. The default has none to end.
    fn end_loans(&mut self) -> Result<(), B::Error> {
        Ok(())
    }

    /// One micro-batch's part of `name`'s gradient: the `first` replaces, later ones
    /// add; after the `last` the gradient is final.
    fn put_grad(
        &mut self,
        name: &str,
        grad: &B::Tensor,
        first: bool,
        last: bool,
    ) -> Result<(), B::Error>;

    /// Steps what the gradients made final so far let the optimizer step before
    /// backward ends (a store trained with `Overlap::Backward`): the driver calls it
    /// after each block's gradients are put. The default steps nothing.
    fn step_early(&mut self) -> Result<(), B::Error> {
        Ok(())
    }

    /// Makes the steps of `names` still due from the last optimizer step (a store
    /// trained with `Overlap::Forward`): the driver calls it before each block runs, with
    /// the block's parameters, so that the step is timed as the optimizer's. The
    /// default steps nothing.
    fn step_deferred(&mut self, names: &[String]) -> Result<(), B::Error> {
        let _ = names;
        Ok(())
    }

    /// The activations take `bytes` where the blocks compute from now on (see the
    /// module doc): the driver calls it before each block's forward and backward, and
    /// with 0 after backward. The default ignores it.
    fn hold_activations(&mut self, bytes: u64) -> Result<(), B::Error> {
        let _ = bytes;
        Ok(())
    }

    /// The optimizer step, after the last micro-batch.
    fn step(&mut self) -> Result<StepDecision, B::Error>;
}

/// Where the block inputs kept for backward wait (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SavedInputs {
    /// Where the blocks compute.
    #[default]
    Compute,
    /// In host memory ([`Blocks::to_host`]), brought back for the block's backward
    /// ([`Blocks::to_place_of`]).
    Host,
}

/// How a step's micro-batches meet the blocks, and where their saved inputs wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockSchedule {
    /// The micro-batches' order.
    pub order: MicroBatchOrder,
    /// Where the saved block inputs wait.
    pub saved_inputs: SavedInputs,
}

impl From<MicroBatchOrder> for BlockSchedule {
    fn from(order: MicroBatchOrder) -> Self {
        BlockSchedule {
            order,
            saved_inputs: SavedInputs::Compute,
        }
    }
}

/// How micro-batches meet the blocks (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MicroBatchOrder {
    /// Every micro-batch through a block before the next block: each block's
    /// parameters fetched once per pass.
    #[default]
    Vertical,
    /// One micro-batch through every block after another.
    Horizontal,
}

/// Where the time of one step went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The blocks' forward, recompute and backward.
    pub compute: Duration,
    /// Getting parameters and putting gradients (waits for chunks included).
    pub store: Duration,
    /// The optimizer step (its chunk I/O included), the parts made during backward
    /// ([`BlockParams::step_early`]) and, of the last step, during this forward
    /// ([`BlockParams::step_deferred`]) included.
    pub optimizer: Duration,
}

/// What [`train_step`](super::train_step) did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamedStep {
    /// The mean loss over the micro-batches, before the step.
    pub loss: f32,
    /// The optimizer's decision.
    pub decision: StepDecision,
    /// Where the time went.
    pub times: StepTimes,
}
