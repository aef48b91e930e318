//! The ranks of a data-parallel `tidestore finetune`, launched as people launch such
//! programs, each process one rank. Two engines, chosen by the launcher:
//! - `mpirun -np 2 tidestore finetune`: MPI's collectives (Open MPI, MPICH; the `mpi`
//!   feature, through the `mpi` crate). On CPU ranks MPI is the engine that exists and
//!   is kept.
//! - `torchrun --nproc-per-node 2 --no-python tidestore finetune` (or any launcher that
//!   sets torchrun's `RANK`, `WORLD_SIZE` and `LOCAL_RANK`): NCCL's, on each rank's GPU
//!   (the `nccl` feature, through cudarc's binding; see `nccl.rs`).
//!
//! A rank learns its place from the launcher's environment: `OMPI_COMM_WORLD_SIZE`
//! (Open MPI) or `PMI_SIZE` (MPICH, Slurm) for MPI, `WORLD_SIZE` and `RANK` for
//! torchrun. Without any, or with one rank, the run is the ordinary single-process one.
//!
//! A rank that dies: the launcher ends the job, the other ranks with it (`mpirun`
//! reports the rank that exited first; torchrun's agent stops the other workers);
//! checkpoints already written stay valid.

use tidestore_train::Ranks;

use crate::error::{Error, Result};

mod id_file;
#[cfg(feature = "mpi")]
#[allow(unsafe_code)]
mod mpi;
#[cfg(feature = "nccl")]
#[allow(unsafe_code)]
mod nccl;

/// MPI launchers' variables that give the world size, in the order they are read.
const MPI_WORLD_VARS: [&str; 2] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

/// How this process was launched as one of several ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    /// By an MPI launcher: `var` gave the world size `world`; MPI tells the rank.
    Mpi { var: &'static str, world: usize },
    /// By torchrun (or alike): rank `rank` of `world`.
    Torchrun { rank: usize, world: usize },
}

impl Launch {
    fn world(&self) -> usize {
        match self {
            Launch::Mpi { world, .. } | Launch::Torchrun { world, .. } => *world,
        }
    }
}

/// A launcher's variable as a number; `what` names it in the error.
fn number(var: &str, v: &str, what: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| Error::Finetune(format!("{var} = {v:?} is not {what}")))
}

/// How the variables `get` gives launched this process (`None`: not as ranks). MPI's
/// variables are read first: `mpirun` may run under a torchrun-style environment, never
/// the other way round.
fn launch_in(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
    for var in MPI_WORLD_VARS {
        if let Some(v) = get(var) {
            let world = number(var, &v, "a number of ranks")?;
            return Ok(Some(Launch::Mpi { var, world }));
        }
    }
    let Some(w) = get("WORLD_SIZE") else {
        return Ok(None);
    };
    let world = number("WORLD_SIZE", &w, "a number of ranks")?;
    let rank = match get("RANK") {
        Some(r) => number("RANK", &r, "a rank")?,
        None if world <= 1 => 0,
        None => {
            return Err(Error::Finetune(format!(
                "WORLD_SIZE = {world} but RANK is not set: launch the ranks with torchrun \
                 (`torchrun --nproc-per-node {world} --no-python tidestore finetune`), which \
                 sets both"
            )))
        }
    };
    if rank >= world.max(1) {
        return Err(Error::Finetune(format!(
            "RANK = {rank} is not below WORLD_SIZE = {world}"
        )));
    }
    Ok(Some(Launch::Torchrun { rank, world }))
}

/// The launcher's variables that give a rank's place among the ranks on its machine.
const LOCAL_RANK_VARS: [&str; 3] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "LOCAL_RANK",
];

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
            return number(var, &v, "a local rank").map(Some);
        }
    }
    Ok(None)
}

