//! Guards issue 26, "a run does what it says or stops": each test here is a way
//! `tidestore finetune` (or `bench`) once ended with exit 0 and a wrong result, lost
//! work it could have refused up front, left files behind, or said something unclear:
//! 1. NaN weights trained as "skipped" steps and exported; a diverged step skipped
//!    silently without a loss scaler;
//! 2. a fresh run into another run's checkpoint directory (its checkpoints pruned, and
//!    `--resume` loading the other run's);
//! 3. `export_dir = model_dir` overwriting the base model;
//! 4. `nvme.size`, `nvme.compression`, an extra tensor in the model ignored;
//! 5. an unwritable checkpoint, export or plot path found only after the steps ran;
//! 6. swap files left after a run, after Ctrl-C, and a killed export's temporaries;
//! 7. a token id beyond the vocabulary reported by candle, an empty tokenizer blaming
//!    the text, another `optimizer.states` reported as a tensor mismatch, the report
//!    listing pruned checkpoints.
//!
//! `TIDESTORE_BIN` runs them against another build of the binary (to see them fail on
//! an older one).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

mod common;

use common::{bin, ok, run};

const TEXT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/data/genesis-kjv.txt"
);

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn config(extra: &str) -> String {
    format!(
        "[device]\nkind = \"sim\"\nbudget = \"16MiB\"\n[host]\nbudget = \"16MiB\"\n\
         [nvme]\ndir = \"swap\"\nsize = \"256MiB\"\n[optimizer]\nlr = 1e-3\nthreads = 1\n\
         [train]\nmodel_dir = \"model\"\ntext = \"{TEXT}\"\nsteps = 4\nsequence = 32\n\
         micro_batch = 2\ncheckpoint_every = 2\ncheckpoint_dir = \"ckpt\"\n{extra}"
    )
}

fn write_config(dir: &Path, extra: &str) {
    std::fs::write(dir.join("tidestore.toml"), config(extra)).unwrap();
}

/// A directory with a tiny sharded bf16 model (vocab 300) and a config using it.
fn setup(extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("swap")).unwrap();
    ok(dir.path(), common::TINY_MODEL_ARGS);
    write_config(dir.path(), extra);
    dir
}

/// The shard of the model holding `tensor`.
fn shard_of(model: &Path, tensor: &str) -> PathBuf {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    model.join(index["weight_map"][tensor].as_str().unwrap())
}

/// Overwrites elements `from..to` of the bf16 tensor `tensor` with `bits`.
fn patch_bf16(model: &Path, tensor: &str, from: usize, to: usize, bits: u16) {
    let path = shard_of(model, tensor);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[tensor]["dtype"], "BF16");
    let start = 8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    for i in from..to {
        bytes[start + 2 * i..start + 2 * i + 2].copy_from_slice(&bits.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
}

/// Sends `child` SIGINT, as Ctrl-C does, and returns its output once it has exited; a
/// child still running a minute later (a clean-up that hangs) is killed and fails the
/// test.
fn interrupt(mut child: Child) -> Output {
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("still running 60 s after SIGINT (killed): {}", stderr(&out));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The files under `dir`, recursively, relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(read) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in read {
        let p = e.unwrap().path();
        let name = p.strip_prefix(dir).unwrap().display().to_string();
        if p.is_dir() {
            out.push(format!("{name}/"));
            out.extend(files_under(&p).into_iter().map(|f| format!("{name}/{f}")));
        } else {
            out.push(name);
        }
    }
    out.sort();
    out
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).expect("a JSON report")
}

// ---- 1. non-finite values ------------------------------------------------------------

