//! Checkpoints streamed out of a [`ChunkStore`] and back into one: the one checkpoint
//! format of tidestore, for the bench, the trainer and library users.
//!
//! # Format (`tidestore.checkpoint.v1`)
//! One plain safetensors file. For each tensor the caller lists, every list the store's
//! layout gives it a place in, under these names and with the dtype the store holds:
//! - [`ListKind::Params`]: the tensor's own name (BF16 / F16, or F32 for a frozen fp32
//!   tensor), so the file loads as a model in any safetensors tool;
//! - [`ListKind::Master`]: `optimizer.master.NAME` (F32);
//! - [`ListKind::Momentum`]: `optimizer.exp_avg.NAME` (F32, Adam's M);
//! - [`ListKind::Variance`]: `optimizer.exp_avg_sq.NAME` (F32, Adam's V).
//!
//! Gradients (`Grads`) are not state between steps and are not saved. The shape is the
//! tensor's registered shape. The data section holds the F32 tensors first (master, M,
//! V, then frozen fp32 parameters), then the 16-bit ones, each list in chunk order: the
//! header is padded with spaces so the data starts 8-byte aligned, and with that order
//! every tensor starts aligned to its element size (readers can view it in place).
//!
//! `__metadata__` (string values, as safetensors wants): `format` =
//! `tidestore.checkpoint.v1`, `step`, `loss_scale_bits` and `loss_scale_good_steps`
//! (the scaler's f32 as its bits in decimal, exact; both absent without a scaler),
//! `crc32c.NAME` = `0x%08x` for every tensor, and the caller's metadata as `user.KEY`.
//!
//! # Writing: one pass, checksums patched
//! The header comes first in the file but a tensor's crc32c is known only once its bytes
//! have been streamed. A first pass over the store for the checksums would read every
//! tensor twice — for tensors spilled to NVMe that doubles the checkpoint's disk reads
//! and evicts chunks twice. So the header is written once with every checksum `0x00000000`
//! (fixed width: 8 hex digits), the tensors are streamed one at a time
//! ([`ChunkStore::read`]: peak memory is one tensor, never the model), and the header is
//! written again over the first one with the real checksums — the same length by
//! construction, which is checked. The provisional header only ever exists in the
//! temporary file, which no reader opens.
//!
//! # Atomicity
//! The file is written to `.NAME.tmp.PID` in the target's directory, `fsync`ed, renamed
//! over the target and the directory `fsync`ed. A crash at any point leaves the target
//! either absent / the old complete checkpoint (before the rename is durable) or the new
//! complete one (after); a stray temporary file is never read (and
//! [`crate::CheckpointDir`] removes them).
//!
//! # Reading: everything verified before anything is loaded
//! [`load`] maps the file (memmap2), parses it with the `safetensors` crate (offsets
//! contiguous and covering the file exactly), then checks the format tag, the
//! controller state, and for every expected tensor: present, the store's dtype and
//! shape, and its crc32c. Only then is each tensor written into the store with
//! [`ChunkStore::write`] straight from the map. Every refusal is a typed
//! [`TrainError`] naming the file and the tensor; a refused file leaves the store
//! untouched. Tensors in the file that the caller did not ask for are ignored (not
//! verified, not loaded).
//!
//! [`read_tensors`] reads tensors out of a file without a store (to seed a model of
//! another layout, e.g. a LoRA base from a full run's checkpoint): the same parse and
//! format check, and each tensor it returns checked against its crc32c.
//!
//! Bytes go verbatim between the store and the file: both are little endian on the
//! targets tidestore builds for (x86-64, aarch64).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use tidestore_chunk::{ChunkStore, DType, Layout, ListKind, TensorId};
use tidestore_optimizer::{ControllerState, LossScalerState};

use crate::error::{Result, TrainError};

#[cfg(target_endian = "big")]
compile_error!("tidestore checkpoints copy little-endian tensor bytes verbatim");

