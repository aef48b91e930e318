//! Checkpoints of a [`TideParams`] in tidestore's one checkpoint format: the trainer's
//! ([`tidestore_train::Trainer::save`] / [`tidestore_train::Trainer::load`]: every
//! parameter with its master copy, M, V and 16-bit copy, the controller state, the
//! precision; streamed from the store, crc32c per tensor, atomic, verified whole before
//! a load changes anything). The glue adds only what candle's side knows: no checkpoint
//! between `backward()` and `step()`, and no load while a forward pass holds the old
//! values.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tidestore_train::Trainer;

use crate::error::{Error, Result};
use crate::tide::TideParams;

/// Writes `params`' state to `path` atomically. Call it between iterations: after
/// [`TideParams::step`], not between [`TideParams::backward`] and the step.
pub fn save(params: &mut TideParams, path: &Path) -> Result<()> {
    save_with(params, path, BTreeMap::new())
}

/// [`save`] with the caller's `metadata` (string pairs, e.g. a run's identity) in the
/// file; read back with [`Trainer::read_metadata`].
pub fn save_with(
    params: &mut TideParams,
    path: &Path,
    metadata: BTreeMap<String, String>,
) -> Result<()> {
    if params.grads_pending() {
        return Err(refused(
            path,
            "saved between backward() and step(); step first",
        ));
    }
    Ok(params.trainer_mut().save(path, metadata)?)
}

/// Loads the checkpoint at `path` into `params` (the same registration and precision):
/// values, 16-bit copies, M, V, the step count and the loss scaler. Call it between
/// iterations, with no forward pass in progress. A file that is refused leaves `params`
/// as it was.
pub fn load(params: &mut TideParams, path: &Path) -> Result<()> {
    if params.grads_pending() {
        return Err(refused(
            path,
            "loaded between backward() and step(); step first",
        ));
    }
    if params.forward_in_progress() {
        return Err(refused(
            path,
            "loaded while a forward pass holds the old values; load before forward",
        ));
    }
    params.trainer_mut().load(path)?;
    Ok(())
}

/// The parameters of the checkpoint at `path`, by name, as fp32 values (see
/// [`Trainer::read_params`]).
pub fn read_params(path: &Path) -> Result<HashMap<String, Vec<f32>>> {
    Ok(Trainer::read_params(path)?)
}

fn refused(path: &Path, reason: &str) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("cannot be {reason}"),
    }
}
