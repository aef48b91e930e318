//! `[train]`: what `tidestore finetune` trains, on what, and for how long. Paths are
//! relative to the config file. Every value is checked by [`TrainSection::validate`],
//! the error naming the key.

use std::path::PathBuf;

use serde::Deserialize;

use crate::config::Size;
use crate::error::{Error, Result};
use crate::workload::{LoraTargets, TrainMode};

/// `train.schedule`: the learning rate over the steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// `optimizer.lr` throughout (after the warm-up).
    #[default]
    Constant,
    /// Cosine decay from `optimizer.lr` to 10 % of it at the last step (after the
    /// warm-up).
    Cosine,
}

/// `train.precision`: what forward reads and backward writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionName {
    /// bf16 compute copy, bf16 gradients over it, fp32 master, M and V: 16 bytes per
    /// trained parameter.
    #[default]
    Bf16,
    /// fp32 compute from the master copy, fp32 gradients of their own (20 bytes per
    /// trained parameter); needed for `accumulation` > 1 in horizontal order.
    F32,
}

/// `train.micro_batch_order`: how the micro-batches of a step meet the blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MicroBatchOrderName {
    /// Every micro-batch through a block before the next block: each block's weights
    /// read once per step however many micro-batches.
    #[default]
    Vertical,
    /// One micro-batch through every block after another: each block's weights read
    /// once per micro-batch.
    Horizontal,
}

impl MicroBatchOrderName {
    /// The train crate's order.
    pub fn order(self) -> tidestore_train::MicroBatchOrder {
        match self {
            MicroBatchOrderName::Vertical => tidestore_train::MicroBatchOrder::Vertical,
            MicroBatchOrderName::Horizontal => tidestore_train::MicroBatchOrder::Horizontal,
        }
    }
}

/// `train.saved_inputs`: where the block inputs kept for backward wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SavedInputsName {
    /// Where the blocks compute (on a GPU, its memory).
    #[default]
    Device,
    /// In host memory, copied back for each block's backward: the GPU holds only the
    /// inputs the next block reads (long sequences).
    Host,
}

impl SavedInputsName {
    /// The train crate's place.
    pub fn place(self) -> tidestore_train::SavedInputs {
        match self {
            SavedInputsName::Device => tidestore_train::SavedInputs::Compute,
            SavedInputsName::Host => tidestore_train::SavedInputs::Host,
        }
    }
}

/// `train.export_dtype`: the dtype of the exported weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExportDtype {
    /// bfloat16.
    #[default]
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

/// `train.data_format`: what the training data file holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// Plain UTF-8 text (`train.text`), cut into windows of `sequence + 1` tokens.
    #[default]
    Text,
    /// JSON Lines (`train.data`), one `{"text": ...}` document a line; every token
    /// carries loss; BOS/EOS as the tokenizer says.
    Jsonl,
    /// JSON Lines (`train.data`), one `{"messages": [{"role", "content"}, ...]}`
    /// conversation a line, rendered with the model's chat template; only the
    /// assistant's tokens carry loss.
    Chat,
}

