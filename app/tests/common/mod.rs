//! What the CLI tests share: the tiny model they fine-tune.

/// `tidestore init-model` arguments of the tests' tiny model: two layers, grouped-query
/// attention, vocabulary 300, sharded (64 KiB shards), seed 3, written to `model/`.
pub const TINY_MODEL_ARGS: &[&str] = &[
    "init-model",
    "--out",
    "model",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--intermediate",
    "160",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "300",
    "--seed",
    "3",
    "--max-shard-size",
    "64KiB",
];
