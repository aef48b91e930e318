//! LLaMA as Hugging Face's `LlamaForCausalLM` computes it, and the families built on
//! it (Mistral, Qwen2 / Qwen2.5, Qwen3), written against [`ParamSource`] and cut into
//! blocks, so that the same code runs as one candle graph (in memory) and block by
//! block through tidestore ([`crate::streamed`]).
//!
//! The architecture: token embedding; per layer a pre-RMSNorm grouped-query attention
//! with rotary position embeddings (the "rotate half" form of `modeling_llama.py`, the
//! inverse frequencies and attention factor of the config's RoPE — default, linear,
//! llama3, yarn — from [`tidestore_train::hf::Rope`]) and a pre-RMSNorm SwiGLU MLP
//! (`down(silu(gate(x)) · up(x))`), each added to the residual stream; a final RMSNorm
//! and the output head (`lm_head`, or the embedding when `tie_word_embeddings`). The
//! families' differences ([`LlamaArch`]): q/k/v biases (Qwen2), an explicit head
//! dimension and per-head RMSNorm of queries and keys before RoPE (Qwen3), a sliding
//! attention window as a mask (Mistral). Tensor names and shapes are Hugging Face's
//! (`model.layers.N.self_attn.q_proj.weight` is `[heads·head_dim, hidden]`), so a
//! checkpoint maps one to one. Optional LoRA adapters on chosen projections
//! (`…q_proj.lora_A.weight` `[r, in]`, `…lora_B.weight` `[out, r]`, scaled by
//! `alpha / r`, `B` starting at zero), the base (biases and norms included) frozen.
//!
//! Blocks: `0` is the embedding, `1..=layers` the decoder layers, `layers + 1` the
//! final norm and head. [`Llama::block`] runs one; [`Llama::block_params`] names what it
//! reads, in the order of [`tidestore_train::hf::llama_blocks`].

use candle_core::{DType, Device, Tensor, D};

use tidestore_train::hf::{Family, Rope};
use tidestore_train::SavedInputs;

use crate::error::{Error, Result};
use crate::gpt::Rng;
use crate::source::{ParamSource, ParamSpec};

/// A target that carries no loss ([`Llama::loss`]): a prompt or padding position, as
/// PyTorch's `ignore_index = -100` in a u32 tensor.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// The shape of a LLaMA model (the fields of its `config.json` that matter here).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size`.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads` (divides `heads`).
    pub kv_heads: usize,
    /// `rms_norm_eps`.
    pub rms_eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `tie_word_embeddings`.
    pub tie_embeddings: bool,
    /// LoRA adapters, when only they train.
    pub lora: Option<LlamaLora>,
}

/// LoRA adapters of a [`Llama`].
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaLora {
    /// Rank.
    pub rank: usize,
    /// Scale numerator (`alpha / rank` multiplies the adapter's output).
    pub alpha: f32,
    /// Adapted projections, by their short names (`q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, `gate_proj`, `up_proj`, `down_proj`).
    pub targets: Vec<String>,
}

/// What the families change in LLaMA's decoder (all off: Llama 2's arithmetic).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LlamaArch {
    /// An explicit head dimension (Qwen3: `heads · head_dim ≠ hidden`); `hidden / heads`
    /// when `None`.
    pub head_dim: Option<usize>,
    /// RoPE θ and scaling; its θ must equal [`LlamaConfig::rope_theta`].
    pub rope: Rope,
    /// q/k/v projections with biases (Qwen2): `…q_proj.bias` `[out]`.
    pub qkv_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3): `…self_attn.q_norm.weight`
    /// and `…k_norm.weight` `[head_dim]`.
    pub qk_norm: bool,
    /// A query attends only to the last `w` positions, itself included (Mistral).
    pub sliding_window: Option<usize>,
}

/// A LLaMA model's code (its parameters live in a [`ParamSource`]).
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: LlamaConfig,
    arch: LlamaArch,
    /// Rows of logits the head's backward computes at once (see [`HEAD_CHUNK_BYTES`]).
    head_chunk_rows: usize,
}

