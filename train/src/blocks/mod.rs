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
//! With several micro-batches (gradient accumulation) the [`MicroBatchOrder`] says how
//! they meet the blocks:
//! - [`MicroBatchOrder::Vertical`] (the default): every micro-batch goes through a block
//!   before the next block, forward and, in reverse, backward. A block's parameters are
//!   fetched once per pass however many micro-batches there are, so each block's
//!   weights cross the disk once in forward and once in backward per step; its
//!   gradients are summed over the micro-batches in the framework's memory and put
//!   once. Every micro-batch's block inputs are kept.
//! - [`MicroBatchOrder::Horizontal`]: steps 1–3 run for one micro-batch after another,
//!   each fetching every block's parameters again; the first micro-batch's gradients
//!   replace what the store holds, later ones are added to it there.
//!
//! Both give a parameter's gradient as the sum over the micro-batches in the same order
//! (bit-identical); a parameter used by several blocks is summed in another order
//! (within fp32 rounding). With one micro-batch the two are the same computation.
//!
//! Block inputs (`batch · time · hidden` each, one per block and micro-batch) stay in
//! the framework's memory, not in the store, where [`SavedInputs`] says: where the
//! blocks compute, or in host memory ([`SavedInputs::Host`], for long sequences on a
//! GPU), copied there once the block that read it is done and back for its backward;
//! the compute device then holds only the inputs the next block reads.
//!
//! **Activations are non-model memory where the blocks compute.** Before each block's
//! forward and backward the driver tells the source what the activations take then
//! ([`BlockParams::hold_activations`]): the saved inputs and the gradients flowing
//! back, by their sizes ([`Blocks::tensor_bytes`]), what a forward kept for the
//! backward after it ([`Blocks::kept_bytes`]), and what the block about to run
//! allocates on top ([`Blocks::working_bytes`]); 0 once backward is done. A store on a
//! device that cannot measure them (the simulation) counts them against its tidal
//! budget, so chunks never take the memory the blocks need.

mod contract;
mod driver;

pub use contract::{
    BlockGrads, BlockParams, BlockSchedule, Blocks, Keeping, Loan, MicroBatchOrder, SavedInputs,
    StepTimes, StreamedStep, Upstream,
};
pub use driver::train_step;
