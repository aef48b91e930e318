//! Export of a model in a [`ChunkStore`] as a Hugging Face LLaMA directory: safetensors
//! shards, their index and `config.json`, streamed tensor by tensor.
//!
//! # Layout of the directory (as `transformers`' `save_pretrained` writes it)
//! Tensors in forward order are cut into shards: a shard is closed when the next tensor
//! would take it past `max_shard_bytes` (a tensor larger than that gets a shard of its
//! own). One shard is `model.safetensors`; several are `model-00001-of-0000N.safetensors`
//! with `model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Each file
//! carries `__metadata__ = {"format": "pt"}`. `config.json` is the imported one, unknown
//! keys kept, with `torch_dtype` set to the exported dtype.
//!
//! # Values
//! A trainable tensor is exported from its fp32 master, a frozen one from its 16-bit copy,
//! converted to the chosen dtype (f32 -> 16-bit rounds to nearest even; a bf16 tensor
//! imported and exported as bf16 without training is byte-identical; a value beyond f16's
//! range refuses an f16 export, naming the tensor). A LoRA model is
//! exported merged: each adapted weight is `W + (alpha / r) · B · A`, computed in f32,
//! then converted. Peak memory: one tensor (an adapted weight with its A and B).
//!
//! # Atomicity
//! Everything is written into `.NAME.tmp.PID` next to the target directory and each file
//! `fsync`ed; then an existing target is renamed aside, the temporary directory renamed
//! to the target, the old one removed and the parent `fsync`ed. A failure before the
//! rename removes the temporary directory and leaves an existing target as it was. An
//! existing target is replaced only when it holds nothing but files an export writes
//! (config, weights, index, adapter and [`COPIED_FILES`]): a directory holding anything
//! else is refused before any writing, so a mistyped path never deletes a user's files.

use std::path::{Path, PathBuf};

use tidestore_chunk::typed::decode_f32;
use tidestore_chunk::{ChunkStore, DType, ListKind};

use crate::checkpoint::io_err;
use crate::error::{Result, TrainError};
use crate::hf::config::{LlamaConfig, CONFIG_FILE};
use crate::hf::files::{check_fits, encode, COPIED_FILES};
use crate::hf::names::{base_tensors, lora_adapters, LoraSpec};
use crate::hf::shards::{
    write_dir_atomically, write_shards, ExportReport, OutTensor, DEFAULT_MAX_SHARD_BYTES,
};

/// How a model is exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOptions {
    /// The dtype of every exported tensor.
    pub dtype: DType,
    /// The largest shard (see the module doc); [`DEFAULT_MAX_SHARD_BYTES`] by default.
    pub max_shard_bytes: u64,
    /// A model directory whose [`COPIED_FILES`] are copied along (the imported one).
    pub copy_from: Option<PathBuf>,
}

impl Default for ExportOptions {
    /// bf16, 5 GB shards, nothing copied along.
    fn default() -> Self {
        ExportOptions {
            dtype: DType::BF16,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            copy_from: None,
        }
    }
}

/// Writes the full model in `store` (merged, for a LoRA store) to `out_dir` as a
/// Hugging Face directory (see the module doc). Call it between steps, with no guard of
/// the model's tensors held.
pub fn export_model(
    store: &mut ChunkStore,
    cfg: &LlamaConfig,
    lora: Option<&LoraSpec>,
    out_dir: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    export_model_from(&mut |name| read_f32(store, name), cfg, lora, out_dir, opts)
}

/// A tensor's whole f32 values by its registered name: where an export reads them
/// (a store; a data-parallel rank that gathers every rank's shard).
pub type ReadTensor<'a> = dyn FnMut(&str) -> Result<Vec<f32>> + 'a;

/// [`export_model`] with each tensor's values from `read`, one tensor at a time.
pub fn export_model_from(
    read: &mut ReadTensor<'_>,
    cfg: &LlamaConfig,
    lora: Option<&LoraSpec>,
    out_dir: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    let tensors = base_tensors(cfg);
    let config = cfg.to_json(opts.dtype);
    write_export(out_dir, &tensors, Some(&config), opts, |name| {
        merged_f32(read, cfg, lora, name)
    })
}

/// Writes the tensors `tensors` (name, shape; in this order) of `store` to `out_dir` as
/// safetensors shards of `opts.dtype` with their index (see the module doc), streamed one
/// tensor at a time from its master when trainable, else its stored copy; with
/// `config_json` as `config.json` when given. For models whose config and names the
/// front end knows (the Python engine's torch modules), not only LLaMA's.
pub fn export_tensors(
    store: &mut ChunkStore,
    tensors: &[(String, Vec<usize>)],
    config_json: Option<&str>,
    out_dir: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    export_tensors_from(
        &mut |name| read_f32(store, name),
        tensors,
        config_json,
        out_dir,
        opts,
    )
}

/// [`export_tensors`] with each tensor's whole values from `read` (a data-parallel
/// rank's gather), one tensor at a time.
pub fn export_tensors_from(
    read: &mut ReadTensor<'_>,
    tensors: &[(String, Vec<usize>)],
    config_json: Option<&str>,
    out_dir: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    write_export(out_dir, tensors, config_json, opts, read)
}