/// The projections of a layer: (module path under the layer, short name, out, in).
fn projections(c: &LlamaConfig, hd: usize) -> [(&'static str, &'static str, usize, usize); 7] {
    let (q, kv) = (c.heads * hd, c.kv_heads * hd);
    [
        ("self_attn", "q_proj", q, c.hidden),
        ("self_attn", "k_proj", kv, c.hidden),
        ("self_attn", "v_proj", kv, c.hidden),
        ("self_attn", "o_proj", c.hidden, q),
        ("mlp", "gate_proj", c.intermediate, c.hidden),
        ("mlp", "up_proj", c.intermediate, c.hidden),
        ("mlp", "down_proj", c.hidden, c.intermediate),
    ]
}

impl Llama {
    /// The model of `cfg` with Llama 2's arithmetic (plain RoPE of `cfg.rope_theta`),
    /// checked as [`Llama::with_arch`].
    pub fn new(cfg: LlamaConfig) -> Result<Self> {
        let arch = LlamaArch {
            rope: Rope {
                theta: cfg.rope_theta,
                ..Rope::default()
            },
            ..LlamaArch::default()
        };
        Llama::with_arch(cfg, arch)
    }

    /// The model a checked Hugging Face config describes (any family tidestore reads),
    /// with LoRA adapters when given.
    pub fn from_hf(hf: &tidestore_train::hf::LlamaConfig, lora: Option<LlamaLora>) -> Result<Self> {
        let cfg = LlamaConfig {
            vocab: hf.vocab_size,
            hidden: hf.hidden_size,
            intermediate: hf.intermediate_size,
            layers: hf.num_hidden_layers,
            heads: hf.num_attention_heads,
            kv_heads: hf.num_key_value_heads,
            rms_eps: hf.rms_norm_eps,
            rope_theta: hf.rope.theta,
            tie_embeddings: hf.tie_word_embeddings,
            lora,
        };
        let arch = LlamaArch {
            head_dim: Some(hf.head_dim),
            rope: hf.rope.clone(),
            qkv_bias: hf.qkv_bias,
            qk_norm: hf.qk_norm,
            sliding_window: hf.sliding_window,
        };
        debug_assert_eq!(hf.qkv_bias, hf.family == Family::Qwen2);
        Llama::with_arch(cfg, arch)
    }

    /// The model of `cfg` with a family's differences, checked: kv heads divide the
    /// heads, the head dimension (explicit, or heads dividing the width) is even (rotary
    /// embeddings rotate pairs), RoPE's θ is `cfg.rope_theta`, a window is at least 1.
    pub fn with_arch(cfg: LlamaConfig, arch: LlamaArch) -> Result<Self> {
        let bad = |reason: String| Error::BadParam {
            name: "config".into(),
            reason,
        };
        if arch.rope.theta != cfg.rope_theta {
            return Err(bad(format!(
                "RoPE theta {} is not rope_theta {}",
                arch.rope.theta, cfg.rope_theta
            )));
        }
        if arch.sliding_window == Some(0) {
            return Err(bad("a sliding window of 0 positions".into()));
        }
        if cfg.heads == 0 {
            return Err(bad("0 attention heads".into()));
        }
        let hd = match arch.head_dim {
            Some(d) => d,
            None if cfg.hidden.is_multiple_of(cfg.heads) => cfg.hidden / cfg.heads,
            None => {
                return Err(bad(format!(
                    "hidden size {} is not a multiple of {} heads",
                    cfg.hidden, cfg.heads
                )))
            }
        };
        if cfg.kv_heads == 0 || !cfg.heads.is_multiple_of(cfg.kv_heads) {
            return Err(bad(format!(
                "{} heads are not a multiple of {} key/value heads",
                cfg.heads, cfg.kv_heads
            )));
        }
        if hd == 0 || !hd.is_multiple_of(2) {
            return Err(bad("the head dimension must be even (rotary pairs)".into()));
        }
        if let Some(l) = &cfg.lora {
            let known = projections(&cfg, hd).map(|p| p.1);
            if let Some(t) = l.targets.iter().find(|t| !known.contains(&t.as_str())) {
                return Err(bad(format!("unknown LoRA target `{t}`")));
            }
        }
        let head_chunk_rows = (HEAD_CHUNK_BYTES / (4 * cfg.vocab.max(1))).max(1);
        Ok(Llama {
            cfg,
            arch,
            head_chunk_rows,
        })
    }

