//! Checkpoints of a [`TideParams`]: fp32 parameter values (the master copy of trainable
//! ones, the tensor itself of frozen ones), Adam M and V, and the step count, in one
//! safetensors file written atomically (a temporary file in the same directory, fsync,
//! rename, fsync of the directory), so a crash leaves the old checkpoint or the new one,
//! never half of one.
//!
//! Keys: `param/NAME`, `adam_m/NAME`, `adam_v/NAME` (trainable only), and `meta/step`
//! (one i64). [`read_params`] reads only the `param/` tensors, e.g. to start a LoRA
//! fine-tune from a fully trained base.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tidestore_optimizer::ControllerState;

use crate::error::{Error, Result};
use crate::tide::TideParams;

fn err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Writes `params`' state to `path` atomically.
pub fn save(params: &mut TideParams, path: &Path) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let specs: Vec<_> = params.specs().cloned().collect();
    let cpu = Device::Cpu;
    for spec in &specs {
        let shape = spec.shape.as_slice();
        let values = params.values(&spec.name)?;
        tensors.insert(
            format!("param/{}", spec.name),
            Tensor::from_vec(values, shape, &cpu)?,
        );
        if spec.trainable {
            let (m, v) = params.moments(&spec.name)?;
            tensors.insert(
                format!("adam_m/{}", spec.name),
                Tensor::from_vec(m, shape, &cpu)?,
            );
            tensors.insert(
                format!("adam_v/{}", spec.name),
                Tensor::from_vec(v, shape, &cpu)?,
            );
        }
    }
    let step = i64::try_from(params.controller_state().step).map_err(|e| err(path, e))?;
    tensors.insert("meta/step".into(), Tensor::new(&[step], &cpu)?);

    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| err(path, e))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    candle_core::safetensors::save(&tensors, &tmp)?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| err(path, e))?;
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| err(&dir, e))?;
    tracing::info!(path = %path.display(), step, "tidestore-candle: checkpoint written");
    Ok(())
}

/// Loads `path` into `params` (same registration): values, M, V and the step count.
/// A parameter missing from the file is an error naming it.
pub fn load(params: &mut TideParams, path: &Path) -> Result<()> {
    let mut tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
    let mut take = |key: String| -> Result<Vec<f32>> {
        let t = tensors
            .remove(&key)
            .ok_or_else(|| err(path, format!("no tensor `{key}`")))?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    };
    let specs: Vec<_> = params.specs().cloned().collect();
    for spec in &specs {
        let values = take(format!("param/{}", spec.name))?;
        if spec.trainable {
            let m = take(format!("adam_m/{}", spec.name))?;
            let v = take(format!("adam_v/{}", spec.name))?;
            params.restore(&spec.name, &values, Some((&m, &v)))?;
        } else {
            params.restore(&spec.name, &values, None)?;
        }
    }
    let step = tensors
        .remove("meta/step")
        .ok_or_else(|| err(path, "no tensor `meta/step`"))?
        .to_vec1::<i64>()?;
    let step = step
        .first()
        .and_then(|&s| u64::try_from(s).ok())
        .ok_or_else(|| err(path, "`meta/step` is not one non-negative integer"))?;
    params.restore_controller(ControllerState {
        step,
        loss_scaler: None,
    })?;
    tracing::info!(path = %path.display(), step, "tidestore-candle: checkpoint loaded");
    Ok(())
}

/// The `param/` tensors of a checkpoint, by parameter name (fp32 values, flattened).
pub fn read_params(path: &Path) -> Result<HashMap<String, Vec<f32>>> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
    tensors
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("param/").map(|n| (n.to_string(), t)))
        .map(|(n, t)| Ok((n, t.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}
