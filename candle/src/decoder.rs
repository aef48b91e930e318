//! LLaMA's decoder layer, head and embedding computed with what their backward needs
//! kept, and that backward written out (the vector-Jacobian product of each operation,
//! in reverse): what the layer-streamed trainer runs.
//!
//! candle's autograd gives every node of the graph a gradient buffer of its own, zeroed
//! and then added into (`GradStore::or_insert` + `add`): for a projection's weight that
//! is three weight-sized zero fills and additions per backward (the weight, its
//! transpose, its broadcast): in a profile of a 0.51B LLaMA on a 2-core CPU, a quarter
//! of the time the matrix products took. Here each gradient is the result of the one
//! operation that makes it: a weight's is `gᵀ · x`, nothing is zeroed, frozen weights
//! get no product at all, and the fused forward kernels (`candle_nn`'s RMSNorm and
//! last-dimension softmax, which have no backward in candle) serve the forward passes.
//!
//! The same forward, in [`Mode::Graph`], is [`Llama::block`]'s differentiable graph
//! (primitive operations only): the reference that `tests/llama_streamed.rs` holds this
//! backward to, gradient by gradient.
//!
//! Grouped-query attention never repeats keys and values: the `rep = heads / kv_heads`
//! query heads that share a key/value head are laid out as `rep · time` rows of one
//! product against it (`(batch · kv_heads, rep · time, head_dim)`), so the keys' and
//! values' gradients come out summed over the group by the product itself.

use std::collections::HashMap;

use candle_core::{Tensor, D};

use crate::blas::{matmul as mm, matmul_slice};
use crate::error::{Error, Result};
use crate::llama::{causal_mask, rope_tables, Llama};
use crate::source::{Loan, ParamSource};

/// How the forward operations are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Primitive candle operations, each with its backward: a graph candle's autograd
    /// differentiates.
    Graph,
    /// Fused kernels without a backward in candle (RMSNorm, softmax): the forward of
    /// the hand-written backward below.
    Fused,
}

/// `x · rsqrt(mean(x²) + eps) · w` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, mode: Mode) -> Result<Tensor> {
    if mode == Mode::Fused && x.is_contiguous() {
        return Ok(candle_nn::ops::rms_norm(x, w, eps as f32)?);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    Ok(xn.broadcast_mul(w)?)
}

/// The gradient of [`rms_norm`] with respect to `x` for the output gradient `g`, and
/// with respect to `w` when `w_grad`: with `r = rsqrt(mean(x²) + eps)` and `x̂ = x·r`,
/// `dx = r · (g·w − x̂ · mean(g·w·x̂))` and `dw = Σ_rows g·x̂`.
fn rms_norm_back(x: &Tensor, w: &Tensor, eps: f64, g: &Tensor, w_grad: bool) -> Result<Grad2> {
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let xhat = x.broadcast_mul(&r)?;
    let gw = g.broadcast_mul(w)?;
    let dot = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
    let dx = (gw - xhat.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
    let dw = if w_grad {
        let rows = xhat.elem_count() / w.elem_count();
        Some((g * xhat)?.reshape((rows, w.elem_count()))?.sum(0)?)
    } else {
        None
    };
    Ok((dx, dw))
}

/// A gradient with respect to an input, and one with respect to a parameter if it
/// trains.
type Grad2 = (Tensor, Option<Tensor>);

/// Rotary embedding `x · cos + rotate_half(x) · sin`, `rotate_half(x) = [−x₂, x₁]`;
/// with `transposed`, its transpose (the backward): `g · cos + [s₂, −s₁]` for
/// `s = g · sin`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, transposed: bool) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let s = if transposed {
        x.broadcast_mul(sin)?
    } else {
        x.clone()
    };
    let (s1, s2) = (
        s.narrow(D::Minus1, 0, hd / 2)?,
        s.narrow(D::Minus1, hd / 2, hd / 2)?,
    );
    let rotated = if transposed {
        Tensor::cat(&[&s2, &s1.neg()?], D::Minus1)?
    } else {
        Tensor::cat(&[&s2.neg()?, &s1], D::Minus1)?.broadcast_mul(sin)?
    };
    Ok((x.broadcast_mul(cos)? + rotated)?)
}

/// What a projection's backward needs: its input, and LoRA's low-rank activation.
#[derive(Debug, Clone)]
struct ProjSaved {
    /// The input rows `(rows, in)`.
    x: Tensor,
    /// `x · Aᵀ` `(rows, rank)`, when the projection is adapted.
    low: Option<Tensor>,
}