    /// Has the head's backward compute `rows` rows of logits at a time (at least 1)
    /// instead of [`HEAD_CHUNK_BYTES`]' worth: the gradients are the same sums in
    /// another order.
    pub fn set_head_chunk_rows(&mut self, rows: usize) {
        self.head_chunk_rows = rows.max(1);
    }

    /// Rows of logits the head's backward computes at once.
    pub fn head_chunk_rows(&self) -> usize {
        self.head_chunk_rows
    }

    /// The shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The family's differences.
    pub fn arch(&self) -> &LlamaArch {
        &self.arch
    }

    /// The head dimension.
    pub fn head_dim(&self) -> usize {
        self.arch
            .head_dim
            .unwrap_or(self.cfg.hidden / self.cfg.heads)
    }

    /// Blocks: the embedding, every layer, the head.
    pub fn blocks(&self) -> usize {
        self.cfg.layers + 2
    }

    pub(crate) fn adapted(&self, short: &str) -> Option<&LlamaLora> {
        self.cfg
            .lora
            .as_ref()
            .filter(|l| l.targets.iter().any(|t| t == short))
    }

    /// Every parameter of block `b`, in the order the block reads them.
    pub fn block_params(&self, b: usize) -> Vec<ParamSpec> {
        let c = &self.cfg;
        let base = c.lora.is_none();
        let embed = || ParamSpec::new("model.embed_tokens.weight", &[c.vocab, c.hidden], base);
        if b == 0 {
            return vec![embed()];
        }
        if b == c.layers + 1 {
            let head = if c.tie_embeddings {
                embed()
            } else {
                ParamSpec::new("lm_head.weight", &[c.vocab, c.hidden], base)
            };
            return vec![ParamSpec::new("model.norm.weight", &[c.hidden], base), head];
        }
        let p = format!("model.layers.{}", b - 1);
        let hd = self.head_dim();
        let mut v = Vec::new();
        for (i, (module, short, out, inp)) in projections(c, hd).into_iter().enumerate() {
            if i == 0 {
                v.push(ParamSpec::new(
                    format!("{p}.input_layernorm.weight"),
                    &[c.hidden],
                    base,
                ));
            }
            if i == 4 {
                v.push(ParamSpec::new(
                    format!("{p}.post_attention_layernorm.weight"),
                    &[c.hidden],
                    base,
                ));
            }
            let name = format!("{p}.{module}.{short}");
            v.push(ParamSpec::new(format!("{name}.weight"), &[out, inp], base));
            if self.biased(short) {
                v.push(ParamSpec::new(format!("{name}.bias"), &[out], base));
            }
            if let Some(l) = self.adapted(short) {
                v.push(ParamSpec::new(
                    format!("{name}.lora_A.weight"),
                    &[l.rank, inp],
                    true,
                ));
                v.push(ParamSpec::new(
                    format!("{name}.lora_B.weight"),
                    &[out, l.rank],
                    true,
                ));
            }
            if let Some(norm) = self.qk_norm_of(short) {
                v.push(ParamSpec::new(
                    format!("{p}.self_attn.{norm}.weight"),
                    &[hd],
                    base,
                ));
            }
        }
        v
    }

    /// Whether projection `short` carries a bias.
    pub(crate) fn biased(&self, short: &str) -> bool {
        self.arch.qkv_bias && matches!(short, "q_proj" | "k_proj" | "v_proj")
    }

