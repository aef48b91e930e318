//! Guards against the shipped `tidestore.toml` drifting from the code: it must load and
//! validate as it is, set every key the configuration has (so the example shows them
//! all), and explain each one in a comment above it.

use std::path::Path;

use tidestore::Config;

fn shipped() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tidestore.toml")
}

#[test]
fn shipped_config_loads_and_validates() {
    let cfg = Config::load(&shipped()).expect("the shipped tidestore.toml is valid");
    cfg.io_config()
        .expect("converts")
        .validate()
        .expect("io crate accepts it");
}

#[test]
fn shipped_workload_fits_its_budgets_and_uses_all_three_tiers() {
    let cfg = Config::load(&shipped()).expect("valid");
    let p = tidestore::session::prepare(&cfg).expect("the shipped workload fits");
    let param16 = p.layout.list_bytes(tidestore::chunk::ListKind::Params);
    assert!(
        cfg.device.budget.bytes() < param16,
        "the device budget holds every 16-bit chunk: no device eviction would be shown"
    );
    let slots = p.capacity.chunks + 1;
    assert!(
        p.capacity.host_buffers < slots,
        "the host pool holds every chunk: NVMe would not be used"
    );
    assert!(
        cfg.nvme.size.bytes() <= 4 << 30,
        "the shipped swap file stays modest"
    );
}

#[test]
fn shipped_config_sets_and_documents_every_key() {
    let text = std::fs::read_to_string(shipped()).expect("readable");
    let table: toml::Table = text.parse().expect("valid TOML");
    let expected: &[(&str, &[&str])] = &[
        (
            "io",
            &[
                "engine",
                "block_size",
                "queue_depth",
                "direct",
                "fixed_buffers",
                "threads",
            ],
        ),
        ("chunk", &["size"]),
        (
            "device",
            &[
                "kind",
                "budget",
                "tidal_margin",
                "sim_memory",
                "pcie_gbps",
                "ordinal",
            ],
        ),
        ("host", &["budget"]),
        ("nvme", &["dir", "size", "compression"]),
        (
            "policy",
            &["eviction", "prefetch_lookahead", "host_prefetch_lookahead"],
        ),
        (
            "optimizer",
            &[
                "device",
                "threads",
                "lr",
                "beta1",
                "beta2",
                "eps",
                "weight_decay",
                "mode",
                "max_grad_norm",
                "overlap",
                "states",
            ],
        ),
        (
            "workload",
            &[
                "model",
                "mode",
                "lora_rank",
                "lora_targets",
                "iterations",
                "micro_batch",
                "sequence",
                "tflops",
                "arch",
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "intermediate",
                "vocab",
            ],
        ),
        (
            "train",
            &[
                "data_format",
                "too_long",
                "steps",
                "sequence",
                "micro_batch",
                "accumulation",
                "micro_batch_order",
                "saved_inputs",
                "schedule",
                "warmup_steps",
                "mode",
                "lora_rank",
                "lora_alpha",
                "lora_targets",
                "precision",
                "checkpoint_every",
                "export_shard_size",
                "export_dtype",
                "seed",
                "collectives_ahead",
            ],
        ),
    ];
    let sections: Vec<&String> = table.keys().collect();
    assert_eq!(sections.len(), expected.len(), "sections: {sections:?}");
    for (section, keys) in expected {
        let t = table[*section].as_table().expect("a table");
        let mut got: Vec<&str> = t.keys().map(String::as_str).collect();
        let mut want = keys.to_vec();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "keys of [{section}]");
    }
    // Every `key = value` line follows a comment line.
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        let above = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .find(|l| !l.is_empty());
        assert!(
            above.is_some_and(|l| l.starts_with('#')),
            "key line `{line}` has no comment above it"
        );
    }
}
