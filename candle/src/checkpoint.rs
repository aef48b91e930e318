//! Checkpoints of a [`TideParams`] in tidestore's one checkpoint format,
//! `tidestore.checkpoint.v1` ([`tidestore_train::checkpoint`]): the glue only says which
//! tensors are state; the train crate streams them between the store and the file.
//!
//! What a checkpoint holds: every registered parameter — a trainable one with its fp32
//! master copy (`optimizer.master.NAME`), Adam M and V (`optimizer.exp_avg.NAME`,
//! `optimizer.exp_avg_sq.NAME`) and its 16-bit copy (`NAME`, bf16), a frozen one (a LoRA
//! base) as its fp32 values under `NAME` — and the step loop's controller state (step
//! count, loss scaler). The gradient companions `NAME#grad` of [`Precision::F32`] hold
//! only the last backward's gradients and are not saved. In `F32` mode forward reads the
//! master copy and the 16-bit copy is never written (it is saved as zeros); in `Bf16` mode
//! it is the copy forward reads.
//!
//! The precision is recorded in the file's metadata (`user.candle.precision`) and a
//! load into the other precision is refused: an `F32` file's 16-bit copies are zeros,
//! which a `Bf16` forward would read.
//!
//! The train crate gives: tensors streamed one at a time (peak memory one tensor, never
//! the model), a crc32c per tensor, an atomic write (temporary file, `fsync`, rename,
//! directory `fsync`), and a load that verifies the whole file before it changes
//! anything. Every refusal names the file and the tensor ([`Error::Train`] with a
//! [`tidestore_train::TrainError`]).
//!

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tidestore_chunk::typed;
use tidestore_train::checkpoint as ckpt;
use tidestore_train::CheckpointState;

use crate::error::{Error, Result};
use crate::tide::{Precision, TideParams};

/// File-name prefix of the fp32 master copies (see [`ckpt::tensor_name`]).
const MASTER_PREFIX: &str = "optimizer.master.";
/// File-name prefix of every optimizer entry.
const OPTIMIZER_PREFIX: &str = "optimizer.";
/// Metadata key of the precision the file was saved in.
const KEY_PRECISION: &str = "candle.precision";

fn precision_text(p: Precision) -> &'static str {
    match p {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
    }
}

/// Writes `params`' state to `path` atomically. Call it between iterations: after
/// [`TideParams::step`], not between [`TideParams::backward`] and the step (the
/// gradients would be lost, and in `Bf16` mode they lie over the 16-bit copy).
pub fn save(params: &mut TideParams, path: &Path) -> Result<()> {
    if params.grads_pending() {
        return Err(refused(
            path,
            "saved between backward() and step(); step first",
        ));
    }
    let tensors = params.checkpoint_ids();
    let state = CheckpointState {
        controller: params.controller_state(),
        metadata: BTreeMap::from([(
            KEY_PRECISION.to_string(),
            precision_text(params.precision()).to_string(),
        )]),
    };
    ckpt::save(params.store_mut(), &tensors, &state, path)?;
    Ok(())
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
    // The header alone (no tensor is read): the precision before anything is loaded.
    let (header, _) = ckpt::read_tensors(path, |_| false)?;
    let want = precision_text(params.precision());
    match header.metadata.get(KEY_PRECISION).map(String::as_str) {
        Some(found) if found == want => {}
        found => {
            return Err(refused(
                path,
                &format!(
                    "loaded: metadata `user.{KEY_PRECISION}` is {found:?}, this model trains in \"{want}\""
                ),
            ))
        }
    }
    let tensors = params.checkpoint_ids();
    // Verified whole before the store is changed; the controller only after that.
    let state = ckpt::load(params.store_mut(), &tensors, path)?;
    params.restore_controller(state.controller)?;
    Ok(())
}

/// The parameters of the checkpoint at `path`, by name, as fp32 values (flattened): the
/// master copy of a trainable parameter, the tensor itself of a frozen one. Reads only
/// those tensors, each checked against its crc32c; for seeding a model of another
/// layout, e.g. a LoRA base from a full run's checkpoint.
pub fn read_params(path: &Path) -> Result<HashMap<String, Vec<f32>>> {
    let (_, tensors) = ckpt::read_tensors(path, |name| {
        name.starts_with(MASTER_PREFIX) || !name.starts_with(OPTIMIZER_PREFIX)
    })?;
    let mut out = HashMap::with_capacity(tensors.len());
    let mut masters = Vec::new();
    for t in tensors {
        let mut values = vec![0.0f32; t.shape.iter().product()];
        typed::decode_f32(&t.bytes, t.dtype, &mut values);
        match t.name.strip_prefix(MASTER_PREFIX) {
            Some(name) => masters.push((name.to_string(), values)),
            None => {
                out.insert(t.name, values);
            }
        }
    }
    // A trainable parameter's master copy over its 16-bit copy.
    out.extend(masters);
    Ok(out)
}

fn refused(path: &Path, reason: &str) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("cannot be {reason}"),
    }
}
