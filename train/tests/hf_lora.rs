//! Guards against LoRA adapters leaving tidestore in a form PEFT or `transformers` would
//! misread: adapters initialised as PEFT does (A bounded by 1/sqrt(in), B zero, the base
//! untouched and frozen), PEFT's key names, shapes and `adapter_config.json` fields, and
//! a merged export equal to W + (alpha/r)·B·A computed directly.

mod common;

use common::hf::*;
use tidestore_chunk::{DType, ListKind};
use tidestore_train::hf::{
    self, export_adapter, export_model, import, ExportOptions, LoraSpec, LoraTarget,
    ADAPTER_CONFIG_FILE, ADAPTER_FILE, SINGLE_FILE,
};

fn lora() -> LoraSpec {
    LoraSpec {
        dropout: 0.05,
        ..LoraSpec::new(4, 8.0, &[LoraTarget::Q, LoraTarget::V, LoraTarget::Down])
    }
}

#[test]
fn adapters_start_as_peft_and_export_in_its_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let cfg = tiny_model(&src, DType::BF16, u64::MAX, 6);
    let lora = lora();
    let mut store = hf_store(&tmp.path().join("swap"), &cfg, Some(&lora), DType::BF16);
    let report = import(&src, &cfg, &mut store, Some(&lora), 42).unwrap();
    assert_eq!(report.adapters, 2 * 3 * cfg.num_hidden_layers);
    let files = read_st(&src.join(SINGLE_FILE));
    let adapters = hf::lora_adapters(&cfg, &lora);
    for ad in &adapters {
        let a = store.layout().tensor_id(&ad.a).unwrap();
        let a = to_f32(
            safetensors::Dtype::F32,
            &store.read(a, ListKind::Master).unwrap(),
        );
        let bound = 1.0 / (ad.in_features as f32).sqrt();
        assert!(a.iter().all(|x| x.abs() <= bound) && a.iter().any(|x| *x != 0.0));
        let b = store.layout().tensor_id(&ad.b).unwrap();
        let b = store.read(b, ListKind::Master).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        // The frozen base is the file's bf16, with no master.
        let w = store.layout().tensor_id(&ad.base).unwrap();
        assert!(store.layout().location(w, ListKind::Master).is_none());
        assert_eq!(store.read(w, ListKind::Params).unwrap(), files[&ad.base].2);
    }

    let out = tmp.path().join("adapter");
    export_adapter(&mut store, &cfg, &lora, &out, DType::F32, "meta-llama/Tiny").unwrap();
    let saved = read_st(&out.join(ADAPTER_FILE));
    assert_eq!(saved.len(), 2 * adapters.len());
    let (d, shape, _) = &saved["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"];
    assert_eq!(
        (*d, shape.as_slice()),
        (safetensors::Dtype::F32, &[4usize, 16][..])
    );
    let (_, shape, _) = &saved["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"];
    assert_eq!(shape.as_slice(), &[16, 4]);
    assert!(saved
        .keys()
        .all(|k| k.starts_with("base_model.model.model.layers.")
            && (k.ends_with(".lora_A.weight") || k.ends_with(".lora_B.weight"))));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert!((config["lora_dropout"].as_f64().unwrap() - 0.05).abs() < 1e-7);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );
    assert_eq!(config["bias"], "none");
    assert_eq!(config["fan_in_fan_out"], false);
    assert_eq!(config["base_model_name_or_path"], "meta-llama/Tiny");
}

