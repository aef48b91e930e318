//! The model of a fine-tuning run: a Hugging Face LLaMA directory read through the train
//! crate's `hf` module (its `config.json` checked, its safetensors shards mapped), the
//! candle [`Llama`] that computes it, its weights imported into the store one tensor at
//! a time (dtype converted on the way, the whole model never in RAM), the text
//! tokenized, and the trained weights exported.

use std::path::{Path, PathBuf};

use tidestore_candle::{Llama, LlamaLora, TideParams};
use tidestore_train::hf;

use tidestore_train::DType;

use super::checks;
use super::data::Samples;
use crate::error::{Error, Result};
use tidestore::config::{ExportDtype, TrainSection};
use tidestore::workload::{LoraTargets, TrainMode};

/// A model directory, read and checked.
#[derive(Debug)]
pub struct Loaded {
    /// The candle model.
    pub model: Llama,
    /// Its `config.json`.
    pub hf: hf::LlamaConfig,
    /// The directory.
    pub dir: PathBuf,
    /// Its tokenizer (byte-level when it has no `tokenizer.json`).
    pub tokenizer: hf::Tokenizer,
    /// Its `tokenizer_config.json` (empty when it has none).
    pub tokenizer_config: hf::TokenizerConfig,
}

fn targets(t: LoraTargets) -> Vec<String> {
    t.projections()
        .iter()
        .map(|p| format!("{p}_proj"))
        .collect()
}

impl Loaded {
    /// One line: shape, parameters, what trains.
    pub fn describe(&self) -> String {
        let c = &self.hf;
        let what = match &self.model.config().lora {
            Some(l) => format!("LoRA rank {} on {}", l.rank, l.targets.join(",")),
            None => "full fine-tuning".into(),
        };
        format!(
            "{} (llama, {} layers, hidden {}, {} heads / {} kv, vocab {}), {}",
            self.dir.display(),
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            what
        )
    }

    /// Parameters of the model (adapters included).
    pub fn params(&self) -> u64 {
        self.model.specs().iter().map(|s| s.elements() as u64).sum()
    }

    /// Trained parameters.
    pub fn params_trainable(&self) -> u64 {
        self.model
            .specs()
            .iter()
            .filter(|s| s.trainable)
            .map(|s| s.elements() as u64)
            .sum()
    }
}

/// `train.sequence` within `max_position_embeddings`, or beyond it only when the
/// config scales RoPE (positions past the trained ones are what scaling is for).
fn check_sequence(sequence: usize, c: &hf::LlamaConfig, dir: &Path) -> Result<()> {
    if sequence <= c.max_position_embeddings {
        return Ok(());
    }
    if c.rope.is_scaled() {
        tracing::warn!(
            sequence,
            max_position_embeddings = c.max_position_embeddings,
            "train.sequence beyond max_position_embeddings, with the config's RoPE scaling"
        );
        return Ok(());
    }
    Err(Error::Finetune(format!(
        "train.sequence = {sequence} exceeds max_position_embeddings = {} of {} and the \
         model has no RoPE scaling; shorten train.sequence",
        c.max_position_embeddings,
        dir.join(hf::CONFIG_FILE).display()
    )))
}

/// Reads `train.model_dir`'s config and makes the model the section asks for.
pub fn open(t: &TrainSection) -> Result<Loaded> {
    let dir = t.model_dir()?;
    let c = hf::LlamaConfig::load(dir)?;
    let tokenizer = hf::Tokenizer::for_model(dir)?;
    let tokenizer_config = hf::TokenizerConfig::for_model(dir)?;
    checks::check_tokenizer(tokenizer.vocab_size(), &tokenizer.source())?;
    tokenizer.check_fits(&c, dir)?;
    let weights = hf::HfWeights::open(dir, &c)?;
    let files = weights
        .names()
        .iter()
        .filter_map(|n| weights.file_of(n).map(Path::to_path_buf))
        .collect();
    checks::refuse_unused_tensors(dir, weights.names(), &files, c.tie_word_embeddings)?;
    drop(weights);
    check_sequence(t.sequence as usize, &c, dir)?;
    let lora = (t.mode == TrainMode::Lora).then(|| LlamaLora {
        rank: t.lora_rank as usize,
        alpha: t.lora_alpha as f32,
        targets: targets(t.lora_targets),
    });
    // The family's RoPE scaling, biases, q/k norms, head_dim and window, as read.
    let model = Llama::from_hf(&c, lora)?;
    Ok(Loaded {
        model,
        hf: c,
        dir: dir.to_path_buf(),
        tokenizer,
        tokenizer_config,
    })
}