/// A decoder layer's forward values that its backward reads (rows are `batch · time`).
#[derive(Debug)]
pub(crate) struct LayerSaved {
    x: Tensor,
    qkv: [ProjSaved; 3],
    /// q and k before their per-head norm (Qwen3), `(rows · n, head_dim)`.
    qk_pre: Option<(Tensor, Tensor)>,
    /// Rotated queries `(b·kv, rep·t, hd)`, keys and values `(b·kv, t, hd)`.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// Attention probabilities `(b·kv, rep·t, t)`.
    p: Tensor,
    o_proj: ProjSaved,
    x_mid: Tensor,
    gate: Tensor,
    up: Tensor,
    mlp: [ProjSaved; 3],
}

impl LayerSaved {
    /// The bytes its tensors take, each counted once however many of its fields share
    /// it (the projections of one input do).
    pub(crate) fn bytes(&self) -> u64 {
        let projs = self.qkv.iter().chain([&self.o_proj]).chain(&self.mlp);
        let saved = projs.flat_map(|p| std::iter::once(&p.x).chain(&p.low));
        let pre = self.qk_pre.iter().flat_map(|(q, k)| [q, k]);
        let own = [
            &self.x,
            &self.q,
            &self.k,
            &self.v,
            &self.cos,
            &self.sin,
            &self.p,
            &self.x_mid,
            &self.gate,
            &self.up,
        ];
        let mut seen = std::collections::HashSet::new();
        own.into_iter()
            .chain(pre)
            .chain(saved)
            .filter(|t| seen.insert(t.id()))
            .map(crate::llama::tensor_bytes)
            .sum()
    }
}

/// Queries, keys and values with their projections' saved values, and q and k before
/// their per-head norms.
type QkvOut = (Vec<(Tensor, ProjSaved)>, Vec<Tensor>);

/// Parameter gradients of one block, by name.
pub(crate) type ParamGrads = HashMap<String, Tensor>;

/// The input's gradient, the parameters' gradients and (the head's) unscaled loss.
pub(crate) type BlockBack = (Option<Tensor>, ParamGrads, Option<f32>);

impl Llama {
    /// Runs block `b` on `x` (token ids `(batch, time)` u32 for the embedding, hidden
    /// states `(batch, time, hidden)` otherwise); the head returns logits.
    pub fn block(&self, b: usize, src: &mut dyn ParamSource, x: &Tensor) -> Result<Tensor> {
        self.block_in(b, src, x, Mode::Graph)
    }

    /// [`Llama::block`] computed as `mode` says.
    pub(crate) fn block_in(
        &self,
        b: usize,
        src: &mut dyn ParamSource,
        x: &Tensor,
        mode: Mode,
    ) -> Result<Tensor> {
        if b == 0 {
            let (bs, t) = x.dims2()?;
            let (w, _) = weight(src, "model.embed_tokens.weight", mode)?;
            let rows = w.rows(src, &x.flatten_all()?)?;
            return Ok(rows.reshape((bs, t, self.config().hidden))?);
        }
        if b == self.config().layers + 1 {
            return Ok(self.head_forward(src, x, mode)?.0);
        }
        Ok(self.layer_forward(b - 1, src, x, mode)?.0)
    }

    /// `x · Wᵀ (+ b) (+ (alpha / r) · (x · Aᵀ) · Bᵀ)` on rows `x` `(rows, in)`.
    fn project(
        &self,
        x: &Tensor,
        src: &mut dyn ParamSource,
        name: &str,
        short: &str,
        mode: Mode,
    ) -> Result<(Tensor, ProjSaved)> {
        let (w, _) = weight(src, &format!("{name}.weight"), mode)?;
        let mut y = w.apply(src, x)?;
        if self.biased(short) {
            y = y.broadcast_add(&param(src, &format!("{name}.bias"), mode)?)?;
        }
        let mut low = None;
        if let Some(l) = self.adapted(short) {
            let a = param(src, &format!("{name}.lora_A.weight"), mode)?;
            let bm = param(src, &format!("{name}.lora_B.weight"), mode)?;
            let lo = mm(x, &a.t()?)?;
            let delta = mm(&lo, &bm.t()?)?;
            y = (y + (delta * self.lora_scale(l))?)?;
            low = Some(lo);
        }
        Ok((y, ProjSaved { x: x.clone(), low }))
    }

