//! Training samples, and which of them make step `s`'s micro-batch `k`: a function of
//! (seed, s, k) alone, so a resumed run sees the batches an uninterrupted one would.
//!
//! Plain text is one token stream cut into windows of `sequence + 1` tokens, the first
//! `sequence` the input and the last `sequence` the targets, every target trained.
//!
//! JSONL samples (documents, conversations) are **padded**, one sample per row of
//! `sequence` positions, not packed several to a row. Packing would need attention
//! that does not cross sample boundaries (a block-diagonal causal mask) and positions
//! that restart at each sample; the model's attention ([`tidestore_candle::Llama`])
//! has one causal mask per micro-batch and positions `0..sequence` for every row, and
//! the streamed blocks take tokens only. Padding needs neither: a row holds one sample
//! from position 0, its padding after it, so causal attention never lets a sample's
//! token see the padding, and the padded targets are [`IGNORE_TARGET`], which carry no
//! loss and no gradient. What this costs is compute on the padding, which the summary
//! reports ([`DataSummary::padding_tokens`]) beside the tokens that carry loss.
//!
//! A micro-batch's loss is the mean over its own targets that carry loss, and a step's
//! the mean of its micro-batches': a micro-batch with few such targets weighs as much as
//! a full one (transformers since 4.46 divides a step's sum by its total count instead).

use candle_core::{Device, Tensor};
use serde::Serialize;
use tidestore_candle::IGNORE_TARGET;

use crate::bench::splitmix64;
use crate::error::{Error, Result};

/// One sample before padding: its tokens, and for each whether predicting it carries
/// loss (the first token's flag is never used: nothing predicts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Per token: whether it is a trained target.
    pub loss: Vec<bool>,
}

/// What became of the records of a JSONL data file (all zero for plain text but
/// `loss_tokens`, the text's windows' targets).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DataSummary {
    /// `train.data_format`.
    pub format: String,
    /// Records read (lines that are not blank).
    pub records: u64,
    /// Samples trained on.
    pub samples: u64,
    /// Samples longer than `sequence + 1` tokens cut to it (`train.too_long =
    /// "truncate"`).
    pub truncated: u64,
    /// Samples longer than `sequence + 1` tokens left out (`train.too_long = "drop"`).
    pub dropped_too_long: u64,
    /// Samples left out because no token of theirs carries loss (a conversation
    /// without an assistant turn, or one truncated before it).
    pub dropped_no_loss: u64,
    /// Tokens that carry loss, over the samples trained on.
    pub loss_tokens: u64,
    /// Padding positions, over the samples trained on.
    pub padding_tokens: u64,
}

#[derive(Debug, Clone)]
enum Kind {
    /// The tokenized text, cut into windows.
    Windows(Vec<u32>),
    /// `sequence` inputs and targets per row, padded, rows one after another.
    Rows { inputs: Vec<u32>, targets: Vec<u32> },
}

/// The samples and how they are batched.
#[derive(Debug, Clone)]
pub struct Samples {
    kind: Kind,
    sequence: usize,
    micro_batch: usize,
    seed: u64,
    fingerprint: String,
    summary: DataSummary,
}

