//! Helpers of the Hugging Face tests: tiny LLaMA directories, stores over their tensors,
//! and a safetensors rewriter to damage files with.

use std::collections::BTreeMap;
use std::path::Path;

use tidestore_chunk::{ChunkStore, DType, Layout, LayoutConfig};
use tidestore_train::hf::{self, InitOptions, LlamaConfig, LlamaShape, LoraSpec};

/// Slots per chunk: the largest tiny tensor (258 x 16) fits.
pub const HF_CHUNK_ELEMENTS: u64 = 8192;

/// A tiny GQA LLaMA with an untied head and the byte-level vocabulary.
pub fn tiny_shape() -> LlamaShape {
    LlamaShape {
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        vocab_size: 258,
        tie_word_embeddings: false,
        max_position_embeddings: 64,
    }
}

/// Writes a tiny model into `dir` in `dtype`, in shards of at most `max_shard_bytes`.
pub fn tiny_model(dir: &Path, dtype: DType, max_shard_bytes: u64, seed: u64) -> LlamaConfig {
    let opts = InitOptions {
        seed,
        dtype,
        max_shard_bytes,
        tokenizer: true,
    };
    hf::init_model(dir, tiny_shape(), &opts).expect("init_model")
}

/// A store (swap file in `dir`) over the model's tensors, with `param16` compute copies.
pub fn hf_store(
    dir: &Path,
    cfg: &LlamaConfig,
    lora: Option<&LoraSpec>,
    param16: DType,
) -> ChunkStore {
    let specs = hf::llama_tensors(cfg, lora).expect("specs");
    let config = LayoutConfig::new(HF_CHUNK_ELEMENTS).with_param16_dtype(param16);
    let layout = Layout::new(config, specs).expect("layout");
    super::open_store(dir, layout)
}

/// A safetensors file's tensors: name -> (dtype, shape, bytes), through the plain crate.
pub type Tensors = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// Reads every tensor of a safetensors file.
pub fn read_st(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// Writes `tensors` as a safetensors file through the plain crate.
pub fn write_st(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Every tensor of a model directory (single file or shards), by name.
pub fn read_model(dir: &Path) -> Tensors {
    let mut out = Tensors::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            out.extend(read_st(&p));
        }
    }
    out
}

/// f32 values of little-endian bytes of `dtype`.
pub fn to_f32(dtype: safetensors::Dtype, bytes: &[u8]) -> Vec<f32> {
    let d = match dtype {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        other => panic!("{other:?}"),
    };
    let mut out = vec![0f32; bytes.len() / d.size_bytes() as usize];
    tidestore_chunk::typed::decode_f32(bytes, d, &mut out);
    out
}