    /// The backward of [`Llama::project`]: the input's gradient for `g` `(rows, out)`;
    /// the trainable parameters' gradients go into `grads`.
    fn project_back(
        &self,
        saved: &ProjSaved,
        src: &mut dyn ParamSource,
        name: &str,
        short: &str,
        g: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let x = &saved.x;
        let weight_name = format!("{name}.weight");
        let w = weight(src, &weight_name, Mode::Fused)?;
        let mut dx = weight_back(src, &w, &weight_name, x, g, grads)?;
        if self.biased(short) {
            let bias = format!("{name}.bias");
            if trained(src, &bias)?.1 {
                add_grad(grads, bias, g.sum(0)?)?;
            }
        }
        if let (Some(low), Some(l)) = (&saved.low, self.adapted(short)) {
            let (a, a_trains) = trained(src, &format!("{name}.lora_A.weight"))?;
            let (bm, b_trains) = trained(src, &format!("{name}.lora_B.weight"))?;
            let gs = (g * self.lora_scale(l))?;
            if b_trains {
                add_grad(grads, format!("{name}.lora_B.weight"), mm(&gs.t()?, low)?)?;
            }
            let dlow = mm(&gs, &bm)?;
            if a_trains {
                add_grad(grads, format!("{name}.lora_A.weight"), mm(&dlow.t()?, x)?)?;
            }
            dx = (dx + mm(&dlow, &a)?)?;
        }
        Ok(dx)
    }

    fn lora_scale(&self, l: &crate::llama::LlamaLora) -> f64 {
        f64::from(l.alpha / l.rank as f32)
    }

    /// Queries, keys and values of normed rows `h1`, each `(batch, n, time, head_dim)`
    /// with its projection's saved values, and q and k before their per-head norm
    /// (Qwen3).
    fn qkv_forward(
        &self,
        src: &mut dyn ParamSource,
        a: &str,
        h1: &Tensor,
        (bs, t): (usize, usize),
        mode: Mode,
    ) -> Result<QkvOut> {
        let c = self.config();
        let (hd, rows, eps) = (self.head_dim(), bs * t, c.rms_eps);
        let mut qkv = Vec::with_capacity(3);
        let mut pre = Vec::new();
        for (short, n) in [
            ("q_proj", c.heads),
            ("k_proj", c.kv_heads),
            ("v_proj", c.kv_heads),
        ] {
            let (y, saved) = self.project(h1, src, &format!("{a}.{short}"), short, mode)?;
            let y = match self.qk_norm_of(short) {
                Some(norm) => {
                    let w = param(src, &format!("{a}.{norm}.weight"), mode)?;
                    let y = y.reshape((rows * n, hd))?;
                    pre.push(y.clone());
                    rms_norm(&y, &w, eps, mode)?
                }
                None => y,
            };
            // (b, t, n, hd) -> (b, n, t, hd)
            let y = y.reshape((bs, t, n, hd))?.transpose(1, 2)?.contiguous()?;
            qkv.push((y, saved));
        }
        Ok((qkv, pre))
    }

    /// Decoder layer `l` on `x` `(batch, time, hidden)`: its output and what its
    /// backward needs.
    pub(crate) fn layer_forward(
        &self,
        l: usize,
        src: &mut dyn ParamSource,
        x: &Tensor,
        mode: Mode,
    ) -> Result<(Tensor, LayerSaved)> {
        let c = self.config();
        let p = format!("model.layers.{l}");
        let (bs, t, hidden) = x.dims3()?;
        let (hd, rows, rep) = (self.head_dim(), bs * t, c.heads / c.kv_heads);
        let x2 = x.reshape((rows, hidden))?;
        let eps = c.rms_eps;
        let h1 = rms_norm(
            &x2,
            &param(src, &format!("{p}.input_layernorm.weight"), mode)?,
            eps,
            mode,
        )?;
        let a = format!("{p}.self_attn");
        let (qkv, pre) = self.qkv_forward(src, &a, &h1, (bs, t), mode)?;
        let (cos, sin) = rope_tables(t, hd, &self.arch().rope, x.device())?;
        let q = rotate(&qkv[0].0, &cos, &sin, false)?.reshape((bs * c.kv_heads, rep * t, hd))?;
        let k = rotate(&qkv[1].0, &cos, &sin, false)?.reshape((bs * c.kv_heads, t, hd))?;
        let v = qkv[2].0.reshape((bs * c.kv_heads, t, hd))?;
        let probs = self.attention_probs(&q, &k, (bs, t), mode)?;
        let o = mm(&probs, &v)?
            .reshape((bs, c.heads, t, hd))?
            .transpose(1, 2)?
            .reshape((rows, c.heads * hd))?;
        let (attn, o_proj) = self.project(&o, src, &format!("{a}.o_proj"), "o_proj", mode)?;
        let x_mid = (&x2 + attn)?;
        let w_post = param(src, &format!("{p}.post_attention_layernorm.weight"), mode)?;
        let h2 = rms_norm(&x_mid, &w_post, eps, mode)?;
        let m = format!("{p}.mlp");
        let (gate, gate_s) =
            self.project(&h2, src, &format!("{m}.gate_proj"), "gate_proj", mode)?;
        let (up, up_s) = self.project(&h2, src, &format!("{m}.up_proj"), "up_proj", mode)?;
        let act = (gate.silu()? * &up)?;
        let (down, down_s) =
            self.project(&act, src, &format!("{m}.down_proj"), "down_proj", mode)?;
        let out = (&x_mid + down)?.reshape((bs, t, hidden))?;
        let mut qkv = qkv.into_iter().map(|(_, s)| s);
        let mut next = || qkv.next().expect("three projections");
        let saved = LayerSaved {
            x: x2,
            qkv: [next(), next(), next()],
            qk_pre: (pre.len() == 2).then(|| (pre[0].clone(), pre[1].clone())),
            q,
            k,
            v,
            cos,
            sin,
            p: probs,
            o_proj,
            x_mid,
            gate,
            up,
            mlp: [gate_s, up_s, down_s],
        };
        Ok((out, saved))
    }

