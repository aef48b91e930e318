//! Guards against loss masking that leaks: a prompt or padding position
//! ([`IGNORE_TARGET`]) that still adds to the loss, to its divisor, or to the gradient,
//! so a chat fine-tune would learn to write the user's turns or the padding.

use candle_core::{Device, IndexOp, Tensor, Var};
use tidestore_candle::{Llama, IGNORE_TARGET};

const B: usize = 2;
const T: usize = 5;
const V: usize = 7;

fn logits(seed: u32) -> Vec<f32> {
    (0..B * T * V)
        .map(|i| ((((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 250.0) - 2.0)
        .collect()
}

/// Targets with positions 0, 1 of row 0 and 3 of row 1 masked (a prompt, a pad).
fn targets() -> Vec<u32> {
    let mut y: Vec<u32> = (0..B * T).map(|i| (i * 3 % V) as u32).collect();
    for at in [0, 1, T + 3] {
        y[at] = IGNORE_TARGET;
    }
    y
}

/// `-log softmax(row)[target]` in f64.
fn nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    -((row[target as usize] as f64 - max) - sum.ln())
}

fn loss_and_grad(l: &[f32], y: &[u32]) -> (f32, Vec<f32>) {
    let dev = Device::Cpu;
    let var = Var::from_vec(l.to_vec(), (B, T, V), &dev).unwrap();
    let y = Tensor::from_vec(y.to_vec(), (B, T), &dev).unwrap();
    let loss = Llama::loss(var.as_tensor(), &y).unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(var.as_tensor()).unwrap();
    let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (loss.to_scalar::<f32>().unwrap(), g)
}

#[test]
fn the_loss_is_the_mean_over_the_unmasked_positions_only() {
    let l = logits(1);
    let y = targets();
    let kept: Vec<usize> = (0..B * T).filter(|&i| y[i] != IGNORE_TARGET).collect();
    assert_eq!(kept.len(), B * T - 3);
    let want: f64 = kept
        .iter()
        .map(|&i| nll(&l[i * V..(i + 1) * V], y[i]))
        .sum::<f64>()
        / kept.len() as f64;
    let (got, _) = loss_and_grad(&l, &y);
    assert!((f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
}

#[test]
fn masked_positions_change_neither_the_loss_nor_any_gradient() {
    let y = targets();
    let (loss, grad) = loss_and_grad(&logits(1), &y);
    // Other logits at the masked positions (what a different prompt token would give).
    let mut other = logits(1);
    let fresh = logits(99);
    for at in [0, 1, T + 3] {
        other[at * V..(at + 1) * V].copy_from_slice(&fresh[at * V..(at + 1) * V]);
    }
    let (loss2, grad2) = loss_and_grad(&other, &y);
    assert_eq!(loss.to_bits(), loss2.to_bits());
    assert_eq!(grad, grad2);
    for at in [0, 1, T + 3] {
        assert!(
            grad[at * V..(at + 1) * V].iter().all(|&g| g == 0.0),
            "position {at}"
        );
    }
    // Unmasked rows: softmax - onehot, over the count of unmasked positions (8).
    let row = &logits(1)[2 * V..3 * V];
    let max = row.iter().fold(f32::MIN, |m, &x| m.max(x));
    let z: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    for (j, &g) in grad[2 * V..3 * V].iter().enumerate() {
        let p = (row[j] - max).exp() / z;
        let want = (p - if j as u32 == y[2] { 1.0 } else { 0.0 }) / 7.0;
        assert!((g - want).abs() < 1e-6, "{g} vs {want}");
    }
}

#[test]
fn unmasked_targets_give_candle_nn_cross_entropy_and_all_masked_gives_zero() {
    let dev = Device::Cpu;
    let l = Tensor::from_vec(logits(3), (B, T, V), &dev).unwrap();
    let y: Vec<u32> = (0..B * T).map(|i| (i % V) as u32).collect();
    let yt = Tensor::from_vec(y, (B, T), &dev).unwrap();
    let ours = Llama::loss(&l, &yt).unwrap().to_scalar::<f32>().unwrap();
    let reference = candle_nn::loss::cross_entropy(
        &l.reshape((B * T, V)).unwrap(),
        &yt.reshape(B * T).unwrap(),
    )
    .unwrap()
    .to_scalar::<f32>()
    .unwrap();
    assert!((ours - reference).abs() < 1e-6, "{ours} vs {reference}");
    let none = Tensor::full(IGNORE_TARGET, (B, T), &dev).unwrap();
    let var = Var::from_tensor(&l).unwrap();
    let loss = Llama::loss(var.as_tensor(), &none).unwrap();
    assert_eq!(loss.to_scalar::<f32>().unwrap(), 0.0);
    let g = loss.backward().unwrap();
    let g = g.get(var.as_tensor()).unwrap();
    assert_eq!(
        g.i(0)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
}

/// Through a small LLaMA: every parameter's gradient of the masked loss is the gradient
/// of candle_nn's cross-entropy over the unmasked positions alone.
#[test]
fn parameter_gradients_see_the_unmasked_positions_only() {
    use tidestore_candle::{InMemory, LlamaConfig};
    let model = Llama::new(LlamaConfig {
        vocab: 64,
        hidden: 16,
        intermediate: 32,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        tie_embeddings: false,
        lora: None,
    })
    .unwrap();
    let dev = Device::Cpu;
    let init = model.init(3);
    let x = Tensor::from_vec((0..12u32).map(|i| i * 5 % 64).collect(), (2, 6), &dev).unwrap();
    let mut y: Vec<u32> = (0..12u32).map(|i| (i * 11 + 1) % 64).collect();
    let masked = [0usize, 1, 2, 9, 10, 11];
    for &at in &masked {
        y[at] = IGNORE_TARGET;
    }
    let kept: Vec<u32> = (0..12u32)
        .filter(|i| !masked.contains(&(*i as usize)))
        .collect();
    let grads_of = |masked_loss: bool| {
        let mut mem = InMemory::new(&init, &dev).unwrap();
        let logits = model.forward(&mut mem, &x).unwrap();
        let yt = Tensor::from_vec(y.clone(), (2, 6), &dev).unwrap();
        let loss = if masked_loss {
            Llama::loss(&logits, &yt).unwrap()
        } else {
            let idx = Tensor::from_vec(kept.clone(), kept.len(), &dev).unwrap();
            let rows = logits
                .reshape((12, 64))
                .unwrap()
                .index_select(&idx, 0)
                .unwrap();
            let targets = yt.flatten_all().unwrap().index_select(&idx, 0).unwrap();
            candle_nn::loss::cross_entropy(&rows, &targets).unwrap()
        };
        let g = loss.backward().unwrap();
        let per_param: Vec<Vec<f32>> = mem
            .vars()
            .iter()
            .map(|v| {
                g.get(v.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), per_param)
    };
    let (loss, grads) = grads_of(true);
    let (want_loss, want) = grads_of(false);
    assert!((loss - want_loss).abs() < 1e-6, "{loss} vs {want_loss}");
    for (g, w) in grads.iter().zip(&want) {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err <= 1e-5 * scale, "{err} of {scale}");
    }
    assert!(!grads.is_empty());
}
