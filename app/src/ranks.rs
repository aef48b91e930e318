//! The ranks of a data-parallel `tidestore finetune`: launched as people launch MPI
//! programs (`mpirun -np 2 tidestore finetune`), each process one rank, the collectives
//! MPI's (Open MPI, MPICH: the `mpi` feature, through the `mpi` crate). On GPUs NCCL is
//! the engine people use; here, on CPU ranks, MPI is the one that exists and is kept.
//!
//! A rank learns its place from the launcher's environment: `OMPI_COMM_WORLD_SIZE`
//! (Open MPI) or `PMI_SIZE` (MPICH, Slurm). Without either, or with one rank, the run is
//! the ordinary single-process one.
//!
//! A rank that dies: MPI's launcher ends the job, the other ranks with it (`mpirun`
//! reports the rank that exited first); checkpoints already written stay valid.

use tidestore_train::Ranks;

use crate::error::{Error, Result};

/// The launcher's variables that give the world size, in the order they are read.
const WORLD_VARS: [&str; 2] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

/// The world size the launcher set (`None`: not launched as ranks).
fn launched_world() -> Result<Option<(&'static str, usize)>> {
    for var in WORLD_VARS {
        if let Ok(v) = std::env::var(var) {
            let n = v
                .trim()
                .parse::<usize>()
                .map_err(|_| Error::Finetune(format!("{var} = {v:?} is not a number of ranks")))?;
            return Ok(Some((var, n)));
        }
    }
    Ok(None)
}

/// The launcher's variables that give a rank's place among the ranks on its machine.
const LOCAL_RANK_VARS: [&str; 2] = ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"];

/// This rank's place among the ranks on its machine, as the launcher set it (`None`:
/// no launcher said): the GPU it takes unless `device.ordinal` names one, so that the
/// ranks on one machine do not all open GPU 0.
pub fn local_rank() -> Result<Option<usize>> {
    local_rank_in(|var| std::env::var(var).ok())
}

/// [`local_rank`] from the variables `get` gives.
fn local_rank_in(get: impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    for var in LOCAL_RANK_VARS {
        if let Some(v) = get(var) {
            return v
                .trim()
                .parse::<usize>()
                .map(Some)
                .map_err(|_| Error::Finetune(format!("{var} = {v:?} is not a local rank")));
        }
    }
    Ok(None)
}

/// This process's ranks when a launcher started it as one of several, else `None`.
pub fn from_env() -> Result<Option<Ranks>> {
    match launched_world()? {
        None | Some((_, 0 | 1)) => Ok(None),
        Some((var, n)) => join(var, n).map(Some),
    }
}

/// Ends the whole job for `error` on this rank: the error printed, naming the rank,
/// then every rank stopped through the engine (MPI's abort), since the others would wait
/// for this one in their next collective. Does not return.
pub fn fail(ranks: &Ranks, error: &Error) -> ! {
    use std::io::Write;
    // Not `eprintln!`: a closed stderr must not turn an error into a panic.
    let _ = writeln!(
        std::io::stderr(),
        "error (rank {} of {}): {}",
        ranks.rank(),
        ranks.world(),
        error.one_line()
    );
    ranks.abort(i32::from(error.exit_code()));
    std::process::exit(i32::from(error.exit_code()))
}

#[cfg(feature = "mpi")]
fn join(var: &str, n: usize) -> Result<Ranks> {
    let rank = mpi_engine::MpiRank::init()?;
    use tidestore_train::Collective;
    if rank.world() != n {
        return Err(Error::Finetune(format!(
            "{var} = {n}, but MPI's world has {} ranks",
            rank.world()
        )));
    }
    tracing::info!(
        rank = rank.rank(),
        world = n,
        "tidestore finetune: MPI rank"
    );
    Ok(Ranks::new(Box::new(rank))?)
}

#[cfg(not(feature = "mpi"))]
fn join(var: &str, n: usize) -> Result<Ranks> {
    Err(Error::Finetune(format!(
        "launched as one of {n} ranks ({var} = {n}), but this tidestore was built without \
         MPI: build it with `cargo build --release --features mpi` (needs an MPI library, \
         e.g. Debian's libopenmpi-dev, and libclang-dev), or run one process"
    )))
}

#[cfg(feature = "mpi")]
#[allow(unsafe_code)]
mod mpi_engine {
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
    // thread may call it as long as no two call at once, and every call on this rank goes
    // through `tidestore_train::Ranks`, which holds it behind one mutex.
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

        fn all_gather_u16(
            &mut self,
            shard: &[u16],
            out: &mut [u16],
        ) -> tidestore_train::Result<()> {
            self.gather(shard, out)
        }

        fn reduce_scatter(
            &mut self,
            whole: &[f32],
            shard: &mut [f32],
        ) -> tidestore_train::Result<()> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_rank_is_open_mpis_or_mpichs() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank_in(env(&[])).unwrap(), None);
        let ompi = env(&[
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("MPI_LOCALRANKID", "5"),
        ]);
        assert_eq!(local_rank_in(ompi).unwrap(), Some(1));
        assert_eq!(
            local_rank_in(env(&[("MPI_LOCALRANKID", " 3 ")])).unwrap(),
            Some(3)
        );
        let e = local_rank_in(env(&[("MPI_LOCALRANKID", "x")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("MPI_LOCALRANKID = \"x\" is not a local rank"),
            "{e}"
        );
    }
}