    /// Attention's probabilities `softmax(q·kᵀ / √d + causal mask)` of the queries `q`
    /// `(batch · kv_heads, rep · time, head_dim)` and keys `k`, in `q`'s shape but
    /// `time` wide. Each `(batch, heads, time, time)` tensor is dropped once the next
    /// exists: two alive at once, whatever the sequence length.
    fn attention_probs(
        &self,
        q: &Tensor,
        k: &Tensor,
        (bs, t): (usize, usize),
        mode: Mode,
    ) -> Result<Tensor> {
        let c = self.config();
        let (hd, rep) = (self.head_dim(), c.heads / c.kv_heads);
        let scores = mm(q, &k.t()?)?;
        let scaled = (&scores / (hd as f64).sqrt())?.reshape((bs, c.heads, t, t))?;
        drop(scores);
        let mask = causal_mask(t, self.arch().sliding_window, q.device())?;
        let masked = scaled.broadcast_add(&mask)?;
        drop(scaled);
        let probs = match mode {
            Mode::Fused => candle_nn::ops::softmax_last_dim(&masked)?,
            Mode::Graph => candle_nn::ops::softmax(&masked, D::Minus1)?,
        };
        Ok(probs.reshape((bs * c.kv_heads, rep * t, t))?)
    }

    /// The backward of decoder layer `l` for the output gradient `g`
    /// `(batch, time, hidden)`: the input's gradient; the trainable parameters' go into
    /// `grads`.
    pub(crate) fn layer_backward(
        &self,
        l: usize,
        src: &mut dyn ParamSource,
        s: &LayerSaved,
        g: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let c = self.config();
        let p = format!("model.layers.{l}");
        let (bs, t, hidden) = g.dims3()?;
        let g2 = g.reshape((bs * t, hidden))?;
        let dh2 = self.mlp_backward(src, &format!("{p}.mlp"), s, &g2, grads)?;
        let post = format!("{p}.post_attention_layernorm.weight");
        let (w_post, trains) = trained(src, &post)?;
        let (dx, dw) = rms_norm_back(&s.x_mid, &w_post, c.rms_eps, &dh2, trains)?;
        put(grads, post, dw)?;
        let d_mid = (g2 + dx)?;
        let a = format!("{p}.self_attn");
        let d_o = self.project_back(
            &s.o_proj,
            src,
            &format!("{a}.o_proj"),
            "o_proj",
            &d_mid,
            grads,
        )?;
        let dqkv = self.attention_backward(s, &d_o, (bs, t))?;
        let dh1 = self.qkv_backward(src, &a, s, dqkv, (bs, t), grads)?;
        let input = format!("{p}.input_layernorm.weight");
        let (w_in, trains) = trained(src, &input)?;
        let (dx, dw) = rms_norm_back(&s.x, &w_in, c.rms_eps, &dh1, trains)?;
        put(grads, input, dw)?;
        Ok((d_mid + dx)?.reshape((bs, t, hidden))?)
    }