#[test]
fn merged_export_is_w_plus_scaled_ba() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let cfg = tiny_model(&src, DType::BF16, u64::MAX, 7);
    let lora = lora();
    let mut store = hf_store(&tmp.path().join("swap"), &cfg, Some(&lora), DType::BF16);
    import(&src, &cfg, &mut store, Some(&lora), 1).unwrap();
    // Trained adapters: give every B non-zero values (as training would).
    let mut rng = hf::SplitMix64::new(99);
    for ad in hf::lora_adapters(&cfg, &lora) {
        let b: Vec<f32> = (0..ad.out_features * lora.r)
            .map(|_| rng.uniform_f32(-0.1, 0.1))
            .collect();
        let id = store.layout().tensor_id(&ad.b).unwrap();
        let bytes: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        store.write(id, ListKind::Master, &bytes).unwrap();
    }
    let out = tmp.path().join("merged");
    let opts = ExportOptions {
        dtype: DType::F32,
        ..ExportOptions::default()
    };
    export_model(&mut store, &cfg, Some(&lora), &out, &opts).unwrap();
    let merged = read_st(&out.join(SINGLE_FILE));
    let base = read_st(&src.join(SINGLE_FILE));
    let adapted: Vec<_> = hf::lora_adapters(&cfg, &lora);
    let scale = lora.alpha / lora.r as f32;
    for (name, (d, _, bytes)) in &base {
        let got = to_f32(merged[name].0, &merged[name].2);
        let w = to_f32(*d, bytes);
        let Some(ad) = adapted.iter().find(|a| &a.base == name) else {
            assert_eq!(got, w, "{name} is not adapted and must come back unchanged");
            continue;
        };
        let mut read = |n: &str| {
            let id = store.layout().tensor_id(n).unwrap();
            to_f32(
                safetensors::Dtype::F32,
                &store.read(id, ListKind::Master).unwrap(),
            )
        };
        let (a, b) = (read(&ad.a), read(&ad.b));
        let (out_f, in_f, r) = (ad.out_features, ad.in_features, lora.r);
        let mut max_err = 0f64;
        for o in 0..out_f {
            for i in 0..in_f {
                let ba: f64 = (0..r)
                    .map(|k| f64::from(b[o * r + k]) * f64::from(a[k * in_f + i]))
                    .sum();
                let want = f64::from(w[o * in_f + i]) + f64::from(scale) * ba;
                max_err = max_err.max((f64::from(got[o * in_f + i]) - want).abs());
            }
        }
        assert!(max_err < 1e-6, "{name}: max error {max_err}");
        assert_ne!(got, w, "{name} must change");
    }
}

/// PEFT's own adapters on the families whose layers differ (Qwen2's biases, Qwen3's
/// q/k norms and head_dim, Llama 3.1), written by PEFT 0.21.2 beside the parity
/// fixtures: put into the store, `export_adapter` writes them back with PEFT's keys,
/// shapes and bytes, and the merged export keeps every other tensor (biases, norms) as
/// the checkpoint has it.
#[test]
fn peft_adapters_of_every_family_export_with_peft_keys_and_bytes() {
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../candle/tests/fixtures/families");
    for family in ["qwen2", "qwen3", "llama31"] {
        let src = root.join(family);
        let peft_file = read_st(&root.join(format!("{family}_lora")).join(ADAPTER_FILE));
        let cfg = hf::LlamaConfig::load(&src).unwrap();
        let lora = LoraSpec {
            base_dtype: DType::F32,
            ..LoraSpec::new(4, 8.0, &LoraTarget::ALL)
        };
        let tmp = tempfile::tempdir().unwrap();
        let mut store = hf_store(&tmp.path().join("swap"), &cfg, Some(&lora), DType::BF16);
        import(&src, &cfg, &mut store, Some(&lora), 3).unwrap();
        for (key, (_, _, bytes)) in &peft_file {
            let name = key.strip_prefix("base_model.model.").unwrap();
            let id = store.layout().tensor_id(name).unwrap();
            store.write(id, ListKind::Master, bytes).unwrap();
        }
        let out = tmp.path().join("adapter");
        export_adapter(&mut store, &cfg, &lora, &out, DType::F32, family).unwrap();
        assert_eq!(read_st(&out.join(ADAPTER_FILE)), peft_file, "{family}");
        let merged = tmp.path().join("merged");
        let opts = ExportOptions {
            dtype: DType::F32,
            ..ExportOptions::default()
        };
        export_model(&mut store, &cfg, Some(&lora), &merged, &opts).unwrap();
        let (base, merged) = (
            read_st(&src.join(SINGLE_FILE)),
            read_st(&merged.join(SINGLE_FILE)),
        );
        assert_eq!(
            base.keys().collect::<Vec<_>>(),
            merged.keys().collect::<Vec<_>>()
        );
        for (name, t) in &base {
            if name.ends_with(".bias") || name.ends_with("norm.weight") {
                assert_eq!(&merged[name], t, "{family}: {name}");
            }
        }
    }
}
