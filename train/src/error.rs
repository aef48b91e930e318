//! The one error type of the train crate.
//!
//! Errors of the layers below (the chunk store, the optimizer, file I/O) are wrapped with
//! what was being done; errors of this crate's own checks name the tensor, file or key at
//! fault. Nothing here panics on bad input.

use std::path::PathBuf;

use tidestore_chunk::ChunkError;
use tidestore_optimizer::OptimError;

/// Errors of the train crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The chunk store refused or failed.
    #[error(transparent)]
    Store(#[from] ChunkError),

    /// The optimizer refused or failed.
    #[error(transparent)]
    Optim(#[from] OptimError),

    /// A file could not be read or written.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done (`creating`, `reading`, `renaming`, ...).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A setting that cannot work, named as the caller's configuration names it.
    #[error("invalid config `{key}`: {reason}")]
    Config {
        /// The key (`optimizer.overlap`, ...).
        key: &'static str,
        /// Why, with the numbers.
        reason: String,
    },

    /// An argument a front end handed over that does not fit the registered parameters:
    /// an index out of range, values, a gradient or an output of the wrong size or
    /// dtype, a gradient for a frozen parameter. Nothing was changed.
    #[error("tensor `{tensor}`: {reason}")]
    Argument {
        /// The parameter's name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },

    /// A tensor of the step (or a checkpoint) that does not fit what the store holds.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },

    /// A checkpoint file that is not a well-formed checkpoint of this format: not
    /// safetensors, a header that does not parse, a missing or foreign format tag, a
    /// metadata entry missing or unreadable (the reason names it).
    #[error("checkpoint `{path}`: {reason}")]
    CheckpointMalformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key or tensor.
        reason: String,
    },

    /// A checkpoint file shorter than its own header says it is (a copy cut short, a
    /// file written by something that did not finish).
    #[error(
        "checkpoint `{path}` is truncated: {len_bytes} bytes, at least {expected_bytes} expected"
    )]
    CheckpointTruncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        len_bytes: u64,
        /// The length its header (or the format's smallest header) asks for.
        expected_bytes: u64,
    },

    /// A tensor the store expects that the checkpoint does not hold.
    #[error("checkpoint `{path}` has no tensor `{tensor}`")]
    CheckpointMissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
    },

    /// A tensor whose dtype or shape in the checkpoint differs from the store's.
    #[error("checkpoint `{path}`: tensor `{tensor}` is {found}, the store holds {expected}")]
    CheckpointMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Dtype and shape in the store (`BF16 [4, 8]`).
        expected: String,
        /// Dtype and shape in the file.
        found: String,
    },

    /// A tensor whose bytes fail their crc32c: the file was changed after it was written.
    #[error("checkpoint `{path}`: tensor `{tensor}` fails its checksum (crc32c {found:#010x}, recorded {expected:#010x})")]
    CheckpointChecksum {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// The crc32c recorded in the header.
        expected: u32,
        /// The crc32c of the bytes found.
        found: u32,
    },

    /// A checkpoint saved into a directory that already holds a later one: the
    /// directory's `latest` would not be the one just saved.
    #[error(
        "checkpoint directory `{dir}` holds step {latest}; refusing to save step {step} behind it"
    )]
    CheckpointBehind {
        /// The directory.
        dir: PathBuf,
        /// The step being saved.
        step: u64,
        /// The latest step already there.
        latest: u64,
    },

    /// A checkpoint saved in another precision than the run trains in: its 16-bit
    /// copies (never written in `f32`) would be read as the weights.
    #[error(
        "checkpoint `{path}` was saved in precision {found} (metadata `user.trainer.precision`); \
         this run trains in \"{expected}\""
    )]
    CheckpointPrecision {
        /// The file.
        path: PathBuf,
        /// The precision the file records (`none` where it records none).
        found: String,
        /// The run's precision.
        expected: &'static str,
    },

    /// A tensor's step failed part way through an optimizer step: some tensors hold the
    /// new step and others the old one, so the loop refuses to go on until a checkpoint
    /// is loaded into the store and [`crate::StepLoop::restore`] is called.
    #[error(
        "the step loop stopped after a failed step ({reason}); some tensors hold the new \
         step and others the old one: load a checkpoint and call restore()"
    )]
    Poisoned {
        /// The failure that stopped it.
        reason: String,
    },

    /// A Hugging Face `config.json` this crate cannot use: a key missing, of the wrong
    /// type, or naming something tidestore's LLaMA does not implement (another
    /// architecture, `rope_scaling`, biases, ...).
    #[error("model config `{path}`: key `{key}`: {reason}")]
    HfConfig {
        /// The file.
        path: PathBuf,
        /// The key at fault (a JSON path: `rope_scaling`, `architectures[0]`, ...).
        key: String,
        /// What is wrong.
        reason: String,
    },

    /// A file of a Hugging Face model directory that is not there: a shard the index
    /// names, `model.safetensors` itself, the `config.json`.
    #[error("model file `{path}` is missing{}", needed_by(tensor))]
    HfMissingFile {
        /// The file that is not there.
        path: PathBuf,
        /// A tensor the index places in it, if that is why it is needed.
        tensor: Option<String>,
    },

    /// A tensor config.json implies that no file of the model holds.
    #[error("model `{path}` has no tensor `{tensor}`")]
    HfMissingTensor {
        /// The file looked in (the single `model.safetensors`, or the shard index).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },

    /// A tensor whose shape (or dtype) in a model file disagrees with config.json, or
    /// whose dtype tidestore does not read (it reads F32, F16 and BF16).
    #[error("model file `{path}`: tensor `{tensor}` is {found}, {expected}")]
    HfTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What config.json (or tidestore) asks for, in words (`config.json implies
        /// [64, 32]`, `expected F32, F16 or BF16`).
        expected: String,
        /// Dtype and shape found (`BF16 [64, 16]`).
        found: String,
    },

    /// A model file that is not a well-formed safetensors file (or index), or is
    /// shorter than its own header says.
    #[error("model file `{path}`: {reason}")]
    HfMalformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor or key where there is one.
        reason: String,
    },

    /// An export's target that cannot be written or replaced: not a directory path, or an
    /// existing directory holding files an export does not write.
    #[error("export target `{path}`: {reason}")]
    ExportTarget {
        /// The target directory.
        path: PathBuf,
        /// Why, naming the file in the way.
        reason: String,
    },

    /// A training text file that cannot be used: empty, or not UTF-8.
    #[error("text file `{path}`: {reason}")]
    TextFile {
        /// The file.
        path: PathBuf,
        /// What is wrong (with the byte offset of the first invalid byte).
        reason: String,
    },

    /// A `tokenizer.json` the `tokenizers` crate refuses, or text it cannot encode.
    #[error("tokenizer `{path}`: {reason}")]
    Tokenizer {
        /// The file (`tokenizer.json`), or `<byte-level>` for the built-in one.
        path: PathBuf,
        /// The tokenizers crate's message.
        reason: String,
    },

    /// A chat template that fails to compile or render, that leaves out a message, or
    /// whose renders of a conversation's prefixes are not prefixes of the whole.
    #[error("chat template `{path}`: {reason}")]
    ChatTemplate {
        /// Where the template was read (a `.jinja` file, `tokenizer_config.json`, or the
        /// model directory that has none).
        path: PathBuf,
        /// What failed.
        reason: String,
    },

    /// The step loop was driven out of order (a tensor stepped twice in one step, a
    /// step finished with tensors left, ...).
    #[error("step loop: {0}")]
    Protocol(String),

    /// A collective with the other data-parallel ranks failed (a rank died, a timeout,
    /// ranks that disagree).
    #[error("data parallel: {0}")]
    Collective(String),
}

fn needed_by(tensor: &Option<String>) -> String {
    match tensor {
        Some(t) => format!(" (the shard index places tensor `{t}` in it)"),
        None => String::new(),
    }
}

/// The result type of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
