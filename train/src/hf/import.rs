//! Import of a Hugging Face LLaMA directory into a [`ChunkStore`], shard by shard,
//! through memmap2: the whole model is never in memory.
//!
//! A model directory holds `config.json` and either one `model.safetensors` (looked for
//! first, as `transformers` does) or shards listed by `model.safetensors.index.json`
//! (`weight_map`: tensor name -> shard file). Tensors may be F32, F16 or BF16.
//!
//! # Everything checked before anything is written
//! [`HfWeights::open`] maps each needed file and parses its header with the `safetensors`
//! crate (offsets contiguous, covering the file exactly), then checks every tensor
//! config.json implies: present, its shape, a dtype tidestore reads and, when
//! config.json names one (`torch_dtype`), that dtype. [`import`] also checks that the
//! store's layout holds every tensor of [`llama_tensors`] with its shape and
//! trainability; and, for a layout whose 16-bit dtype is f16, that an F32 or BF16
//! tensor's values fit f16. Only then is anything written; every refusal is a typed error naming
//! the file and the tensor, and leaves the store untouched.
//!
//! # Writing
//! Each tensor goes to its places: the [`ListKind::Params`] copy in the layout's dtype
//! there, and for a trainable tensor the [`ListKind::Master`] master. A tensor whose
//! file dtype equals its place's dtype is written straight from the map (bf16 -> bf16 is
//! byte-identical); otherwise it is converted through f32 (bf16/f16 -> f32 is exact,
//! f32 -> 16-bit rounds to nearest even). Files are visited one after the other, each in
//! offset order. Peak memory: one tensor's converted bytes (and its f32 values). The
//! mapped pages of a tensor are dropped from the process (`madvise(MADV_DONTNEED)`) once
//! it is written, so the resident set does not grow with the files read: the kernel's
//! page cache keeps them (reclaimable), the process does not.
//!
//! LoRA adapters are not in a base checkpoint: A is drawn uniformly from
//! ±1/sqrt(in_features) — PEFT's `kaiming_uniform_(a=sqrt(5))` — from a seeded PRNG, and
//! B is zero, so the adapted model starts equal to the base.
//!
//! Tensors in the files that the model does not use (an `lm_head.weight` with tied
//! embeddings, old `rotary_emb.inv_freq` buffers) are ignored.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tidestore_chunk::typed::decode_f32;
use tidestore_chunk::{ChunkStore, DType, ListKind, TensorId};

use crate::checkpoint::{map_file, parse, HEADER_LEN_BYTES};
use crate::error::{Result, TrainError};
use crate::hf::config::{dtype_to_torch, LlamaConfig};
use crate::hf::files::{convert, encode, F16_MAX, INDEX_FILE, SINGLE_FILE};
use crate::hf::names::{base_tensors, llama_tensors, lora_adapters, LoraSpec};
use crate::hf::rng::SplitMix64;

/// One mapped safetensors file.
struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
    data_start: usize,
}

/// Where one tensor of the model lies.
#[derive(Debug, Clone)]
struct Located {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The weights of a model directory, mapped and checked against its config.
pub struct HfWeights {
    files: Vec<MappedFile>,
    tensors: HashMap<String, Located>,
    /// Base tensor names in forward order.
    order: Vec<String>,
}

impl std::fmt::Debug for HfWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfWeights")
            .field(
                "files",
                &self.files.iter().map(|m| &m.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.order.len())
            .finish()
    }
}

/// What an import did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportReport {
    /// The files read, in the order read.
    pub files: Vec<PathBuf>,
    /// Base tensors written.
    pub tensors: usize,
    /// Bytes of tensor data read from the files.
    pub bytes_read: u64,
    /// LoRA adapter tensors initialised (A and B each count).
    pub adapters: usize,
}

/// Recasts the checkpoint module's file errors as model-file errors.
fn model_file_error(e: TrainError) -> TrainError {
    match e {
        TrainError::CheckpointTruncated {
            path,
            len_bytes,
            expected_bytes,
        } => TrainError::HfMalformed {
            path,
            reason: format!(
                "truncated: {len_bytes} bytes, its header asks for at least {expected_bytes}"
            ),
        },
        TrainError::CheckpointMalformed { path, reason } => {
            TrainError::HfMalformed { path, reason }
        }
        other => other,
    }
}