/// The value of the `format` metadata key.
pub const CHECKPOINT_FORMAT: &str = "tidestore.checkpoint.v1";

/// The lists a checkpoint holds, in the order their tensors are laid out in the file.
pub const CHECKPOINT_LISTS: [ListKind; 4] = [
    ListKind::Master,
    ListKind::Momentum,
    ListKind::Variance,
    ListKind::Params,
];

const KEY_FORMAT: &str = "format";
const KEY_STEP: &str = "step";
const KEY_LOSS_SCALE_BITS: &str = "loss_scale_bits";
const KEY_LOSS_SCALE_GOOD_STEPS: &str = "loss_scale_good_steps";
const CRC_KEY_PREFIX: &str = "crc32c.";
const USER_KEY_PREFIX: &str = "user.";
/// safetensors' length prefix of the header.
pub(crate) const HEADER_LEN_BYTES: usize = 8;
/// Buffer of the file writer: many small tensors become few writes.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// What a checkpoint holds besides the tensors: the step controller's state and the
/// caller's metadata (a data cursor, a run name...).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointState {
    /// Step count and loss scaler.
    pub controller: ControllerState,
    /// Free-form string pairs, stored as `user.KEY` in `__metadata__`.
    pub metadata: BTreeMap<String, String>,
}

/// The name in the file of `name`'s tensor in `list`; `None` for a list checkpoints do
/// not hold (`Grads`).
pub fn tensor_name(name: &str, list: ListKind) -> Option<String> {
    match list {
        ListKind::Params => Some(name.to_string()),
        ListKind::Master => Some(format!("optimizer.master.{name}")),
        ListKind::Momentum => Some(format!("optimizer.exp_avg.{name}")),
        ListKind::Variance => Some(format!("optimizer.exp_avg_sq.{name}")),
        ListKind::Grads => None,
    }
}

/// One tensor of one list, as the file holds it.
#[derive(Debug)]
struct Entry {
    tensor: TensorId,
    list: ListKind,
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    len_bytes: usize,
}

/// The file's tensors for `tensors` under `layout`, in file order (see the module doc).
/// Refuses an unknown id, an id listed twice and two tensors with the same file name.
fn entries(layout: &Layout, tensors: &[TensorId]) -> Result<Vec<Entry>> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for &t in tensors {
        let spec = layout.tensor(t).ok_or_else(|| TrainError::Tensor {
            tensor: t.to_string(),
            reason: "not a tensor of the store's layout".into(),
        })?;
        if !seen.insert(t) {
            return Err(TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: "listed twice for the checkpoint".into(),
            });
        }
    }
    let mut out = Vec::new();
    for list in CHECKPOINT_LISTS {
        let mut placed: Vec<_> = tensors
            .iter()
            .filter_map(|&t| layout.location(t, list).map(|loc| (t, loc)))
            .collect();
        // Wider elements first (alignment), then chunk order (each chunk read once).
        placed.sort_by_key(|(_, loc)| {
            (
                std::cmp::Reverse(loc.dtype.size_bytes()),
                loc.chunk.index(),
                loc.offset_elements,
            )
        });
        for (t, loc) in placed {
            let spec = layout.tensor(t).ok_or_else(|| TrainError::Tensor {
                tensor: t.to_string(),
                reason: "not a tensor of the store's layout".into(),
            })?;
            let name = tensor_name(&spec.name, list).ok_or_else(|| TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: format!("list {list} is not checkpointed"),
            })?;
            let len_bytes = usize::try_from(loc.bytes()).map_err(|_| TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: "larger than this machine's address space".into(),
            })?;
            // Compact moments are kept as they are: bf16 elements in the tensor's shape,
            // or a Q8 place's bytes as one U8 vector (codes, padding, absmax). Loading
            // into a store of another state type fails naming both forms.
            let shape = match loc.dtype {
                DType::Q8 => vec![len_bytes],
                _ => spec.shape.clone(),
            };
            out.push(Entry {
                tensor: t,
                list,
                name,
                dtype: loc.dtype,
                shape,
                len_bytes,
            });
        }
    }
    check_names(&out)?;
    Ok(out)
}