/// The export both kinds share: `config_json` and the files `opts.copy_from` names, then
/// `tensors` in shards, each tensor's f32 values from `values`, checked to fit the dtype
/// and encoded; all atomically in `out_dir`.
fn write_export(
    out_dir: &Path,
    tensors: &[(String, Vec<usize>)],
    config_json: Option<&str>,
    opts: &ExportOptions,
    mut values: impl FnMut(&str) -> Result<Vec<f32>>,
) -> Result<ExportReport> {
    let dtype = opts.dtype;
    let out: Vec<OutTensor> = tensors
        .iter()
        .map(|(name, shape)| OutTensor::new(name.clone(), shape.clone(), dtype))
        .collect();
    let report = write_dir_atomically(out_dir, |tmp| {
        if let Some(json) = config_json {
            std::fs::write(tmp.join(CONFIG_FILE), json)
                .map_err(io_err("writing", &tmp.join(CONFIG_FILE)))?;
        }
        if let Some(src) = &opts.copy_from {
            copy_along(src, tmp)?;
        }
        write_shards(tmp, &out, dtype, opts.max_shard_bytes, |name| {
            let v = values(name)?;
            check_fits(name, &v, dtype)?;
            Ok(encode(&v, dtype))
        })
    })?;
    tracing::info!(dir = %out_dir.display(), shards = report.shards.len(),
        bytes = report.tensor_bytes, "model exported");
    Ok(ExportReport {
        dir: out_dir.to_path_buf(),
        ..report
    })
}

/// A tensor's values in f32: its master when trainable, else its 16-bit copy.
pub(crate) fn read_f32(store: &mut ChunkStore, name: &str) -> Result<Vec<f32>> {
    let layout = store.layout();
    let id = layout.tensor_id(name).ok_or_else(|| TrainError::Tensor {
        tensor: name.to_string(),
        reason: "not registered in the store".into(),
    })?;
    let (list, dtype) = match layout.location(id, ListKind::Master) {
        Some(loc) => (ListKind::Master, loc.dtype),
        None => {
            let loc = layout
                .location(id, ListKind::Params)
                .ok_or_else(|| TrainError::Tensor {
                    tensor: name.to_string(),
                    reason: "has no Params place (a bug)".into(),
                })?;
            (ListKind::Params, loc.dtype)
        }
    };
    let bytes = store.read(id, list)?;
    let mut out = vec![0f32; bytes.len() / dtype.size_bytes() as usize];
    decode_f32(&bytes, dtype, &mut out);
    Ok(out)
}

/// Base tensor `name` with its adapters merged in when `lora` adapts it.
fn merged_f32(
    read: &mut ReadTensor<'_>,
    cfg: &LlamaConfig,
    lora: Option<&LoraSpec>,
    name: &str,
) -> Result<Vec<f32>> {
    let mut w = read(name)?;
    let Some(l) = lora else { return Ok(w) };
    // One adapter at most per base weight; found by name (few per layer).
    if let Some(ad) = lora_adapters(cfg, l).into_iter().find(|a| a.base == name) {
        let a = read(&ad.a)?;
        let b = read(&ad.b)?;
        merge_into(
            &mut w,
            &a,
            &b,
            ad.out_features,
            ad.in_features,
            l.r,
            l.scale(),
        );
    }
    Ok(w)
}

/// `w [out, in] += scale · b [out, r] · a [r, in]`, in f32, row-major.
pub fn merge_into(
    w: &mut [f32],
    a: &[f32],
    b: &[f32],
    out: usize,
    inp: usize,
    r: usize,
    scale: f32,
) {
    assert_eq!(w.len(), out * inp, "w is [out, in]");
    assert_eq!(a.len(), r * inp, "a is [r, in]");
    assert_eq!(b.len(), out * r, "b is [out, r]");
    let mut row = vec![0f32; inp];
    for o in 0..out {
        row.iter_mut().for_each(|x| *x = 0.0);
        for k in 0..r {
            let bk = b[o * r + k];
            for (x, &ak) in row.iter_mut().zip(&a[k * inp..(k + 1) * inp]) {
                *x += bk * ak;
            }
        }
        for (wv, &x) in w[o * inp..(o + 1) * inp].iter_mut().zip(&row) {
            *wv += scale * x;
        }
    }
}

/// Copies [`COPIED_FILES`] that exist in `src` into `dst`.
fn copy_along(src: &Path, dst: &Path) -> Result<()> {
    for name in COPIED_FILES {
        let from = src.join(name);
        if from.is_file() {
            std::fs::copy(&from, dst.join(name)).map_err(io_err("copying", &from))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_matches_a_direct_product() {
        let (out, inp, r) = (3, 4, 2);
        let mut w: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let a: Vec<f32> = (0..8).map(|x| x as f32 * 0.5).collect();
        let b: Vec<f32> = (0..6).map(|x| 1.0 - x as f32).collect();
        let w0 = w.clone();
        merge_into(&mut w, &a, &b, out, inp, r, 2.0);
        for o in 0..out {
            for i in 0..inp {
                let d: f32 = (0..r).map(|k| b[o * r + k] * a[k * inp + i]).sum();
                assert_eq!(w[o * inp + i], w0[o * inp + i] + 2.0 * d);
            }
        }
    }
}