    /// The per-head norm that follows projection `short` (Qwen3's `q_norm`, `k_norm`).
    pub(crate) fn qk_norm_of(&self, short: &str) -> Option<&'static str> {
        match short {
            "q_proj" if self.arch.qk_norm => Some("q_norm"),
            "k_proj" if self.arch.qk_norm => Some("k_norm"),
            _ => None,
        }
    }

    /// Every parameter once, in forward order (a tied head is the embedding).
    pub fn specs(&self) -> Vec<ParamSpec> {
        let mut seen = std::collections::HashSet::new();
        (0..self.blocks())
            .flat_map(|b| self.block_params(b))
            .filter(|p| seen.insert(p.name.clone()))
            .collect()
    }

    /// Initial values from `seed`: weights normal with std 0.02 (HF's
    /// `initializer_range`), norms 1, biases 0, LoRA `A` like PEFT's Kaiming-uniform and `B` zero.
    pub fn init(&self, seed: u64) -> Vec<(ParamSpec, Vec<f32>)> {
        let mut rng = Rng::new(seed);
        self.specs()
            .into_iter()
            .map(|s| {
                let n = s.elements();
                let values = if s.name.ends_with("norm.weight") {
                    vec![1.0; n]
                } else if s.name.ends_with("lora_B.weight") || s.name.ends_with(".bias") {
                    vec![0.0; n]
                } else if s.name.ends_with("lora_A.weight") {
                    let bound = (1.0 / s.shape[1] as f64).sqrt();
                    (0..n)
                        .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                        .collect()
                } else {
                    (0..n).map(|_| rng.normal(0.02)).collect()
                };
                (s, values)
            })
            .collect()
    }

    /// A lower bound of the memory the layer-streamed trainer's activations take at
    /// once where the blocks compute, for micro-batches of `batch × time` of which
    /// `kept` have their block inputs saved at a time (all of a step's with the
    /// vertical order, one with the horizontal): every block's saved input (the tokens,
    /// then f32 hidden states; with `saved_inputs` in host memory, one per kept
    /// micro-batch and one brought back for a backward), plus the larger of a decoder
    /// layer's [`Llama::block_working_bytes`] and the head's with the last layer's
    /// attention probabilities and MLP activations, kept from its forward for its
    /// backward right after the head's. A lower bound: the blocks' other intermediates,
    /// their parameters' gradients and the allocator's slack come on top.
    pub fn activation_bytes_at_least(
        &self,
        batch: usize,
        time: usize,
        kept: usize,
        saved_inputs: SavedInputs,
    ) -> u64 {
        let c = &self.cfg;
        let (b, t) = (batch as u64, time as u64);
        let (tokens, hidden) = (b * t * 4, b * t * c.hidden as u64 * 4);
        let saved = match saved_inputs {
            SavedInputs::Compute => (tokens + (c.layers as u64 + 1) * hidden) * kept as u64,
            // The inputs the next block reads, and one brought back for a backward.
            SavedInputs::Host => (kept as u64 + 1) * hidden,
        };
        let head = self.blocks() - 1;
        let mut at_head = self.block_working_bytes(head, batch, time);
        if c.layers > 0 {
            // The last layer's forward values, kept for its backward after the head's.
            at_head += b * c.heads as u64 * t * t * 4 + 2 * b * t * c.intermediate as u64 * 4;
        }
        let in_layer = if c.layers > 0 {
            self.block_working_bytes(1, batch, time)
        } else {
            0
        };
        saved + at_head.max(in_layer)
    }

    /// What one micro-batch of `batch × time` allocates at least in block `block` beyond
    /// its input and what the driver holds (`tidestore_train::Blocks::working_bytes`):
    /// the embedding its output; a decoder layer its output and its attention scores
    /// with their softmax and its gradient (`3 · batch · heads · time² · 4` bytes); the
    /// head its logits with the two tensors of their size the log-softmax makes while
    /// they are alive (`HEAD_COPIES · rows · vocab · 4`, for the rows of one block of
    /// [`Llama::head_chunk_rows`]).
    pub fn block_working_bytes(&self, block: usize, batch: usize, time: usize) -> u64 {
        let c = &self.cfg;
        let (b, t) = (batch as u64, time as u64);
        let output = b * t * c.hidden as u64 * 4;
        if block == 0 {
            output
        } else if block + 1 >= self.blocks() {
            let rows = (b * t).min(self.head_chunk_rows as u64);
            HEAD_COPIES * rows * c.vocab as u64 * 4
        } else {
            output + 3 * b * c.heads as u64 * t * t * 4
        }
    }

    /// Logits of `tokens` `(batch, time)` as one graph.
    pub fn forward(&self, src: &mut dyn ParamSource, tokens: &Tensor) -> Result<Tensor> {
        let mut x = tokens.clone();
        for b in 0..self.blocks() {
            x = self.block(b, src, &x)?;
        }
        Ok(x)
    }

    /// Mean next-token cross-entropy of `logits` `(batch, time, vocab)` against
    /// `targets` `(batch, time)` u32, over the positions whose target is not
    /// [`IGNORE_TARGET`] only: a masked position contributes nothing to the sum nor to
    /// the count, so its logits get a gradient of exactly zero (its term is multiplied
    /// by 0 before the sum). With no masked position this is the plain mean; with every
    /// position masked the loss is 0 and so is every gradient.
    pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        MaskedLogProbs::new(logits, targets)?.loss()
    }

    /// For `logits` `(rows, vocab)` of some of a micro-batch's positions and their
    /// `targets` `(rows)`: the sum of the kept positions' log-likelihoods (a scalar) and
    /// the logits' gradient of the micro-batch's mean loss times `scale`, `(softmax −
    /// one-hot of the target) · scale / count` at kept positions, 0 at masked ones
    /// (`count`: the micro-batch's kept positions, [`Llama::kept_count`]). Each `(rows,
    /// vocab)` tensor is dropped as soon as the next is made (the logits too, which it
    /// takes): at most [`HEAD_COPIES`] are alive at once.
    pub(crate) fn log_lik_and_grad(
        logits: Tensor,
        targets: &Tensor,
        scale: f64,
        count: f32,
    ) -> Result<(Tensor, Tensor)> {
        let m = MaskedLogProbs::new(&logits, targets)?;
        drop(logits);
        let total = m.log_lik()?;
        let MaskedLogProbs {
            log_p,
            safe,
            weight,
        } = m;
        let idx = safe.unsqueeze(1)?;
        let minus_one = Tensor::full(-1f32, idx.shape(), idx.device())?;
        let factor = (weight * (scale / f64::from(count.max(1.0))))?.unsqueeze(1)?;
        let p = log_p.exp()?;
        drop(log_p);
        let g = p.scatter_add(&idx, &minus_one, 1)?;
        drop(p);
        Ok((total, g.broadcast_mul(&factor)?))
    }

    /// The positions of `targets` that carry loss (not [`IGNORE_TARGET`]), counted in
    /// `dtype` as [`Llama::loss`] counts them.
    pub(crate) fn kept_count(targets: &Tensor, dtype: DType) -> Result<f32> {
        let kept = kept(&targets.flatten_all()?)?;
        Ok(kept.to_dtype(dtype)?.sum_all()?.to_scalar::<f32>()?)
    }

    /// The mean loss of a micro-batch from the sum of its kept positions'
    /// log-likelihoods and their count.
    pub(crate) fn mean_loss(log_lik: &Tensor, count: f32) -> Result<f32> {
        Ok(mean_nll(log_lik, count)?.to_scalar::<f32>()?)
    }
}

