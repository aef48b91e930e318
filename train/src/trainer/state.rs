//! A [`Trainer`]'s state in tidestore's one checkpoint format ([`crate::checkpoint`]):
//! every registered parameter — a trainable one with its fp32 master copy, M, V and
//! 16-bit copy, a frozen one as its fp32 values — and the step loop's controller state.
//! The `F32` gradients (the `Grads` list) hold only the last backward's and are not
//! saved.
//!
//! The precision is recorded in the file's metadata (`user.trainer.precision`) and a
//! load into the other precision is refused: an `F32` file's 16-bit copies were never
//! written (zeros), which a `Bf16` forward would read. Files written before the key
//! existed carry `user.candle.precision` (the candle glue's) or, from the Python
//! optimizer, nothing — which was always `f32`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tidestore_chunk::{typed, DType, TensorId};

use super::{Precision, Trainer};
use crate::checkpoint::{self as ckpt, CheckpointState};
use crate::error::{Result, TrainError};
use crate::hf;

/// Metadata key of the precision a checkpoint was saved in.
const KEY_PRECISION: &str = "trainer.precision";
/// The same, as the candle glue wrote it before the trainer existed.
const KEY_PRECISION_CANDLE: &str = "candle.precision";

impl Trainer {
    fn checkpoint_ids(&self) -> Vec<TensorId> {
        self.entries.iter().map(|e| e.id).collect()
    }

    /// Streams the run's state (and the caller's `metadata`) into a checkpoint at
    /// `path`, one tensor at a time, atomically. Between steps only.
    pub fn save(&mut self, path: &Path, mut metadata: BTreeMap<String, String>) -> Result<()> {
        self.between_steps(&format!("checkpoint `{}` saved", path.display()))?;
        self.complete_step()?;
        metadata.insert(KEY_PRECISION.into(), self.precision.as_str().into());
        let state = CheckpointState {
            controller: self.step.controller_state(),
            metadata,
        };
        let ids = self.checkpoint_ids();
        ckpt::save(&mut self.store, &ids, &state, path)
    }

    /// Loads the checkpoint at `path` (verified whole before anything changes; the same
    /// registration and precision) and the controller state it holds; returns the
    /// caller's metadata. Between steps only. A refused file leaves the run as it was.
    pub fn load(&mut self, path: &Path) -> Result<BTreeMap<String, String>> {
        self.between_steps(&format!("checkpoint `{}` loaded", path.display()))?;
        let (header, _) = ckpt::read_tensors(path, |_| false)?;
        let mut metadata = header.metadata;
        let found = metadata
            .remove(KEY_PRECISION)
            .or_else(|| metadata.remove(KEY_PRECISION_CANDLE));
        let want = self.precision.as_str();
        let matches = match &found {
            Some(f) => f == want,
            None => self.precision == Precision::F32,
        };
        if !matches {
            return Err(TrainError::CheckpointPrecision {
                path: path.to_path_buf(),
                found: found.unwrap_or_else(|| "none".into()),
                expected: want,
            });
        }
        let ids = self.checkpoint_ids();
        let state = ckpt::load(&mut self.store, &ids, path)?;
        self.step.restore(state.controller)?;
        Ok(metadata)
    }

    /// The caller's metadata of the checkpoint at `path` (its header only; no tensor
    /// is read), without the trainer's own keys.
    pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
        let (state, _) = ckpt::read_tensors(path, |_| false)?;
        let mut metadata = state.metadata;
        metadata.remove(KEY_PRECISION);
        metadata.remove(KEY_PRECISION_CANDLE);
        Ok(metadata)
    }
}

/// File-name prefix of the fp32 master copies (see [`ckpt::tensor_name`]).
const MASTER_PREFIX: &str = "optimizer.master.";
/// File-name prefix of every optimizer entry.
const OPTIMIZER_PREFIX: &str = "optimizer.";

impl Trainer {
    /// The parameters of the checkpoint at `path`, by name, as fp32 values (flattened):
    /// the master copy of a trainable parameter, the tensor itself of a frozen one.
    /// Reads only those tensors, each checked against its crc32c; for seeding a model of
    /// another layout, e.g. a LoRA base from a full run's checkpoint.
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
}

impl Trainer {
    /// Writes the model as a Hugging Face directory (see [`hf::export_model`]),
    /// streamed from the store tensor by tensor. Between steps only.
    pub fn export_model(
        &mut self,
        cfg: &hf::LlamaConfig,
        lora: Option<&hf::LoraSpec>,
        out_dir: &Path,
        opts: &hf::ExportOptions,
    ) -> Result<hf::ExportReport> {
        self.between_steps(&format!("export to `{}`", out_dir.display()))?;
        self.complete_step()?;
        hf::export_model(&mut self.store, cfg, lora, out_dir, opts)
    }

    /// Writes every parameter, under its registered name, as safetensors shards of
    /// `opts.dtype` in `out_dir` (see [`hf::export_tensors`]), with `config_json` as
    /// `config.json` when given. Between steps only.
    pub fn export_tensors(
        &mut self,
        config_json: Option<&str>,
        out_dir: &Path,
        opts: &hf::ExportOptions,
    ) -> Result<hf::ExportReport> {
        self.between_steps(&format!("export to `{}`", out_dir.display()))?;
        self.complete_step()?;
        let tensors: Vec<(String, Vec<usize>)> = self
            .entries
            .iter()
            .map(|e| (e.spec.name.clone(), e.spec.shape.clone()))
            .collect();
        hf::export_tensors(&mut self.store, &tensors, config_json, out_dir, opts)
    }

    /// Writes the LoRA adapters in PEFT's layout (see [`hf::export_adapter`]). Between
    /// steps only.
    pub fn export_adapter(
        &mut self,
        cfg: &hf::LlamaConfig,
        lora: &hf::LoraSpec,
        out_dir: &Path,
        dtype: DType,
        base_model_name_or_path: &str,
    ) -> Result<hf::ExportReport> {
        self.between_steps(&format!("export to `{}`", out_dir.display()))?;
        self.complete_step()?;
        hf::export_adapter(
            &mut self.store,
            cfg,
            lora,
            out_dir,
            dtype,
            base_model_name_or_path,
        )
    }
}