#[test]
fn item1_nan_weights_are_refused_at_import_naming_tensor_and_index() {
    let d = setup("export_dir = \"export\"\n");
    patch_bf16(
        &d.path().join("model"),
        "model.embed_tokens.weight",
        77,
        78,
        0x7fc0,
    );
    let out = run(d.path(), &["finetune"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("index 77"),
        "{err}"
    );
    assert!(!d.path().join("export").exists(), "nothing exported");
    assert!(files_under(&d.path().join("ckpt")).is_empty());
}

#[test]
fn item1_a_diverged_step_without_a_loss_scaler_stops_the_run() {
    // Finite but huge weights (bf16's largest): the first forward overflows.
    let d = setup("export_dir = \"export\"\n");
    // A finite but huge final norm (bf16's largest): the logits overflow.
    patch_bf16(&d.path().join("model"), "model.norm.weight", 0, 64, 0x7f7f);
    let out = run(d.path(), &["finetune"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("step 1:") && err.contains("no loss scaler"),
        "{err}"
    );
    assert!(
        !d.path().join("export").exists(),
        "a diverged model is not exported"
    );
}

// ---- 2. run identity -----------------------------------------------------------------

#[test]
fn item2_another_runs_checkpoints_are_refused_fresh_and_on_resume() {
    let d = setup("");
    ok(d.path(), &["finetune", "--steps", "4"]);
    let ckpts = files_under(&d.path().join("ckpt"));
    assert_eq!(
        ckpts,
        ["ckpt-000002.safetensors", "ckpt-000004.safetensors"]
    );
    // Another lr, a fresh run into the same directory: refused before step 1.
    let toml = config("").replace("lr = 1e-3", "lr = 2e-3");
    std::fs::write(d.path().join("tidestore.toml"), &toml).unwrap();
    let out = run(d.path(), &["finetune", "--steps", "2"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("train.checkpoint_dir")
            && err.contains("optimizer.lr: checkpoint 0.001, this run 0.002"),
        "{err}"
    );
    // --resume with that lr: refused naming what differs, nothing loaded or run.
    let out = run(d.path(), &["finetune", "--steps", "6", "--resume"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("optimizer.lr: checkpoint 0.001, this run 0.002"),
        "{err}"
    );
    assert_eq!(files_under(&d.path().join("ckpt")), ckpts, "untouched");
    // The same run resumes.
    write_config(d.path(), "");
    let v = json(&ok(
        d.path(),
        &["finetune", "--steps", "6", "--resume", "--json"],
    ));
    assert_eq!(v["resumed_from"], 4);
}

// ---- 3. export over the model ----------------------------------------------------------

#[test]
fn item3_an_export_over_or_into_the_model_is_refused() {
    let d = setup("");
    let before = std::fs::read(shard_of(
        &d.path().join("model"),
        "model.embed_tokens.weight",
    ))
    .unwrap();
    for target in ["model", "model/out", "./model/../model"] {
        write_config(d.path(), &format!("export_dir = \"{target}\"\n"));
        let out = run(d.path(), &["finetune", "--steps", "2"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{target}: {err}");
        assert!(err.contains("train.export_dir"), "{err}");
    }
    let after = std::fs::read(shard_of(
        &d.path().join("model"),
        "model.embed_tokens.weight",
    ))
    .unwrap();
    assert!(before == after, "the base model is untouched");
    assert!(!d.path().join("model/out").exists());
}

// ---- 4. settings finetune would ignore -------------------------------------------------

#[test]
fn item4_settings_finetune_cannot_honour_are_refused_naming_the_key() {
    let d = setup("");
    // (from, to, the key named, and a word the message must hold): settings finetune
    // does not read, and stepping during backward, which it honours but refuses beside
    // clipping, which needs every gradient first.
    let cases = [
        (
            "size = \"256MiB\"",
            "size = \"1MiB\"",
            "nvme.size",
            "finetune",
        ),
        (
            "size = \"256MiB\"",
            "size = \"256MiB\"\ncompression = \"zstd\"",
            "nvme.compression",
            "finetune",
        ),
        (
            "threads = 1\n",
            "threads = 1\noverlap = \"backward\"\n",
            "optimizer.overlap",
            "max_grad_norm",
        ),
    ];
    for (from, to, key, word) in cases {
        std::fs::write(
            d.path().join("tidestore.toml"),
            config("").replace(from, to),
        )
        .unwrap();
        let out = run(d.path(), &["finetune", "--steps", "1"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{key}: {err}");
        assert!(err.contains(key) && err.contains(word), "{key}: {err}");
    }
    if !cfg!(feature = "cuda") {
        std::fs::write(
            d.path().join("tidestore.toml"),
            config("").replace("kind = \"sim\"", "kind = \"cuda\""),
        )
        .unwrap();
        let out = run(d.path(), &["finetune", "--steps", "1"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("device.kind"), "{}", stderr(&out));
    }
    assert!(
        files_under(&d.path().join("ckpt")).is_empty(),
        "no step ran"
    );
}

#[test]
fn item4_a_tensor_the_model_does_not_use_is_refused() {
    let d = setup("");
    let model = d.path().join("model");
    // A shard of its own holding `extra.weight`, listed in the index.
    let header = br#"{"extra.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0u8; 8]);
    std::fs::write(model.join("extra.safetensors"), file).unwrap();
    let index_path = model.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["extra.weight"] = "extra.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let out = run(d.path(), &["finetune", "--steps", "1"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("extra.weight") && err.contains("not used"),
        "{err}"
    );
}

// ---- 5. outputs checked before step 1 --------------------------------------------------

/// An existing folder this process cannot write in: a read-only one of its own when it
/// is not root; as root (which ignores permissions), a folder of a read-only system
/// file system. `None` where there is none.
fn read_only_dir(base: &Path) -> Option<PathBuf> {
    let own = base.join("read-only");
    std::fs::create_dir_all(&own).unwrap();
    let mut perms = std::fs::metadata(&own).unwrap().permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(&own, perms).unwrap();
    [
        own,
        PathBuf::from("/sys/kernel"),
        PathBuf::from("/proc/sys"),
    ]
    .into_iter()
    .find(|d| d.is_dir() && std::fs::write(d.join(".tidestore-test-probe"), b"x").is_err())
}

#[test]
fn item5_unwritable_outputs_are_refused_before_any_step() {
    let d = setup("");
    // A file where a folder must be: unwritable for every user, root included.
    std::fs::write(d.path().join("blocker"), b"a file").unwrap();
    let mut cases = vec![
        (
            "checkpoint_dir = \"ckpt\"".to_string(),
            "checkpoint_dir = \"blocker/ckpt\"".to_string(),
            "train.checkpoint_dir",
        ),
        (
            "micro_batch = 2".to_string(),
            "micro_batch = 2\nexport_dir = \"blocker/export\"".to_string(),
            "train.export_dir",
        ),
    ];
    // An existing read-only folder: once found only at the first checkpoint / the export.
    match read_only_dir(d.path()) {
        Some(ro) => {
            cases.push((
                "checkpoint_dir = \"ckpt\"".into(),
                format!("checkpoint_dir = \"{}\"", ro.display()),
                "train.checkpoint_dir",
            ));
            cases.push((
                "micro_batch = 2".into(),
                format!("micro_batch = 2\nexport_dir = \"{}/export\"", ro.display()),
                "train.export_dir",
            ));
        }
        None => println!("skipped the read-only folder cases: no folder this process cannot write"),
    }
    for (from, to, key) in cases {
        std::fs::write(
            d.path().join("tidestore.toml"),
            config("").replace(&from, &to),
        )
        .unwrap();
        let out = run(d.path(), &["finetune", "--json"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{key}: {err}");
        assert!(err.contains(key), "{key}: {err}");
        assert!(out.stdout.is_empty(), "no step ran");
    }
    write_config(d.path(), "");
    let out = run(d.path(), &["finetune", "--plot", "blocker/loss.svg"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--plot"), "{err}");
    assert!(
        files_under(&d.path().join("ckpt")).is_empty(),
        "no step ran"
    );
}

// ---- 6. nothing left behind ------------------------------------------------------------

#[test]
fn item6_finetune_leaves_no_swap_file_and_cleans_a_dead_runs_leftovers() {
    let d = setup("export_dir = \"export\"\n");
    // What a run killed with -9 left: its swap directory and a half-written export.
    let dead = u32::MAX - 7;
    let stale_swap = d.path().join(format!("swap/finetune.{dead}"));
    std::fs::create_dir(&stale_swap).unwrap();
    std::fs::write(stale_swap.join("tidestore-chunks.swap"), b"old").unwrap();
    let stale_export = d.path().join(format!(".export.tmp.{dead}"));
    std::fs::create_dir(&stale_export).unwrap();
    std::fs::write(stale_export.join("model.safetensors"), b"half").unwrap();
    let out = ok(d.path(), &["finetune", "--steps", "2"]);
    assert!(out.contains("swap directory (removed)"), "{out}");
    assert!(
        files_under(&d.path().join("swap")).is_empty(),
        "{:?}",
        files_under(&d.path().join("swap"))
    );
    assert!(!stale_export.exists());
    let mut top = files_under(d.path());
    top.retain(|f| !f.contains('/') || f.ends_with('/'));
    assert_eq!(
        top,
        ["ckpt/", "export/", "model/", "swap/", "tidestore.toml"]
    );
}

#[test]
fn item6_ctrl_c_removes_the_swap_directory_and_keeps_complete_checkpoints() {
    let d = setup("");
    std::fs::write(
        d.path().join("tidestore.toml"),
        config("").replace("steps = 4", "steps = 100000"),
    )
    .unwrap();
    let mut child = Command::new(bin())
        .current_dir(d.path())
        .args(["finetune"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a first checkpoint (the run is then well inside its steps). Any one: a
    // small model steps fast enough that the first is pruned (only the last are kept)
    // between two polls.
    let ckpt_dir = d.path().join("ckpt");
    let complete = |f: &String| f.starts_with("ckpt-") && f.ends_with(".safetensors");
    while !files_under(&ckpt_dir).iter().any(complete) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("exited before its first checkpoint: {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SIGINT, as Ctrl-C sends it.
    let out = interrupt(child);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert!(
        files_under(&d.path().join("swap")).is_empty(),
        "{:?}",
        files_under(&d.path().join("swap"))
    );
    let ckpts = files_under(&d.path().join("ckpt"));
    assert!(
        !ckpts.is_empty() && ckpts.iter().all(|f| f.starts_with("ckpt-")),
        "{ckpts:?}"
    );
    // Each one complete: a resume verifies the newest (every tensor's crc32c).
    std::fs::write(
        d.path().join("tidestore.toml"),
        config("").replace("steps = 4", "steps = 100000"),
    )
    .unwrap();
    let newest = ckpts.last().unwrap();
    let step: u32 = newest["ckpt-".len()..newest.len() - ".safetensors".len()]
        .parse()
        .unwrap();
    let v = json(&ok(
        d.path(),
        &[
            "finetune",
            "--resume",
            "--json",
            "--steps",
            &(step + 1).to_string(),
        ],
    ));
    assert_eq!(v["resumed_from"], step);
}

#[test]
fn item6_bench_leaves_no_swap_file() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("swap")).unwrap();
    std::fs::write(
        d.path().join("tidestore.toml"),
        "[io]\nblock_size = 4096\nqueue_depth = 8\n[chunk]\nsize = \"auto\"\n[device]\nkind = \"sim\"\nbudget = \"512KiB\"\n\
         [host]\nbudget = \"2MiB\"\n[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
         [workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
         intermediate = 256\nvocab = 512\nsequence = 64\niterations = 1\n",
    )
    .unwrap();
    let out = ok(d.path(), &["bench"]);
    assert!(out.contains("swap directory (removed)"), "{out}");
    assert!(
        files_under(&d.path().join("swap")).is_empty(),
        "{:?}",
        files_under(&d.path().join("swap"))
    );
}

// ---- 7. messages -----------------------------------------------------------------------

#[test]
fn item7_a_token_beyond_the_vocabulary_names_the_tokenizer_and_both_numbers() {
    let d = setup("");
    let path = d.path().join("model/tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["model"]["vocab"]["e"] = 5000.into();
    std::fs::write(&path, tok.to_string()).unwrap();
    let out = run(d.path(), &["finetune", "--steps", "1"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("tokenizer.json") && err.contains("5000") && err.contains("vocab_size is 300"),
        "{err}"
    );
    // A tokenizer without ids: it is named, not the text.
    tok["model"]["vocab"] = serde_json::json!({});
    tok["added_tokens"] = serde_json::json!([]);
    std::fs::write(&path, tok.to_string()).unwrap();
    let out = run(d.path(), &["finetune", "--steps", "1"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("tokenizer.json") && err.contains("empty vocabulary"),
        "{err}"
    );
}

#[test]
fn item7_resuming_with_other_states_names_the_setting_and_the_report_lists_kept_checkpoints() {
    let d = setup("");
    let v = json(&ok(d.path(), &["finetune", "--steps", "6", "--json"]));
    let listed: Vec<String> = v["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed.len(), 2, "the two kept, not the pruned: {listed:?}");
    assert!(
        listed.iter().all(|p| d.path().join(p).exists()),
        "{listed:?}"
    );
    std::fs::write(
        d.path().join("tidestore.toml"),
        config("").replace("threads = 1\n", "threads = 1\nstates = \"int8\"\n"),
    )
    .unwrap();
    let out = run(d.path(), &["finetune", "--steps", "8", "--resume"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("optimizer.states: checkpoint fp32, this run int8"),
        "{err}"
    );
}

#[test]
fn item6_ctrl_c_during_io_bench_removes_its_file() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("swap")).unwrap();
    std::fs::write(
        d.path().join("tidestore.toml"),
        "[nvme]\ndir = \"swap\"\nsize = \"1GiB\"\n",
    )
    .unwrap();
    let mut child = Command::new(bin())
        .current_dir(d.path())
        .args(["io-bench", "--file-size", "64MiB", "--repeats", "1000"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let file = d.path().join("swap/tidestore-io-bench.dat");
    while !file.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("exited before making its file: {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = interrupt(child);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("tidestore-io-bench.dat"),
        "named as removed: {err}"
    );
    assert!(files_under(&d.path().join("swap")).is_empty());
}