/// File names must be unique and must not be safetensors' reserved key.
fn check_names(entries: &[Entry]) -> Result<()> {
    let mut names = HashSet::with_capacity(entries.len());
    for e in entries {
        if e.name == "__metadata__" || !names.insert(e.name.as_str()) {
            return Err(TrainError::Tensor {
                tensor: e.name.clone(),
                reason: "this name is taken in the checkpoint (reserved, or another \
                         tensor's optimizer entry)"
                    .into(),
            });
        }
    }
    Ok(())
}

pub(crate) fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        // A Q8 moment is stored as its place's raw bytes (codes, padding, absmax).
        DType::Q8 => safetensors::Dtype::U8,
    }
}

fn crc_text(crc: u32) -> String {
    format!("0x{crc:08x}")
}

/// The header — length prefix and JSON padded with spaces so the data starts 8-byte
/// aligned — with `crcs` (one per entry), or all-zero checksums when `None`.
fn header_bytes(entries: &[Entry], state: &CheckpointState, crcs: Option<&[u32]>) -> Vec<u8> {
    let mut meta = serde_json::Map::new();
    meta.insert(KEY_FORMAT.into(), CHECKPOINT_FORMAT.into());
    let ctrl = &state.controller;
    meta.insert(KEY_STEP.into(), ctrl.step.to_string().into());
    if let Some(ls) = ctrl.loss_scaler {
        let bits = ls.scale.to_bits().to_string();
        meta.insert(KEY_LOSS_SCALE_BITS.into(), bits.into());
        let good = ls.good_steps.to_string();
        meta.insert(KEY_LOSS_SCALE_GOOD_STEPS.into(), good.into());
    }
    for (k, v) in &state.metadata {
        meta.insert(format!("{USER_KEY_PREFIX}{k}"), v.clone().into());
    }
    for (i, e) in entries.iter().enumerate() {
        let crc = crcs.and_then(|c| c.get(i).copied()).unwrap_or(0);
        meta.insert(format!("{CRC_KEY_PREFIX}{}", e.name), crc_text(crc).into());
    }
    safetensors_header(
        entries.iter().map(|e| HeaderTensor {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            len_bytes: e.len_bytes,
        }),
        meta,
    )
}

/// One tensor as a safetensors header lists it.
pub(crate) struct HeaderTensor<'a> {
    pub(crate) name: &'a str,
    pub(crate) dtype: DType,
    pub(crate) shape: &'a [usize],
    pub(crate) len_bytes: usize,
}

