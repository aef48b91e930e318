//! The identity of a fine-tuning run: every setting that changes what the run computes
//! (optimizer hyper-parameters and moment storage, the batches' shape, order and seed,
//! the schedule, the training mode and precision), a fingerprint of the model's weights
//! as imported and one of the tokenized text. Two runs with the same identity compute
//! the same steps bit for bit; `train.steps` counts only under the cosine schedule
//! (the one it shapes), so a run may be extended with `--steps` and resumed.
//!
//! Every checkpoint carries its run's identity in its metadata (`user.run.*`). A fresh
//! run refuses a checkpoint directory that holds any checkpoint (its own identity's or
//! another's: the newer ones would win over its own), and `--resume` refuses a
//! checkpoint of another run, naming each setting that differs with both values —
//! before anything is loaded.

use std::collections::BTreeMap;
use std::path::Path;

use tidestore_train::{CheckpointDir, Trainer};

use crate::error::{Error, Result};
use tidestore::config::Config;
use tidestore::config::Schedule;

/// Metadata key of the settings (a JSON object, setting -> value).
const KEY_SETTINGS: &str = "run.settings";
/// Metadata key of the fingerprint of everything in [`KEY_SETTINGS`].
const KEY_FINGERPRINT: &str = "run.fingerprint";

/// What a run is, setting by setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunIdentity {
    settings: BTreeMap<String, String>,
}

/// FNV-1a, 64 bits: a fingerprint stable across builds and platforms.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn lower<T: std::fmt::Debug>(v: T) -> String {
    format!("{v:?}").to_lowercase()
}