/// `cos` and `sin` tables `(t, head_dim)`: position `i` times `rope`'s inverse
/// frequencies (f32, as transformers), each frequency twice (the two halves a rotation
/// pairs), times RoPE's attention factor (YaRN's; 1 otherwise).
pub(crate) fn rope_tables(
    t: usize,
    hd: usize,
    rope: &Rope,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = hd / 2;
    let inv = rope.inv_freq(hd);
    let mut angles = Vec::with_capacity(t * hd);
    for i in 0..t {
        for k in 0..hd {
            angles.push(i as f32 * inv[k % half]);
        }
    }
    let a = Tensor::from_vec(angles, (t, hd), device)?;
    let (cos, sin) = (a.cos()?, a.sin()?);
    let f = rope.attention_factor();
    if f == 1.0 {
        return Ok((cos, sin));
    }
    // transformers multiplies the f32 tables by the factor as an f32.
    let f = f64::from(f as f32);
    Ok(((cos * f)?, (sin * f)?))
}

/// The bytes `t`'s elements take.
pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// `(t, t)`: 0 where query `i` sees key `j` (`j ≤ i`, and `i - j < w` with a sliding
/// window of `w`), a large negative number elsewhere.
pub(crate) fn causal_mask(t: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let w = window.unwrap_or(usize::MAX);
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i && i - j < w { 0.0 } else { -1e9 }))
        .collect();
    Ok(Tensor::from_vec(m, (t, t), device)?.to_dtype(DType::F32)?)
}