/// `train.too_long`: what happens to a JSONL sample longer than `train.sequence + 1`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TooLong {
    /// Left out (counted in the summary): no answer is trained cut off.
    #[default]
    Drop,
    /// Its first `sequence + 1` tokens kept (counted in the summary).
    Truncate,
}

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct TrainSection {
    /// A Hugging Face LLaMA directory (`config.json`, safetensors, optionally
    /// `tokenizer.json`), e.g. one made by `tidestore init-model`.
    pub model_dir: Option<PathBuf>,
    /// The training text (UTF-8), with `data_format = "text"`.
    pub text: Option<PathBuf>,
    /// What the data file holds.
    pub data_format: DataFormat,
    /// The JSON Lines data file, with `data_format = "jsonl"` or `"chat"`.
    pub data: Option<PathBuf>,
    /// A Jinja chat template file used instead of the model's (`chat_template.jinja`
    /// or `tokenizer_config.json`'s `chat_template`), with `data_format = "chat"`.
    pub chat_template: Option<PathBuf>,
    /// What happens to a JSONL sample longer than `sequence + 1` tokens.
    pub too_long: TooLong,
    /// Optimizer steps, 1..=10000000.
    pub steps: u32,
    /// Tokens per sample, 1..=65536.
    pub sequence: u32,
    /// Samples per micro-batch, >= 1.
    pub micro_batch: u32,
    /// Micro-batches per step, >= 1 (more than 1 in horizontal order needs
    /// `precision = "f32"`).
    pub accumulation: u32,
    /// How the micro-batches meet the blocks.
    pub micro_batch_order: MicroBatchOrderName,
    /// Where the block inputs kept for backward wait.
    pub saved_inputs: SavedInputsName,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: u32,
    /// `full` or `lora`.
    pub mode: TrainMode,
    /// LoRA rank, 1..=65536.
    pub lora_rank: u32,
    /// LoRA scale numerator (the adapter's output is multiplied by `alpha / rank`).
    pub lora_alpha: f64,
    /// Which projections get adapters.
    pub lora_targets: LoraTargets,
    /// What forward reads and backward writes.
    pub precision: PrecisionName,
    /// Save a checkpoint every this many steps (and at the end); 0: never.
    pub checkpoint_every: u32,
    /// Where checkpoints go (the last two are kept).
    pub checkpoint_dir: Option<PathBuf>,
    /// Where the trained model is exported at the end (HF safetensors; with LoRA, a
    /// PEFT adapter), when given.
    pub export_dir: Option<PathBuf>,
    /// Where the LoRA run's adapters are also exported merged into the base (a full
    /// Hugging Face model), beside the PEFT adapter in `export_dir`; LoRA only.
    pub export_merged: Option<PathBuf>,
    /// Largest safetensors shard of a full or merged export; more than one shard
    /// writes `model.safetensors.index.json`.
    pub export_shard_size: Size,
    /// `base_model_name_or_path` of the PEFT adapter: by default the model's own name
    /// (its `_name_or_path` when that is not a filesystem path, else the model
    /// directory's name), never a machine path unless given here.
    pub base_model_name: Option<String>,
    /// Dtype of the export.
    pub export_dtype: ExportDtype,
    /// Seed of the batches (and of fresh LoRA adapters).
    pub seed: u64,
    /// Under data parallelism, collectives in flight beside compute, 0..=1024:
    /// parameters' all-gathers started this many fetches ahead (in the order the last
    /// step fetched them), gradients' reduce-scatters waited for this many gradients
    /// later; 0: each waits where it is asked for. The results are the same.
    pub collectives_ahead: u32,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            model_dir: None,
            text: None,
            data_format: DataFormat::Text,
            data: None,
            chat_template: None,
            too_long: TooLong::Drop,
            steps: 100,
            sequence: 128,
            micro_batch: 4,
            accumulation: 1,
            micro_batch_order: MicroBatchOrderName::Vertical,
            saved_inputs: SavedInputsName::Device,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            mode: TrainMode::Full,
            lora_rank: 16,
            lora_alpha: 32.0,
            lora_targets: LoraTargets::Qv,
            precision: PrecisionName::Bf16,
            checkpoint_every: 0,
            checkpoint_dir: None,
            export_dir: None,
            export_merged: None,
            export_shard_size: Size::from_bytes(tidestore_train::hf::DEFAULT_MAX_SHARD_BYTES),
            base_model_name: None,
            export_dtype: ExportDtype::Bf16,
            seed: 0,
            collectives_ahead: tidestore_train::ranks::DEFAULT_AHEAD as u32,
        }
    }
}

fn outside(key: &str, value: impl std::fmt::Display, range: &str) -> Error {
    Error::config(key, format!("{value} is outside {range}"))
}