/// The file of each tensor: every tensor in `model.safetensors`, or the index's map.
fn weight_map(dir: &Path) -> Result<(PathBuf, Option<BTreeMap<String, String>>)> {
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok((single, None));
    }
    let index = dir.join(INDEX_FILE);
    let text = match std::fs::read_to_string(&index) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(TrainError::HfMissingFile {
                path: single,
                tensor: None,
            })
        }
        Err(source) => {
            return Err(TrainError::Io {
                op: "reading",
                path: index,
                source,
            })
        }
    };
    let malformed = |reason: String| TrainError::HfMalformed {
        path: index.clone(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| malformed(format!("not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| malformed("no `weight_map` object".into()))?;
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| malformed(format!("`weight_map.{name}` is not a file name")))?;
        let plain = Path::new(file)
            .file_name()
            .map(|f| f == file)
            .unwrap_or(false);
        if !plain {
            return Err(malformed(format!(
                "`weight_map.{name}` = `{file}` is not a plain file name in the directory"
            )));
        }
        out.insert(name.clone(), file.to_string());
    }
    Ok((index, Some(out)))
}

impl HfWeights {
    /// Maps the weights of the model directory `dir` and checks every tensor `cfg`
    /// implies (see the module doc). Nothing is read beyond the headers.
    pub fn open(dir: &Path, cfg: &LlamaConfig) -> Result<HfWeights> {
        check_layer_count(dir, cfg)?;
        Self::open_tensors(dir, base_tensors(cfg), cfg.torch_dtype)
    }

    /// As [`HfWeights::open`] for any model: maps the files that hold `expected` (name,
    /// shape; in the order they are wanted) and checks each tensor is there with that
    /// shape, in a dtype tidestore reads and, when `torch_dtype` is given, in it.
    pub fn open_tensors(
        dir: &Path,
        expected: Vec<(String, Vec<usize>)>,
        torch_dtype: Option<DType>,
    ) -> Result<HfWeights> {
        let (listing, map) = weight_map(dir)?;
        // The file of each expected tensor, by name.
        let mut file_of: Vec<(String, Vec<usize>, String)> = Vec::with_capacity(expected.len());
        for (name, shape) in expected {
            let file = match &map {
                None => SINGLE_FILE.to_string(),
                Some(m) => m
                    .get(&name)
                    .cloned()
                    .ok_or_else(|| TrainError::HfMissingTensor {
                        path: listing.clone(),
                        tensor: name.clone(),
                    })?,
            };
            file_of.push((name, shape, file));
        }
        let mut files: Vec<MappedFile> = Vec::new();
        let mut metas: Vec<safetensors::tensor::Metadata> = Vec::new();
        let mut index_of: HashMap<String, usize> = HashMap::new();
        let mut tensors = HashMap::with_capacity(file_of.len());
        let mut order = Vec::with_capacity(file_of.len());
        for (name, shape, file) in file_of {
            let i = match index_of.get(&file) {
                Some(&i) => i,
                None => {
                    let path = dir.join(&file);
                    if !path.is_file() {
                        return Err(TrainError::HfMissingFile {
                            path,
                            tensor: Some(name),
                        });
                    }
                    let map = map_file(&path).map_err(model_file_error)?;
                    let (header_len, meta) = parse(&map, &path).map_err(model_file_error)?;
                    files.push(MappedFile {
                        path,
                        map,
                        data_start: HEADER_LEN_BYTES + header_len,
                    });
                    metas.push(meta);
                    index_of.insert(file, files.len() - 1);
                    files.len() - 1
                }
            };
            let located = locate(&files[i], &metas[i], i, &name, &shape, torch_dtype)?;
            tensors.insert(name.clone(), located);
            order.push(name);
        }
        Ok(HfWeights {
            files,
            tensors,
            order,
        })
    }

    /// The base tensors' names, in forward order.
    pub fn names(&self) -> &[String] {
        &self.order
    }

    /// A tensor's dtype, shape and bytes (little endian) as the file holds them.
    pub fn tensor(&self, name: &str) -> Option<(DType, &[usize], &[u8])> {
        let t = self.tensors.get(name)?;
        let f = &self.files[t.file];
        Some((t.dtype, &t.shape, &f.map[t.start..t.end]))
    }

    /// Drops tensor `name`'s mapped pages from the process's resident set once it has
    /// been read (they stay in the page cache): a caller reading tensor by tensor keeps
    /// its RSS at one tensor, not the files read so far.
    pub fn release(&self, name: &str) {
        if let Some(t) = self.tensors.get(name) {
            release_pages(&self.files[t.file], t.start, t.end - t.start);
        }
    }

    /// A tensor's values as f32 (exact for every dtype read).
    pub fn tensor_f32(&self, name: &str) -> Option<Vec<f32>> {
        let (dtype, _, bytes) = self.tensor(name)?;
        let mut out = vec![0f32; bytes.len() / dtype.size_bytes() as usize];
        decode_f32(bytes, dtype, &mut out);
        Some(out)
    }

    /// The file a tensor is read from.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        let t = self.tensors.get(name)?;
        Some(&self.files[t.file].path)
    }
}

