//! A small GPT written against [`ParamSource`], so the same forward runs in candle's
//! memory and through tidestore: byte tokens, learned positions, pre-LayerNorm blocks of
//! causal multi-head self-attention and a GELU MLP, a separate output head. Optional
//! LoRA adapters on the attention's `qkv` and `proj` (base frozen, `B` starts at zero so
//! the adapted model starts as the base).
//!
//! Also the deterministic pieces both sides need: initial values from a seed
//! ([`Gpt::init`]) and batches of a byte text chosen by (seed, step) ([`Batches`]), so
//! a resumed run sees the same batches as an uninterrupted one.

use candle_core::{Device, Module, Tensor, D};
use candle_nn::Linear;

use crate::error::Result;
use crate::source::{ParamSource, ParamSpec};

/// LoRA adapters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraConfig {
    /// Rank of the adapters.
    pub rank: usize,
    /// Scale numerator: the adapter's output is multiplied by `alpha / rank`.
    pub alpha: f32,
}

/// The model's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// Vocabulary (256 for bytes).
    pub vocab: usize,
    /// Context length (positions).
    pub ctx: usize,
    /// Width.
    pub d_model: usize,
    /// Attention heads (divides `d_model`).
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// LoRA adapters: the base is frozen and only they train.
    pub lora: Option<LoraConfig>,
}

/// A tiny xorshift generator with Box-Muller normals: deterministic everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Normal(0, std).
    pub fn normal(&mut self, std: f32) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * std
    }
}

/// The model: its shape and the names of its parameters.
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
}

impl Gpt {
    /// A model of shape `cfg`.
    pub fn new(cfg: GptConfig) -> Self {
        Gpt { cfg }
    }

    /// Its shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Every parameter in forward order; with LoRA only the adapters are trainable.
    pub fn specs(&self) -> Vec<ParamSpec> {
        let c = &self.cfg;
        let (d, base) = (c.d_model, c.lora.is_none());
        let mut s = vec![
            ParamSpec::new("wte", &[c.vocab, d], base),
            ParamSpec::new("wpe", &[c.ctx, d], base),
        ];
        let linear = |s: &mut Vec<ParamSpec>, name: String, out: usize, inp: usize, lora: bool| {
            s.push(ParamSpec::new(format!("{name}.weight"), &[out, inp], base));
            s.push(ParamSpec::new(format!("{name}.bias"), &[out], base));
            if let (Some(l), true) = (c.lora, lora) {
                s.push(ParamSpec::new(
                    format!("{name}.lora_a"),
                    &[l.rank, inp],
                    true,
                ));
                s.push(ParamSpec::new(
                    format!("{name}.lora_b"),
                    &[out, l.rank],
                    true,
                ));
            }
        };
        for l in 0..c.layers {
            let p = format!("h.{l}");
            s.push(ParamSpec::new(format!("{p}.ln1.weight"), &[d], base));
            s.push(ParamSpec::new(format!("{p}.ln1.bias"), &[d], base));
            linear(&mut s, format!("{p}.attn.qkv"), 3 * d, d, true);
            linear(&mut s, format!("{p}.attn.proj"), d, d, true);
            s.push(ParamSpec::new(format!("{p}.ln2.weight"), &[d], base));
            s.push(ParamSpec::new(format!("{p}.ln2.bias"), &[d], base));
            linear(&mut s, format!("{p}.mlp.fc"), 4 * d, d, false);
            linear(&mut s, format!("{p}.mlp.proj"), d, 4 * d, false);
        }
        s.push(ParamSpec::new("ln_f.weight", &[d], base));
        s.push(ParamSpec::new("ln_f.bias", &[d], base));
        s.push(ParamSpec::new("head.weight", &[c.vocab, d], base));
        s
    }

    /// Initial values from `seed`: weights Normal(0, 0.02) (residual projections scaled
    /// by `1/sqrt(2 layers)`), biases 0, LayerNorm weights 1, LoRA `A` Normal(0, 0.02)
    /// and `B` 0.
    pub fn init(&self, seed: u64) -> Vec<(ParamSpec, Vec<f32>)> {
        let mut rng = Rng::new(seed);
        let resid = 0.02 / (2.0 * self.cfg.layers as f32).sqrt();
        self.specs()
            .into_iter()
            .map(|s| {
                let n = s.elements();
                let name = s.name.as_str();
                let values = if name.ends_with(".bias") || name.ends_with(".lora_b") {
                    vec![0.0; n]
                } else if name.contains(".ln") || name.starts_with("ln_f") {
                    vec![1.0; n]
                } else {
                    let std = if name.ends_with("proj.weight") {
                        resid
                    } else {
                        0.02
                    };
                    (0..n).map(|_| rng.normal(std)).collect()
                };
                (s, values)
            })
            .collect()
    }