/// The `(rows, vocab)` f32 tensors the head's backward holds at once at its peak: the
/// logits, and the log-softmax's shifted logits and their exponentials (candle's
/// `log_softmax`: `x − max`, then `exp` of it summed).
pub const HEAD_COPIES: u64 = 3;

/// Bytes of one `(rows, vocab)` f32 tensor of the head's backward: it computes its
/// logits, loss and gradients this many bytes of rows at a time (a micro-batch of 4096
/// tokens and a 128256-token vocabulary: 2 GiB a tensor at once, 256 MiB in blocks).
pub const HEAD_CHUNK_BYTES: usize = 256 << 20;

/// The log-probabilities of `logits` `(batch, time, vocab)` as rows, and which targets
/// count: a masked target ([`IGNORE_TARGET`]) is read as id 0 (any valid id) with
/// weight 0.
struct MaskedLogProbs {
    log_p: Tensor,
    safe: Tensor,
    weight: Tensor,
}

impl MaskedLogProbs {
    fn new(logits: &Tensor, targets: &Tensor) -> Result<Self> {
        let v = logits.dim(D::Minus1)?;
        let rows = logits.elem_count() / v.max(1);
        let targets = targets.reshape(rows)?;
        let kept = kept(&targets)?;
        // A masked target is read as id 0 (any valid id), with weight 0.
        let safe = kept.where_cond(&targets, &targets.zeros_like()?)?;
        let log_p = candle_nn::ops::log_softmax(&logits.reshape((rows, v))?, D::Minus1)?;
        let weight = kept.to_dtype(log_p.dtype())?;
        Ok(MaskedLogProbs {
            log_p,
            safe,
            weight,
        })
    }

    /// The sum of the kept positions' log-likelihoods (a scalar).
    fn log_lik(&self) -> Result<Tensor> {
        let picked = self.log_p.gather(&self.safe.unsqueeze(1)?, 1)?.squeeze(1)?;
        Ok((picked * &self.weight)?.sum_all()?)
    }

    /// The mean of the kept positions' negative log-likelihoods (0 with none kept).
    fn loss(&self) -> Result<Tensor> {
        let count = self.weight.sum_all()?.to_scalar::<f32>()?;
        mean_nll(&self.log_lik()?, count)
    }
}

/// The mean negative log-likelihood of `count` positions (0 with none) from the sum of
/// their log-likelihoods.
fn mean_nll(log_lik: &Tensor, count: f32) -> Result<Tensor> {
    Ok((log_lik.neg()? / f64::from(count.max(1.0)))?)
}

/// Which of `targets` `(rows)` carry loss (not [`IGNORE_TARGET`]), as u8.
fn kept(targets: &Tensor) -> Result<Tensor> {
    let ignore = Tensor::full(IGNORE_TARGET, targets.elem_count(), targets.device())?;
    Ok(targets.ne(&ignore)?)
}
