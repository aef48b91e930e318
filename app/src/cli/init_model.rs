//! `tidestore init-model`: a random-weight LLaMA written as a Hugging Face directory
//! (`config.json`, safetensors, a byte-level `tokenizer.json`), so that tests and a
//! newcomer have a model to fine-tune without any download.

use std::path::PathBuf;

use tidestore::chunk::DType;
use tidestore::train::hf::{self, InitOptions, LlamaShape};
use tidestore::Size;

use super::Error;

/// Options of `init-model`.
#[derive(Debug, clap::Args)]
pub struct InitModelArgs {
    /// The directory to write (made, or replaced whole when it holds an older model).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Decoder layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// MLP width.
    #[arg(long, default_value_t = 704)]
    intermediate: usize,
    /// Attention heads (divide the hidden size).
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (divide the heads).
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    /// Vocabulary size (at least 258 for the byte-level tokenizer: 256 bytes, <s>, </s>).
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    /// Tie the head to the embedding.
    #[arg(long)]
    tie: bool,
    /// Longest sequence (max_position_embeddings).
    #[arg(long, default_value_t = 2048)]
    max_positions: usize,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Dtype of the weights: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Largest shard (more than one writes model.safetensors.index.json).
    #[arg(long, value_name = "SIZE")]
    max_shard_size: Option<Size>,
}

/// A config.json key `init-model` refused, as the flag that set it (`--layers` for
/// `num_hidden_layers`): the user typed flags, not the file's keys.
fn flag_error(e: tidestore::train::TrainError) -> Error {
    let tidestore::train::TrainError::HfConfig { key, reason, .. } = &e else {
        return e.into();
    };
    let flag = match key.as_str() {
        "num_hidden_layers" => "--layers",
        "hidden_size" => "--hidden",
        "intermediate_size" => "--intermediate",
        "num_attention_heads" => "--heads",
        "num_key_value_heads" => "--kv-heads",
        "vocab_size" => "--vocab",
        "max_position_embeddings" => "--max-positions",
        _ => return e.into(),
    };
    Error::Usage {
        flag,
        reason: reason.clone(),
    }
}

/// Runs `init-model`.
pub fn run(args: &InitModelArgs) -> Result<(), Error> {
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => {
            return Err(Error::Usage {
                flag: "--dtype",
                reason: format!("`{other}` is not bf16, f16 or f32"),
            })
        }
    };
    let shape = LlamaShape {
        hidden_size: args.hidden,
        intermediate_size: args.intermediate,
        num_hidden_layers: args.layers,
        num_attention_heads: args.heads,
        num_key_value_heads: args.kv_heads,
        vocab_size: args.vocab,
        tie_word_embeddings: args.tie,
        max_position_embeddings: args.max_positions,
    };
    let opts = InitOptions {
        seed: args.seed,
        dtype,
        max_shard_bytes: args.max_shard_size.map_or(u64::MAX, |s| s.bytes()),
        tokenizer: true,
    };
    let cfg = hf::init_model(&args.out, shape, &opts).map_err(flag_error)?;
    out!(
        "init-model: {} ({} layers, hidden {}, {} params, {}) written",
        args.out.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.parameter_count(),
        args.dtype
    );
    Ok(())
}