/// This process's ranks when a launcher started it as one of several, else `None`.
pub fn from_env() -> Result<Option<Ranks>> {
    match launch_in(|var| std::env::var(var).ok())? {
        Some(launch) if launch.world() > 1 => join(&launch).map(Some),
        _ => Ok(None),
    }
}

/// Joins the ranks `launch` describes through its engine.
fn join(launch: &Launch) -> Result<Ranks> {
    match *launch {
        Launch::Mpi { var, world } => join_mpi(var, world),
        Launch::Torchrun { rank, world } => join_nccl(rank, world),
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
fn join_mpi(var: &str, n: usize) -> Result<Ranks> {
    let rank = mpi::MpiRank::init()?;
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
fn join_mpi(var: &str, n: usize) -> Result<Ranks> {
    Err(Error::Finetune(format!(
        "launched as one of {n} ranks ({var} = {n}), but this tidestore was built without \
         MPI: build it with `cargo build --release --features mpi` (needs an MPI library, \
         e.g. Debian's libopenmpi-dev, and libclang-dev), or run one process"
    )))
}

#[cfg(feature = "nccl")]
fn join_nccl(rank: usize, world: usize) -> Result<Ranks> {
    let ordinal = local_rank()?.unwrap_or(0);
    let engine = nccl::NcclRank::init(rank, world, ordinal, &id_file::IdExchange::from_env()?)?;
    tracing::info!(rank, world, ordinal, "tidestore finetune: NCCL rank");
    Ok(Ranks::new(Box::new(engine))?)
}

#[cfg(not(feature = "nccl"))]
fn join_nccl(rank: usize, world: usize) -> Result<Ranks> {
    Err(Error::Finetune(format!(
        "launched as rank {rank} of {world} by torchrun-style variables (WORLD_SIZE = \
         {world}), but this tidestore was built without NCCL: build it with `cargo build \
         --release --features nccl` (the ranks need a GPU each and NCCL's library), launch \
         CPU ranks with `mpirun` (the `mpi` feature), or run one process"
    )))
}

/// A launcher's environment of `pairs`, as the `*_in` functions read it.
#[cfg(test)]
fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k: &str| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::env_of as env;
    use super::*;

    #[test]
    fn mpis_launchers_and_torchruns_are_told_apart() {
        assert_eq!(launch_in(env(&[])).unwrap(), None);
        assert_eq!(
            launch_in(env(&[("WORLD_SIZE", "4"), ("RANK", "3")])).unwrap(),
            Some(Launch::Torchrun { rank: 3, world: 4 })
        );
        // mpirun inside a torchrun-style environment: MPI's variables decide.
        assert_eq!(
            launch_in(env(&[("WORLD_SIZE", "4"), ("PMI_SIZE", "2")])).unwrap(),
            Some(Launch::Mpi {
                var: "PMI_SIZE",
                world: 2
            })
        );
        // One process under torchrun is the single-process run.
        assert_eq!(
            launch_in(env(&[("WORLD_SIZE", "1")]))
                .unwrap()
                .map(|l| l.world()),
            Some(1)
        );
        for (vars, says) in [
            (&[("WORLD_SIZE", "2")][..], "RANK is not set"),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")][..],
                "RANK = 2 is not below WORLD_SIZE = 2",
            ),
            (
                &[("WORLD_SIZE", "two"), ("RANK", "0")][..],
                "WORLD_SIZE = \"two\" is not a number",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "-1")][..],
                "RANK = \"-1\" is not a rank",
            ),
        ] {
            let e = launch_in(env(vars)).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn the_local_rank_is_open_mpis_or_mpichs() {
        assert_eq!(local_rank_in(env(&[])).unwrap(), None);
        let ompi = env(&[
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("MPI_LOCALRANKID", "5"),
        ]);
        assert_eq!(local_rank_in(ompi).unwrap(), Some(1));
        assert_eq!(
            local_rank_in(env(&[("LOCAL_RANK", "2")])).unwrap(),
            Some(2),
            "torchrun's"
        );
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
