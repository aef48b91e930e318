//! What `finetune` does otherwise as one rank of a data-parallel run ([`crate::ranks`]):
//! - each rank's store holds its shard of every parameter
//!   ([`TideParams::open_sharded`]);
//! - micro-batch `k` of rank `r` of `N` is the run's micro-batch `k · N + r`, so `N`
//!   ranks with `train.accumulation = a` see the batches of one rank with `a · N`, and
//!   train as it does (the ranks' gradients averaged, as one rank averages its
//!   micro-batches);
//! - the loss reported is the ranks' mean;
//! - checkpoints: rank `r` writes its shards to `train.checkpoint_dir/rank{r}/`, with
//!   the world size in the run's identity (another world size is refused when resuming:
//!   tidestore does not re-shard); a resume continues from the newest step every rank
//!   has (a rank killed while writing leaves the others one checkpoint ahead);
//! - the export: rank 0 writes it, every tensor gathered from the ranks as it is
//!   written.

use std::path::{Path, PathBuf};

use tidestore_candle::TideParams;
use tidestore_train::{hf, CheckpointDir, Ranks, TrainError};

use crate::error::{Error, Result};

/// Rank `r`'s checkpoint directory in `dir`.
pub(super) fn checkpoint_dir(dir: &Path, ranks: Option<&Ranks>) -> Result<PathBuf> {
    let Some(r) = ranks else {
        let of_ranks = dir.join(rank_dir(0));
        if of_ranks.is_dir() {
            return Err(Error::config(
                "train.checkpoint_dir",
                format!(
                    "{} holds the checkpoints of a data-parallel run ({}); resume it with \
                     its ranks (mpirun or torchrun), or give this run another directory",
                    dir.display(),
                    of_ranks.display()
                ),
            ));
        }
        return Ok(dir.to_path_buf());
    };
    Ok(dir.join(rank_dir(r.rank())))
}

fn rank_dir(rank: usize) -> String {
    format!("rank{rank}")
}

/// The newest checkpoint every rank has (`None`: none has one).
pub(super) fn common_latest(dir: &CheckpointDir, ranks: &Ranks) -> Result<Option<(u64, PathBuf)>> {
    let mine = dir.list()?;
    let steps: Vec<u64> = mine.iter().map(|(s, _)| *s).collect();
    let all: Vec<Vec<u64>> = ranks.gather_json(&steps, "checkpoint steps")?;
    let mut common: Option<Vec<u64>> = None;
    let mut any = false;
    for theirs in all {
        any |= !theirs.is_empty();
        common = Some(match common {
            None => theirs,
            Some(c) => c.into_iter().filter(|s| theirs.contains(s)).collect(),
        });
    }
    let newest = common.unwrap_or_default().into_iter().max();
    match newest {
        Some(step) => Ok(mine.into_iter().find(|(s, _)| *s == step)),
        None if any => Err(Error::config(
            "train.checkpoint_dir",
            format!(
                "the ranks have no checkpoint step in common ({} has {steps:?}); resume \
                 needs every rank's shards of one step",
                dir.dir().display()
            ),
        )),
        None => Ok(None),
    }
}

/// The run's micro-batch number of this rank's micro-batch `k`.
pub(super) fn micro_batch(k: u64, ranks: Option<&Ranks>) -> u64 {
    ranks.map_or(k, |r| k * r.world() as u64 + r.rank() as u64)
}

/// The ranks' mean loss and their loss tokens in all.
pub(super) fn across_ranks(loss: f32, tokens: u64, ranks: Option<&Ranks>) -> Result<(f32, u64)> {
    let Some(r) = ranks else {
        return Ok((loss, tokens));
    };
    let mut v = [f64::from(loss), tokens as f64];
    r.sum(&mut v)?;
    Ok(((v[0] / r.world() as f64) as f32, v[1] as u64))
}

/// Every rank's `mine`, in rank order, for rank 0's report.
pub(super) fn every_rank(
    mine: super::RankFigures,
    ranks: &Ranks,
) -> Result<Vec<super::RankFigures>> {
    Ok(ranks.gather_json(&mine, "report figures")?)
}

/// Runs `write` (the export) on rank 0, reading each tensor whole as it is written;
/// every other rank joins each tensor's gather until rank 0 says it is done.
pub(super) fn export<F>(ranks: &Ranks, params: &mut TideParams, write: F) -> Result<()>
where
    F: FnOnce(&mut hf::ReadTensor<'_>) -> tidestore_train::Result<()>,
{
    // The end of the export, told to the others (no tensor has an empty name).
    const DONE: &[u8] = b"";
    if ranks.rank() != 0 {
        loop {
            let name = ranks.from_rank0(DONE)?;
            if name.is_empty() {
                return Ok(());
            }
            let name = String::from_utf8_lossy(&name).into_owned();
            params.values(&name)?;
        }
    }
    let written = write(&mut |name| {
        ranks.from_rank0(name.as_bytes())?;
        params.values(name).map_err(|e| match e {
            tidestore_candle::Error::Train(t) => t,
            other => TrainError::Collective(format!("gathering `{name}`: {other}")),
        })
    });
    ranks.from_rank0(DONE)?;
    Ok(written?)
}
