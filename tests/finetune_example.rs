//! The README's complete `tidestore finetune` example, run as a new user runs it: the
//! random-weight tiny LLaMA written by `init-model` with the README's arguments, then
//! the shipped `examples/finetune.toml` (its paths relative to itself) for two steps.
//! The shipped config once stopped working when the default `io.block_size` grew (its
//! chunks outgrew its small device budget) and nothing noticed; this test would.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .current_dir(dir)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary")
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_shipped_finetune_example_runs_as_the_readme_says() {
    // A copy of the checkout's layout: examples/ (config and text) beside models/.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("examples/data")).unwrap();
    std::fs::copy(
        Path::new(ROOT).join("examples/finetune.toml"),
        root.join("examples/finetune.toml"),
    )
    .unwrap();
    std::fs::copy(
        Path::new(ROOT).join("examples/data/genesis-kjv.txt"),
        root.join("examples/data/genesis-kjv.txt"),
    )
    .unwrap();
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let init = [
        "init-model",
        "--out",
        "models/tiny-llama",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--intermediate",
        "704",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--vocab",
        "512",
    ];
    assert!(
        readme.contains(
            "init-model --out models/tiny-llama --layers 4 --hidden 256 \\\n    \
             --intermediate 704 --heads 8 --kv-heads 4 --vocab 512"
        ),
        "the README's init-model command changed; update this test with it"
    );
    ok(root, &init);
    let json = ok(
        root,
        &[
            "--config",
            "examples/finetune.toml",
            "finetune",
            "--steps",
            "2",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON report");
    let steps = v["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 2, "{json}");
    for s in steps {
        let loss = s["loss"].as_f64().expect("a loss");
        assert!(loss.is_finite() && loss > 0.0, "{s}");
    }
    // The budgets are small on purpose: the chunks really use all three tiers.
    let peak = v["peak_tier_bytes"].as_array().expect("peak per tier");
    assert!(
        peak.iter().all(|b| b.as_u64().unwrap_or(0) > 0),
        "device, host and NVMe all used: {peak:?}"
    );
}
