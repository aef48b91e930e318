//! Guards against a Hugging Face model changing on its way through the store: an import
//! followed by an export without training must give back the same tensors, byte for
//! byte; import from fp32, fp16 and bf16 must put exactly the file's values in the
//! master and their rounding in the 16-bit copy; a sharded and a single-file model must
//! load the same; and `init_model` must write a directory that plain tools read.

mod common;

use std::path::Path;

use common::hf::*;
use tidestore_chunk::{DType, ListKind};
use tidestore_train::hf::{
    self, export_model, import, ExportOptions, LlamaConfig, Tokenizer, INDEX_FILE, SINGLE_FILE,
};

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::Q8 => unreachable!("model weights are never block-quantized moments"),
    }
}

#[test]
fn init_model_writes_a_directory_plain_tools_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let cfg = tiny_model(&dir, DType::BF16, u64::MAX, 1);
    assert!(dir.join(SINGLE_FILE).is_file() && !dir.join(INDEX_FILE).exists());
    let again = LlamaConfig::load(&dir).unwrap();
    assert_eq!(again, cfg);
    assert_eq!(cfg.torch_dtype, Some(DType::BF16));
    let tensors = read_st(&dir.join(SINGLE_FILE));
    let want = hf::base_tensors(&cfg);
    assert_eq!(tensors.len(), want.len());
    for (name, shape) in &want {
        let (d, s, _) = &tensors[name];
        assert_eq!((d, s), (&safetensors::Dtype::BF16, shape), "{name}");
    }
    let norm = to_f32(
        tensors["model.norm.weight"].0,
        &tensors["model.norm.weight"].2,
    );
    assert!(norm.iter().all(|&x| x == 1.0));
    let q = &tensors["model.layers.0.self_attn.q_proj.weight"];
    let q = to_f32(q.0, &q.2);
    let std = (q.iter().map(|x| x * x).sum::<f32>() / q.len() as f32).sqrt();
    assert!((0.01..0.03).contains(&std), "std {std}");
    // The same seed gives the same bytes.
    let other = tmp.path().join("tiny2");
    tiny_model(&other, DType::BF16, u64::MAX, 1);
    assert_eq!(read_st(&other.join(SINGLE_FILE)), tensors);
    // Its tokenizer.json and the built-in byte level agree.
    let tok = Tokenizer::for_model(&dir).unwrap();
    assert!(!tok.is_byte_level());
    let text = "Héllo, wörld!\n\tx  y";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids, Tokenizer::byte_level().encode(text).unwrap());
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert_eq!(tok.token_id("</s>"), Some(257));
    assert_eq!(tok.vocab_size(), 258);
}

/// Imports `src` into a fresh store and exports it as `dtype` to `out`.
fn through_store(tmp: &Path, src: &Path, out: &Path, dtype: DType, max_shard_bytes: u64) {
    let cfg = LlamaConfig::load(src).unwrap();
    let mut store = hf_store(&tmp.join("swap"), &cfg, None, DType::BF16);
    let report = import(src, &cfg, &mut store, None, 0).unwrap();
    assert_eq!(report.tensors, hf::base_tensors(&cfg).len());
    let opts = ExportOptions {
        dtype,
        max_shard_bytes,
        copy_from: Some(src.to_path_buf()),
    };
    export_model(&mut store, &cfg, None, out, &opts).unwrap();
}

