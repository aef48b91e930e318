//! LoRA adapters exported in PEFT's layout, as `PeftModel.save_pretrained` writes them:
//! a directory with `adapter_model.safetensors` and `adapter_config.json`.
//!
//! Keys: PEFT wraps the model (`PeftModel` -> `LoraModel` -> `LlamaForCausalLM`) and drops
//! the adapter name on save, so the adapter of module `model.layers.0.self_attn.q_proj`
//! is saved as `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` `[r, in]`
//! and `...lora_B.weight` `[out, r]`. Values come from the adapters' fp32 masters,
//! written in the chosen dtype (fp32 is what PEFT trains and saves by default).
//!
//! `adapter_config.json` holds the keys PEFT versions since 0.5 read (`peft_type`
//! "LORA", `task_type` "CAUSAL_LM", `r`, `lora_alpha`, `lora_dropout`, `target_modules`,
//! `bias` "none", `fan_in_fan_out` false, `base_model_name_or_path`, ...) and no newer
//! ones, so older PEFT versions load it too. The directory is written atomically as an
//! export is ([`crate::hf::export`]).

use std::path::Path;

use tidestore_chunk::{ChunkStore, DType};

use crate::checkpoint::io_err;
use crate::error::{Result, TrainError};
use crate::hf::config::LlamaConfig;
use crate::hf::export::{read_f32, ReadTensor};
use crate::hf::files::{encode, ADAPTER_CONFIG_FILE, ADAPTER_FILE};
use crate::hf::names::{lora_adapters, LoraSpec};
use crate::hf::shards::{write_dir_atomically, write_shards, ExportReport, OutTensor};

/// The prefix PEFT puts before a module's name.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// PEFT's key for a store tensor (`model.layers.0.self_attn.q_proj.lora_A.weight` ->
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
pub fn peft_key(name: &str) -> String {
    format!("{PEFT_PREFIX}{name}")
}

/// The `adapter_config.json` of `lora` (see the module doc).
pub fn adapter_config(lora: &LoraSpec, base_model_name_or_path: &str) -> serde_json::Value {
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
    serde_json::json!({
        "auto_mapping": null,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": lora.r,
        "revision": null,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
    })
}

/// Writes the adapters of the LoRA model in `store` to `out_dir` in PEFT's layout, in
/// `dtype`; `base_model_name_or_path` is recorded in the config (the base model's
/// directory or hub name). Call it between steps, with no guard held.
pub fn export_adapter(
    store: &mut ChunkStore,
    cfg: &LlamaConfig,
    lora: &LoraSpec,
    out_dir: &Path,
    dtype: DType,
    base_model_name_or_path: &str,
) -> Result<ExportReport> {
    let read = &mut |name: &str| read_f32(store, name);
    export_adapter_from(read, cfg, lora, out_dir, dtype, base_model_name_or_path)
}

/// [`export_adapter`] with each adapter's values from `read`, one tensor at a time.
pub fn export_adapter_from(
    read: &mut ReadTensor<'_>,
    cfg: &LlamaConfig,
    lora: &LoraSpec,
    out_dir: &Path,
    dtype: DType,
    base_model_name_or_path: &str,
) -> Result<ExportReport> {
    let adapters = lora_adapters(cfg, lora);
    let mut tensors = Vec::with_capacity(2 * adapters.len());
    for ad in &adapters {
        tensors.push(OutTensor::new(
            peft_key(&ad.a),
            vec![lora.r, ad.in_features],
            dtype,
        ));
        tensors.push(OutTensor::new(
            peft_key(&ad.b),
            vec![ad.out_features, lora.r],
            dtype,
        ));
    }
    let report = write_dir_atomically(out_dir, |tmp| {
        let config = adapter_config(lora, base_model_name_or_path);
        let path = tmp.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_string_pretty(&config)
            .unwrap_or_else(|e| unreachable!("a JSON value always serialises: {e}"));
        std::fs::write(&path, text + "\n").map_err(io_err("writing", &path))?;
        let mut report = write_shards(tmp, &tensors, dtype, u64::MAX, |key| {
            let name = key.strip_prefix(PEFT_PREFIX).unwrap_or(key);
            let values = read(name)?;
            crate::hf::files::check_fits(name, &values, dtype)?;
            Ok(encode(&values, dtype))
        })?;
        // One shard is always `model.safetensors`: PEFT names it otherwise.
        let first = report.shards.first().ok_or_else(|| TrainError::Config {
            key: "lora.targets",
            reason: "no adapter to export".into(),
        })?;
        let from = tmp.join(first);
        let to = tmp.join(ADAPTER_FILE);
        std::fs::rename(&from, &to).map_err(io_err("renaming", &from))?;
        report.shards = vec![ADAPTER_FILE.to_string()];
        Ok(report)
    })?;
    tracing::info!(dir = %out_dir.display(), tensors = report.tensors, "LoRA adapter exported");
    Ok(ExportReport {
        dir: out_dir.to_path_buf(),
        ..report
    })
}