impl TrainSection {
    /// Checks ranges and combinations; the error names the key. Paths are checked when
    /// a run starts.
    pub fn validate(&self) -> Result<()> {
        if self.collectives_ahead as usize > tidestore_train::ranks::MAX_AHEAD {
            return Err(outside(
                "train.collectives_ahead",
                self.collectives_ahead,
                &format!("0..={}", tidestore_train::ranks::MAX_AHEAD),
            ));
        }
        if !(1..=10_000_000).contains(&self.steps) {
            return Err(outside("train.steps", self.steps, "1..=10000000"));
        }
        if !(1..=65536).contains(&self.sequence) {
            return Err(outside("train.sequence", self.sequence, "1..=65536"));
        }
        if self.micro_batch == 0 {
            return Err(Error::config("train.micro_batch", "must be at least 1"));
        }
        if self.accumulation == 0 {
            return Err(Error::config("train.accumulation", "must be at least 1"));
        }
        if self.accumulation > 1
            && self.precision == PrecisionName::Bf16
            && self.micro_batch_order == MicroBatchOrderName::Horizontal
        {
            return Err(Error::config(
                "train.accumulation",
                "more than 1 in micro_batch_order = \"horizontal\" needs precision = \"f32\": \
                 in bf16 the gradient is written over the 16-bit parameters, which the next \
                 micro-batch's forward reads (\"vertical\" sums a block's gradients over the \
                 micro-batches before it writes them)",
            ));
        }
        if !(1..=65536).contains(&self.lora_rank) {
            return Err(outside("train.lora_rank", self.lora_rank, "1..=65536"));
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(Error::config(
                "train.lora_alpha",
                format!("{} is not a number > 0", self.lora_alpha),
            ));
        }
        self.validate_paths()?;
        self.validate_data()?;
        self.validate_export()?;
        if self.checkpoint_every > 0 && self.checkpoint_dir.is_none() {
            return Err(Error::config(
                "train.checkpoint_dir",
                "missing: checkpoint_every is set",
            ));
        }
        Ok(())
    }

    /// No path key set to the empty string (which would read or write the current
    /// directory's nothing, refused only late and unnamed).
    fn validate_paths(&self) -> Result<()> {
        let paths = [
            ("train.model_dir", &self.model_dir),
            ("train.text", &self.text),
            ("train.data", &self.data),
            ("train.chat_template", &self.chat_template),
            ("train.checkpoint_dir", &self.checkpoint_dir),
            ("train.export_dir", &self.export_dir),
            ("train.export_merged", &self.export_merged),
        ];
        match paths
            .into_iter()
            .find(|(_, p)| p.as_ref().is_some_and(|p| p.as_os_str().is_empty()))
        {
            Some((key, _)) => Err(Error::config(
                key,
                "is empty: give a path, or leave the key out",
            )),
            None => Ok(()),
        }
    }

    /// The data keys agree with `data_format`.
    fn validate_data(&self) -> Result<()> {
        let (wanted, other) = match self.data_format {
            DataFormat::Text => ("train.text", self.data.as_ref().map(|_| "train.data")),
            DataFormat::Jsonl | DataFormat::Chat => {
                ("train.data", self.text.as_ref().map(|_| "train.text"))
            }
        };
        if let Some(key) = other {
            return Err(Error::config(
                key,
                format!(
                    "set, but data_format = {} reads {wanted}",
                    super::as_toml(&self.data_format)
                ),
            ));
        }
        if self.chat_template.is_some() && self.data_format != DataFormat::Chat {
            return Err(Error::config(
                "train.chat_template",
                "set, but only data_format = \"chat\" renders a chat template",
            ));
        }
        Ok(())
    }

    /// The export keys agree with each other and the mode.
    fn validate_export(&self) -> Result<()> {
        if self.export_merged.is_some() && self.mode != TrainMode::Lora {
            return Err(Error::config(
                "train.export_merged",
                "set, but only a LoRA run has adapters to merge (a full run's export_dir is \
                 the whole model)",
            ));
        }
        if self.export_shard_size.bytes() == 0 {
            return Err(Error::config(
                "train.export_shard_size",
                "must be more than 0",
            ));
        }
        if self.base_model_name.as_deref() == Some("") {
            return Err(Error::config(
                "train.base_model_name",
                "is empty: give the base model's name (a hub id or a path), or leave the key out",
            ));
        }
        if self.base_model_name.is_some() && self.mode != TrainMode::Lora {
            return Err(Error::config(
                "train.base_model_name",
                "set, but only a LoRA run's PEFT adapter records a base model",
            ));
        }
        Ok(())
    }

