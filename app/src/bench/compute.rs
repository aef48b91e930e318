//! The bench's compute model: with `workload.tflops` set, forward and backward take the
//! time their FLOPs take at that rate on the device's compute stream, so that what the
//! store and the optimizer do meanwhile can overlap it, as on a GPU.
//!
//! FLOPs per use of a tensor in a block, for `T = micro_batch · sequence` tokens:
//! a matrix (2-D, outside the embedding block) costs `2 · elements · T` forward; vectors
//! (norms, biases) and the embedding lookup count as nothing. Each layer adds attention,
//! `2 · micro_batch · sequence² · hidden` forward (causal, after Kaplan et al.), charged
//! to the layer's first tensor. Backward recomputes the block from its checkpoint
//! (1× forward), propagates the input gradient (1×) and, for trainable matrices, forms
//! the weight gradient (1×); attention's backward is 3× its forward.
//!
//! The stream is a timeline: [`ComputeStream::launch`] queues work behind what is queued
//! and returns when it will be done; [`ComputeStream::wait`] blocks until then, keeping
//! the store's transfers moving (its I/O advances only inside its calls). On the
//! simulated device the work is this wait; a CUDA build of the bench models it the same
//! way (the bench runs no matmul anywhere).

use std::time::{Duration, Instant};

use tidestore_chunk::ChunkStore;

use crate::error::Result;
use tidestore::workload::Workload;

/// The FLOPs of every use of a tensor in forward and backward (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct ComputeModel {
    /// FLOP/s of the device; 0: not modeled.
    flops_per_s: f64,
    /// Per block, per position in `Block::tensors`: forward FLOPs.
    forward: Vec<Vec<f64>>,
    /// The same, backward (with recompute).
    backward: Vec<Vec<f64>>,
}

impl ComputeModel {
    /// The model of `workload` at `tflops` (0: compute takes no time).
    pub(crate) fn new(workload: &Workload, tflops: f64) -> Self {
        let tokens = (workload.micro_batch * workload.sequence) as f64;
        let attention = 2.0
            * workload.micro_batch as f64
            * (workload.sequence as f64).powi(2)
            * f64::from(workload.shape.hidden);
        let mut forward = Vec::with_capacity(workload.blocks.len());
        let mut backward = Vec::with_capacity(workload.blocks.len());
        for b in &workload.blocks {
            let embedding = !b.is_layer && b.name == "embed";
            let (mut f, mut bw) = (Vec::new(), Vec::new());
            for (k, &i) in b.tensors.iter().enumerate() {
                let t = &workload.tensors[i];
                let matmul = if t.shape.len() == 2 && !embedding {
                    2.0 * t.shape.iter().product::<usize>() as f64 * tokens
                } else {
                    0.0
                };
                let weight_grad = if t.trainable { matmul } else { 0.0 };
                let attn = if b.is_layer && k == 0 { attention } else { 0.0 };
                f.push(matmul + attn);
                bw.push(2.0 * matmul + weight_grad + 3.0 * attn);
            }
            forward.push(f);
            backward.push(bw);
        }
        ComputeModel {
            flops_per_s: tflops * 1e12,
            forward,
            backward,
        }
    }

    /// Whether compute takes time.
    pub(super) fn is_on(&self) -> bool {
        self.flops_per_s > 0.0
    }

    fn seconds(&self, flops: f64) -> f64 {
        if self.is_on() {
            flops / self.flops_per_s
        } else {
            0.0
        }
    }

    /// Seconds of the forward use of tensor `k` of block `block`.
    pub(super) fn forward_seconds(&self, block: usize, k: usize) -> f64 {
        self.seconds(self.forward[block][k])
    }

    /// Seconds of its backward use.
    pub(super) fn backward_seconds(&self, block: usize, k: usize) -> f64 {
        self.seconds(self.backward[block][k])
    }

    /// Seconds of compute in one iteration (forward and backward).
    pub(crate) fn iteration_seconds(&self) -> f64 {
        self.seconds(flops(&self.forward) + flops(&self.backward))
    }

    /// Forward's share of the iteration's FLOPs (one half when there are none).
    pub(crate) fn forward_fraction(&self) -> f64 {
        let (f, b) = (flops(&self.forward), flops(&self.backward));
        if f + b > 0.0 {
            f / (f + b)
        } else {
            0.5
        }
    }
}

fn flops(per_block: &[Vec<f64>]) -> f64 {
    per_block.iter().flatten().sum()
}

/// The device's compute stream as a timeline (see the module doc).
#[derive(Debug, Default)]
pub(super) struct ComputeStream {
    /// When the work queued so far is done.
    free_at: Option<Instant>,
    /// Time spent in [`ComputeStream::wait`].
    pub(super) waited: Duration,
}

/// Longest sleep between two polls of the store's transfers while waiting.
const POLL_SLICE: Duration = Duration::from_micros(200);
/// The end of a wait is spun (yielding the core), not slept: a sleeping thread wakes up
/// late on a loaded machine, and every late wake-up would delay the next launch, as a
/// GPU's queued work is not delayed. (CUDA's own synchronisation spins too.)
const SPIN: Duration = Duration::from_micros(500);

impl ComputeStream {
    /// Queues `seconds` of work; returns when it will be done.
    pub(super) fn launch(&mut self, seconds: f64) -> Instant {
        let now = Instant::now();
        let start = self.free_at.map_or(now, |t| t.max(now));
        let end = start + Duration::from_secs_f64(seconds.max(0.0));
        self.free_at = Some(end);
        end
    }

    /// Blocks until `until`, polling `store`'s transfers meanwhile.
    pub(super) fn wait(&mut self, until: Instant, store: &mut ChunkStore) -> Result<()> {
        let started = Instant::now();
        loop {
            store.poll_io()?;
            let now = Instant::now();
            if now >= until {
                break;
            }
            let left = until - now;
            if left > SPIN {
                std::thread::sleep((left - SPIN).min(POLL_SLICE));
            } else {
                std::thread::yield_now();
            }
        }
        self.waited += started.elapsed();
        Ok(())
    }
}