/// The plain training text tokenized with the model directory's `tokenizer.json`
/// (byte-level when it has none) and cut into windows; every id checked against the
/// model's vocabulary.
pub fn text_samples(t: &TrainSection, loaded: &Loaded) -> Result<Samples> {
    let path = t.text()?;
    let tokens = loaded.tokenizer.encode(&hf::read_text(path)?)?;
    let source = loaded.tokenizer.source();
    checks::check_tokens(&tokens, loaded.hf.vocab_size, &source, path)?;
    Samples::new(
        tokens,
        t.sequence as usize,
        t.micro_batch as usize,
        t.seed,
        &path.display().to_string(),
    )
}

/// Writes the directory's weights into `params`, one tensor at a time, and fresh LoRA
/// adapters (seeded by `train.seed`) when the section asks for them. A weight that is
/// NaN or infinite is refused naming the tensor, the index and the file. Returns the
/// fingerprint of the weights as imported (crc32c over `config.json`, every tensor's
/// name and its f32 values, in order), the model part of the run's identity.
pub fn import(t: &TrainSection, loaded: &Loaded, params: &mut TideParams) -> Result<String> {
    let weights = hf::HfWeights::open(&loaded.dir, &loaded.hf)?;
    let config = loaded.dir.join(hf::CONFIG_FILE);
    let mut crc = crc32c::crc32c(&std::fs::read(&config).unwrap_or_default());
    for name in weights.names() {
        let values = weights.tensor_f32(name).ok_or_else(|| {
            Error::Finetune(format!(
                "{}: tensor `{name}` vanished",
                loaded.dir.display()
            ))
        })?;
        let file = weights.file_of(name).unwrap_or(&loaded.dir);
        checks::check_finite_weight(name, &values, file)?;
        crc = crc32c::crc32c_append(crc, name.as_bytes());
        crc = crc32c::crc32c_append(crc, bytemuck::cast_slice(&values));
        params.set_param(name, &values)?;
        weights.release(name);
    }
    if loaded.model.config().lora.is_some() {
        for (spec, values) in loaded.model.init(t.seed) {
            if spec.name.contains(".lora_") {
                params.set_param(&spec.name, &values)?;
            }
        }
    }
    Ok(format!("crc32c {crc:08x}"))
}

/// The LoRA setting of the run, in the `hf` module's terms.
fn lora_spec(loaded: &Loaded) -> Result<Option<hf::LoraSpec>> {
    let Some(l) = &loaded.model.config().lora else {
        return Ok(None);
    };
    let targets = l
        .targets
        .iter()
        .map(|t| t.parse::<hf::LoraTarget>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Some(hf::LoraSpec::new(l.rank, l.alpha, &targets)))
}

/// The base model's name a PEFT adapter records: `train.base_model_name`, else the
/// config's `_name_or_path` when it is a name (a hub id such as `org/model`) and not a
/// filesystem path, else the model directory's own name; never a machine path unless
/// the setting gives one.
pub fn base_model_name(t: &TrainSection, loaded: &Loaded) -> String {
    let own = loaded.hf.raw.get("_name_or_path").and_then(|v| v.as_str());
    name_of_base(t.base_model_name.as_deref(), own, &loaded.dir)
}