    /// The MLP's backward, `down(silu(gate) · up)`, for its output's gradient `g2`
    /// `(rows, hidden)`: the gradient of its normed input.
    fn mlp_backward(
        &self,
        src: &mut dyn ParamSource,
        m: &str,
        s: &LayerSaved,
        g2: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let down = format!("{m}.down_proj");
        let d_act = self.project_back(&s.mlp[2], src, &down, "down_proj", g2, grads)?;
        // Each (rows, intermediate) temporary is dropped once the next exists.
        let sig = candle_nn::ops::sigmoid(&s.gate)?;
        let silu = (&s.gate * &sig)?;
        let d_up = (&d_act * &silu)?;
        drop(silu);
        // silu'(z) = σ(z) · (1 + z · (1 − σ(z)))
        let one_minus = sig.affine(-1.0, 1.0)?;
        let z_one_minus = (&s.gate * &one_minus)?;
        drop(one_minus);
        let dsilu = (&sig * (z_one_minus + 1.0)?)?;
        drop(sig);
        let d_gate = ((d_act * &s.up)? * dsilu)?;
        let (gate, up) = (format!("{m}.gate_proj"), format!("{m}.up_proj"));
        let dh_gate = self.project_back(&s.mlp[0], src, &gate, "gate_proj", &d_gate, grads)?;
        let dh_up = self.project_back(&s.mlp[1], src, &up, "up_proj", &d_up, grads)?;
        Ok((dh_gate + dh_up)?)
    }

    /// Attention's backward from the gradient of its output rows `d_o`
    /// `(rows, heads · head_dim)` to the rotated-back queries', keys' and values'
    /// gradients, each `(batch, n, time, head_dim)`: with `S = q·kᵀ / √d`, `P =
    /// softmax(S)`, `O = P·v`: `dv = Pᵀ·dO`, `dP = dO·vᵀ`, `dS = P ∘ (dP − rowsum(P ∘ dP))`.
    fn attention_backward(
        &self,
        s: &LayerSaved,
        d_o: &Tensor,
        (bs, t): (usize, usize),
    ) -> Result<[Tensor; 3]> {
        let c = self.config();
        let (hd, rep) = (self.head_dim(), c.heads / c.kv_heads);
        let d_o = d_o
            .reshape((bs, t, c.heads, hd))?
            .transpose(1, 2)?
            .reshape((bs * c.kv_heads, rep * t, hd))?;
        let dv = mm(&s.p.t()?, &d_o)?;
        // Each (batch, heads, time, time) tensor is dropped once the next exists: two
        // alive at once beside the saved probabilities.
        let dp = mm(&d_o, &s.v.t()?)?;
        let p_dp = (&s.p * &dp)?;
        let rowsum = p_dp.sum_keepdim(D::Minus1)?;
        drop(p_dp);
        let centred = dp.broadcast_sub(&rowsum)?;
        drop(dp);
        let ds_unscaled = (&s.p * &centred)?;
        drop(centred);
        let ds = (&ds_unscaled / (hd as f64).sqrt())?;
        drop(ds_unscaled);
        let dq = mm(&ds, &s.k)?.reshape((bs, c.heads, t, hd))?;
        let dk = mm(&ds.t()?, &s.q)?.reshape((bs, c.kv_heads, t, hd))?;
        Ok([
            rotate(&dq, &s.cos, &s.sin, true)?,
            rotate(&dk, &s.cos, &s.sin, true)?,
            dv.reshape((bs, c.kv_heads, t, hd))?,
        ])
    }

    /// The q, k and v projections' backward (with Qwen3's per-head norms) from their
    /// outputs' gradients `(batch, n, time, head_dim)`: the gradient of their normed
    /// input rows, summed over the three.
    fn qkv_backward(
        &self,
        src: &mut dyn ParamSource,
        a: &str,
        s: &LayerSaved,
        dqkv: [Tensor; 3],
        (bs, t): (usize, usize),
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let c = self.config();
        let (hd, rows) = (self.head_dim(), bs * t);
        let heads = [c.heads, c.kv_heads, c.kv_heads];
        let mut dh1: Option<Tensor> = None;
        for (i, (short, d)) in ["q_proj", "k_proj", "v_proj"]
            .into_iter()
            .zip(dqkv)
            .enumerate()
        {
            let n = heads[i];
            // (b, n, t, hd) -> rows of (b, t, n, hd)
            let mut d = d.transpose(1, 2)?.contiguous()?;
            if let (Some(norm), Some((qp, kp))) = (self.qk_norm_of(short), &s.qk_pre) {
                let name = format!("{a}.{norm}.weight");
                let (w, trains) = trained(src, &name)?;
                let pre = if i == 0 { qp } else { kp };
                let d_rows = d.reshape((rows * n, hd))?;
                let (dx, dw) = rms_norm_back(pre, &w, c.rms_eps, &d_rows, trains)?;
                put(grads, name, dw)?;
                d = dx;
            }
            let d = d.reshape((rows, n * hd))?;
            let name = format!("{a}.{short}");
            let dx = self.project_back(&s.qkv[i], src, &name, short, &d, grads)?;
            dh1 = Some(match dh1 {
                Some(sum) => (sum + dx)?,
                None => dx,
            });
        }
        dh1.ok_or_else(|| Error::BadParam {
            name: a.to_string(),
            reason: "no q, k or v projection".into(),
        })
    }

