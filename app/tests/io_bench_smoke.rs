//! Guards against `tidestore io-bench` failing or printing no figures on a real file:
//! a tiny run on each engine must succeed, print MB/s for write and read, and leave no
//! test file behind; `--tune` must end in a TOML snippet; `--compare-fio` must print
//! ratios where fio is installed (skipped, with the reason printed, where it is not).

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

fn io_bench(dir: &Path, args: &[&str]) -> Output {
    let config = dir.join("tidestore.toml");
    std::fs::write(&config, "[nvme]\ndir = \"swap\"\nsize = \"1GiB\"\n").expect("write config");
    Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("io-bench")
        .args(args)
        .output()
        .expect("run the binary")
}

fn assert_ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

#[test]
fn tiny_io_bench_prints_write_and_read_figures() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = io_bench(
        dir.path(),
        &[
            "--file-size",
            "8MiB",
            "--chunk-size",
            "1MiB",
            "--repeats",
            "1",
        ],
    );
    let stdout = assert_ok(&out);
    assert!(stdout.contains("MB/s"), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("write ours")),
        "{stdout}"
    );
    assert!(
        stdout.lines().any(|l| l.starts_with("read  ours")),
        "{stdout}"
    );
    assert!(
        !dir.path().join("swap/tidestore-io-bench.dat").exists(),
        "the test file it created is removed"
    );
}

#[test]
fn tiny_io_bench_on_the_thread_pool_engine() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = io_bench(
        dir.path(),
        &[
            "--file-size",
            "8MiB",
            "--chunk-size",
            "2MiB",
            "--repeats",
            "2",
            "--engine",
            "threads",
            "--keep-file",
        ],
    );
    let stdout = assert_ok(&out);
    assert!(stdout.contains("engine:   threads"), "{stdout}");
    assert!(stdout.contains("summary of 2 runs"), "{stdout}");
    let kept = dir.path().join("swap/tidestore-io-bench.dat");
    assert_eq!(std::fs::metadata(kept).expect("kept").len(), 8 << 20);
}

#[test]
fn default_chunk_larger_than_the_file_is_shrunk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let stdout = assert_ok(&io_bench(
        dir.path(),
        &["--file-size", "4MiB", "--repeats", "1"],
    ));
    assert!(stdout.contains("chunks of 4MiB"), "{stdout}");
}

#[test]
fn tune_prints_a_toml_snippet() {
    let dir = tempfile::tempdir().expect("temp dir");
    let stdout = assert_ok(&io_bench(
        dir.path(),
        &["--tune", "--file-size", "4MiB", "--chunk-size", "1MiB"],
    ));
    let snippet: String = stdout
        .lines()
        .skip_while(|l| *l != "[io]")
        .collect::<Vec<_>>()
        .join("\n");
    let table: toml::Table = snippet.parse().expect("the snippet is TOML");
    let io = table["io"].as_table().expect("[io]");
    assert!(
        io.contains_key("block_size") && io.contains_key("queue_depth"),
        "{snippet}"
    );
    // 5 block sizes x 6 depths, one row each.
    let rows = stdout
        .lines()
        .filter(|l| l.contains("KiB ") || l.contains("MiB "))
        .count();
    assert!(rows >= 30, "{stdout}");
}

#[test]
fn compare_fio_prints_ratios() {
    let has_fio = Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_fio {
        println!("skipped: fio is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let out = io_bench(
        dir.path(),
        &[
            "--file-size",
            "16MiB",
            "--chunk-size",
            "4MiB",
            "--repeats",
            "1",
            "--compare-fio",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("fio") {
        // fio itself may be unable to use io_uring here (seccomp, old kernel).
        println!("skipped: fio could not run here: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ours/fio (medians): write"), "{stdout}");
}