/// The names of the tensors the weights hold: the shard index's, or the single file's
/// header (only the header is read).
fn held_names(dir: &Path) -> Result<(PathBuf, Vec<String>)> {
    let (listing, map) = weight_map(dir)?;
    if let Some(map) = map {
        return Ok((listing, map.into_keys().collect()));
    }
    let file = map_file(&listing).map_err(model_file_error)?;
    let (_, meta) = parse(&file, &listing).map_err(model_file_error)?;
    Ok((listing, meta.tensors().into_keys().collect()))
}

/// Refuses a `num_hidden_layers` other than the count of decoder layers the weights
/// hold (`model.layers.N.…`), before anything is made per layer: a count far beyond
/// the files (a typo, a corrupted config) would otherwise be allocated for.
fn check_layer_count(dir: &Path, cfg: &LlamaConfig) -> Result<()> {
    let (listing, names) = held_names(dir)?;
    let held = names
        .iter()
        .filter_map(|n| {
            n.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |last| last + 1);
    if held == cfg.num_hidden_layers {
        return Ok(());
    }
    let holds = match held {
        0 => "no decoder layer's tensors".to_string(),
        n => format!(
            "the tensors of {n} decoder layers (model.layers.0 to model.layers.{})",
            n - 1
        ),
    };
    Err(TrainError::HfConfig {
        path: dir.join(crate::hf::config::CONFIG_FILE),
        key: "num_hidden_layers".into(),
        reason: format!(
            "{} layers, but {} holds {holds}: config.json must describe the weights",
            cfg.num_hidden_layers,
            listing.display()
        ),
    })
}

/// Finds `name` in one parsed file and checks it against config.json.
fn locate(
    file: &MappedFile,
    meta: &safetensors::tensor::Metadata,
    index: usize,
    name: &str,
    shape: &[usize],
    torch_dtype: Option<DType>,
) -> Result<Located> {
    let info = meta.info(name).ok_or_else(|| TrainError::HfMissingTensor {
        path: file.path.clone(),
        tensor: name.to_string(),
    })?;
    let found = || format!("{:?} {:?}", info.dtype, info.shape);
    let refuse = |expected: String| TrainError::HfTensor {
        path: file.path.clone(),
        tensor: name.to_string(),
        expected,
        found: found(),
    };
    let dtype = match info.dtype {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        _ => return Err(refuse("tidestore reads F32, F16 and BF16".into())),
    };
    if info.shape != shape {
        return Err(refuse(format!("config.json implies shape {shape:?}")));
    }
    if let Some(want) = torch_dtype.filter(|&d| d != dtype) {
        return Err(refuse(format!(
            "config.json's torch_dtype (or dtype) is {}",
            dtype_to_torch(want)
        )));
    }
    let (a, b) = info.data_offsets;
    Ok(Located {
        file: index,
        dtype,
        shape: info.shape.clone(),
        start: file.data_start + a,
        end: file.data_start + b,
    })
}

/// Drops the mapped pages of `len` bytes at `offset` of `file` from the process's
/// resident set (they stay in the page cache). Best effort: a refusal is logged.
#[allow(unsafe_code)]
fn release_pages(file: &MappedFile, offset: usize, len: usize) {
    // SAFETY: the map is a read-only shared mapping of a file tidestore never writes
    // (see `checkpoint::map_file`); MADV_DONTNEED on it drops the page-table entries
    // only, and a later access faults the same bytes back in from the file, so every
    // slice of the map stays valid with the same contents. `offset..offset + len` lies
    // within the map: it is a tensor's range, checked by the safetensors parse.
    let advised = unsafe {
        file.map
            .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len)
    };
    if let Err(e) = advised {
        tracing::debug!(path = %file.path.display(), error = %e, "madvise(DONTNEED) refused");
    }
}

/// One place to write: tensor, list and the dtype there.
struct Place {
    tensor: TensorId,
    list: ListKind,
    dtype: DType,
}

/// The places of `name` in the store: Params, and Master when trainable.
fn places(store: &ChunkStore, name: &str) -> Result<Vec<Place>> {
    let layout = store.layout();
    let missing = || TrainError::Tensor {
        tensor: name.to_string(),
        reason: "not registered in the store".into(),
    };
    let id = layout.tensor_id(name).ok_or_else(missing)?;
    let mut out = Vec::with_capacity(2);
    for list in [ListKind::Params, ListKind::Master] {
        if let Some(loc) = layout.location(id, list) {
            out.push(Place {
                tensor: id,
                list,
                dtype: loc.dtype,
            });
        }
    }
    Ok(out)
}