    /// The head's logits `(batch, time, vocab)` of `x`, and its normed input `(rows,
    /// hidden)` (what its backward needs).
    pub(crate) fn head_forward(
        &self,
        src: &mut dyn ParamSource,
        x: &Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Tensor)> {
        let (bs, t, _) = x.dims3()?;
        let h = self.head_input(src, x, mode)?;
        let p = self.block_params(self.blocks() - 1);
        let logits = weight(src, &p[1].name, mode)?.0.apply(src, &h)?;
        Ok((logits.reshape((bs, t, self.config().vocab))?, h))
    }

    /// The head's normed input `(rows, hidden)` of `x` `(batch, time, hidden)`.
    fn head_input(&self, src: &mut dyn ParamSource, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (bs, t, hidden) = x.dims3()?;
        let p = self.block_params(self.blocks() - 1);
        let x2 = x.reshape((bs * t, hidden))?;
        rms_norm(
            &x2,
            &param(src, &p[0].name, mode)?,
            self.config().rms_eps,
            mode,
        )
    }

    /// The backward of the whole block `b` on its input `x` for `upstream` (the head
    /// takes the loss against targets, times a scale, or its logits' gradient; a
    /// decoder layer or the embedding its output's gradient).
    pub(crate) fn block_backward(
        &self,
        b: usize,
        src: &mut dyn ParamSource,
        x: &Tensor,
        upstream: tidestore_train::Upstream<'_, Tensor>,
    ) -> Result<BlockBack> {
        use tidestore_train::Upstream;
        let mut grads = ParamGrads::new();
        let head = self.blocks() - 1;
        if b == head {
            let h = self.head_input(src, x, Mode::Fused)?;
            let (dh, loss) = match upstream {
                Upstream::Loss { targets, scale } => {
                    let (dh, loss) = self.head_loss_back(src, &h, targets, scale, &mut grads)?;
                    (dh, Some(loss))
                }
                Upstream::Grad(g) => {
                    let g = g.reshape((h.dim(0)?, self.config().vocab))?;
                    (self.head_weight_back(src, &h, &g, &mut grads)?, None)
                }
            };
            let dx = self.head_norm_back(src, x, &dh, &mut grads)?;
            return Ok((Some(dx), grads, loss));
        }
        let Upstream::Grad(g) = upstream else {
            return Err(Error::BadParam {
                name: format!("block {b}"),
                reason: "a loss handed to a block that is not the head".into(),
            });
        };
        if b == 0 {
            let name = "model.embed_tokens.weight";
            let (w, trains) = weight(src, name, Mode::Fused)?;
            if trains {
                let ids = x.flatten_all()?;
                let hidden = self.config().hidden;
                let rows = g.reshape((ids.elem_count(), hidden))?;
                add_grad(
                    &mut grads,
                    name.to_string(),
                    embedding_grad(&w, &ids, &rows)?,
                )?;
            }
            return Ok((None, grads, None));
        }
        let (_, saved) = self.layer_forward(b - 1, src, x, Mode::Fused)?;
        self.layer_block_backward(b, src, &saved, g)
    }

    /// Block `b` (decoder layer `b - 1`)'s backward for its output's gradient `g`, from
    /// its forward's `saved` values: a recompute's, or what the forward kept.
    pub(crate) fn layer_block_backward(
        &self,
        b: usize,
        src: &mut dyn ParamSource,
        saved: &LayerSaved,
        g: &Tensor,
    ) -> Result<BlockBack> {
        let mut grads = ParamGrads::new();
        let dx = self.layer_backward(b - 1, src, saved, g, &mut grads)?;
        Ok((Some(dx), grads, None))
    }

