//! What the CLI tests share: running the binary, and the tiny model they fine-tune.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary under test: `TIDESTORE_BIN` when set, else the one cargo built.
pub fn bin() -> PathBuf {
    std::env::var_os("TIDESTORE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tidestore")))
}

/// Runs [`bin`] in `dir` with `args` (logging at `warn`).
pub fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .current_dir(dir)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary")
}

/// [`run`], which must succeed; its standard output.
pub fn ok(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

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