/// Checks that the store registers every tensor of the model with its shape and
/// trainability.
fn check_store(store: &ChunkStore, cfg: &LlamaConfig, lora: Option<&LoraSpec>) -> Result<()> {
    let layout = store.layout();
    for want in llama_tensors(cfg, lora)? {
        let id = layout
            .tensor_id(&want.name)
            .ok_or_else(|| TrainError::Tensor {
                tensor: want.name.clone(),
                reason: "the model has it and the store does not register it".into(),
            })?;
        let have = layout.tensor(id).ok_or_else(|| TrainError::Tensor {
            tensor: want.name.clone(),
            reason: "registered without a spec (a bug)".into(),
        })?;
        if have.shape != want.shape || have.trainable != want.trainable {
            return Err(TrainError::Tensor {
                tensor: want.name.clone(),
                reason: format!(
                    "the store registers {:?} (trainable {}), the model needs {:?} (trainable {})",
                    have.shape, have.trainable, want.shape, want.trainable
                ),
            });
        }
    }
    Ok(())
}

/// Refuses a tensor whose values do not fit the store's f16 copy of it (an F32 or BF16
/// file into an f16 layout would otherwise turn them into infinities). Reads only the
/// tensors converted to f16 from a wider range, and only then: a bf16 or f32 layout
/// costs nothing here.
fn check_f16_range(weights: &HfWeights, store: &ChunkStore) -> Result<()> {
    for name in &weights.order {
        let t = &weights.tensors[name];
        if t.dtype == DType::F16 {
            continue;
        }
        if !places(store, name)?.iter().any(|p| p.dtype == DType::F16) {
            continue;
        }
        let file = &weights.files[t.file];
        let values = weights.tensor_f32(name).unwrap_or_default();
        release_pages(file, t.start, t.end - t.start);
        if let Some(v) = values.iter().find(|v| v.is_finite() && v.abs() > F16_MAX) {
            return Err(TrainError::HfTensor {
                path: file.path.clone(),
                tensor: name.clone(),
                expected: format!(
                    "values within f16's range (±{F16_MAX}) for the store's f16 copy"
                ),
                found: format!("{:?} {:?} holding {v}", t.dtype, t.shape),
            });
        }
    }
    Ok(())
}

/// Imports the model directory `dir` (whose checked config is `cfg`) into `store`,
/// whose layout registers [`llama_tensors`]`(cfg, lora)`; LoRA adapters are initialised
/// from `seed`. Everything is checked before anything is written (see the module doc).
/// Call it with no guard of the model's tensors held. A store error while writing
/// leaves the store partly loaded: treat it as not loaded.
pub fn import(
    dir: &Path,
    cfg: &LlamaConfig,
    store: &mut ChunkStore,
    lora: Option<&LoraSpec>,
    seed: u64,
) -> Result<ImportReport> {
    let weights = HfWeights::open(dir, cfg)?;
    check_store(store, cfg, lora)?;
    check_f16_range(&weights, store)?;
    let mut report = ImportReport {
        files: weights.files.iter().map(|f| f.path.clone()).collect(),
        tensors: 0,
        bytes_read: 0,
        adapters: 0,
    };
    // File by file, each in offset order.
    let mut by_file: Vec<&String> = weights.order.iter().collect();
    by_file.sort_by_key(|n| {
        let t = &weights.tensors[*n];
        (t.file, t.start)
    });
    for name in by_file {
        let (dtype, _, bytes) = weights
            .tensor(name)
            .ok_or_else(|| TrainError::Protocol(format!("tensor `{name}` lost (a bug)")))?;
        for p in places(store, name)? {
            store.write(p.tensor, p.list, &convert(bytes, dtype, p.dtype))?;
        }
        let t = &weights.tensors[name];
        release_pages(&weights.files[t.file], t.start, t.end - t.start);
        report.tensors += 1;
        report.bytes_read += bytes.len() as u64;
    }
    if let Some(l) = lora {
        report.adapters = init_adapters(store, cfg, l, seed)?;
    }
    tracing::info!(dir = %dir.display(), tensors = report.tensors,
        bytes = report.bytes_read, adapters = report.adapters, "model imported");
    Ok(report)
}

/// Writes PEFT's initial adapters (A uniform in ±1/sqrt(in), B zero) into every place
/// of each adapter tensor; returns the count of tensors written.
fn init_adapters(
    store: &mut ChunkStore,
    cfg: &LlamaConfig,
    lora: &LoraSpec,
    seed: u64,
) -> Result<usize> {
    let mut rng = SplitMix64::new(seed);
    let mut written = 0;
    for ad in lora_adapters(cfg, lora) {
        let bound = 1.0 / (ad.in_features as f32).sqrt();
        let a: Vec<f32> = (0..lora.r * ad.in_features)
            .map(|_| rng.uniform_f32(-bound, bound))
            .collect();
        let b = vec![0f32; ad.out_features * lora.r];
        for (name, values) in [(&ad.a, &a), (&ad.b, &b)] {
            for p in places(store, name)? {
                store.write(p.tensor, p.list, &encode(values, p.dtype))?;
            }
            written += 1;
        }
    }
    Ok(written)
}