/// A safetensors header for `tensors`, laid out back to back in the given order, with
/// `metadata` as `__metadata__` (omitted when empty): the length prefix, then the JSON
/// padded with spaces so the data starts 8-byte aligned.
pub(crate) fn safetensors_header<'a>(
    tensors: impl IntoIterator<Item = HeaderTensor<'a>>,
    metadata: serde_json::Map<String, serde_json::Value>,
) -> Vec<u8> {
    let mut root = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let dtype = format!("{:?}", st_dtype(t.dtype));
        root.insert(
            t.name.to_string(),
            serde_json::json!({
                "dtype": dtype,
                "shape": t.shape,
                "data_offsets": [offset, offset + t.len_bytes],
            }),
        );
        offset += t.len_bytes;
    }
    if !metadata.is_empty() {
        root.insert("__metadata__".into(), serde_json::Value::Object(metadata));
    }
    let mut json = serde_json::Value::Object(root).to_string().into_bytes();
    while !(HEADER_LEN_BYTES + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(HEADER_LEN_BYTES + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn malformed(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::CheckpointMalformed {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The directory of `path` and the temporary name to write it under.
fn temp_path(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = path
        .file_name()
        .ok_or_else(|| malformed(path, "is not a file path"))?
        .to_string_lossy()
        .into_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    Ok((dir, tmp))
}

/// A safetensors file written front to back: created with its header, then each
/// tensor's bytes in order through one write buffer.
pub(crate) struct TensorFile<'a> {
    w: BufWriter<File>,
    path: &'a Path,
}

impl<'a> TensorFile<'a> {
    /// Creates `path` (`fresh`: it must not exist yet; else one there is truncated) and
    /// writes `header`.
    pub(crate) fn create(path: &'a Path, fresh: bool, header: &[u8]) -> Result<Self> {
        let mut open = OpenOptions::new();
        if fresh {
            open.create_new(true);
        } else {
            open.create(true).truncate(true);
        }
        let file = open
            .write(true)
            .open(path)
            .map_err(io_err("creating", path))?;
        let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
        w.write_all(header)
            .map_err(io_err("writing the header of", path))?;
        Ok(TensorFile { w, path })
    }

    /// Appends tensor `name`'s bytes, which the header gave `len_bytes`.
    pub(crate) fn write_tensor(
        &mut self,
        name: &str,
        bytes: &[u8],
        len_bytes: usize,
    ) -> Result<()> {
        if bytes.len() != len_bytes {
            return Err(TrainError::Tensor {
                tensor: name.to_string(),
                reason: format!(
                    "{} bytes to write, its header entry says {len_bytes}",
                    bytes.len()
                ),
            });
        }
        self.w
            .write_all(bytes)
            .map_err(io_err("writing a tensor to", self.path))
    }

    /// Flushes the buffer; the file, not yet synced.
    pub(crate) fn finish(self) -> Result<File> {
        self.w
            .into_inner()
            .map_err(|e| io_err("writing", self.path)(e.into_error()))
    }
}

/// `written` as it is; where it failed, the half-written `tmp` (a `what`) is removed
/// first with `remove` (a file's or a directory's), a failure to remove it logged: the
/// write's error is the one returned.
pub(crate) fn removed_on_err<T>(
    written: Result<T>,
    tmp: &Path,
    what: &str,
    remove: fn(&Path) -> std::io::Result<()>,
) -> Result<T> {
    if written.is_err() {
        if let Err(rm) = remove(tmp) {
            tracing::warn!(path = %tmp.display(), error = %rm,
                "could not remove a half-written {what}");
        }
    }
    written
}

/// `fsync`s a directory, so that a rename or removal in it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing the directory", dir))
}

/// Saves `tensors` (every list each has a place in; see the module doc) and `state` from
/// `store` to `path`, atomically. Peak memory: one tensor plus the header. Call it
/// between iterations, with no guard of the listed tensors held.
pub fn save(
    store: &mut ChunkStore,
    tensors: &[TensorId],
    state: &CheckpointState,
    path: &Path,
) -> Result<()> {
    let entries = entries(store.layout(), tensors)?;
    let (dir, tmp) = temp_path(path)?;
    let written = write_file(store, &entries, state, &tmp).and_then(|bytes| {
        std::fs::rename(&tmp, path).map_err(io_err("renaming the temporary file", path))?;
        Ok(bytes)
    });
    let bytes = removed_on_err(written, &tmp, "checkpoint", |p| std::fs::remove_file(p))?;
    sync_dir(&dir)?;
    tracing::info!(path = %path.display(), step = state.controller.step,
        tensors = entries.len(), bytes, "checkpoint saved");
    Ok(())
}

/// Writes the whole file at `tmp` and `fsync`s it; returns its length.
fn write_file(
    store: &mut ChunkStore,
    entries: &[Entry],
    state: &CheckpointState,
    tmp: &Path,
) -> Result<u64> {
    let provisional = header_bytes(entries, state, None);
    let mut w = TensorFile::create(tmp, false, &provisional)?;
    let mut crcs = Vec::with_capacity(entries.len());
    let mut len = provisional.len() as u64;
    for e in entries {
        let bytes = store.read(e.tensor, e.list)?;
        w.write_tensor(&e.name, &bytes, e.len_bytes)?;
        crcs.push(crc32c::crc32c(&bytes));
        len += bytes.len() as u64;
    }
    let header = header_bytes(entries, state, Some(&crcs));
    if header.len() != provisional.len() {
        return Err(malformed(
            tmp,
            format!(
                "the header changed length between passes ({} -> {} bytes; a bug)",
                provisional.len(),
                header.len()
            ),
        ));
    }
    let mut file = w.finish()?;
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.write_all(&header))
        .map_err(io_err("rewriting the header of", tmp))?;
    file.sync_all().map_err(io_err("syncing", tmp))?;
    Ok(len)
}

/// Loads the checkpoint at `path` into `store` for `tensors` (every list each has a
/// place in) and returns its controller state and metadata. Everything is verified
/// first (see the module doc); a refused file leaves the store untouched. A store
/// error while writing leaves the store partly loaded: treat it as not loaded.
pub fn load(store: &mut ChunkStore, tensors: &[TensorId], path: &Path) -> Result<CheckpointState> {
    let entries = entries(store.layout(), tensors)?;
    let map = map_file(path)?;
    let (state, ranges) = verify_map(&map, &entries, path)?;
    for (e, range) in entries.iter().zip(ranges) {
        store.write(e.tensor, e.list, &map[range])?;
    }
    tracing::info!(path = %path.display(), step = state.controller.step,
        tensors = entries.len(), "checkpoint loaded");
    Ok(state)
}

/// Verifies the checkpoint at `path` against `layout` for `tensors` exactly as [`load`]
/// does, without loading it; returns its controller state and metadata.
pub fn verify(layout: &Layout, tensors: &[TensorId], path: &Path) -> Result<CheckpointState> {
    let entries = entries(layout, tensors)?;
    let map = map_file(path)?;
    let (state, _) = verify_map(&map, &entries, path)?;
    Ok(state)
}

/// One tensor read out of a checkpoint file by [`read_tensors`].
#[derive(Debug, Clone, PartialEq)]
pub struct FileTensor {
    /// Its name in the file (see [`tensor_name`]).
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes, little endian, checked against their crc32c.
    pub bytes: Vec<u8>,
}

/// Reads the tensors of the checkpoint at `path` whose file names `wanted` accepts, in
/// file order, without a store or layout (to seed a model of another layout, e.g. a LoRA
/// base from a full run's checkpoint); returns them with the file's state. The file is
/// parsed and its format tag checked as by [`load`], and every tensor returned is
/// checked against its crc32c (a failure names the file and the tensor). Peak memory:
/// the tensors asked for.
pub fn read_tensors(
    path: &Path,
    mut wanted: impl FnMut(&str) -> bool,
) -> Result<(CheckpointState, Vec<FileTensor>)> {
    let map = map_file(path)?;
    let (header_len, meta) = parse(&map, path)?;
    let kv = tidestore_kv(&meta, path)?;
    let state = read_state(kv, path)?;
    let data_start = HEADER_LEN_BYTES + header_len;
    let mut out = Vec::new();
    for name in meta.offset_keys() {
        if !wanted(&name) {
            continue;
        }
        let info = meta
            .info(&name)
            .ok_or_else(|| malformed(path, format!("tensor `{name}` listed without its entry")))?;
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::U8 => DType::Q8,
            other => {
                return Err(malformed(
                    path,
                    format!("tensor `{name}` is {other:?}; checkpoints hold F32, F16 and BF16"),
                ))
            }
        };
        let (a, b) = info.data_offsets;
        let bytes = &map[data_start + a..data_start + b];
        check_crc(kv, &name, bytes, path)?;
        out.push(FileTensor {
            dtype,
            shape: info.shape.clone(),
            bytes: bytes.to_vec(),
            name,
        });
    }
    Ok((state, out))
}

