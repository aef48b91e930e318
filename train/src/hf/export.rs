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

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tidestore_chunk::typed::decode_f32;
use tidestore_chunk::{ChunkStore, DType, ListKind};

use crate::checkpoint::{io_err, safetensors_header, sync_dir, HeaderTensor, WRITE_BUFFER_BYTES};
use crate::error::{Result, TrainError};
use crate::hf::config::{LlamaConfig, CONFIG_FILE};
use crate::hf::import::{encode, F16_MAX, INDEX_FILE, SINGLE_FILE};
use crate::hf::names::{base_tensors, lora_adapters, LoraSpec};
use crate::hf::peft::ADAPTER_CONFIG_FILE;

/// `transformers`' default `max_shard_size`, "5GB" (decimal).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Files of a model directory other than weights and config that an export copies
/// along when they exist (tokenizer and generation settings).
pub const COPIED_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
];

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

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportReport {
    /// The directory.
    pub dir: PathBuf,
    /// The weight files written, in order (names in the directory).
    pub shards: Vec<String>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub tensor_bytes: u64,
}

/// One tensor to write: name, shape and its size in the output dtype.
#[derive(Debug, Clone)]
pub(crate) struct OutTensor {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) len_bytes: usize,
}

impl OutTensor {
    pub(crate) fn new(name: String, shape: Vec<usize>, dtype: DType) -> Self {
        let len_bytes = shape.iter().product::<usize>() * dtype.size_bytes() as usize;
        OutTensor {
            name,
            shape,
            len_bytes,
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
    let dtype = opts.dtype;
    let tensors: Vec<OutTensor> = base_tensors(cfg)
        .into_iter()
        .map(|(name, shape)| OutTensor::new(name, shape, dtype))
        .collect();
    let report = write_dir_atomically(out_dir, |tmp| {
        std::fs::write(tmp.join(CONFIG_FILE), cfg.to_json(dtype))
            .map_err(io_err("writing", &tmp.join(CONFIG_FILE)))?;
        if let Some(src) = &opts.copy_from {
            copy_along(src, tmp)?;
        }
        write_shards(tmp, &tensors, dtype, opts.max_shard_bytes, |name| {
            let values = merged_f32(store, cfg, lora, name)?;
            check_fits(name, &values, dtype)?;
            Ok(encode(&values, dtype))
        })
    })?;
    tracing::info!(dir = %out_dir.display(), shards = report.shards.len(),
        bytes = report.tensor_bytes, "model exported");
    Ok(ExportReport {
        dir: out_dir.to_path_buf(),
        ..report
    })
}

/// Refuses values an f16 export would turn into infinities.
pub(crate) fn check_fits(name: &str, values: &[f32], dtype: DType) -> Result<()> {
    if dtype != DType::F16 {
        return Ok(());
    }
    match values.iter().find(|v| v.is_finite() && v.abs() > F16_MAX) {
        None => Ok(()),
        Some(v) => Err(TrainError::Tensor {
            tensor: name.to_string(),
            reason: format!("holds {v}, beyond f16's range (±{F16_MAX}): export it as bf16 or f32"),
        }),
    }
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
    store: &mut ChunkStore,
    cfg: &LlamaConfig,
    lora: Option<&LoraSpec>,
    name: &str,
) -> Result<Vec<f32>> {
    let mut w = read_f32(store, name)?;
    let Some(l) = lora else { return Ok(w) };
    // One adapter at most per base weight; found by name (few per layer).
    if let Some(ad) = lora_adapters(cfg, l).into_iter().find(|a| a.base == name) {
        let a = read_f32(store, &ad.a)?;
        let b = read_f32(store, &ad.b)?;
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

/// The shard file names for `n` shards.
fn shard_name(i: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
    }
}

/// Cuts `tensors` into shards of at most `max_bytes` each (a larger tensor alone).
fn plan_shards(tensors: &[OutTensor], max_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, t) in tensors.iter().enumerate() {
        let len = t.len_bytes as u64;
        if i > start && bytes + len > max_bytes {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += len;
    }
    if start < tensors.len() {
        out.push(start..tensors.len());
    }
    out
}

/// Writes `tensors` (bytes in `dtype` from `source`) into `dir` as shards, and the index
/// when there are several; returns what was written (without `dir`).
pub(crate) fn write_shards(
    dir: &Path,
    tensors: &[OutTensor],
    dtype: DType,
    max_shard_bytes: u64,
    mut source: impl FnMut(&str) -> Result<Vec<u8>>,
) -> Result<ExportReport> {
    let plan = plan_shards(tensors, max_shard_bytes.max(1));
    let mut weight_map = serde_json::Map::new();
    let mut report = ExportReport {
        dir: PathBuf::new(),
        shards: Vec::with_capacity(plan.len()),
        tensors: 0,
        tensor_bytes: 0,
    };
    for (i, range) in plan.iter().enumerate() {
        let name = shard_name(i, plan.len());
        let shard = &tensors[range.clone()];
        write_shard(&dir.join(&name), shard, dtype, &mut source)?;
        for t in shard {
            weight_map.insert(t.name.clone(), name.clone().into());
            report.tensor_bytes += t.len_bytes as u64;
        }
        report.tensors += shard.len();
        report.shards.push(name);
    }
    if plan.len() > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": report.tensor_bytes},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index)
            .unwrap_or_else(|e| unreachable!("a JSON value always serialises: {e}"));
        std::fs::write(&path, text + "\n").map_err(io_err("writing", &path))?;
    }
    Ok(report)
}

/// One shard: header, then each tensor's bytes as `source` gives them; `fsync`ed.
fn write_shard(
    path: &Path,
    tensors: &[OutTensor],
    dtype: DType,
    source: &mut impl FnMut(&str) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    let header = safetensors_header(
        tensors.iter().map(|t| HeaderTensor {
            name: &t.name,
            dtype,
            shape: &t.shape,
            len_bytes: t.len_bytes,
        }),
        meta,
    );
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err("creating", path))?;
    let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
    w.write_all(&header)
        .map_err(io_err("writing the header of", path))?;
    for t in tensors {
        let bytes = source(&t.name)?;
        if bytes.len() != t.len_bytes {
            return Err(TrainError::Tensor {
                tensor: t.name.clone(),
                reason: format!(
                    "{} bytes to export, its shape and dtype say {}",
                    bytes.len(),
                    t.len_bytes
                ),
            });
        }
        w.write_all(&bytes)
            .map_err(io_err("writing a tensor to", path))?;
    }
    let file: File = w
        .into_inner()
        .map_err(|e| io_err("writing", path)(e.into_error()))?;
    file.sync_all().map_err(io_err("syncing", path))
}

/// Runs `fill` on a fresh temporary directory next to `target`, then puts it in
/// `target`'s place (see the module doc). Returns what `fill` returned.
pub(crate) fn write_dir_atomically<T>(
    target: &Path,
    fill: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let name = target
        .file_name()
        .ok_or_else(|| TrainError::ExportTarget {
            path: target.to_path_buf(),
            reason: "is not a directory path with a name".into(),
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io_err("creating", &parent))?;
    check_replaceable(target)?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp.{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err("removing a stale", &tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err("creating", &tmp))?;
    let out = match fill(&tmp).and_then(|out| sync_dir(&tmp).map(|()| out)) {
        Ok(out) => out,
        Err(e) => {
            if let Err(rm) = std::fs::remove_dir_all(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %rm,
                    "could not remove a half-written export");
            }
            return Err(e);
        }
    };
    let old = parent.join(format!(".{name}.old.{pid}"));
    let had_old = target.exists();
    if had_old {
        std::fs::rename(target, &old).map_err(io_err("moving the old export aside", target))?;
    }
    std::fs::rename(&tmp, target).map_err(io_err("renaming the export into", target))?;
    if had_old {
        std::fs::remove_dir_all(&old).map_err(io_err("removing the old export", &old))?;
    }
    sync_dir(&parent)?;
    Ok(out)
}

/// Refuses a `target` that exists and holds anything but an export's files.
fn check_replaceable(target: &Path) -> Result<()> {
    if !target.exists() {
        return Ok(());
    }
    let refuse = |reason: String| TrainError::ExportTarget {
        path: target.to_path_buf(),
        reason,
    };
    if !target.is_dir() {
        return Err(refuse(
            "exists and is not a directory: refusing to replace it".into(),
        ));
    }
    let ours = |name: &str| {
        name.ends_with(".safetensors")
            || [CONFIG_FILE, INDEX_FILE, ADAPTER_CONFIG_FILE].contains(&name)
            || COPIED_FILES.contains(&name)
    };
    for entry in std::fs::read_dir(target).map_err(io_err("listing", target))? {
        let entry = entry.map_err(io_err("listing", target))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if !is_file || !ours(&name) {
            return Err(refuse(format!(
                "exists and holds `{name}`, which an export does not write: refusing to \
                 replace it (choose a new directory or remove it)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_like_transformers() {
        let t = |n: usize| OutTensor::new(format!("t{n}"), vec![n], DType::F32);
        let ts = [t(10), t(10), t(30), t(1)];
        assert_eq!(plan_shards(&ts, 80), vec![0..2, 2..3, 3..4]);
        assert_eq!(plan_shards(&ts, 1 << 20), vec![0..4]);
        assert_eq!(plan_shards(&ts, 1), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(shard_name(1, 3), "model-00002-of-00003.safetensors");
    }

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
