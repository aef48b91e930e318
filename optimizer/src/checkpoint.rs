//! Checkpoints of a [`StreamingOptimizer`]: master parameters, M, V, the step count and
//! the loss scaler, in one safetensors file written atomically.
//!
//! # Format
//! A plain safetensors file (readable by any safetensors reader) with three F32 tensors
//! of shape `[len]` per optimizer group `i` (= chunk `i` of the chunk lists), named
//! `group.{i:06}.master`, `group.{i:06}.m`, `group.{i:06}.v`, laid out in that order, and
//! `__metadata__` string entries:
//! `format = "tidestore-optimizer"`, `version = "1"`, `groups`, `step`,
//! `loss_scale_bits` (the f32's bits in decimal, exact), `loss_scale_good_steps`
//! (both absent without a scaler), and `crc32c.<tensor>` = `0x%08x` for every tensor.
//!
//! # Atomicity and integrity
//! The file is written to `.<name>.tmp.<pid>` in the same directory (header with
//! provisional (zero) checksums, then the tensors streamed one group array at a time through a
//! ring buffer, then the header again with the real checksums — same length), `fsync`ed,
//! renamed over `<name>`, and the directory `fsync`ed. A crash leaves either the old
//! checkpoint or the new one, never a mix; a stray temp file is never read. Loading
//! validates the safetensors structure (offsets cover the file exactly), the format,
//! the group count and lengths, and every tensor's crc32c before anything is written to
//! the swap file; a failure leaves the optimizer as it was (still poisoned if it was).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::controller::{ControllerState, StepController};
use crate::error::{OptimError, Result};
use crate::loss_scale::LossScalerState;
use crate::stream::{f32s_mut, MasterPlace, StreamingOptimizer, ARRAY_M, ARRAY_MASTER, ARRAY_V};

/// Value of the `format` metadata key.
pub const CHECKPOINT_FORMAT: &str = "tidestore-optimizer";
/// Value of the `version` metadata key written by this code.
pub const CHECKPOINT_VERSION: &str = "1";

const ARRAYS: [(u64, &str); 3] = [(ARRAY_MASTER, "master"), (ARRAY_M, "m"), (ARRAY_V, "v")];

/// Name of a tensor in the checkpoint.
pub fn tensor_name(group: usize, array: &str) -> String {
    format!("group.{group:06}.{array}")
}

fn ck_err(path: &Path, reason: impl Into<String>) -> OptimError {
    OptimError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io_ck(path: &Path, what: &str, e: std::io::Error) -> OptimError {
    ck_err(path, format!("{what}: {e}"))
}

/// The safetensors header (JSON, padded with spaces to a multiple of 8) for `lens` with
/// the given checksums (all zero for the provisional header).
fn header_bytes(lens: &[usize], state: &ControllerState, crcs: &[u32]) -> Vec<u8> {
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), CHECKPOINT_FORMAT.into());
    meta.insert("version".into(), CHECKPOINT_VERSION.into());
    meta.insert("groups".into(), lens.len().to_string().into());
    meta.insert("step".into(), state.step.to_string().into());
    if let Some(ls) = state.loss_scaler {
        meta.insert(
            "loss_scale_bits".into(),
            ls.scale.to_bits().to_string().into(),
        );
        meta.insert(
            "loss_scale_good_steps".into(),
            ls.good_steps.to_string().into(),
        );
    }
    let mut root = serde_json::Map::new();
    let mut offset = 0u64;
    let mut k = 0;
    for (i, &len) in lens.iter().enumerate() {
        for (_, array) in ARRAYS {
            let name = tensor_name(i, array);
            let bytes = len as u64 * 4;
            root.insert(
                name.clone(),
                serde_json::json!({
                    "dtype": "F32",
                    "shape": [len],
                    "data_offsets": [offset, offset + bytes],
                }),
            );
            meta.insert(
                format!("crc32c.{name}"),
                format!("0x{:08x}", crcs.get(k).copied().unwrap_or(0)).into(),
            );
            offset += bytes;
            k += 1;
        }
    }
    root.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut json = serde_json::Value::Object(root).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

fn temp_path(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = path
        .file_name()
        .ok_or_else(|| ck_err(path, "is not a file path"))?
        .to_string_lossy()
        .into_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    Ok((dir, tmp))
}

