//! Writing a model directory's weights: tensors cut into safetensors shards of at most
//! a size (with `model.safetensors.index.json` when there are several), each shard
//! written through a buffer and `fsync`ed, and the directory made next to its target
//! and renamed into place, replacing only a directory that holds an export's files.

use std::path::{Path, PathBuf};

use tidestore_chunk::DType;

use crate::checkpoint::{
    io_err, removed_on_err, safetensors_header, sync_dir, HeaderTensor, TensorFile,
};
use crate::error::{Result, TrainError};
use crate::hf::config::CONFIG_FILE;
use crate::hf::files::{ADAPTER_CONFIG_FILE, COPIED_FILES, INDEX_FILE, SINGLE_FILE};

/// `transformers`' default `max_shard_size`, "5GB" (decimal).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

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
    let mut w = TensorFile::create(path, true, &header)?;
    for t in tensors {
        let bytes = source(&t.name)?;
        w.write_tensor(&t.name, &bytes, t.len_bytes)?;
    }
    w.finish()?.sync_all().map_err(io_err("syncing", path))
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
    let filled = fill(&tmp).and_then(|out| sync_dir(&tmp).map(|()| out));
    let out = removed_on_err(filled, &tmp, "export", |p| std::fs::remove_dir_all(p))?;
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
}