impl Samples {
    /// Windows of `sequence` tokens of a text, `micro_batch` per micro-batch; an error
    /// naming `what` when the text is shorter than one window.
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
        let summary = DataSummary {
            format: "text".into(),
            loss_tokens: tokens.len() as u64 - 1,
            ..DataSummary::default()
        };
        Ok(Samples {
            fingerprint: super::identity::tokens_fingerprint(&tokens),
            kind: Kind::Windows(tokens),
            sequence,
            micro_batch,
            seed,
            summary,
        })
    }

    /// Padded samples (see the module doc) of `rows`, each at most `sequence + 1`
    /// tokens with at least one trained target; `pad` fills the inputs past a sample's
    /// end. `summary` is completed with the counts of loss and padding tokens.
    pub fn padded(
        rows: &[Row],
        pad: u32,
        sequence: usize,
        micro_batch: usize,
        seed: u64,
        mut summary: DataSummary,
    ) -> Result<Self> {
        let mut inputs = Vec::with_capacity(rows.len() * sequence);
        let mut targets = Vec::with_capacity(rows.len() * sequence);
        for row in rows {
            let n = row.ids.len();
            assert!((2..=sequence + 1).contains(&n) && row.loss.len() == n);
            inputs.extend_from_slice(&row.ids[..n - 1]);
            inputs.resize(inputs.len() + sequence + 1 - n, pad);
            targets.extend((1..n).map(|j| {
                if row.loss[j] {
                    row.ids[j]
                } else {
                    IGNORE_TARGET
                }
            }));
            targets.resize(targets.len() + sequence + 1 - n, IGNORE_TARGET);
            summary.padding_tokens += (sequence + 1 - n) as u64;
        }
        summary.samples = rows.len() as u64;
        summary.loss_tokens = targets.iter().filter(|&&t| t != IGNORE_TARGET).count() as u64;
        assert_eq!(inputs.len(), rows.len() * sequence);
        let both: Vec<u32> = inputs.iter().chain(&targets).copied().collect();
        Ok(Samples {
            fingerprint: super::identity::tokens_fingerprint(&both),
            kind: Kind::Rows { inputs, targets },
            sequence,
            micro_batch,
            seed,
            summary,
        })
    }

    /// The fingerprint of the tokens and targets (part of the run's identity).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// What the data file gave.
    pub fn summary(&self) -> &DataSummary {
        &self.summary
    }

    /// Tokens in the text, or input positions of the padded samples.
    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Windows(tokens) => tokens.len(),
            Kind::Rows { inputs, .. } => inputs.len(),
        }
    }

    /// Whether there are no tokens (never: the constructors refuse that).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Micro-batch `k` of step `step`: inputs and targets, `(micro_batch, sequence)`
    /// u32, and the count of targets that carry loss.
    pub fn batch(&self, step: u64, k: u64, device: &Device) -> Result<((Tensor, Tensor), u64)> {
        let s = self.sequence;
        let mut x = Vec::with_capacity(self.micro_batch * s);
        let mut y = Vec::with_capacity(self.micro_batch * s);
        for i in 0..self.micro_batch as u64 {
            let r = splitmix64(self.seed ^ splitmix64(step, k), i);
            match &self.kind {
                Kind::Windows(tokens) => {
                    let at = (r % (tokens.len() - s) as u64) as usize;
                    x.extend_from_slice(&tokens[at..at + s]);
                    y.extend_from_slice(&tokens[at + 1..at + 1 + s]);
                }
                Kind::Rows { inputs, targets } => {
                    let at = (r % (inputs.len() / s) as u64) as usize * s;
                    x.extend_from_slice(&inputs[at..at + s]);
                    y.extend_from_slice(&targets[at..at + s]);
                }
            }
        }
        let loss_tokens = y.iter().filter(|&&t| t != IGNORE_TARGET).count() as u64;
        let shape = (self.micro_batch, s);
        let t = |v| Tensor::from_vec(v, shape, device).map_err(|e| Error::Finetune(e.to_string()));
        Ok(((t(x)?, t(y)?), loss_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_rows_mask_the_untrained_targets_and_the_padding() {
        let rows = [
            Row {
                ids: vec![10, 11, 12],
                loss: vec![false, false, true],
            },
            Row {
                ids: vec![20, 21, 22, 23, 24],
                loss: vec![false, true, true, true, true],
            },
        ];
        let s = Samples::padded(&rows, 0, 4, 2, 7, DataSummary::default()).unwrap();
        let Kind::Rows { inputs, targets } = &s.kind else {
            panic!("rows")
        };
        let m = IGNORE_TARGET;
        assert_eq!(inputs, &[10, 11, 0, 0, 20, 21, 22, 23]);
        assert_eq!(targets, &[m, 12, m, m, 21, 22, 23, 24]);
        assert_eq!(s.summary().loss_tokens, 5);
        assert_eq!(s.summary().padding_tokens, 2);
        let ((x, y), loss) = s.batch(1, 0, &Device::Cpu).unwrap();
        assert_eq!(x.dims(), [2, 4]);
        let y: Vec<u32> = y.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(loss, y.iter().filter(|&&t| t != m).count() as u64);
    }
}
