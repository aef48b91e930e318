//! `tidestore bench` on a LoRA workload: the frozen base weights have no gradients, so
//! backward must report only the adapters' gradients final (a frozen tensor reported
//! final once failed every LoRA bench with "a gradient reported final before it was
//! written"). The tiny model spills to NVMe so that every tier is used.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

fn config(overlap: &str) -> String {
    format!(
        "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[device]\nkind = \"sim\"\nbudget = \"512KiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
[optimizer]\noverlap = \"{overlap}\"\nmax_grad_norm = 0.0\n\
[workload]\nmodel = \"custom\"\narch = \"llama\"\nlayers = 4\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 2\n\
mode = \"lora\"\nlora_rank = 4\n"
    )
}

#[test]
fn lora_bench_runs_and_steps_only_the_adapters() {
    for overlap in ["off", "backward"] {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("tidestore.toml");
        std::fs::write(&path, config(overlap)).expect("write config");
        let out = Command::new(BIN)
            .arg("--config")
            .arg(&path)
            .args(["bench", "--json"])
            .env("RUST_LOG", "warn")
            .output()
            .expect("run the binary");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "overlap = {overlap}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
        assert_eq!(v["workload"]["mode"], "lora");
        let base = v["workload"]["params_base"].as_u64().expect("params_base");
        let trainable = v["workload"]["params_trainable"]
            .as_u64()
            .expect("params_trainable");
        assert!(
            trainable > 0 && trainable * 10 < base,
            "LoRA trains a small part: {trainable} of {base}"
        );
    }
}
