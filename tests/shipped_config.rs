//! Guards against the shipped `tidestore.toml` drifting from the code: it must load and
//! validate as it is, set every key the configuration has (so the example shows them
//! all), and explain each one in a comment above it.

use std::path::Path;

use tidestore::Config;

fn shipped() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tidestore.toml")
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
        ("nvme", &["dir", "size"]),
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
