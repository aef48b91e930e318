//! Guards against a damaged or foreign Hugging Face model being loaded, even in part: a
//! missing shard, a tensor missing, a shape or dtype that disagrees with config.json, a
//! dtype tidestore does not read, a file cut short or whose header does not parse, an
//! architecture tidestore does not compute, a store that does not register the model.
//! Each is refused with a typed error whose message names the file and the tensor (or
//! key), before a single byte of the store is changed. Also the text file and tokenizer.

mod common;

use std::path::{Path, PathBuf};

use common::hf::*;
use common::{fill, snapshot};
use tidestore_chunk::DType;
use tidestore_train::hf::{
    import, read_text, HfWeights, LlamaConfig, LoraSpec, LoraTarget, Tokenizer, CONFIG_FILE,
    INDEX_FILE, SINGLE_FILE,
};
use tidestore_train::TrainError;

const UP1: &str = "model.layers.1.mlp.up_proj.weight";

/// Imports `dir` into a filled store of its config (read from `cfg_dir`'s config) and
/// checks the store kept every byte; returns the error.
fn refused(tmp: &Path, dir: &Path, lora: Option<&LoraSpec>) -> TrainError {
    let cfg = LlamaConfig::load(dir).unwrap();
    let mut store = hf_store(&tmp.join("swap"), &cfg, None, DType::BF16);
    fill(&mut store, 9);
    let before = snapshot(&mut store);
    let err = import(dir, &cfg, &mut store, lora, 0).expect_err("the import must be refused");
    assert!(snapshot(&mut store) == before, "the store changed: {err}");
    err
}

fn names(err: &TrainError, parts: &[&str]) {
    let text = err.to_string();
    for p in parts {
        assert!(text.contains(p), "`{text}` does not name `{p}`");
    }
}

fn model(tmp: &Path, max_shard_bytes: u64) -> PathBuf {
    let dir = tmp.join("m");
    tiny_model(&dir, DType::BF16, max_shard_bytes, 5);
    dir
}

/// The shard the index places `tensor` in.
fn shard_of(dir: &Path, tensor: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
    v["weight_map"][tensor].as_str().unwrap().to_string()
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join(CONFIG_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn missing_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), 2000);
    let name = shard_of(&dir, UP1);
    let shard = dir.join(&name);
    std::fs::remove_file(&shard).unwrap();
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfMissingFile { ref path, tensor: Some(_) } if *path == shard));
    names(&e, &[&name, "model.layers."]);
}

#[test]
fn no_weights_at_all() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    std::fs::remove_file(dir.join(SINGLE_FILE)).unwrap();
    let e = refused(tmp.path(), &dir, None);
    names(&e, &[SINGLE_FILE, "missing"]);
}

#[test]
fn tensor_missing_from_the_file_the_index_or_the_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    let file = dir.join(SINGLE_FILE);
    let mut t = read_st(&file);
    t.remove(UP1).unwrap();
    write_st(&file, &t);
    let e = refused(tmp.path(), &dir, None);
    assert!(
        matches!(e, TrainError::HfMissingTensor { ref path, ref tensor } if *path == file && tensor == UP1)
    );

    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), 2000);
    let index = dir.join(INDEX_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let shard = v["weight_map"][UP1].as_str().unwrap().to_string();
    v["weight_map"].as_object_mut().unwrap().remove(UP1);
    std::fs::write(&index, v.to_string()).unwrap();
    let e = refused(tmp.path(), &dir, None);
    names(&e, &[INDEX_FILE, UP1]);

    // The index names a shard that does not hold the tensor.
    let first = shard_of(&dir, "model.embed_tokens.weight");
    assert_ne!(shard, first);
    v["weight_map"][UP1] = serde_json::Value::from(first.clone());
    std::fs::write(&index, v.to_string()).unwrap();
    let e = refused(tmp.path(), &dir, None);
    names(&e, &[&first, UP1]);

    // A shard name that leaves the directory.
    v["weight_map"][UP1] = serde_json::Value::from("../elsewhere.safetensors");
    std::fs::write(&index, v.to_string()).unwrap();
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfMalformed { .. }));
    names(&e, &[INDEX_FILE, UP1]);
}

#[test]
fn shape_or_dtype_disagreeing_with_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    edit_config(&dir, "intermediate_size", 32.into());
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfTensor { .. }));
    names(
        &e,
        &[
            SINGLE_FILE,
            "model.layers.0.mlp.gate_proj.weight",
            "[32, 16]",
            "[24, 16]",
        ],
    );

    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    edit_config(&dir, "torch_dtype", "float32".into());
    let e = refused(tmp.path(), &dir, None);
    names(
        &e,
        &[SINGLE_FILE, "model.embed_tokens.weight", "float32", "BF16"],
    );
}

#[test]
fn unsupported_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    let file = dir.join(SINGLE_FILE);
    let mut t = read_st(&file);
    t.get_mut(UP1).unwrap().0 = safetensors::Dtype::I16;
    write_st(&file, &t);
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfTensor { .. }));
    names(&e, &[SINGLE_FILE, UP1, "I16"]);
}

