//! The collectives a data-parallel group needs, behind one trait that the engines
//! (MPI, NCCL, the in-process group of the tests) implement.

use crate::error::Result;

/// The collectives of a data-parallel group, over an engine that exists. Every rank
/// calls the same collectives in the same order; a failure (a rank that died, a
/// timeout) is [`TrainError::Collective`].
pub trait Collective: Send {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world(&self) -> usize;

    /// The engine's name, for messages and reports (`mpi`, `nccl`, `in-process`).
    fn engine(&self) -> &str;

    /// Every rank's `shard` (all of one length) laid end to end in rank order into
    /// `out` (`world` times its length).
    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> Result<()>;

    /// [`Collective::all_gather`] of 16-bit elements (bf16 parameters, as their bits).
    fn all_gather_u16(&mut self, shard: &[u16], out: &mut [u16]) -> Result<()>;

    /// `whole` (`world` times `shard`'s length) summed over the ranks; this rank's part
    /// of the sum into `shard`. Every rank sums in the same order, so a rank's part is
    /// what any rank would compute for it.
    fn reduce_scatter(&mut self, whole: &[f32], shard: &mut [f32]) -> Result<()>;

    /// `values` summed over the ranks, in place, the same on every rank.
    fn all_reduce(&mut self, values: &mut [f64]) -> Result<()>;

    /// Every rank's `mine` (lengths may differ), in rank order: the start-up checks.
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// This rank cannot go on: end every rank of the group now, with exit status
    /// `code`, as MPI's abort does (the others would wait for this rank in their next
    /// collective). An engine without such a call returns, and the other ranks fail
    /// their next collective when this one is gone.
    fn abort(&mut self, code: i32) {
        let _ = code;
    }
}
