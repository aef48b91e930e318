//! Guards against the binary panicking, exiting 0 or 1, or printing an error that does
//! not name what to fix when the configuration or a flag is bad: each case must exit
//! with code 2 and put one `error:` line naming the key (or flag) on stderr.

use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

struct Run {
    _dir: tempfile::TempDir,
    out: Output,
}

/// Run `tidestore --config <file with body> io-bench <args>`; `{swap}` in `body` is a
/// writable folder.
fn run(body: &str, args: &[&str]) -> Run {
    run_command(body, "io-bench", args)
}

/// [`run`] with another command.
fn run_command(body: &str, command: &str, args: &[&str]) -> Run {
    let dir = tempfile::tempdir().expect("temp dir");
    let swap: PathBuf = dir.path().join("swap");
    let config = dir.path().join("tidestore.toml");
    std::fs::write(&config, body.replace("{swap}", &swap.display().to_string())).expect("write");
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg(command)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary");
    Run { _dir: dir, out }
}

fn assert_exit_2_naming(r: &Run, name: &str) {
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert_eq!(r.out.status.code(), Some(2), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(
        stderr.contains(name),
        "stderr does not name {name}: {stderr}"
    );
    assert!(r.out.stdout.is_empty(), "printed results for a bad input");
}

fn assert_one_error_line(r: &Run, key: &str) {
    assert_exit_2_naming(r, key);
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line: {stderr}");
    assert!(errors[0].contains(&format!("`{key}`")), "{stderr}");
}

const NVME: &str = "[nvme]\ndir = \"{swap}\"\n";

#[test]
fn unknown_key_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nblok_size = 4096\n{NVME}"), &[]),
        "io.blok_size",
    );
}

#[test]
fn wrong_type_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nqueue_depth = \"deep\"\n{NVME}"), &[]),
        "io.queue_depth",
    );
}

#[test]
fn negative_size_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nblock_size = -4096\n{NVME}"), &[]),
        "io.block_size",
    );
}

#[test]
fn unparsable_size_exits_2() {
    assert_one_error_line(
        &run(&format!("[chunk]\nsize = \"lots\"\n{NVME}"), &[]),
        "chunk.size",
    );
}

#[test]
fn block_size_not_a_multiple_of_4096_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nblock_size = 6144\n{NVME}"), &[]),
        "io.block_size",
    );
}

#[test]
fn queue_depth_zero_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nqueue_depth = 0\n{NVME}"), &[]),
        "io.queue_depth",
    );
}

#[test]
fn queue_depth_4097_exits_2() {
    assert_one_error_line(
        &run(&format!("[io]\nqueue_depth = 4097\n{NVME}"), &[]),
        "io.queue_depth",
    );
}

#[test]
fn missing_nvme_dir_exits_2() {
    assert_one_error_line(&run("[io]\nqueue_depth = 8\n", &[]), "nvme.dir");
}

#[test]
fn nvme_dir_that_is_a_file_exits_2() {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    let body = format!("[nvme]\ndir = \"{}\"\n", file.path().display());
    assert_one_error_line(&run(&body, &[]), "nvme.dir");
}

#[test]
fn unwritable_nvme_dir_exits_2() {
    assert_one_error_line(
        &run("[nvme]\ndir = \"/proc/tidestore-swap\"\n", &[]),
        "nvme.dir",
    );
}

#[test]
fn swap_file_too_small_for_one_chunk_exits_2() {
    let body = "[chunk]\nsize = \"64MiB\"\n[nvme]\ndir = \"{swap}\"\nsize = \"1MiB\"\n";
    assert_one_error_line(&run(body, &[]), "nvme.size");
}

#[test]
fn malformed_toml_exits_2_with_line_and_column() {
    let r = run("[io\nqueue_depth = 8\n", &[]);
    assert_exit_2_naming(&r, "invalid TOML");
    let stderr = String::from_utf8_lossy(&r.out.stderr);
    assert!(stderr.contains("tidestore.toml:1:"), "{stderr}");
}

#[test]
fn missing_config_file_exits_2() {
    let out = Command::new(BIN)
        .args(["--config", "/nonexistent/tidestore.toml", "io-bench"])
        .output()
        .expect("run the binary");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/tidestore.toml"), "{stderr}");
}

#[test]
fn unparsable_size_flag_exits_2() {
    assert_exit_2_naming(&run(NVME, &["--file-size", "huge"]), "--file-size");
}

#[test]
fn bad_block_size_flag_names_the_flag() {
    assert_exit_2_naming(&run(NVME, &["--block-size", "6144"]), "--block-size");
}

#[test]
fn bad_queue_depth_flag_names_the_flag() {
    assert_exit_2_naming(&run(NVME, &["--queue-depth", "0"]), "--queue-depth");
}

#[test]
fn chunk_larger_than_file_names_the_flag() {
    let r = run(NVME, &["--file-size", "8MiB", "--chunk-size", "16MiB"]);
    assert_exit_2_naming(&r, "--chunk-size");
}

#[test]
fn zero_repeats_exits_2() {
    assert_exit_2_naming(&run(NVME, &["--repeats", "0"]), "--repeats");
}

#[test]
fn missing_fio_is_a_clear_error() {
    // An empty PATH hides fio whether or not it is installed.
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("tidestore.toml");
    let body = NVME.replace("{swap}", &dir.path().join("swap").display().to_string());
    std::fs::write(&config, body).expect("write");
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .args(["io-bench", "--file-size", "8MiB", "--compare-fio"])
        .env("PATH", dir.path())
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("fio is not installed"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `plan` flags that mean something only beside another were ignored without a word.
#[test]
fn plan_flags_without_the_flag_they_qualify_exit_2() {
    assert_exit_2_naming(
        &run_command(NVME, "plan", &["--ram-reserve", "1GiB"]),
        "--ram",
    );
    assert_exit_2_naming(&run_command(NVME, "plan", &["--link", "10"]), "--gpus");
}

/// `init-model` names the flag the user typed (once config.json's `num_hidden_layers`).
#[test]
fn init_model_names_the_flag_at_fault() {
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().join("m");
    let dir = dir.to_str().expect("a UTF-8 path");
    for (flag, value) in [("--layers", "0"), ("--heads", "0"), ("--vocab", "0")] {
        let r = run_command(NVME, "init-model", &["--out", dir, flag, value]);
        assert_exit_2_naming(&r, &format!("invalid value for {flag}"));
    }
}