/// The `__metadata__` of a parsed checkpoint, or the error saying the file is not one of
/// tidestore's.
fn tidestore_kv<'m>(
    meta: &'m safetensors::tensor::Metadata,
    path: &Path,
) -> Result<&'m HashMap<String, String>> {
    meta.metadata()
        .as_ref()
        .ok_or_else(|| malformed(path, "no __metadata__ (not a tidestore checkpoint)"))
}

/// Maps `path` read-only; a file too short to hold a header is truncated.
#[allow(unsafe_code)]
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(io_err("opening", path))?;
    let len = file
        .metadata()
        .map_err(io_err("reading the size of", path))?
        .len();
    if len < HEADER_LEN_BYTES as u64 {
        return Err(TrainError::CheckpointTruncated {
            path: path.to_path_buf(),
            len_bytes: len,
            expected_bytes: HEADER_LEN_BYTES as u64,
        });
    }
    // SAFETY: the map is read-only and lives only for one `load`/`verify` call (or one
    // Hugging Face import, `crate::hf::import`, whose model files tidestore never writes).
    // Checkpoints are written under a temporary name and renamed, never modified in
    // place, so the mapped bytes do not change under us; another process truncating the
    // file would raise SIGBUS, not hand us changed bytes. Bytes changed by another process
    // between verification and loading are outside what this format defends against.
    unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("mapping", path))
}

