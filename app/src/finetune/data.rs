//! Training samples: windows of `sequence + 1` tokens of the tokenized text, the first
//! `sequence` the input and the last `sequence` the targets. Which windows make step
//! `s`'s micro-batch `k` is a function of (seed, s, k) alone, so a resumed run sees the
//! batches an uninterrupted one would.

use candle_core::{Device, Tensor};

use crate::bench::splitmix64;
use crate::error::{Error, Result};

/// The tokenized text and how it is cut.
#[derive(Debug, Clone)]
pub struct Samples {
    tokens: Vec<u32>,
    sequence: usize,
    micro_batch: usize,
    seed: u64,
    fingerprint: String,
}

impl Samples {
    /// Samples of `sequence` tokens, `micro_batch` per micro-batch; an error naming
    /// `what` when the text is shorter than one window.
    pub fn new(
        tokens: Vec<u32>,
        sequence: usize,
        micro_batch: usize,
        seed: u64,
        what: &str,
    ) -> Result<Self> {
        if tokens.len() < sequence + 1 {
            return Err(Error::Finetune(format!(
                "{what}: {} tokens, fewer than one sample of train.sequence + 1 = {}",
                tokens.len(),
                sequence + 1
            )));
        }
        Ok(Samples {
            fingerprint: super::identity::tokens_fingerprint(&tokens),
            tokens,
            sequence,
            micro_batch,
            seed,
        })
    }

    /// The fingerprint of the tokens (part of the run's identity).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Tokens in the text.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the text has no tokens (never: [`Samples::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Micro-batch `k` of step `step`: inputs and targets, `(micro_batch, sequence)` u32.
    pub fn batch(&self, step: u64, k: u64, device: &Device) -> Result<(Tensor, Tensor)> {
        let starts = self.tokens.len() - self.sequence;
        let mut x = Vec::with_capacity(self.micro_batch * self.sequence);
        let mut y = Vec::with_capacity(self.micro_batch * self.sequence);
        for i in 0..self.micro_batch as u64 {
            let r = splitmix64(self.seed ^ splitmix64(step, k), i);
            let at = (r % starts as u64) as usize;
            x.extend_from_slice(&self.tokens[at..at + self.sequence]);
            y.extend_from_slice(&self.tokens[at + 1..at + 1 + self.sequence]);
        }
        let shape = (self.micro_batch, self.sequence);
        let t = |v| Tensor::from_vec(v, shape, device).map_err(|e| Error::Finetune(e.to_string()));
        Ok((t(x)?, t(y)?))
    }
}
