//! Guards `tidestore finetune` and `tidestore init-model` end to end, as a user runs
//! them: a random-weight LLaMA written as a Hugging Face directory, fine-tuned on the
//! shipped text through the store; the loss falls; a run stopped at a checkpoint and
//! resumed gives the very losses (bit for bit) of one never stopped; the export is a
//! Hugging Face directory (with LoRA, a PEFT adapter); the README's example runs on the
//! shipped `examples/finetune.toml`; bad input is refused naming the key or file (a
//! budget too small for the chunks also says why they are that large; a `TIDESTORE_BLAS`
//! that names no usable library; micro-batches whose activations cannot fit in memory),
//! exit code 2 for configuration.

use std::path::Path;
use std::process::Output;

mod common;

use common::{ok, run};

const TEXT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/data/genesis-kjv.txt"
);

fn config(extra: &str) -> String {
    format!(
        "[device]\nkind = \"sim\"\nbudget = \"16MiB\"\n[host]\nbudget = \"16MiB\"\n\
         [nvme]\ndir = \"swap\"\nsize = \"256MiB\"\n[optimizer]\nlr = 1e-3\nthreads = 1\n\
         [train]\nmodel_dir = \"model\"\ntext = \"{TEXT}\"\nsteps = 8\nsequence = 32\n\
         micro_batch = 2\ncheckpoint_every = 4\ncheckpoint_dir = \"ckpt\"\n{extra}"
    )
}

/// A directory with a tiny model (two layers, grouped-query attention, sharded) and a
/// config using it.
fn setup(extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("swap")).unwrap();
    ok(dir.path(), common::TINY_MODEL_ARGS);
    std::fs::write(dir.path().join("tidestore.toml"), config(extra)).unwrap();
    dir
}

fn losses(json: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(json).expect("JSON report");
    v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].to_string())
        .collect()
}

#[test]
fn a_resumed_run_repeats_the_uninterrupted_losses_and_exports_a_model() {
    let d = setup("export_dir = \"export\"\n");
    assert!(
        d.path().join("model/model.safetensors.index.json").exists(),
        "sharded"
    );
    let whole = ok(d.path(), &["finetune", "--json"]);
    let all = losses(&whole);
    assert_eq!(all.len(), 8);
    let (first, last): (f64, f64) = (all[0].parse().unwrap(), all[7].parse().unwrap());
    assert!(last < first, "the loss falls: {first} -> {last}");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(d.path().join("export").join(f).exists(), "export/{f}");
    }

    let d2 = setup("");
    ok(d2.path(), &["finetune", "--json", "--steps", "4"]);
    let resumed = ok(d2.path(), &["finetune", "--json", "--resume"]);
    let v: serde_json::Value = serde_json::from_str(&resumed).unwrap();
    assert_eq!(v["resumed_from"], 4);
    assert_eq!(losses(&resumed), all[4..], "steps 5..8 after a resume");
}

#[test]
fn the_optimizer_step_on_the_device_trains_as_the_host_step_and_resumes() {
    // `optimizer.device = "gpu"` on the simulated device: the same CPU kernel over the
    // device's memory, each gradient written there; `auto` there is the host pool.
    let on = |device: &str| {
        let d = setup("");
        let cfg = config("").replace(
            "threads = 1\n",
            &format!("threads = 1\ndevice = \"{device}\"\n"),
        );
        std::fs::write(d.path().join("tidestore.toml"), cfg).unwrap();
        d
    };
    let (host, dev) = (on("auto"), on("gpu"));
    let report = |json: &str| -> serde_json::Value { serde_json::from_str(json).unwrap() };
    let h = ok(host.path(), &["finetune", "--json"]);
    let g = ok(dev.path(), &["finetune", "--json"]);
    assert_eq!(
        report(&h)["optimizer"],
        "host",
        "{}",
        report(&h)["optimizer_reason"]
    );
    assert_eq!(
        report(&g)["optimizer"],
        "device",
        "{}",
        report(&g)["optimizer_reason"]
    );
    assert_eq!(
        losses(&g),
        losses(&h),
        "the step on the device trained otherwise"
    );

    let again = on("gpu");
    ok(again.path(), &["finetune", "--json", "--steps", "4"]);
    let resumed = ok(again.path(), &["finetune", "--json", "--resume"]);
    assert_eq!(
        losses(&resumed),
        losses(&g)[4..],
        "steps 5..8 after a resume"
    );
}