    /// The head's loss against `targets` times `scale` and its backward to the normed
    /// input `h` `(rows, hidden)`: the logits, their loss and their gradient a block of
    /// [`Llama::head_chunk_rows`] rows at a time, so that at most that many rows of
    /// `(rows, vocab)` tensors are alive at once; the weight's gradient is the blocks'
    /// sum. Returns `h`'s gradient and the micro-batch's mean loss.
    fn head_loss_back(
        &self,
        src: &mut dyn ParamSource,
        h: &Tensor,
        targets: &Tensor,
        scale: f64,
        grads: &mut ParamGrads,
    ) -> Result<(Tensor, f32)> {
        let rows = h.dim(0)?;
        let targets = targets.reshape(rows)?;
        let count = Llama::kept_count(&targets, h.dtype())?;
        let name = &self.block_params(self.blocks() - 1)[1].name;
        let w = weight(src, name, Mode::Fused)?;
        let (mut log_lik, mut dh) = (None::<Tensor>, Vec::new());
        let chunk = self.head_chunk_rows();
        for at in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - at);
            let h_c = h.narrow(0, at, n)?;
            let logits = w.0.apply(src, &h_c)?;
            let (lik, g) =
                Llama::log_lik_and_grad(logits, &targets.narrow(0, at, n)?, scale, count)?;
            log_lik = Some(match log_lik {
                Some(sum) => (sum + lik)?,
                None => lik,
            });
            // The weight's gradient is the blocks' sum, added up in `grads`.
            dh.push(weight_back(src, &w, name, &h_c, &g, grads)?);
        }
        let loss = match log_lik {
            Some(l) => Llama::mean_loss(&l, count)?,
            None => 0.0,
        };
        Ok((Tensor::cat(&dh, 0)?, loss))
    }

    /// The head weight's backward for the logits' gradient `g` `(rows, vocab)` of its
    /// normed input `h`: its gradient put when it trains; returns `h`'s.
    fn head_weight_back(
        &self,
        src: &mut dyn ParamSource,
        h: &Tensor,
        g: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let name = &self.block_params(self.blocks() - 1)[1].name;
        let w = weight(src, name, Mode::Fused)?;
        weight_back(src, &w, name, h, g, grads)
    }

    /// The head norm's backward for its output's gradient `dh` `(rows, hidden)`: its
    /// weight's gradient put; returns the gradient of the head's input `x`.
    fn head_norm_back(
        &self,
        src: &mut dyn ParamSource,
        x: &Tensor,
        dh: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let (bs, t, hidden) = x.dims3()?;
        let name = self.block_params(self.blocks() - 1)[0].name.clone();
        let (wn, wn_trains) = trained(src, &name)?;
        let x2 = x.reshape((bs * t, hidden))?;
        let (dx, dw) = rms_norm_back(&x2, &wn, self.config().rms_eps, dh, wn_trains)?;
        put(grads, name, dw)?;
        Ok(dx.reshape((bs, t, hidden))?)
    }
}

/// The backward of the matrix `w` (with whether it trains, as [`weight`] gives it, named
/// `name`) for the gradient `g` `(rows, out)` of its output on the input rows `h`:
/// `gᵀ·h` added to its gradient in `grads` when it trains; returns `g·W`, `h`'s.
fn weight_back(
    src: &dyn ParamSource,
    (w, trains): &(Weight, bool),
    name: &str,
    h: &Tensor,
    g: &Tensor,
    grads: &mut ParamGrads,
) -> Result<Tensor> {
    if *trains {
        add_grad(grads, name.to_string(), mm(&g.t()?, h)?)?;
    }
    w.back(src, g)
}

/// The embedding `w`'s gradient: each of `rows` `(tokens, hidden)` added, in order, at the
/// row its token `ids` names, zero elsewhere. On the CPU one zeroed allocation that the
/// kernel maps lazily (the untouched rows of a large vocabulary are never written) with
/// the rows added in place, where candle's zeros-then-`index_add` writes the whole
/// matrix twice (0.26 GB each for a 32000 × 2048 fp32 table); on a GPU through candle.
/// The same additions in the same order, so the same values.
fn embedding_grad(w: &Weight, ids: &Tensor, rows: &Tensor) -> Result<Tensor> {
    let shape = w.shape();
    if !rows.device().is_cpu() {
        let zeros = Tensor::zeros(shape, candle_core::DType::F32, rows.device())?;
        return Ok(zeros.index_add(ids, rows, 0)?);
    }
    let [vocab, hidden] = shape[..] else {
        return Err(Error::BadParam {
            name: "model.embed_tokens.weight".into(),
            reason: format!("shape {shape:?} where a matrix was expected"),
        });
    };
    let ids = ids.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
    let rows = rows.flatten_all()?.to_vec1::<f32>()?;
    let mut g = vec![0f32; vocab * hidden];
    for (id, row) in ids.iter().zip(rows.chunks_exact(hidden)) {
        let at = *id as usize;
        let Some(dst) = g.get_mut(at * hidden..(at + 1) * hidden) else {
            return Err(Error::BadParam {
                name: "model.embed_tokens.weight".into(),
                reason: format!("token id {id} is outside the vocabulary of {vocab}"),
            });
        };
        dst.iter_mut().zip(row).for_each(|(d, r)| *d += r);
    }
    Ok(Tensor::from_vec(
        g,
        (vocab, hidden),
        &candle_core::Device::Cpu,
    )?)
}