/// Parses and checks the whole file against `entries`; returns the state and each
/// entry's byte range in `map`.
fn verify_map(
    map: &[u8],
    entries: &[Entry],
    path: &Path,
) -> Result<(CheckpointState, Vec<Range<usize>>)> {
    let (header_len, meta) = parse(map, path)?;
    let kv = tidestore_kv(&meta, path)?;
    let state = read_state(kv, path)?;
    let data_start = HEADER_LEN_BYTES + header_len;
    let mut ranges = Vec::with_capacity(entries.len());
    for e in entries {
        let info = meta
            .info(&e.name)
            .ok_or_else(|| TrainError::CheckpointMissingTensor {
                path: path.to_path_buf(),
                tensor: e.name.clone(),
            })?;
        if info.dtype != st_dtype(e.dtype) || info.shape != e.shape {
            return Err(TrainError::CheckpointMismatch {
                path: path.to_path_buf(),
                tensor: e.name.clone(),
                expected: format!("{:?} {:?}", st_dtype(e.dtype), e.shape),
                found: format!("{:?} {:?}", info.dtype, info.shape),
            });
        }
        let (a, b) = info.data_offsets;
        let range = data_start + a..data_start + b;
        check_crc(kv, &e.name, &map[range.clone()], path)?;
        ranges.push(range);
    }
    Ok((state, ranges))
}

/// The safetensors header, through the crate; a file shorter than its header says is
/// [`TrainError::CheckpointTruncated`].
pub(crate) fn parse(map: &[u8], path: &Path) -> Result<(usize, safetensors::tensor::Metadata)> {
    use safetensors::SafeTensorError as E;
    match safetensors::SafeTensors::read_metadata(map) {
        Ok(parsed) => Ok(parsed),
        Err(e @ (E::InvalidHeaderLength | E::MetadataIncompleteBuffer)) => {
            match declared_len(map) {
                Some(expected) if expected > map.len() as u64 => {
                    Err(TrainError::CheckpointTruncated {
                        path: path.to_path_buf(),
                        len_bytes: map.len() as u64,
                        expected_bytes: expected,
                    })
                }
                _ => Err(malformed(
                    path,
                    format!("not a valid safetensors file: {e}"),
                )),
            }
        }
        Err(E::TensorInvalidInfo) => Err(malformed(
            path,
            match header_entries(map).and_then(|h| invalid_entry(&h)) {
                Some(why) => format!("not a valid safetensors file: {why}"),
                None => format!("not a valid safetensors file: {}", E::TensorInvalidInfo),
            },
        )),
        Err(e) => Err(malformed(
            path,
            format!("not a valid safetensors file: {e}"),
        )),
    }
}

