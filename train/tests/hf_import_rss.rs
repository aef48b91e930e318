//! Guards against an import whose resident memory grows with the model: the files are
//! mapped, and a mapped page read stays in the process's resident set until it is
//! dropped, so without care importing a model maps its whole size into RSS. A ~230 MB
//! bf16 model is imported under LoRA (frozen bf16 base, no conversion) into a store
//! whose host tier holds two chunks; the growth of the peak RSS during the import must
//! stay near the largest tensor, not the model (measured: 17 MiB growth for a 203 MiB
//! model; 203 MiB without dropping the pages). It writes ~0.5 GB into a temporary
//! directory and takes a few seconds in release.

mod common;

use common::hf::{read_model, HF_CHUNK_ELEMENTS};
use tidestore_chunk::{Layout, LayoutConfig};
use tidestore_train::hf::{self, InitOptions, LlamaShape, LoraSpec, LoraTarget};

fn status_kib(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Resets the peak RSS (VmHWM) to the current RSS (Linux 4.0+).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

#[test]
fn import_rss_stays_near_one_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("m");
    let shape = LlamaShape {
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 8,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        vocab_size: 8000,
        tie_word_embeddings: false,
        max_position_embeddings: 256,
    };
    let opts = InitOptions {
        max_shard_bytes: 100_000_000,
        ..InitOptions::default()
    };
    let cfg = hf::init_model(&src, shape, &opts).unwrap();
    let lora = LoraSpec::new(8, 16.0, &[LoraTarget::Q, LoraTarget::V]);
    let specs = hf::llama_tensors(&cfg, Some(&lora)).unwrap();
    let largest = specs.iter().map(|s| s.elements().unwrap()).max().unwrap();
    let chunk = largest.max(HF_CHUNK_ELEMENTS);
    let layout = Layout::new(LayoutConfig::new(chunk), specs).unwrap();
    let mut store = common::open_store(&tmp.path().join("swap"), layout);
    let model_bytes: usize = read_model(&src).values().map(|t| t.2.len()).sum();
    reset_peak();
    let before = status_kib("VmRSS:");
    let t0 = std::time::Instant::now();
    hf::import(&src, &cfg, &mut store, Some(&lora), 0).unwrap();
    let import_s = t0.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:");
    let grown_mib = (peak.saturating_sub(before)) as f64 / 1024.0;
    let largest_mib = (largest * 2) as f64 / (1 << 20) as f64;
    let model_mib = model_bytes as f64 / (1 << 20) as f64;
    println!(
        "import: model {model_mib:.0} MiB, largest tensor {largest_mib:.0} MiB, \
         peak RSS grew {grown_mib:.0} MiB (store host tier: 2 chunks of fp32 = {:.0} MiB)",
        (2 * chunk * 4) as f64 / (1 << 20) as f64
    );
    assert!(grown_mib < model_mib * 0.75, "RSS grew with the model");
    let t0 = std::time::Instant::now();
    let out = tmp.path().join("out");
    let opts = hf::ExportOptions {
        max_shard_bytes: 100_000_000,
        ..Default::default()
    };
    hf::export_model(&mut store, &cfg, Some(&lora), &out, &opts).unwrap();
    let export_s = t0.elapsed().as_secs_f64();
    println!(
        "import {import_s:.2} s ({:.0} MiB/s), merged bf16 export {export_s:.2} s ({:.0} MiB/s)",
        model_mib / import_s,
        model_mib / export_s
    );
}