impl StreamingOptimizer {
    /// Saves master parameters, M, V, the step count and `ctrl`'s loss scaler to `path`,
    /// atomically (see the module documentation). Refused while poisoned.
    pub fn save_checkpoint(&mut self, path: &Path, ctrl: &StepController) -> Result<()> {
        self.check_usable()?;
        let state = ControllerState {
            step: self.step,
            loss_scaler: ctrl.state().loss_scaler,
        };
        let (dir, tmp) = temp_path(path)?;
        let result = self.write_checkpoint(&tmp, &state);
        if let Err(e) = result {
            if let Err(rm) = std::fs::remove_file(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %rm, "could not remove a half-written checkpoint");
            }
            return Err(e);
        }
        std::fs::rename(&tmp, path).map_err(|e| io_ck(path, "renaming the temp file", e))?;
        let d = std::fs::File::open(&dir).map_err(|e| io_ck(path, "opening its directory", e))?;
        d.sync_all()
            .map_err(|e| io_ck(path, "syncing its directory", e))?;
        tracing::info!(path = %path.display(), step = self.step, "checkpoint saved");
        Ok(())
    }

    fn write_checkpoint(&mut self, tmp: &Path, state: &ControllerState) -> Result<()> {
        let lens: Vec<usize> = self.groups.iter().map(|g| g.len).collect();
        let provisional = header_bytes(&lens, state, &[]);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .map_err(|e| io_ck(tmp, "creating", e))?;
        f.write_all(&provisional)
            .map_err(|e| io_ck(tmp, "writing the header", e))?;
        let mut crcs = Vec::with_capacity(lens.len() * ARRAYS.len());
        for (i, &len) in lens.iter().enumerate() {
            for (array, _) in ARRAYS {
                let crc = if array == ARRAY_MASTER && self.cfg.master == MasterPlace::Host {
                    let bytes = f32_bytes(&self.host_master[i]);
                    f.write_all(bytes)
                        .map_err(|e| io_ck(tmp, "writing a tensor", e))?;
                    crc32c::crc32c(bytes)
                } else {
                    let buf = self.read_sync(i, array, "checkpoint save")?;
                    let bytes = &buf[..len * 4];
                    f.write_all(bytes)
                        .map_err(|e| io_ck(tmp, "writing a tensor", e))?;
                    crc32c::crc32c(bytes)
                };
                crcs.push(crc);
            }
        }
        let header = header_bytes(&lens, state, &crcs);
        if header.len() != provisional.len() {
            return Err(ck_err(tmp, "header changed length between passes"));
        }
        f.seek(SeekFrom::Start(0))
            .and_then(|_| f.write_all(&header))
            .map_err(|e| io_ck(tmp, "rewriting the header", e))?;
        f.sync_all().map_err(|e| io_ck(tmp, "fsync", e))?;
        Ok(())
    }

    /// Loads a checkpoint saved by [`StreamingOptimizer::save_checkpoint`] of an
    /// optimizer with the same groups: writes every group's state into the swap file,
    /// flushes it, restores the step count and `ctrl`, and clears a poisoned state.
    /// If the swap file itself refuses writes (a failed write poisoned it), build a new
    /// optimizer over a fresh or reopened swap file with
    /// [`StreamingOptimizer::from_checkpoint`].
    pub fn load_checkpoint(&mut self, path: &Path, ctrl: &mut StepController) -> Result<()> {
        if self.swap.is_poisoned() {
            return Err(OptimError::Stream {
                reason: "the swap file refuses writes after a failed write; reopen it and use from_checkpoint".into(),
            });
        }
        let file = std::fs::File::open(path).map_err(|e| io_ck(path, "opening", e))?;
        // SAFETY: the map is read-only and private to this call; checkpoints are written
        // to a temp file and renamed, never modified in place, so the mapped bytes do not
        // change under us unless another process truncates the file (which would be a
        // SIGBUS, not undefined values we act on silently).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_ck(path, "mapping", e))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| ck_err(path, format!("not a valid safetensors file: {e}")))?;
        let data = &map[8 + n..];
        let kv = meta
            .metadata()
            .as_ref()
            .ok_or_else(|| ck_err(path, "no __metadata__"))?;
        let get = |k: &str| {
            kv.get(k)
                .map(String::as_str)
                .ok_or_else(|| ck_err(path, format!("metadata `{k}` missing")))
        };
        if get("format")? != CHECKPOINT_FORMAT || get("version")? != CHECKPOINT_VERSION {
            return Err(ck_err(
                path,
                format!(
                    "format {:?} version {:?}; expected {CHECKPOINT_FORMAT} version {CHECKPOINT_VERSION}",
                    kv.get("format"),
                    kv.get("version")
                ),
            ));
        }
        let parse_u64 = |k: &str| -> Result<u64> {
            get(k)?
                .parse::<u64>()
                .map_err(|e| ck_err(path, format!("metadata `{k}`: {e}")))
        };
        let groups = parse_u64("groups")? as usize;
        if groups != self.groups.len() {
            return Err(ck_err(
                path,
                format!("has {groups} groups, the optimizer {}", self.groups.len()),
            ));
        }
        let step = parse_u64("step")?;
        let loss_scaler = match kv.get("loss_scale_bits") {
            Some(_) => Some(LossScalerState {
                scale: f32::from_bits(parse_u64("loss_scale_bits")? as u32),
                good_steps: parse_u64("loss_scale_good_steps")? as u32,
            }),
            None => None,
        };
        // Validate every tensor before touching the swap file.
        let mut slices = Vec::with_capacity(groups * ARRAYS.len());
        for i in 0..groups {
            let len = self.groups[i].len;
            for (array, name) in ARRAYS {
                let t = tensor_name(i, name);
                let info = meta
                    .info(&t)
                    .ok_or_else(|| ck_err(path, format!("tensor {t} missing")))?;
                if info.dtype != safetensors::Dtype::F32 || info.shape != [len] {
                    return Err(ck_err(
                        path,
                        format!(
                            "tensor {t} is {:?} {:?}, expected F32 [{len}]",
                            info.dtype, info.shape
                        ),
                    ));
                }
                let (a, b) = info.data_offsets;
                let bytes = &data[a..b];
                let want = get(&format!("crc32c.{t}"))?;
                let found = format!("0x{:08x}", crc32c::crc32c(bytes));
                if want != found {
                    return Err(ck_err(
                        path,
                        format!("tensor {t} fails its checksum: {found}, expected {want}"),
                    ));
                }
                slices.push((i, array, bytes));
            }
        }
        // Write it all; a failure here poisons (the swap holds a mix).
        self.drain_quiet();
        for (i, array, bytes) in slices {
            let len = self.groups[i].len;
            if array == ARRAY_MASTER && self.cfg.master == MasterPlace::Host {
                copy_from_bytes(&mut self.host_master[i], bytes);
                continue;
            }
            let mut buf = self.take_buf("checkpoint load")?;
            copy_from_bytes(f32s_mut(&mut buf, len), bytes);
            if let Err(e) = self.write_sync(i, array, buf, "checkpoint load") {
                self.poison(&e);
                return Err(e);
            }
        }
        if let Err(e) = self.flush_swap(0) {
            self.poison(&e);
            return Err(e);
        }
        ctrl.restore(ControllerState { step, loss_scaler })?;
        self.step = step;
        self.poisoned = None;
        self.initialized = true;
        tracing::info!(path = %path.display(), step, "checkpoint loaded");
        Ok(())
    }

    /// A new optimizer over `swap` (fresh, or reopened after a failure) loaded from the
    /// checkpoint at `path`.
    pub fn from_checkpoint(
        cpu: crate::cpu::AdamW,
        groups: Vec<crate::stream::GroupSpec>,
        swap: tidestore_io::SwapFile,
        cfg: crate::stream::StreamConfig,
        path: &Path,
        ctrl: &mut StepController,
    ) -> Result<Self> {
        let mut opt = StreamingOptimizer::new(cpu, groups, swap, cfg)?;
        opt.load_checkpoint(path, ctrl)?;
        Ok(opt)
    }
}

/// The bytes of `v` (little endian on the x86-64 and aarch64 targets this crate builds
/// for, which is what safetensors stores).
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialised bytes; u8 has alignment 1; the length in bytes is
    // exactly `4 * v.len()`, and the shared borrow keeps `v` alive and unmodified.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Little-endian f32s from `bytes` (which may be unaligned in the map).
fn copy_from_bytes(dst: &mut [f32], bytes: &[u8]) {
    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}