#[test]
fn without_a_gpu_auto_reads_the_host_pool_and_trains_as_the_simulated_gpu() {
    // `kind = "sim"` stands in for a GPU (the blocks read the parameters there); what
    // `auto` leaves without a GPU is host memory, not read at all.
    let sim = setup("");
    let auto = setup("");
    let cfg = config("").replace("kind = \"sim\"", "kind = \"auto\"");
    std::fs::write(auto.path().join("tidestore.toml"), cfg).unwrap();
    let report = |json: &str| -> serde_json::Value { serde_json::from_str(json).unwrap() };
    let (s, a) = (
        ok(sim.path(), &["finetune", "--json"]),
        ok(auto.path(), &["finetune", "--json"]),
    );
    let (rs, ra) = (report(&s), report(&a));
    if ra["compute"] == "cuda" {
        eprintln!("skipped: `auto` found a GPU here, so nothing was left to the simulation");
        return;
    }
    assert_eq!(rs["compute_reads"], "device", "{s}");
    assert_eq!(ra["compute_reads"], "host", "{a}");
    let device_peak = |r: &serde_json::Value| r["peak_tier_bytes"][0].as_u64().unwrap();
    assert!(device_peak(&rs) > 0, "the stand-in holds chunks: {s}");
    assert_eq!(device_peak(&ra), 0, "nothing on the simulated device: {a}");
    assert_eq!(losses(&a), losses(&s), "the same training");
}

