//! The MPI engine: this process as a rank of MPI's world (Open MPI, MPICH), through
//! the `mpi` crate.

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use tidestore_train::{Collective, TrainError};

use crate::error::{Error, Result};

/// This process as a rank of MPI's world.
pub struct MpiRank {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// Finalizes MPI when the last handle on the group is dropped.
    _universe: Universe,
}

// SAFETY: MPI is initialized with `MPI_THREAD_SERIALIZED` (checked in `init`): any
// thread may call it as long as no two call at once. Every call on this rank goes
// through `tidestore_train::Ranks`, which makes them all from its one collectives
// thread, one after another, and gives the engine back to be dropped (MPI finalized)
// on the thread that drops the last handle, after joining that thread.
unsafe impl Send for MpiRank {}

impl MpiRank {
    pub fn init() -> Result<Self> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Finetune("MPI was already initialized".into()))?;
        if level < Threading::Serialized {
            return Err(Error::Finetune(format!(
                "this MPI library gives threading level {level:?}; tidestore needs \
                 Serialized (its step loop may call from another thread)"
            )));
        }
        let world = universe.world();
        Ok(MpiRank {
            rank: world.rank() as usize,
            size: world.size() as usize,
            world,
            _universe: universe,
        })
    }
}

impl MpiRank {
    /// Every rank's `shard` into `out`, in rank order.
    fn gather<T: mpi::datatype::Equivalence>(
        &self,
        shard: &[T],
        out: &mut [T],
    ) -> tidestore_train::Result<()> {
        counts(out.len())?;
        self.world.all_gather_into(shard, out);
        Ok(())
    }
}

fn counts(n: usize) -> std::result::Result<i32, TrainError> {
    i32::try_from(n).map_err(|_| {
        TrainError::Collective(format!("{n} elements exceed MPI's count (i32) in one call"))
    })
}

impl Collective for MpiRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn abort(&mut self, code: i32) {
        self.world.abort(code)
    }

    fn world(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &str {
        "mpi"
    }

    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> tidestore_train::Result<()> {
        self.gather(shard, out)
    }

    fn all_gather_u16(&mut self, shard: &[u16], out: &mut [u16]) -> tidestore_train::Result<()> {
        self.gather(shard, out)
    }

    fn reduce_scatter(&mut self, whole: &[f32], shard: &mut [f32]) -> tidestore_train::Result<()> {
        counts(whole.len())?;
        self.world
            .reduce_scatter_block_into(whole, shard, SystemOperation::sum());
        Ok(())
    }

    fn all_reduce(&mut self, values: &mut [f64]) -> tidestore_train::Result<()> {
        let mine = values.to_vec();
        self.world
            .all_reduce_into(&mine[..], values, SystemOperation::sum());
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> tidestore_train::Result<Vec<Vec<u8>>> {
        // One byte more than asked, so that no buffer is empty (Open MPI refuses the
        // dangling pointer of an empty one).
        let mine: Vec<u8> = mine.iter().copied().chain([0]).collect();
        let len = counts(mine.len())?;
        let mut lens = vec![0i32; self.size];
        self.world.all_gather_into(&len, &mut lens[..]);
        let displs: Vec<i32> = lens
            .iter()
            .scan(0i32, |at, &l| {
                let d = *at;
                *at += l;
                Some(d)
            })
            .collect();
        let total: usize = lens.iter().map(|&l| l as usize).sum();
        let mut all = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
            self.world.all_gather_varcount_into(&mine[..], &mut part);
        }
        Ok(lens
            .iter()
            .zip(&displs)
            .map(|(&l, &d)| all[d as usize..(d + l - 1) as usize].to_vec())
            .collect())
    }
}