impl RunIdentity {
    /// The identity of the run `cfg` describes, on the model whose weights fingerprint
    /// to `model` and the text whose tokens fingerprint to `text`.
    pub fn new(cfg: &Config, model: &str, text: &str) -> RunIdentity {
        let o = &cfg.optimizer;
        let t = &cfg.train;
        let mut s = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            s.insert(k.to_string(), v);
        };
        put("train.model_dir (weights)", model.to_string());
        put("train.text (tokens)", text.to_string());
        put("optimizer.lr", o.lr.to_string());
        put("optimizer.beta1", o.beta1.to_string());
        put("optimizer.beta2", o.beta2.to_string());
        put("optimizer.eps", o.eps.to_string());
        put("optimizer.weight_decay", o.weight_decay.to_string());
        put("optimizer.mode", lower(o.mode));
        put("optimizer.max_grad_norm", o.max_grad_norm.to_string());
        put("optimizer.states", o.states.moments().to_string());
        put("train.sequence", t.sequence.to_string());
        put("train.micro_batch", t.micro_batch.to_string());
        put("train.accumulation", t.accumulation.to_string());
        put("train.micro_batch_order", lower(t.micro_batch_order));
        put("train.schedule", lower(t.schedule));
        put("train.warmup_steps", t.warmup_steps.to_string());
        if t.schedule == Schedule::Cosine {
            put("train.steps", t.steps.to_string());
        }
        put("train.mode", lower(t.mode));
        if t.mode == tidestore::workload::TrainMode::Lora {
            put("train.lora_rank", t.lora_rank.to_string());
            put("train.lora_alpha", t.lora_alpha.to_string());
            put("train.lora_targets", lower(t.lora_targets));
        }
        put("train.precision", lower(t.precision));
        put("train.seed", t.seed.to_string());
        RunIdentity { settings: s }
    }

    /// This identity as one rank of `world` data-parallel ranks (the world size is part
    /// of a checkpoint's identity: tidestore does not re-shard); one rank is the plain
    /// run.
    pub fn with_ranks(mut self, world: usize) -> RunIdentity {
        if world > 1 {
            self.settings
                .insert("data-parallel ranks".into(), world.to_string());
        }
        self
    }

    /// Every setting and its value: what the ranks of one run must agree on.
    pub fn settings(&self) -> Vec<(String, String)> {
        self.settings
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The fingerprint of the whole identity (16 hex digits).
    pub fn fingerprint(&self) -> String {
        let text = serde_json::to_string(&self.settings).unwrap_or_default();
        format!("{:016x}", fnv64(text.as_bytes()))
    }

    /// The identity as checkpoint metadata.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert(
            KEY_SETTINGS.into(),
            serde_json::to_string(&self.settings).unwrap_or_default(),
        );
        m.insert(KEY_FINGERPRINT.into(), self.fingerprint());
        m
    }

    /// The identity recorded in the checkpoint at `path`; `None` for a checkpoint
    /// written without one.
    fn of_checkpoint(path: &Path) -> Result<Option<RunIdentity>> {
        let meta = Trainer::read_metadata(path)?;
        let Some(text) = meta.get(KEY_SETTINGS) else {
            return Ok(None);
        };
        let settings = serde_json::from_str(text).map_err(|e| {
            Error::Finetune(format!(
                "{}: metadata `{KEY_SETTINGS}` is not a settings object: {e}",
                path.display()
            ))
        })?;
        Ok(Some(RunIdentity { settings }))
    }

    /// `setting: checkpoint A, this run B` for every setting that differs.
    fn differences(&self, theirs: &RunIdentity) -> Vec<String> {
        let none = String::from("(not set)");
        let keys: std::collections::BTreeSet<&String> =
            self.settings.keys().chain(theirs.settings.keys()).collect();
        keys.into_iter()
            .filter_map(|k| {
                let (a, b) = (
                    theirs.settings.get(k).unwrap_or(&none),
                    self.settings.get(k).unwrap_or(&none),
                );
                (a != b).then(|| format!("{k}: checkpoint {a}, this run {b}"))
            })
            .collect()
    }

    /// Checks `dir` before step 1: a fresh run wants it without checkpoints; a resumed
    /// one wants its newest checkpoint to be of this run. The error names the key, the
    /// file and each setting that differs.
    pub fn check_dir(&self, dir: &CheckpointDir, resume: bool) -> Result<()> {
        let Some((step, path)) = dir.latest()? else {
            return Ok(());
        };
        let theirs = RunIdentity::of_checkpoint(&path)?;
        let what = match &theirs {
            None => "a checkpoint without a run identity (written by another tool or an \
                     older tidestore)"
                .to_string(),
            Some(theirs) if theirs == self => "a checkpoint of this very run".to_string(),
            Some(theirs) => format!(
                "a checkpoint of another run ({})",
                self.differences(theirs).join("; ")
            ),
        };
        match (resume, &theirs) {
            (true, Some(theirs)) if theirs == self => Ok(()),
            (true, _) => Err(Error::config(
                "train.checkpoint_dir",
                format!(
                    "--resume: the newest checkpoint {} (step {step}) is {what}; resume with \
                     that run's settings, or start a fresh run in another directory",
                    path.display()
                ),
            )),
            (false, _) => Err(Error::config(
                "train.checkpoint_dir",
                format!(
                    "{} already holds {} (step {step}), {what}: a fresh run would mix its \
                     checkpoints with those; pass --resume to continue that run, or use an \
                     empty directory",
                    dir.dir().display(),
                    path.display()
                ),
            )),
        }
    }
}

/// The fingerprint of a token sequence: its length and the FNV-1a of its bytes.
pub fn tokens_fingerprint(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    format!("{} tokens, fnv64 {:016x}", tokens.len(), fnv64(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_the_setting_and_both_values() {
        let mut cfg = Config::default();
        let a = RunIdentity::new(&cfg, "m", "t");
        cfg.optimizer.lr = 2e-3;
        let b = RunIdentity::new(&cfg, "m", "t");
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(
            b.differences(&a),
            vec!["optimizer.lr: checkpoint 0.0001, this run 0.002".to_string()]
        );
        cfg.train.steps += 1;
        assert_eq!(
            RunIdentity::new(&cfg, "m", "t"),
            b,
            "steps: constant schedule"
        );
    }
}