#[test]
fn bf16_round_trip_is_byte_identical_single_and_sharded() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    tiny_model(&src, DType::BF16, u64::MAX, 2);
    let before = read_model(&src);
    // Single file in, shards out (several tensors per shard, and shards of one).
    let sharded = tmp.path().join("sharded");
    through_store(tmp.path(), &src, &sharded, DType::BF16, 2000);
    assert!(!sharded.join(SINGLE_FILE).exists());
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join(INDEX_FILE)).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), before.len());
    let total: usize = before.values().map(|t| t.2.len()).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(read_model(&sharded), before);
    assert!(sharded.join("tokenizer.json").is_file());
    // Shards in, single file out: the same bytes again.
    let single = tmp.path().join("single");
    through_store(
        &tmp.path().join("b"),
        &sharded,
        &single,
        DType::BF16,
        u64::MAX,
    );
    assert!(single.join(SINGLE_FILE).is_file() && !single.join(INDEX_FILE).exists());
    assert_eq!(read_st(&single.join(SINGLE_FILE)), before);
    // Exporting over an existing directory replaces it whole.
    through_store(&tmp.path().join("c"), &src, &single, DType::BF16, 2000);
    assert!(!single.join(SINGLE_FILE).exists());
    assert_eq!(read_model(&single), before);
    // ... but never a directory holding anything an export does not write.
    std::fs::write(single.join("notes.txt"), "mine").unwrap();
    let cfg = LlamaConfig::load(&src).unwrap();
    let mut store = hf_store(&tmp.path().join("d"), &cfg, None, DType::BF16);
    import(&src, &cfg, &mut store, None, 0).unwrap();
    let e = export_model(&mut store, &cfg, None, &single, &ExportOptions::default()).unwrap_err();
    assert!(matches!(
        e,
        tidestore_train::TrainError::ExportTarget { .. }
    ));
    assert!(e.to_string().contains("notes.txt"), "{e}");
    assert_eq!(
        std::fs::read_to_string(single.join("notes.txt")).unwrap(),
        "mine"
    );
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn imports_f32_f16_bf16_exactly_into_master_and_rounds_the_copy() {
    for file_dtype in DType::ALL {
        for param16 in [DType::BF16, DType::F16] {
            let tmp = tempfile::tempdir().unwrap();
            let src = tmp.path().join("src");
            let cfg = tiny_model(&src, file_dtype, 3000, 3);
            assert!(src.join(INDEX_FILE).is_file());
            let mut store = hf_store(&tmp.path().join("swap"), &cfg, None, param16);
            import(&src, &cfg, &mut store, None, 0).unwrap();
            let files = read_model(&src);
            for (name, (d, _, bytes)) in &files {
                assert_eq!(*d, st_dtype(file_dtype));
                let id = store.layout().tensor_id(name).unwrap();
                let master = store.read(id, ListKind::Master).unwrap();
                assert_eq!(to_f32(safetensors::Dtype::F32, &master), to_f32(*d, bytes));
                let copy = store.read(id, ListKind::Params).unwrap();
                if file_dtype == param16 {
                    assert_eq!(&copy, bytes, "{name}");
                } else {
                    let mut want = vec![0u8; copy.len()];
                    tidestore_chunk::typed::encode_f32(&to_f32(*d, bytes), param16, &mut want);
                    assert_eq!(copy, want, "{name}");
                }
            }
            // An f32 export gives back the file's values exactly, whatever they were.
            let out = tmp.path().join("out32");
            let opts = ExportOptions {
                dtype: DType::F32,
                ..ExportOptions::default()
            };
            export_model(&mut store, &cfg, None, &out, &opts).unwrap();
            let back = read_st(&out.join(SINGLE_FILE));
            for (name, (d, _, bytes)) in &files {
                assert_eq!(to_f32(back[name].0, &back[name].2), to_f32(*d, bytes));
            }
            let exported = LlamaConfig::load(&out).unwrap();
            assert_eq!(exported.torch_dtype, Some(DType::F32));
        }
    }
}

#[test]
fn tied_embeddings_have_no_head_and_ignore_a_stray_one() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let shape = hf::LlamaShape {
        tie_word_embeddings: true,
        ..tiny_shape()
    };
    let opts = hf::InitOptions {
        seed: 4,
        ..hf::InitOptions::default()
    };
    let cfg = hf::init_model(&src, shape, &opts).unwrap();
    let mut files = read_st(&src.join(SINGLE_FILE));
    assert!(!files.contains_key("lm_head.weight"));
    let embed = files["model.embed_tokens.weight"].clone();
    files.insert("lm_head.weight".into(), embed);
    write_st(&src.join(SINGLE_FILE), &files);
    let mut store = hf_store(&tmp.path().join("swap"), &cfg, None, DType::BF16);
    import(&src, &cfg, &mut store, None, 0).unwrap();
    assert!(store.layout().tensor_id("lm_head.weight").is_none());
}

/// The transformers-written fixtures of every family (candle/tests/fixtures/families).
fn family_fixtures() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../candle/tests/fixtures/families");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join(hf::CONFIG_FILE).is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 7, "fixtures in {}", root.display());
    dirs
}

/// Every family's checkpoint as transformers wrote it (Qwen2's q/k/v biases, Qwen3's
/// q/k norms, tied heads, `rope_parameters` configs) comes back byte for byte under
/// HF's names, and its config reads back the same.
#[test]
fn every_family_round_trips_byte_identical_with_hf_names() {
    for src in family_fixtures() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        through_store(tmp.path(), &src, &out, DType::F32, u64::MAX);
        let (want, got) = (
            read_st(&src.join(SINGLE_FILE)),
            read_st(&out.join(SINGLE_FILE)),
        );
        assert_eq!(got, want, "{}", src.display());
        let cfg = LlamaConfig::load(&src).unwrap();
        let back = LlamaConfig::load(&out).unwrap();
        assert_eq!((back.rope, back.family), (cfg.rope.clone(), cfg.family));
        let biases = want.keys().filter(|k| k.ends_with(".bias")).count();
        let norms = want.keys().filter(|k| k.contains("_norm.weight")).count();
        let layers = cfg.num_hidden_layers;
        assert_eq!(biases, if cfg.qkv_bias { 3 * layers } else { 0 });
        assert_eq!(norms, if cfg.qk_norm { 2 * layers } else { 0 });
    }
}