#[test]
fn truncated_or_malformed_header() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), 2000);
    let name = shard_of(&dir, UP1);
    let shard = dir.join(&name);
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 7]).unwrap();
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfMalformed { ref path, .. } if *path == shard));
    names(&e, &[&name, "truncated"]);

    std::fs::write(&shard, &bytes[..5]).unwrap();
    let e = refused(tmp.path(), &dir, None);
    names(&e, &[&name, "truncated"]);

    let mut garbage = bytes.clone();
    garbage[8..16].copy_from_slice(b"{\"x\":[1,");
    std::fs::write(&shard, &garbage).unwrap();
    let e = refused(tmp.path(), &dir, None);
    assert!(matches!(e, TrainError::HfMalformed { .. }));
    names(&e, &[&name, "not a valid safetensors file"]);
}

#[test]
fn unsupported_architecture_and_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    for (key, value, named) in [
        (
            "architectures",
            serde_json::json!(["GemmaForCausalLM"]),
            "architectures[0]",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
            "rope_scaling",
        ),
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
            "rope_parameters.rope_type",
        ),
        ("an_unknown_key", serde_json::json!(1), "an_unknown_key"),
    ] {
        let saved = std::fs::read(dir.join(CONFIG_FILE)).unwrap();
        edit_config(&dir, key, value);
        let e = LlamaConfig::load(&dir).unwrap_err();
        assert!(matches!(e, TrainError::HfConfig { .. }));
        names(&e, &[CONFIG_FILE, named]);
        std::fs::write(dir.join(CONFIG_FILE), saved).unwrap();
    }
    std::fs::remove_file(dir.join(CONFIG_FILE)).unwrap();
    let e = LlamaConfig::load(&dir).unwrap_err();
    assert!(matches!(e, TrainError::HfMissingFile { .. }));
}

/// A `num_hidden_layers` far beyond the weights (a typo) once aborted the process
/// allocating its per-layer tensor list; one below them would drop layers. Both are
/// refused naming the key, sharded or not, before anything is made per layer.
#[test]
fn a_layer_count_other_than_the_weights_hold() {
    let tmp = tempfile::tempdir().unwrap();
    for (shard_bytes, sub) in [(u64::MAX, "one"), (2000, "sharded")] {
        let dir = model(&tmp.path().join(sub), shard_bytes);
        let mut cfg = LlamaConfig::load(&dir).unwrap();
        for layers in [1_000_000_000, 1] {
            cfg.num_hidden_layers = layers;
            let e = HfWeights::open(&dir, &cfg).expect_err("refused");
            assert!(
                matches!(e, TrainError::HfConfig { ref key, .. } if key == "num_hidden_layers")
            );
            names(&e, &[CONFIG_FILE, &layers.to_string(), "2 decoder layers"]);
        }
    }
}

#[test]
fn a_store_that_does_not_register_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model(tmp.path(), u64::MAX);
    // The store is the full model's; the import asks for LoRA adapters.
    let lora = LoraSpec::new(2, 4.0, &[LoraTarget::Q]);
    let e = refused(tmp.path(), &dir, Some(&lora));
    assert!(matches!(e, TrainError::Tensor { .. }));
    names(&e, &["model.embed_tokens.weight", "trainable"]);
}

#[test]
fn text_file_empty_or_not_utf8_and_a_bad_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let e = read_text(&empty).unwrap_err();
    assert!(matches!(e, TrainError::TextFile { .. }));
    names(&e, &["empty.txt", "empty"]);
    let latin1 = tmp.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let e = read_text(&latin1).unwrap_err();
    names(&e, &["latin1.txt", "not UTF-8", "offset 3"]);
    let ok = tmp.path().join("ok.txt");
    std::fs::write(&ok, "hello\n").unwrap();
    assert_eq!(read_text(&ok).unwrap(), "hello\n");

    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    assert!(Tokenizer::for_model(&dir).unwrap().is_byte_level());
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let e = Tokenizer::for_model(&dir).unwrap_err();
    assert!(matches!(e, TrainError::Tokenizer { .. }));
    names(&e, &["tokenizer.json"]);
}

#[test]
fn values_beyond_f16_into_an_f16_store() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let cfg = tiny_model(&dir, DType::F32, u64::MAX, 8);
    let file = dir.join(SINGLE_FILE);
    let mut t = read_st(&file);
    t.get_mut(UP1).unwrap().2[..4].copy_from_slice(&1.0e6f32.to_le_bytes());
    write_st(&file, &t);
    let mut store = hf_store(&tmp.path().join("swap"), &cfg, None, DType::F16);
    fill(&mut store, 3);
    let before = snapshot(&mut store);
    let e = import(&dir, &cfg, &mut store, None, 0).unwrap_err();
    assert!(snapshot(&mut store) == before, "the store changed: {e}");
    names(&e, &[SINGLE_FILE, UP1, "1000000", "f16"]);
    // A bf16 store takes it, and an f16 export of it is refused naming the tensor.
    let mut store = hf_store(&tmp.path().join("swap2"), &cfg, None, DType::BF16);
    import(&dir, &cfg, &mut store, None, 0).unwrap();
    let opts = tidestore_train::hf::ExportOptions {
        dtype: DType::F16,
        ..Default::default()
    };
    let out = tmp.path().join("out");
    let e = tidestore_train::hf::export_model(&mut store, &cfg, None, &out, &opts).unwrap_err();
    names(&e, &[UP1, "f16"]);
    assert!(!out.exists());
}