/// Where the header ends: its length prefix plus the length it declares.
fn header_end(map: &[u8]) -> Option<u64> {
    let prefix: [u8; HEADER_LEN_BYTES] = map.get(..HEADER_LEN_BYTES)?.try_into().ok()?;
    (HEADER_LEN_BYTES as u64).checked_add(u64::from_le_bytes(prefix))
}

/// The header's JSON object (its tensors and `__metadata__`), where it can be read.
fn header_entries(map: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    let end = usize::try_from(header_end(map)?).ok()?;
    match serde_json::from_slice(map.get(HEADER_LEN_BYTES..end)?).ok()? {
        serde_json::Value::Object(entries) => Some(entries),
        _ => None,
    }
}

/// The first tensor whose bytes (`data_offsets`) are not what its dtype and shape take,
/// named with both, for the crate's unnamed `TensorInvalidInfo`.
fn invalid_entry(entries: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
    entries
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .find_map(|(name, v)| {
            let dtype: safetensors::Dtype = serde_json::from_value(v.get("dtype")?.clone()).ok()?;
            let shape: Vec<u64> = serde_json::from_value(v.get("shape")?.clone()).ok()?;
            let [start, end]: [u64; 2] =
                serde_json::from_value(v.get("data_offsets")?.clone()).ok()?;
            let bits = shape
                .iter()
                .try_fold(dtype.bitsize() as u64, |acc, &d| acc.checked_mul(d));
            let held = end.checked_sub(start).map(|b| b * 8);
            (bits != held).then(|| {
                format!(
                    "tensor `{name}`: {dtype:?} of shape {shape:?} takes {} bytes, its \
                     data_offsets [{start}, {end}] hold {}",
                    bits.map_or("more than 2^64 bits' worth of".into(), |b| (b / 8)
                        .to_string()),
                    end.saturating_sub(start)
                )
            })
        })
}

/// The file length the header declares (the header's own length when it is cut off,
/// else header + the largest data offset); `None` when it cannot be told.
fn declared_len(map: &[u8]) -> Option<u64> {
    let header_end = header_end(map)?;
    if header_end > map.len() as u64 {
        return Some(header_end);
    }
    let data_end = header_entries(map)?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    header_end.checked_add(data_end)
}

/// The controller state and caller metadata from `__metadata__`, after the format tag.
fn read_state(kv: &HashMap<String, String>, path: &Path) -> Result<CheckpointState> {
    let get = |k: &str| {
        kv.get(k)
            .map(String::as_str)
            .ok_or_else(|| malformed(path, format!("metadata `{k}` missing")))
    };
    let format = get(KEY_FORMAT)?;
    if format != CHECKPOINT_FORMAT {
        return Err(malformed(
            path,
            format!("format `{format}`; this reader reads `{CHECKPOINT_FORMAT}`"),
        ));
    }
    let parse_u64 = |k: &str| -> Result<u64> {
        get(k)?
            .parse::<u64>()
            .map_err(|e| malformed(path, format!("metadata `{k}`: {e}")))
    };
    let parse_u32 = |k: &str| -> Result<u32> {
        get(k)?
            .parse::<u32>()
            .map_err(|e| malformed(path, format!("metadata `{k}`: {e}")))
    };
    let step = parse_u64(KEY_STEP)?;
    let loss_scaler = match (
        kv.contains_key(KEY_LOSS_SCALE_BITS),
        kv.contains_key(KEY_LOSS_SCALE_GOOD_STEPS),
    ) {
        (false, false) => None,
        _ => Some(LossScalerState {
            scale: f32::from_bits(parse_u32(KEY_LOSS_SCALE_BITS)?),
            good_steps: parse_u32(KEY_LOSS_SCALE_GOOD_STEPS)?,
        }),
    };
    let metadata = kv
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(USER_KEY_PREFIX)?.to_string(), v.clone())))
        .collect();
    Ok(CheckpointState {
        controller: ControllerState { step, loss_scaler },
        metadata,
    })
}

