//! Guards against `tidestore bench --json` drifting from the schema the README
//! documents, and `--plot` writing an SVG that does not open or lacks a series: a tiny
//! workload whose chunks use all three tiers must produce JSON with every documented
//! field, and an SVG that parses as XML and names every tier and link.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tidestore");

const TINY: &str = "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[device]\nkind = \"sim\"\nbudget = \"512KiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
[workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 2\n";

#[test]
fn json_has_the_documented_fields_and_the_svg_parses_with_every_series() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("tidestore.toml");
    std::fs::write(&config, TINY).expect("write config");
    let svg = dir.path().join("run.svg");
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .args(["bench", "--json", "--plot"])
        .arg(&svg)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");

    // The schema documented in the README, field by field.
    assert_eq!(v["schema"], "tidestore.bench.v1");
    assert!(v["emulated"].as_str().expect("text").contains("no matmul"));
    for f in [
        "model",
        "arch",
        "description",
        "mode",
        "params_base",
        "params_trainable",
        "tensors",
        "layers",
        "micro_batch",
        "sequence",
        "activation_peak_bytes",
    ] {
        assert!(!v["workload"][f].is_null(), "workload.{f}");
    }
    for f in [
        "device_kind",
        "device_memory_bytes",
        "device_bytes",
        "tidal_margin_bytes",
        "host_bytes",
        "nvme_bytes",
    ] {
        assert!(
            v["budgets"][f].is_u64() || v["budgets"][f].is_string(),
            "budgets.{f}"
        );
    }
    for f in [
        "chunk_elements",
        "searched",
        "param16_chunk_bytes",
        "slot_bytes",
        "lists",
        "waste_bytes",
    ] {
        assert!(!v["chunks"][f].is_null(), "chunks.{f}");
    }
    for f in [
        "policy",
        "prefetch_lookahead",
        "iterations",
        "init_seconds",
        "warmup_seconds",
        "seconds_per_iteration",
        "checksum",
    ] {
        assert!(!v[f].is_null(), "{f}");
    }
    let phases = v["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["forward", "backward", "optimizer"]);
    for p in phases {
        for f in [
            "seconds",
            "host_to_device_bytes",
            "device_to_host_bytes",
            "nvme_to_host_bytes",
            "host_to_nvme_bytes",
            "stall_seconds",
            "accesses",
            "peak_device_bytes",
            "peak_host_bytes",
            "peak_nvme_bytes",
            "nvme_read_bytes_per_s",
            "nvme_requests_in_flight",
            "nvme_busy_fraction",
            "nvme_wait_seconds",
            "bound_seconds",
        ] {
            assert!(p[f].is_number(), "phases[].{f}");
        }
        // The phase's bound is at most its time (its time less the NVMe waits is one
        // candidate), or the disk's: either way positive.
        let secs = p["seconds"].as_f64().unwrap();
        let bound = p["bound_seconds"].as_f64().unwrap();
        assert!(
            bound > 0.0 || secs == 0.0,
            "phases[].bound_seconds = {bound}"
        );
        let in_flight = p["nvme_requests_in_flight"].as_f64().unwrap();
        let depth = v["nvme_queue_depth"].as_u64().expect("nvme_queue_depth") as f64;
        assert!(
            (0.0..=depth).contains(&in_flight),
            "{in_flight} requests in flight on average, queue depth {depth}"
        );
    }
    for f in ["device_bytes", "host_bytes", "nvme_bytes"] {
        assert!(v["peak"][f].is_u64(), "peak.{f}");
    }
    for f in [
        "placement",
        "simulated",
        "placement_reason",
        "simd",
        "simd_reason",
        "threads",
        "params_per_step",
        "steps_applied",
        "steps_skipped",
        "params_per_s",
        "kernel_params_per_s",
        "grad_norm",
        "overlap",
        "tensors_overlapped",
    ] {
        assert!(!v["optimizer"][f].is_null(), "optimizer.{f}");
    }
    for f in [
        "tflops",
        "compute_seconds",
        "pcie_seconds",
        "nvme_seconds",
        "optimizer_seconds",
        "bound_seconds",
        "efficiency",
    ] {
        assert!(v["bound"][f].is_number(), "bound.{f}");
    }
    for f in [
        "read_bytes_per_s",
        "fresh_read_bytes_per_s",
        "write_bytes_per_s",
        "mixed_bytes_per_s",
    ] {
        let rate = v["bound"]["disk"][f].as_f64().expect("disk rate");
        assert!(rate > 0.0, "bound.disk.{f} = {rate}");
    }
    // The bound reads at the slower of the fresh file and the swap file's chunks; this
    // model's chunks are all in memory after it is written (nothing stored: 0).
    let d = &v["bound"]["disk"];
    let fresh = d["fresh_read_bytes_per_s"].as_f64().unwrap();
    let swap = d["swap_read_bytes_per_s"].as_f64().expect("swap read rate");
    let read = d["read_bytes_per_s"].as_f64().unwrap();
    if swap > 0.0 {
        assert_eq!(read, fresh.min(swap));
    } else {
        assert_eq!(read, fresh);
    }
    // NVMe traffic, so the NVMe bound is positive and the bound is the largest part.
    let b = &v["bound"];
    assert!(b["nvme_seconds"].as_f64().unwrap() > 0.0);
    assert!(b["bound_seconds"].as_f64().unwrap() >= b["nvme_seconds"].as_f64().unwrap());
    assert_eq!(v["optimizer"]["overlap"], "off");
    assert_eq!(v["optimizer"]["tensors_overlapped"], 0);
    for f in [
        "device_evictions",
        "host_evictions",
        "demand_loads",
        "prefetch_loads",
        "prefetch_hits",
        "divergences",
        "nvme_reads_ahead",
        "nvme_reads_on_demand",
    ] {
        assert!(v["store"][f].is_u64(), "store.{f}");
    }
    // The budgets put chunks on all three tiers.
    assert!(v["peak"]["nvme_bytes"].as_u64().unwrap() > 0, "NVMe used");
    assert!(
        v["store"]["device_evictions"].as_u64().unwrap() > 0,
        "device evicts"
    );
    assert_eq!(v["optimizer"]["steps_applied"], 2);
    // optimizer.device = auto on the simulated device: the host step, saying why.
    assert_eq!(v["optimizer"]["placement"], "cpu");
    assert_eq!(v["optimizer"]["simulated"], false);
    assert!(v["optimizer"]["placement_reason"]
        .as_str()
        .expect("text")
        .contains("simulated"));

    let text = std::fs::read_to_string(&svg).expect("the SVG was written");
    let doc = roxmltree::Document::parse(&text).expect("the SVG is XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for series in [
        "device",
        "host",
        "nvme",
        "device budget (tide)",
        "host->device",
        "device->host",
        "nvme->host",
        "host->nvme",
    ] {
        assert!(texts.contains(&series), "series `{series}` in {texts:?}");
    }
}

/// With a host pool too small for the model written at start-up, chunks are in the swap
/// file before the first iteration: the bench reads some back for the bound's read rate,
/// which is then the slower of the fresh file's and theirs.
#[test]
fn the_bound_reads_at_the_slower_of_a_fresh_file_and_the_swap_files_chunks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("tidestore.toml");
    let small_host = TINY.replace("budget = \"2MiB\"", "budget = \"1200KiB\"");
    assert_ne!(small_host, TINY);
    std::fs::write(&config, small_host).expect("write config");
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .args(["bench", "--json", "--iterations", "1"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the binary");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let d = &v["bound"]["disk"];
    let fresh = d["fresh_read_bytes_per_s"].as_f64().unwrap();
    let swap = d["swap_read_bytes_per_s"].as_f64().unwrap();
    assert!(swap > 0.0, "the swap file's chunks were not read: {d}");
    assert_eq!(d["read_bytes_per_s"].as_f64().unwrap(), fresh.min(swap));
}
