//! Guards `tidestore plan`'s projection against drifting from what `tidestore bench`
//! measures: on one workload whose iteration is dominated by modeled compute
//! (`workload.tflops`), the plan's projected iteration — with the optimizer at the rate
//! the bench measured — must be within 25 % of the bench's measured iteration, with
//! the step after backward and with the step overlapping it. Compute dominates so that
//! the comparison holds on a loaded 2-core machine.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

/// A tiny GPT whose forward and backward take about 0.4 s at 0.0003 TFLOP/s, with every
/// chunk in the host pool.
fn config(overlap: &str, max_grad_norm: f64) -> String {
    format!(
        "[io]\nblock_size = 4096\nqueue_depth = 8\n\
         [device]\nkind = \"sim\"\nbudget = \"1MiB\"\n\
         [host]\nbudget = \"16MiB\"\n\
         [nvme]\ndir = \"swap\"\nsize = \"32MiB\"\n\
         [optimizer]\noverlap = \"{overlap}\"\nmax_grad_norm = {max_grad_norm}\nthreads = 1\n\
         [workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
         intermediate = 256\nvocab = 512\nsequence = 64\niterations = 3\ntflops = 0.0003\n"
    )
}

fn run_json(dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(BIN)
        .arg("--config")
        .arg(dir.join("tidestore.toml"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn compare(overlap: &str, max_grad_norm: f64) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tidestore.toml"),
        config(overlap, max_grad_norm),
    )
    .unwrap();
    let bench = run_json(dir.path(), &["bench", "--json"]);
    let measured = bench["seconds_per_iteration"].as_f64().unwrap();
    let compute = bench["bound"]["compute_seconds"].as_f64().unwrap();
    assert!(compute > 0.2, "compute dominates: {compute} s");
    let rate = bench["optimizer"]["kernel_params_per_s"].as_f64().unwrap();
    let plan = run_json(
        dir.path(),
        &["plan", "--json", "--optimizer-rate", &rate.to_string()],
    );
    let projected = plan["iteration_seconds"].as_f64().unwrap();
    assert!(
        (plan["compute_seconds"].as_f64().unwrap() - compute).abs() < 1e-9,
        "plan and bench count the same FLOPs"
    );
    let ratio = projected / measured;
    assert!(
        (0.75..=1.25).contains(&ratio),
        "overlap {overlap}: plan projects {projected:.3} s, bench measured {measured:.3} s \
         (ratio {ratio:.2})"
    );
}

#[test]
fn the_plan_projects_what_the_bench_measures() {
    compare("off", 1.0);
}

#[test]
fn the_plan_projects_what_the_bench_measures_with_overlap() {
    compare("backward", 0.0);
}

#[test]
fn plan_gpus_projects_one_ranks_shard_and_its_collectives() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tidestore.toml"), config("off", 1.0)).unwrap();
    let args = ["plan", "--json", "--optimizer-rate", "1e9"];
    let one = run_json(dir.path(), &args);
    let two = run_json(
        dir.path(),
        &[&args[..], &["--gpus", "2", "--link", "10"]].concat(),
    );
    assert_eq!(two["machine"]["ranks"], 2);
    // Full fine-tuning: every parameter gathered twice and its gradient reduce-scattered,
    // half of each through a rank.
    let p = one["params_trainable"].as_u64().unwrap();
    assert_eq!(one["collective_bytes"], 0);
    assert_eq!(two["collective_bytes"].as_u64().unwrap(), 6 * p / 2);
    let stored = |v: &serde_json::Value| -> u64 {
        v["lists"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["payload_bytes"].as_u64().unwrap())
            .sum()
    };
    let (a, b) = (stored(&one), stored(&two));
    assert!(
        b * 2 >= a && b * 2 < a + a / 100,
        "one rank stores {b} of {a}"
    );

    let out = Command::new(BIN)
        .arg("--config")
        .arg(dir.path().join("tidestore.toml"))
        .args(["plan", "--gpus", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--gpus 0 is a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gpus"));
}