/// [`base_model_name`] of a setting, a config's `_name_or_path` and the model directory.
/// A name is a hub id: `name` or `org/name`, neither absolute nor starting with `.` or
/// `~`; a path gives its last component.
fn name_of_base(setting: Option<&str>, own: Option<&str>, dir: &Path) -> String {
    if let Some(name) = setting {
        return name.to_string();
    }
    let own = own.filter(|n| !n.is_empty());
    let is_name = |n: &str| {
        !Path::new(n).is_absolute()
            && !n.starts_with(['.', '~'])
            && !n.contains('\\')
            && n.matches('/').count() <= 1
            && !n.ends_with('/')
    };
    match own {
        Some(n) if is_name(n) => n.to_string(),
        _ => own
            .and_then(|n| Path::new(n).file_name())
            .or_else(|| dir.file_name())
            .map_or_else(|| "base".into(), |n| n.to_string_lossy().into_owned()),
    }
}

fn export_dtype(t: &TrainSection) -> DType {
    match t.export_dtype {
        ExportDtype::Bf16 => DType::BF16,
        ExportDtype::F16 => DType::F16,
        ExportDtype::F32 => DType::F32,
    }
}

/// Writes the trained model to `out`: Hugging Face safetensors (the imported directory's
/// tokenizer and generation config copied along, shards of `train.export_shard_size`),
/// or with LoRA the adapters in PEFT's layout. With `merged`, a LoRA run's adapters
/// merged into the base as a full model (`train.export_merged`). Streamed tensor by
/// tensor, written to a temporary directory and renamed.
pub fn export(
    t: &TrainSection,
    loaded: &Loaded,
    params: &mut TideParams,
    out: &Path,
    merged: bool,
) -> Result<()> {
    let dtype = export_dtype(t);
    let lora = lora_spec(loaded)?;
    let adapter = lora.as_ref().filter(|_| !merged);
    let base = base_model_name(t, loaded);
    let opts = hf::ExportOptions {
        dtype,
        copy_from: Some(loaded.dir.clone()),
        max_shard_bytes: t.export_shard_size.bytes(),
    };
    let Some(ranks) = params.ranks().cloned() else {
        let trainer = params.trainer_mut();
        match adapter {
            Some(l) => trainer.export_adapter(&loaded.hf, l, out, dtype, &base)?,
            None => trainer.export_model(&loaded.hf, lora.as_ref(), out, &opts)?,
        };
        return Ok(());
    };
    // A data-parallel run: rank 0 writes, each tensor gathered from the ranks as it is
    // written (see `ranked::export`).
    super::ranked::export(&ranks, params, |read| {
        match adapter {
            Some(l) => hf::export_adapter_from(read, &loaded.hf, l, out, dtype, &base)?,
            None => hf::export_model_from(read, &loaded.hf, lora.as_ref(), out, &opts)?,
        };
        Ok(())
    })
}

#[cfg(test)]
mod sequence_tests {
    use super::*;

    #[test]
    fn the_base_model_is_named_by_name_never_by_a_machine_path() {
        let dir = Path::new("/data/models/tiny");
        let name = |setting, own| name_of_base(setting, own, dir);
        assert_eq!(
            name(Some("/my/path"), Some("org/m")),
            "/my/path",
            "as asked"
        );
        assert_eq!(
            name(None, Some("meta-llama/Llama-3.2-1B")),
            "meta-llama/Llama-3.2-1B"
        );
        assert_eq!(name(None, Some("gpt2")), "gpt2");
        assert_eq!(name(None, Some("/home/u/models/llama")), "llama");
        assert_eq!(name(None, Some("./models/llama")), "llama");
        assert_eq!(name(None, Some("a/b/c")), "c");
        assert_eq!(name(None, Some("")), "tiny");
        assert_eq!(name(None, None), "tiny");
    }

    fn config(rope: &str) -> hf::LlamaConfig {
        let text = format!(
            r#"{{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 300,
              "max_position_embeddings": 64{rope}}}"#
        );
        hf::LlamaConfig::from_json(&text, Path::new("m/config.json")).unwrap()
    }

    #[test]
    fn a_sequence_beyond_the_positions_needs_rope_scaling() {
        let dir = Path::new("m");
        let plain = config("");
        assert!(check_sequence(64, &plain, dir).is_ok());
        let e = check_sequence(65, &plain, dir).unwrap_err().to_string();
        assert!(
            e.contains("train.sequence") && e.contains("m/config.json"),
            "{e}"
        );
        let scaled = config(r#", "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#);
        assert!(check_sequence(128, &scaled, dir).is_ok());
    }
}
