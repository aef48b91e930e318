//! Guards against `tidestore bench` starting (or panicking, or exiting 1) on a bad
//! configuration: each case of issue 5's list must exit with code 2 before any
//! training starts, with one `error:` line naming the key and the reason, and print no
//! results.

use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

struct Run {
    _dir: tempfile::TempDir,
    out: Output,
}

/// A tiny workload that runs in a fraction of a second; cases replace parts of it.
const TINY: &str = "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[device]\nkind = \"sim\"\nbudget = \"1MiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"{swap}\"\nsize = \"16MiB\"\n\
[workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 2\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 1\n";

fn run(body: &str) -> Run {
    run_command(body, "bench")
}

/// `tidestore --config <body> <command>`.
fn run_command(body: &str, command: &str) -> Run {
    let dir = tempfile::tempdir().expect("temp dir");
    let swap: PathBuf = dir.path().join("swap");
    let config = dir.path().join("tidestore.toml");
    std::fs::write(&config, body.replace("{swap}", &swap.display().to_string())).expect("write");
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg(command)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary");
    Run { _dir: dir, out }
}

fn assert_refused(r: &Run, key: &str, reason_has: &str) {
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert_eq!(r.out.status.code(), Some(2), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line: {stderr}");
    assert!(
        errors[0].contains(&format!("`{key}`")),
        "names {key}: {stderr}"
    );
    assert!(
        errors[0].contains(reason_has),
        "says `{reason_has}`: {stderr}"
    );
    assert!(r.out.stdout.is_empty(), "printed results for a bad config");
}

fn with(section_key: &str, line: &str) -> String {
    // Replace `key = ...` in TINY's section, or add the line to it.
    let (section, key) = section_key.split_once('.').expect("section.key");
    let mut out = String::new();
    let mut in_section = false;
    let mut done = false;
    for l in TINY.lines() {
        if l.starts_with('[') {
            if in_section && !done {
                out.push_str(line);
                out.push('\n');
                done = true;
            }
            in_section = l == format!("[{section}]");
        } else if in_section && l.starts_with(&format!("{key} =")) {
            out.push_str(line);
            out.push('\n');
            done = true;
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    if !done {
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[test]
fn the_tiny_workload_itself_runs() {
    let r = run(TINY);
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert_eq!(r.out.status.code(), Some(0), "{stderr}");
}

#[test]
fn unknown_key() {
    assert_refused(
        &run(&with("workload.iteratoins", "iteratoins = 3")),
        "workload.iteratoins",
        "unknown key",
    );
}

#[test]
fn wrong_type() {
    assert_refused(
        &run(&with("workload.iterations", "iterations = \"many\"")),
        "workload.iterations",
        "invalid type",
    );
}

#[test]
fn negative_size() {
    assert_refused(
        &run(&with("host.budget", "budget = \"-2MiB\"")),
        "host.budget",
        "negative",
    );
}

#[test]
fn unparsable_size() {
    assert_refused(
        &run(&with("device.budget", "budget = \"a lot\"")),
        "device.budget",
        "not a size",
    );
}

#[test]
fn device_budget_smaller_than_one_chunk() {
    assert_refused(
        &run(&with("device.budget", "budget = \"4KiB\"")),
        "device.budget",
        "smaller than one chunk",
    );
}

#[test]
fn unwritable_nvme_dir() {
    // Root may write anywhere on a normal filesystem, but not create folders in /proc.
    assert_refused(
        &run(&with("nvme.dir", "dir = \"/proc/tidestore-swap\"")),
        "nvme.dir",
        "cannot be created",
    );
}

#[test]
fn model_that_does_not_fit() {
    let body = TINY
        .replace(
            "model = \"custom\"\narch = \"gpt2\"\nlayers = 2\nhidden = 64\nheads = 4\n\
             intermediate = 256\nvocab = 512\n",
            "model = \"llama-70b\"\n",
        )
        .replace("budget = \"1MiB\"", "budget = \"8GiB\"")
        .replace("budget = \"2MiB\"", "budget = \"8GiB\"")
        .replace("size = \"16MiB\"", "size = \"32GiB\"");
    assert!(body.contains("llama-70b"), "{body}");
    assert_refused(&run(&body), "nvme.size", "does not fit");
}

#[test]
fn optimizer_on_a_device_too_small_for_a_tensors_four_chunks() {
    // fp32 chunks of up to 512 KiB: the step of `wte` on the device holds its 16-bit
    // chunk and three fp32 chunks (1.55 MiB) at once, more than the 1 MiB simulated
    // device.
    let body = format!("[optimizer]\ndevice = \"gpu\"\n[chunk]\nsize = \"512KiB\"\n{TINY}")
        .replace("[device]\n", "[device]\nsim_memory = \"1MiB\"\n");
    let r = run(&body);
    assert_refused(&r, "optimizer.device", "short");
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert!(
        stderr.contains("tensor `wte` needs 1.55 MiB")
            && stderr.contains("the device budget during the step is 1.00 MiB"),
        "names what is needed and what the step's budget gives: {stderr}"
    );
}

#[test]
fn optimizer_on_a_device_that_holds_the_step_runs() {
    let body = format!("[optimizer]\ndevice = \"gpu\"\n{TINY}")
        .replace("[device]\n", "[device]\nsim_memory = \"8MiB\"\n");
    let r = run(&body);
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert_eq!(r.out.status.code(), Some(0), "{stderr}");
}

#[test]
fn device_kind_cuda_without_a_gpu() {
    let r = run(&with("device.kind", "kind = \"cuda\""));
    if cfg!(feature = "cuda") && r.out.status.code() == Some(0) {
        // A GPU is here: the bench ran on it (tests/bench_gpu.rs checks what it gives).
        println!("skipped: a CUDA GPU is present, so `cuda` is not refused");
        return;
    }
    assert_refused(&r, "device.kind", "no CUDA device");
}

#[test]
fn a_billion_layers_is_refused_before_they_are_listed() {
    // Once each layer's tensors were listed before the fit check: the process aborted
    // allocating them ("memory allocation of … bytes failed").
    let billion = with("workload.layers", "layers = 1000000000");
    assert_refused(&run(&billion), "workload.layers", "does not fit");
    // `plan` listed them too, to report that they do not fit.
    assert_refused(
        &run_command(&billion, "plan"),
        "workload.layers",
        "the plan's GPU + host pool + NVMe",
    );
}