#[test]
fn lora_exports_a_peft_adapter() {
    let d = setup("mode = \"lora\"\nlora_rank = 4\nexport_dir = \"adapter\"\n");
    let out = ok(d.path(), &["finetune", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["params_trainable"].as_u64().unwrap() < v["params"].as_u64().unwrap() / 10);
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.path().join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    assert!(d.path().join("adapter/adapter_model.safetensors").exists());
}

/// Runs with other moment forms are compared as a user does: the first run's `--json`
/// report handed to the second with `--plot-with`; both curves in the SVG, each named by
/// its `optimizer.states`, and the final losses compared on stdout. A report that is not
/// one is refused before any step runs.
#[test]
fn plot_with_draws_earlier_runs_and_compares_their_final_loss() {
    let d = setup("");
    let fp32 = ok(d.path(), &["finetune", "--json", "--steps", "4"]);
    let v: serde_json::Value = serde_json::from_str(&fp32).unwrap();
    assert_eq!(v["states"], "fp32");
    // The simulated device tier: the blocks compute on the CPU, and the report says so.
    assert_eq!(v["compute"], "cpu");

    let d2 = setup("");
    let toml = d2.path().join("tidestore.toml");
    let cfg = std::fs::read_to_string(&toml).unwrap();
    std::fs::write(
        &toml,
        cfg.replace("threads = 1\n", "threads = 1\nstates = \"int8\"\n"),
    )
    .unwrap();
    std::fs::write(d2.path().join("fp32.json"), &fp32).unwrap();
    let out = ok(
        d2.path(),
        &[
            "finetune",
            "--steps",
            "4",
            "--plot",
            "cmp.svg",
            "--plot-with",
            "fp32.json",
        ],
    );
    assert!(out.contains("final loss (mean of the last"), "{out}");
    assert!(
        out.contains("this run (int8)") && out.contains("fp32 (fp32)"),
        "{out}"
    );
    let svg = std::fs::read_to_string(d2.path().join("cmp.svg")).unwrap();
    assert!(svg.contains("this run (int8)") && svg.contains("fp32 (fp32)"));

    std::fs::write(d2.path().join("junk.json"), "{\"schema\": \"other\"}").unwrap();
    let bad = run(
        d2.path(),
        &[
            "finetune",
            "--steps",
            "6",
            "--plot",
            "x.svg",
            "--plot-with",
            "junk.json",
        ],
    );
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("junk.json") && err.contains("schema"), "{err}");
    assert!(!d2.path().join("x.svg").exists(), "refused before the run");

    // A plot target that is a directory: once refused only after the whole run, its
    // report lost.
    std::fs::create_dir(d2.path().join("plots")).unwrap();
    let bad = run(d2.path(), &["finetune", "--steps", "6", "--plot", "plots"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--plot") && err.contains("plots is a directory"),
        "{err}"
    );
    assert!(
        !d2.path().join("ckpt/ckpt-000006.safetensors").exists(),
        "refused before the run"
    );
}

/// `finetune` run in `dir` with `config` as its tidestore.toml.
fn finetune_with(dir: &Path, config: &str) -> Output {
    std::fs::write(dir.join("tidestore.toml"), config).unwrap();
    run(dir, &["finetune"])
}

#[test]
fn bad_input_is_refused_naming_the_key_or_file() {
    let d = setup("");
    // No model.
    let out = finetune_with(d.path(), &config("").replace("model_dir = \"model\"\n", ""));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("train.model_dir"));
    // An empty text file.
    std::fs::write(d.path().join("empty.txt"), "").unwrap();
    let out = finetune_with(d.path(), &config("").replace(TEXT, "empty.txt"));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("empty.txt"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each config refused with exit 2, its message holding every one of the words.
    let refused = |config: &str, words: &[&str]| {
        let out = finetune_with(d.path(), config);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(words.iter().all(|w| err.contains(w)), "{words:?}: {err}");
    };
    // A device budget below the working set: the key, and why chunks are that large.
    refused(
        &config("").replace("budget = \"16MiB\"\n[host]", "budget = \"64KiB\"\n[host]"),
        &["device.budget", "io.block_size"],
    );
    // A chunk smaller than a tensor: once named by the trainer's field (chunk_elements),
    // exit 1.
    refused(
        &config("").replace("[train]", "[chunk]\nsize = \"8192\"\n[train]"),
        &["`chunk.size`", "never split"],
    );
    // A host budget no machine can allocate: once the pool's mapping error, unnamed.
    refused(
        &config("").replace(
            "[host]\nbudget = \"16MiB\"",
            "[host]\nbudget = \"100000TiB\"",
        ),
        &["host.budget", "cannot be allocated"],
    );
    // A matrix-product library that cannot be opened: refused before the model loads.
    std::fs::write(d.path().join("tidestore.toml"), config("")).unwrap();
    let out = std::process::Command::new(common::bin())
        .current_dir(d.path())
        .arg("finetune")
        .env("TIDESTORE_BLAS", "/no/such/libopenblas.so")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TIDESTORE_BLAS=/no/such/libopenblas.so"),
        "{err}"
    );
    // Micro-batches whose activations cannot fit in this machine's memory (logits alone
    // 2 · 10⁶ · 2048 · vocab · 4 bytes): refused before step 1, not killed in it.
    refused(
        &config("").replace(
            "sequence = 32\nmicro_batch = 2",
            "sequence = 2048\nmicro_batch = 1000000",
        ),
        &["train.micro_batch", "available"],
    );
    // A model directory without its weights.
    for f in std::fs::read_dir(d.path().join("model")).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            std::fs::remove_file(&p).unwrap();
            break;
        }
    }
    let out = finetune_with(d.path(), &config(""));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(".safetensors"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--resume` on an empty checkpoint directory once started a fresh run (exit 0), and
/// a renamed checkpoint resumed at the step of its name, skipping steps; both refused.
#[test]
fn resume_needs_a_checkpoint_named_for_the_step_it_records() {
    let d = setup("");
    let out = run(d.path(), &["finetune", "--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("train.checkpoint_dir") && err.contains("no checkpoint found to resume from"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no run");

    ok(d.path(), &["finetune", "--steps", "4"]);
    let ckpt = d.path().join("ckpt");
    std::fs::rename(
        ckpt.join("ckpt-000004.safetensors"),
        ckpt.join("ckpt-000006.safetensors"),
    )
    .unwrap();
    let out = run(d.path(), &["finetune", "--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("ckpt-000006.safetensors")
            && err.contains("step 6")
            && err.contains("records step 4"),
        "{err}"
    );
}

/// An export over the checkpoints once deleted them all (exit 0: the export replaces
/// its directory whole), and one holding the checkpoint directory failed only after
/// training; both are refused before step 1, naming both keys.
#[test]
fn an_export_over_the_checkpoints_is_refused_before_step_1() {
    let d = setup("");
    let lora = "mode = \"lora\"\nexport_dir = \"adapter\"\n";
    for (cfg, key) in [
        (config("export_dir = \"ckpt\"\n"), "train.export_dir"),
        (
            config("export_dir = \"run\"\n")
                .replace("checkpoint_dir = \"ckpt\"", "checkpoint_dir = \"run/ck\""),
            "train.export_dir",
        ),
        (
            config(&format!("{lora}export_merged = \"ckpt\"\n")),
            "train.export_merged",
        ),
    ] {
        let out = finetune_with(d.path(), &cfg);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("`{key}`")) && err.contains("train.checkpoint_dir"),
            "{err}"
        );
        assert!(
            out.stdout.is_empty(),
            "no run: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            !d.path().join("run").exists(),
            "nothing made before the refusal"
        );
    }
}

/// Sets `key` of the tiny model's `config.json` in `dir` to `value`.
fn set_model_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("model/config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&path, v.to_string()).unwrap();
}

/// `tie_word_embeddings: true` over weights that hold `lm_head.weight` once trained
/// without that head (silently dropped); refused naming the tensor and the key.
#[test]
fn a_tied_config_over_an_untied_head_is_refused() {
    let d = setup("");
    set_model_config(
        d.path(),
        "tie_word_embeddings",
        serde_json::Value::Bool(true),
    );
    let out = run(d.path(), &["finetune"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("`lm_head.weight`")
            && err.contains("tie_word_embeddings")
            && err.contains("silently dropped"),
        "{err}"
    );
}

/// The README's complete example, run as a new user runs it: the random-weight tiny
/// LLaMA written by `init-model` with the README's arguments, then the shipped
/// `examples/finetune.toml` (its paths relative to itself) for two steps. The shipped
/// config once stopped working when the default `io.block_size` grew (its chunks
/// outgrew its small device budget) and nothing noticed; this test would.
#[test]
fn the_shipped_finetune_example_runs_as_the_readme_says() {
    // A copy of the checkout's layout: examples/ (config and text) beside models/.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("examples/data")).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/finetune.toml"),
        root.join("examples/finetune.toml"),
    )
    .unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/genesis-kjv.txt"),
        root.join("examples/data/genesis-kjv.txt"),
    )
    .unwrap();
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
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
    // Each step's NVMe traffic, within the run's (which counts the import too); the
    // small budgets make the steps read from NVMe.
    let per_step = |k: &str| steps.iter().map(|s| s[k].as_u64().expect(k)).sum::<u64>();
    let total = v["nvme_bytes"].as_array().expect("nvme_bytes");
    assert!(per_step("nvme_read_bytes") > 0, "{json}");
    assert!(
        per_step("nvme_read_bytes") <= total[0].as_u64().unwrap(),
        "{json}"
    );
    assert!(
        per_step("nvme_written_bytes") <= total[1].as_u64().unwrap(),
        "{json}"
    );
    // The run's bytes per chunk list add up to its total, and M and V moved.
    let lists = v["nvme_bytes_by_list"]
        .as_object()
        .expect("nvme_bytes_by_list");
    for (k, dir) in [(0, "read"), (1, "written")] {
        let sum: u64 = lists.values().map(|rw| rw[k].as_u64().unwrap()).sum();
        assert_eq!(sum, total[k].as_u64().unwrap(), "{dir} per list: {json}");
    }
    assert!(lists.contains_key("m") && lists.contains_key("v"), "{json}");
    // The disk's time for those bytes: some, within each step's wall time.
    for s in steps {
        let busy = s["nvme_busy_seconds"].as_f64().expect("nvme_busy_seconds");
        assert!(busy >= 0.0 && busy <= s["seconds"].as_f64().unwrap(), "{s}");
    }
    let busy: f64 = steps
        .iter()
        .map(|s| s["nvme_busy_seconds"].as_f64().unwrap())
        .sum();
    assert!(busy > 0.0, "steps that read from NVMe kept it busy: {json}");
    // Where the blocks computed, and with which matrix products (OpenBLAS where this
    // machine has it).
    assert_eq!(v["compute"], "cpu", "{json}");
    assert_eq!(
        v["matmul"].as_str(),
        Some(tidestore_candle::blas::backend().unwrap().as_str()),
        "{json}"
    );
    // The budgets are small on purpose: the chunks really use all three tiers.
    let peak = v["peak_tier_bytes"].as_array().expect("peak per tier");
    assert!(
        peak.iter().all(|b| b.as_u64().unwrap_or(0) > 0),
        "device, host and NVMe all used: {peak:?}"
    );
}
