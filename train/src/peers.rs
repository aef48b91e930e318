//! Data-parallel ranks, as the step loop sees them.
//!
//! Under data parallelism (ZeRO-DP, Gemini's layout) each rank steps only its shard of
//! every tensor: its store holds that shard's master copy, M and V, and its gradient
//! is the shard of the ranks' summed gradients (a reduce-scatter, made by the front
//! end on its framework's collectives). What the step loop needs of the other ranks is
//! one number: the global-norm clipping coefficient and the skip of a non-finite step
//! must be decided alike everywhere, from the squared norm of the *whole* gradient,
//! which is the sum of the ranks' shard norms. [`NormPeers`] is that all-reduce.
//!
//! The collectives themselves stay with the engines that exist (torch.distributed,
//! NCCL): this crate writes no transport.

use crate::error::Result;

/// The other ranks of a data-parallel run, for the step's decision.
pub trait NormPeers: Send {
    /// This rank's squared gradient norm (of its shards) summed with every other rank's
    /// (an all-reduce: every rank gets the same sum). A failed collective (a rank that
    /// died, a timeout) is [`TrainError::Collective`](crate::TrainError::Collective).
    fn sum_sq_norm(&mut self, local: f64) -> Result<f64>;
}

/// The [`NormPeers`] a step loop holds.
pub(crate) struct Peers(pub(crate) Box<dyn NormPeers>);

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NormPeers")
    }
}