/// Parameter `name` for `mode`'s forward: detached in the fused passes, which build no
/// graph (candle records every operation on a variable, and the recorded inputs, a
/// layer's weights among them, would live as long as any result: the whole backward
/// pass).
fn param(src: &mut dyn ParamSource, name: &str, mode: Mode) -> Result<Tensor> {
    let t = src.param(name)?;
    Ok(match mode {
        Mode::Fused => t.detach(),
        Mode::Graph => t,
    })
}

/// A weight matrix `(out, in)` as the products read it: a candle tensor, or the
/// source's memory lent for the block (no copy into candle).
enum Weight {
    Tensor(Tensor),
    Lent(Loan),
}

impl Weight {
    /// Its shape.
    fn shape(&self) -> Vec<usize> {
        match self {
            Weight::Tensor(w) => w.dims().to_vec(),
            Weight::Lent(l) => l.shape.clone(),
        }
    }

    /// `(out, in)`, for a lent matrix.
    fn dims2(l: &Loan) -> Result<(usize, usize)> {
        match l.shape[..] {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(Error::BadParam {
                name: format!("loan {}", l.id),
                reason: format!("shape {:?} where a matrix was expected", l.shape),
            }),
        }
    }

    /// `x · Wᵀ` for rows `x` `(rows, in)`.
    fn apply(&self, src: &dyn ParamSource, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Tensor(w) => mm(x, &w.t()?),
            Weight::Lent(l) => matmul_slice(x, src.lent(l)?, Weight::dims2(l)?, true),
        }
    }

    /// `g · W` for rows `g` `(rows, out)`.
    fn back(&self, src: &dyn ParamSource, g: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Tensor(w) => mm(g, w),
            Weight::Lent(l) => matmul_slice(g, src.lent(l)?, Weight::dims2(l)?, false),
        }
    }

    /// Rows `ids` (u32, 1-D) of the matrix: an embedding's lookup.
    fn rows(&self, src: &dyn ParamSource, ids: &Tensor) -> Result<Tensor> {
        let l = match self {
            Weight::Tensor(w) => return Ok(w.index_select(ids, 0)?),
            Weight::Lent(l) => l,
        };
        let (rows, cols) = Weight::dims2(l)?;
        let w = src.lent(l)?;
        let device = ids.device().clone();
        let ids = ids.to_vec1::<u32>()?;
        let mut out = Vec::with_capacity(ids.len() * cols);
        for &id in &ids {
            let r = usize::try_from(id).unwrap_or(usize::MAX);
            if r >= rows {
                return Err(Error::BadParam {
                    name: format!("loan {}", l.id),
                    reason: format!("row {id} of a matrix of {rows} rows"),
                });
            }
            out.extend_from_slice(&w[r * cols..(r + 1) * cols]);
        }
        Ok(Tensor::from_vec(out, (ids.len(), cols), &device)?)
    }
}

/// Weight `name` for `mode`'s pass and whether it trains: lent where the source lends
/// it in a fused pass, else its tensor as [`param`] hands it out (a trainable one is a
/// variable).
fn weight(src: &mut dyn ParamSource, name: &str, mode: Mode) -> Result<(Weight, bool)> {
    if mode == Mode::Graph {
        let t = param(src, name, mode)?;
        let trains = t.is_variable();
        return Ok((Weight::Tensor(t), trains));
    }
    if let Some(l) = src.lend(name)? {
        let trains = l.trainable;
        return Ok((Weight::Lent(l), trains));
    }
    let (t, trains) = trained(src, name)?;
    Ok((Weight::Tensor(t), trains))
}

/// Parameter `name` detached (see [`param`]), and whether it trains (the source hands
/// trainable parameters out as variables).
fn trained(src: &mut dyn ParamSource, name: &str) -> Result<(Tensor, bool)> {
    let t = src.param(name)?;
    Ok((t.detach(), t.is_variable()))
}

fn put(grads: &mut ParamGrads, name: String, g: Option<Tensor>) -> Result<()> {
    match g {
        Some(g) => add_grad(grads, name, g),
        None => Ok(()),
    }
}

/// Adds `g` to the gradient of `name` (a tied weight gets two).
fn add_grad(grads: &mut ParamGrads, name: String, g: Tensor) -> Result<()> {
    let g = match grads.remove(&name) {
        Some(earlier) => (earlier + g)?,
        None => g,
    };
    grads.insert(name, g);
    Ok(())
}