/// Checks `bytes` (the data of the file's tensor `name`) against the crc32c recorded
/// for it.
fn check_crc(kv: &HashMap<String, String>, name: &str, bytes: &[u8], path: &Path) -> Result<()> {
    let key = format!("{CRC_KEY_PREFIX}{name}");
    let text = kv
        .get(&key)
        .ok_or_else(|| malformed(path, format!("metadata `{key}` missing")))?;
    let expected = text
        .strip_prefix("0x")
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| malformed(path, format!("metadata `{key}` = `{text}` is not 0x%08x")))?;
    let found = crc32c::crc32c(bytes);
    if found != expected {
        return Err(TrainError::CheckpointChecksum {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            expected,
            found,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor whose bytes are not what its dtype and shape take is named (the crate
    /// says only "invalid shape, data type, or offset for tensor").
    #[test]
    fn a_tensor_of_the_wrong_size_is_named() {
        let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#;
        let mut map = (header.len() as u64).to_le_bytes().to_vec();
        map.extend_from_slice(header);
        map.extend_from_slice(&[0; 4]);
        let e = parse(&map, Path::new("m.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor `w`: F32 of shape [4] takes 16 bytes"),
            "{e}"
        );
    }

    fn entry(name: &str, dtype: DType, elements: usize) -> Entry {
        Entry {
            tensor: TensorId(0),
            list: ListKind::Params,
            name: name.into(),
            dtype,
            shape: vec![elements],
            len_bytes: elements * dtype.size_bytes() as usize,
        }
    }

    fn state() -> CheckpointState {
        CheckpointState {
            controller: ControllerState {
                step: 7,
                loss_scaler: Some(LossScalerState {
                    scale: 1024.0,
                    good_steps: 3,
                }),
            },
            metadata: BTreeMap::from([("cursor".to_string(), "42".to_string())]),
        }
    }

    #[test]
    fn header_is_aligned_and_keeps_its_length_when_checksums_change() {
        let es = [entry("a", DType::F32, 3), entry("b", DType::BF16, 5)];
        let h0 = header_bytes(&es, &state(), None);
        let h1 = header_bytes(&es, &state(), Some(&[u32::MAX, 0x1234]));
        assert_eq!(h0.len(), h1.len());
        assert_eq!(h0.len() % 8, 0);
        let n = u64::from_le_bytes(h1[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h1.len());
        let v: serde_json::Value = serde_json::from_slice(&h1[8..]).unwrap();
        assert_eq!(v["__metadata__"]["crc32c.a"], "0xffffffff");
        assert_eq!(v["__metadata__"]["crc32c.b"], "0x00001234");
        assert_eq!(v["__metadata__"]["user.cursor"], "42");
        assert_eq!(v["b"]["data_offsets"], serde_json::json!([12, 22]));
    }

    #[test]
    fn state_round_trips_through_metadata() {
        let es = [entry("a", DType::F32, 3)];
        let mut file = header_bytes(&es, &state(), Some(&[0]));
        file.extend_from_slice(&[0u8; 12]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        let kv = meta.metadata().as_ref().unwrap();
        assert_eq!(read_state(kv, Path::new("x")).unwrap(), state());
    }

    #[test]
    fn declared_len_sees_a_cut_header_and_cut_data() {
        let es = [entry("a", DType::F32, 3)];
        let mut file = header_bytes(&es, &state(), None);
        let full = file.len() as u64 + 12;
        assert_eq!(declared_len(&file), Some(full));
        file.truncate(20);
        assert!(declared_len(&file).unwrap() > 20);
    }

    #[test]
    fn names_of_lists() {
        assert_eq!(tensor_name("w", ListKind::Params).as_deref(), Some("w"));
        assert_eq!(
            tensor_name("w", ListKind::Variance).as_deref(),
            Some("optimizer.exp_avg_sq.w")
        );
        assert_eq!(tensor_name("w", ListKind::Grads), None);
    }
}