    /// The learning rate of step `step` (1-based) for the peak rate `lr`.
    pub fn lr_at(&self, step: u32, lr: f64) -> f64 {
        if step <= self.warmup_steps {
            return lr * f64::from(step) / f64::from(self.warmup_steps.max(1));
        }
        match self.schedule {
            Schedule::Constant => lr,
            Schedule::Cosine => {
                let span = f64::from(self.steps.saturating_sub(self.warmup_steps).max(1));
                let t = f64::from(step - self.warmup_steps) / span;
                let min = 0.1 * lr;
                min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
            }
        }
    }

    /// The model directory, or an error naming the key.
    pub fn model_dir(&self) -> Result<&std::path::Path> {
        self.model_dir
            .as_deref()
            .ok_or_else(|| Error::config("train.model_dir", "missing: the model to fine-tune"))
    }

    /// The text file, or an error naming the key.
    pub fn text(&self) -> Result<&std::path::Path> {
        self.text
            .as_deref()
            .ok_or_else(|| Error::config("train.text", "missing: the training text"))
    }

    /// The JSON Lines data file, or an error naming the key.
    pub fn data(&self) -> Result<&std::path::Path> {
        self.data.as_deref().ok_or_else(|| {
            Error::config(
                "train.data",
                format!(
                    "missing: the data file data_format = {} reads",
                    super::as_toml(&self.data_format)
                ),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedules_start_at_warm_up_and_end_where_documented() {
        let mut t = TrainSection {
            steps: 100,
            warmup_steps: 10,
            schedule: Schedule::Cosine,
            ..TrainSection::default()
        };
        assert!((t.lr_at(5, 1.0) - 0.5).abs() < 1e-12);
        assert!((t.lr_at(10, 1.0) - 1.0).abs() < 1e-12);
        assert!((t.lr_at(100, 1.0) - 0.1).abs() < 1e-12);
        assert!(t.lr_at(50, 1.0) < 1.0 && t.lr_at(50, 1.0) > 0.1);
        t.schedule = Schedule::Constant;
        assert_eq!(t.lr_at(100, 1.0), 1.0);
    }

    #[test]
    fn bad_values_name_their_key() {
        let bad = [
            (
                TrainSection {
                    steps: 0,
                    ..TrainSection::default()
                },
                "train.steps",
            ),
            (
                TrainSection {
                    accumulation: 2,
                    micro_batch_order: MicroBatchOrderName::Horizontal,
                    ..TrainSection::default()
                },
                "train.accumulation",
            ),
            (
                TrainSection {
                    checkpoint_every: 5,
                    ..TrainSection::default()
                },
                "train.checkpoint_dir",
            ),
            (
                TrainSection {
                    collectives_ahead: 1025,
                    ..TrainSection::default()
                },
                "train.collectives_ahead",
            ),
            (
                TrainSection {
                    mode: TrainMode::Lora,
                    base_model_name: Some(String::new()),
                    ..TrainSection::default()
                },
                "train.base_model_name",
            ),
        ];
        for (t, key) in bad {
            assert_eq!(t.validate().unwrap_err().key(), Some(key));
        }
        // Empty paths: once refused late (`reading ``: No such file`), unnamed.
        let empty = || Some(std::path::PathBuf::new());
        for (t, key) in [
            (
                TrainSection {
                    model_dir: empty(),
                    ..TrainSection::default()
                },
                "train.model_dir",
            ),
            (
                TrainSection {
                    text: empty(),
                    ..TrainSection::default()
                },
                "train.text",
            ),
            (
                TrainSection {
                    checkpoint_dir: empty(),
                    ..TrainSection::default()
                },
                "train.checkpoint_dir",
            ),
        ] {
            let e = t.validate().unwrap_err();
            assert_eq!(e.key(), Some(key));
            assert!(e.to_string().contains("is empty"), "{e}");
        }
        // bf16 accumulates in vertical order: a block's gradients are summed over the
        // micro-batches before they are written over its 16-bit parameters.
        let vertical = TrainSection {
            accumulation: 2,
            ..TrainSection::default()
        };
        assert_eq!(vertical.precision, PrecisionName::Bf16);
        vertical
            .validate()
            .expect("bf16 with accumulation in vertical order");
    }
}
