//! Guards against a bad `tidestore.toml` being accepted, or rejected with an error that
//! does not say which key to fix: every case here must fail with `Error::Config` (or
//! `Error::Syntax`) naming the key as written in TOML, with the file and, where the
//! parser knows it, the line and column.

use std::path::{Path, PathBuf};

use tidestore::{Config, Error};

/// A config file in a fresh folder whose `nvme.dir` is a writable subfolder, with
/// `body` appended.
struct Case {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn case(body: &str) -> Case {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tidestore.toml");
    std::fs::write(&path, body).expect("write config");
    Case { _dir: dir, path }
}

fn swap_dir(c: &Case) -> PathBuf {
    c.path.parent().expect("has a folder").join("swap")
}

/// Load `body` (with `{swap}` replaced by a writable folder) and return the error.
fn load_err(body: &str) -> (Error, PathBuf) {
    let c = case("");
    let body = body.replace("{swap}", &swap_dir(&c).display().to_string());
    std::fs::write(&c.path, body).expect("write config");
    match Config::load(&c.path) {
        Ok(cfg) => panic!("accepted a bad config: {cfg:?}"),
        Err(e) => (e, c.path.clone()),
    }
}

fn assert_key(body: &str, key: &str, reason_has: &str) {
    let (e, path) = load_err(body);
    assert_eq!(e.key(), Some(key), "wrong key in: {e}");
    assert!(e.is_config(), "not a config error: {e}");
    let text = e.to_string();
    assert!(
        text.contains(&format!("`{key}`")),
        "message does not name {key}: {text}"
    );
    assert!(
        text.contains(reason_has),
        "message lacks `{reason_has}`: {text}"
    );
    assert!(
        text.contains(&path.display().to_string()),
        "message lacks the file: {text}"
    );
    assert!(!text.contains('\n'), "message is not one line: {text}");
}

const NVME: &str = "[nvme]\ndir = \"{swap}\"\n";

#[test]
fn unknown_key_in_a_section() {
    assert_key(
        &format!("[io]\nblok_size = 4096\n{NVME}"),
        "io.blok_size",
        "unknown key",
    );
}

#[test]
fn unknown_section() {
    assert_key(
        &format!("{NVME}[cuda]\ndevice = 0\n"),
        "cuda",
        "unknown key",
    );
}

#[test]
fn wrong_type() {
    assert_key(
        &format!("[io]\nqueue_depth = \"deep\"\n{NVME}"),
        "io.queue_depth",
        "invalid type",
    );
}

#[test]
fn wrong_type_for_a_flag() {
    assert_key(
        &format!("[io]\ndirect = \"yes\"\n{NVME}"),
        "io.direct",
        "invalid type",
    );
}

#[test]
fn negative_size() {
    assert_key(
        &format!("[io]\nblock_size = -4096\n{NVME}"),
        "io.block_size",
        "negative",
    );
}

#[test]
fn negative_size_as_text() {
    assert_key(
        "[nvme]\ndir = \"{swap}\"\nsize = \"-16GiB\"\n",
        "nvme.size",
        "negative",
    );
}

#[test]
fn unparsable_size() {
    assert_key(
        &format!("[io]\nblock_size = \"12 parsecs\"\n{NVME}"),
        "io.block_size",
        "not a size",
    );
}

#[test]
fn float_size() {
    assert_key(
        &format!("[chunk]\nsize = 1.5\n{NVME}"),
        "chunk.size",
        "float",
    );
}

#[test]
fn block_size_not_a_multiple_of_4096() {
    assert_key(
        &format!("[io]\nblock_size = 6144\n{NVME}"),
        "io.block_size",
        "multiple of 4096",
    );
    assert_key(
        &format!("[io]\nblock_size = \"1000\"\n{NVME}"),
        "io.block_size",
        "multiple of 4096",
    );
}

#[test]
fn block_size_zero() {
    assert_key(
        &format!("[io]\nblock_size = 0\n{NVME}"),
        "io.block_size",
        "multiple of 4096",
    );
}

#[test]
fn queue_depth_zero() {
    assert_key(
        &format!("[io]\nqueue_depth = 0\n{NVME}"),
        "io.queue_depth",
        "1..=4096",
    );
}

#[test]
fn queue_depth_over_4096() {
    assert_key(
        &format!("[io]\nqueue_depth = 4097\n{NVME}"),
        "io.queue_depth",
        "1..=4096",
    );
}

#[test]
fn queue_depth_negative() {
    assert_key(
        &format!("[io]\nqueue_depth = -1\n{NVME}"),
        "io.queue_depth",
        "-1",
    );
}

#[test]
fn unknown_engine() {
    assert_key(
        &format!("[io]\nengine = \"aio\"\n{NVME}"),
        "io.engine",
        "unknown variant",
    );
}

#[test]
fn zero_threads() {
    assert_key(
        &format!("[io]\nthreads = 0\n{NVME}"),
        "io.threads",
        "1..=256",
    );
}

#[test]
fn chunk_size_not_a_multiple_of_4096() {
    assert_key(
        &format!("[chunk]\nsize = \"1000KB\"\n{NVME}"),
        "chunk.size",
        "multiple of 4096",
    );
}

#[test]
fn missing_nvme_dir() {
    assert_key("[io]\nqueue_depth = 8\n", "nvme.dir", "missing");
    assert_key("[nvme]\nsize = \"1GiB\"\n", "nvme.dir", "missing");
}

#[test]
fn nvme_dir_that_is_a_file() {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    let body = format!("[nvme]\ndir = \"{}\"\n", file.path().display());
    assert_key(&body, "nvme.dir", "not a directory");
}

#[test]
fn nvme_dir_that_cannot_be_created() {
    // Root may write anywhere on a normal filesystem, but not create folders in /proc.
    assert_key(
        "[nvme]\ndir = \"/proc/tidestore-swap\"\n",
        "nvme.dir",
        "cannot be created",
    );
}

#[test]
fn nvme_dir_whose_parent_is_missing() {
    assert_key(
        "[nvme]\ndir = \"/nonexistent/tidestore/swap\"\n",
        "nvme.dir",
        "does not exist",
    );
}

#[test]
fn swap_file_too_small_for_one_chunk() {
    let body = "[chunk]\nsize = \"64MiB\"\n[nvme]\ndir = \"{swap}\"\nsize = \"16MiB\"\n";
    assert_key(body, "nvme.size", "too small for one chunk");
}

#[test]
fn malformed_toml_reports_line_and_column() {
    let (e, path) = load_err("[io]\nqueue_depth = 8\nblock_size = \"1MiB\n");
    match &e {
        Error::Syntax { at, .. } => {
            assert_eq!(at.file.as_deref(), Some(path.as_path()));
            let (line, column) = at.line_column.expect("a position");
            assert_eq!(line, 3, "{e}");
            assert!(column > 1, "{e}");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(e.is_config());
    assert!(
        e.to_string().contains(&format!("{}:3:", path.display())),
        "{e}"
    );
}

#[test]
fn type_errors_carry_line_and_column() {
    let (e, _) = load_err(&format!("{NVME}[io]\n\nqueue_depth = \"deep\"\n"));
    match &e {
        Error::Config { at, .. } => assert_eq!(at.line_column, Some((5, 15)), "{e}"),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn unreadable_config_file() {
    let e = Config::load(Path::new("/nonexistent/tidestore.toml")).expect_err("no such file");
    assert!(matches!(e, Error::ConfigRead { .. }), "{e:?}");
    assert!(e.is_config());
}

#[test]
fn relative_dir_is_resolved_against_the_config_file() {
    let c = case("[nvme]\ndir = \"swap\"\n");
    let cfg = Config::load(&c.path).expect("valid config");
    assert_eq!(cfg.nvme_dir().expect("dir set"), swap_dir(&c));
    assert!(swap_dir(&c).is_dir(), "last component is created");
}

#[test]
fn a_good_config_converts_to_the_io_crate() {
    let c = case(
        "[io]\nengine = \"threads\"\nblock_size = \"4MiB\"\nqueue_depth = 8\n\
         [chunk]\nsize = \"32MiB\"\n[nvme]\ndir = \"swap\"\nsize = \"1GiB\"\n",
    );
    let cfg = Config::load(&c.path).expect("valid config");
    let io = cfg.io_config().expect("io config");
    assert_eq!(io.engine, tidestore::io::EngineChoice::ThreadPool);
    assert_eq!(io.block_bytes, 4 << 20);
    assert_eq!(io.queue_depth, 8);
    assert_eq!(cfg.chunk.size.fixed().map(|s| s.bytes()), Some(32 << 20));
    io.validate().expect("io crate accepts it");
}

#[test]
fn chunk_size_auto_is_accepted() {
    let c = case("[chunk]\nsize = \"auto\"\n[nvme]\ndir = \"swap\"\n");
    let cfg = Config::load(&c.path).expect("valid config");
    assert_eq!(cfg.chunk.size, tidestore::AutoSize::Auto);
}

#[test]
fn unknown_model() {
    assert_key(
        &format!("[workload]\nmodel = \"gpt5\"\n{NVME}"),
        "workload.model",
        "unknown variant",
    );
}

#[test]
fn custom_shape_key_with_a_named_model() {
    assert_key(
        &format!("[workload]\nmodel = \"gpt2\"\nlayers = 4\n{NVME}"),
        "workload.layers",
        "only used with model = \"custom\"",
    );
}

#[test]
fn custom_model_without_vocab() {
    assert_key(
        &format!(
            "[workload]\nmodel = \"custom\"\narch = \"llama\"\nlayers = 2\nhidden = 64\n\
             heads = 4\nintermediate = 128\n{NVME}"
        ),
        "workload.vocab",
        "missing",
    );
}

#[test]
fn beta_out_of_range() {
    assert_key(
        &format!("[optimizer]\nbeta2 = 1.0\n{NVME}"),
        "optimizer.beta2",
        "[0, 1)",
    );
}

#[test]
fn negative_device_budget() {
    assert_key(
        &format!("[device]\nbudget = \"-1GiB\"\n{NVME}"),
        "device.budget",
        "negative",
    );
}

#[test]
fn unknown_policy() {
    assert_key(
        &format!("[policy]\neviction = \"random\"\n{NVME}"),
        "policy.eviction",
        "unknown variant",
    );
}
