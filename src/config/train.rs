//! `[train]`: what `tidestore finetune` trains, on what, and for how long. Paths are
//! relative to the config file. Every value is checked by [`TrainSection::validate`],
//! the error naming the key.

use std::path::PathBuf;

use serde::Deserialize;

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
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

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct TrainSection {
    /// A Hugging Face LLaMA directory (`config.json`, safetensors, optionally
    /// `tokenizer.json`), e.g. one made by `tidestore init-model`.
    pub model_dir: Option<PathBuf>,
    /// The training text (UTF-8).
    pub text: Option<PathBuf>,
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
    /// Dtype of the export.
    pub export_dtype: ExportDtype,
    /// Seed of the batches (and of fresh LoRA adapters).
    pub seed: u64,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            model_dir: None,
            text: None,
            steps: 100,
            sequence: 128,
            micro_batch: 4,
            accumulation: 1,
            micro_batch_order: MicroBatchOrderName::Vertical,
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
            export_dtype: ExportDtype::Bf16,
            seed: 0,
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
        if self.checkpoint_every > 0 && self.checkpoint_dir.is_none() {
            return Err(Error::config(
                "train.checkpoint_dir",
                "missing: checkpoint_every is set",
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
        ];
        for (t, key) in bad {
            assert_eq!(t.validate().unwrap_err().key(), Some(key));
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