    /// Logits `(batch, time, vocab)` of `tokens` `(batch, time)` (u32).
    pub fn forward(&self, src: &mut dyn ParamSource, tokens: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, t) = tokens.dims2()?;
        let wte = src.param("wte")?;
        let wpe = src.param("wpe")?;
        let tok = wte
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, c.d_model))?;
        let mut x = tok.broadcast_add(&wpe.narrow(0, 0, t)?)?;
        let mask = causal_mask(t, tokens.device())?;
        for l in 0..c.layers {
            let p = format!("h.{l}");
            let h = layer_norm(&x, src, &format!("{p}.ln1"))?;
            let h = self.attention(&h, src, &p, &mask)?;
            x = (x + h)?;
            let h = layer_norm(&x, src, &format!("{p}.ln2"))?;
            let h = self.linear(&h, src, &format!("{p}.mlp.fc"))?.gelu()?;
            let h = self.linear(&h, src, &format!("{p}.mlp.proj"))?;
            x = (x + h)?;
        }
        let x = layer_norm(&x, src, "ln_f")?;
        let head = src.param("head.weight")?;
        Ok(Linear::new(head, None).forward(&x)?)
    }

    /// Mean cross-entropy of the next-byte predictions.
    pub fn loss(&self, src: &mut dyn ParamSource, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let logits = self.forward(src, x)?;
        let (b, t, v) = logits.dims3()?;
        Ok(candle_nn::loss::cross_entropy(
            &logits.reshape((b * t, v))?,
            &y.reshape(b * t)?,
        )?)
    }

    fn linear(&self, x: &Tensor, src: &mut dyn ParamSource, name: &str) -> Result<Tensor> {
        let w = src.param(&format!("{name}.weight"))?;
        let bias = src.param(&format!("{name}.bias"))?;
        let mut y = Linear::new(w, Some(bias)).forward(x)?;
        let adapted = name.contains(".attn.");
        if let (Some(l), true) = (self.cfg.lora, adapted) {
            let a = src.param(&format!("{name}.lora_a"))?;
            let bm = src.param(&format!("{name}.lora_b"))?;
            let low = Linear::new(a, None).forward(x)?;
            let delta = Linear::new(bm, None).forward(&low)?;
            y = (y + (delta * f64::from(l.alpha / l.rank as f32))?)?;
        }
        Ok(y)
    }

    fn attention(
        &self,
        x: &Tensor,
        src: &mut dyn ParamSource,
        p: &str,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, t, d) = x.dims3()?;
        let hd = d / c.heads;
        let qkv = self.linear(x, src, &format!("{p}.attn.qkv"))?;
        let split = |i: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, i * d, d)?
                .reshape((b, t, c.heads, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
        let att = candle_nn::ops::softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        self.linear(&y, src, &format!("{p}.attn.proj"))
    }
}

/// `(t, t)`: 0 on and below the diagonal, a large negative number above it.
fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { -1e9 }))
        .collect();
    Ok(Tensor::from_vec(m, (t, t), device)?)
}

/// LayerNorm over the last dimension, from primitive ops (candle's fused one has no
/// backward).
fn layer_norm(x: &Tensor, src: &mut dyn ParamSource, name: &str) -> Result<Tensor> {
    let w = src.param(&format!("{name}.weight"))?;
    let b = src.param(&format!("{name}.bias"))?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
    Ok(xn.broadcast_mul(&w)?.broadcast_add(&b)?)
}

/// Random windows of a byte text: batch `step` is a function of (seed, step) only.
#[derive(Debug, Clone)]
pub struct Batches {
    data: Vec<u8>,
    batch: usize,
    ctx: usize,
    seed: u64,
}

impl Batches {
    /// Windows of `ctx + 1` bytes of `data`, `batch` at a time; `data` must be longer
    /// than a window.
    pub fn new(data: Vec<u8>, batch: usize, ctx: usize, seed: u64) -> Result<Self> {
        if data.len() <= ctx + 1 || batch == 0 {
            return Err(crate::Error::BadParam {
                name: "batches".into(),
                reason: format!(
                    "{} bytes of text, batch {batch}: need a batch > 0 and more than {} bytes",
                    data.len(),
                    ctx + 1
                ),
            });
        }
        Ok(Batches {
            data,
            batch,
            ctx,
            seed,
        })
    }

    /// Inputs and next-byte targets `(batch, ctx)` (u32) of step `step`.
    pub fn get(&self, step: u64, device: &Device) -> Result<(Tensor, Tensor)> {
        let mut rng = Rng::new(self.seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
        // `new` made sure a whole window fits.
        let span = self.data.len() - self.ctx - 1;
        let mut x = Vec::with_capacity(self.batch * self.ctx);
        let mut y = Vec::with_capacity(self.batch * self.ctx);
        for _ in 0..self.batch {
            let o = (rng.next_u64() % span as u64) as usize;
            let w = &self.data[o..o + self.ctx + 1];
            x.extend(w[..self.ctx].iter().map(|&b| u32::from(b)));
            y.extend(w[1..].iter().map(|&b| u32::from(b)));
        }
        let x = Tensor::from_vec(x, (self.batch, self.ctx), device)?;
        let y = Tensor::from_vec(y, (self.batch, self.ctx), device)?;
        Ok((x, y))
    }
}
