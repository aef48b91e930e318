//! The two overlaps of the step with compute (see the module doc): during backward
//! ([`Overlap::Backward`]: queued groups stepped between blocks, or a gradient handed over
//! stepped at once), and in the next forward ([`Overlap::Forward`]: each chunk group's
//! due step made before compute reads it).

use std::time::Instant;

use tidestore_chunk::{ChunkStore, TensorId};
use tidestore_optimizer::{Grads, StepState};

use super::{Applied, Observer, Overlap, StepLoop};
use crate::error::{Result, TrainError};

impl StepLoop {
    /// Tensors queued for an overlapped step.
    pub fn queued(&self) -> usize {
        self.ready.len()
    }

    /// Steps queued tensors ([`Overlap::Backward`]) until `deadline` has passed (all of
    /// them without one); returns how many were stepped. Nothing is stepped while the
    /// gradients so far are not finite (see the module doc).
    pub fn step_ready(
        &mut self,
        store: &mut ChunkStore,
        deadline: Option<Instant>,
        observe: Observer<'_>,
    ) -> Result<usize> {
        self.check_poisoned()?;
        if self.ready.is_empty() || (self.check_finite && !self.grad_sq.is_finite()) {
            return Ok(0);
        }
        let at = self.early_step();
        let mut n = 0;
        while let Some(i) = self.ready.pop_front() {
            if self.entries[i].stepped {
                // Stepped when its gradient was handed over ([`StepLoop::step_given_now`]).
                continue;
            }
            self.step_entry(store, i, at, observe, None)?;
            self.stats.tensors_overlapped += 1;
            n += 1;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
        }
        Ok(n)
    }

    /// The step made before the decision (during backward): step `n + 1`, its state
    /// fixed at the first of them.
    fn early_step(&mut self) -> Applied {
        let state = *self
            .early
            .get_or_insert(StepState::new(self.ctrl.step() + 1));
        Applied { state, hp: self.hp }
    }

    /// Whether a final gradient handed over from the caller's memory can be stepped at
    /// once ([`StepLoop::step_given_now`]): [`Overlap::Backward`], a loop that
    /// [`StepLoop::reads_given`], and every gradient so far finite.
    pub fn steps_given_now(&self) -> bool {
        self.overlap == Overlap::Backward
            && self.reads_given()
            && (!self.check_finite || self.grad_sq.is_finite())
            && self.poisoned.is_none()
    }

    /// `tensor`'s gradient is final, `grad` in the caller's memory with squared norm
    /// `sq_norm` (finite): it is reported as by [`StepLoop::grad_ready`] and the tensor
    /// is stepped now, reading `grad` where it is, so that its `Grads` place is never
    /// written (no copy, no room in the pool, nothing spilled to NVMe) and its step
    /// runs while the caller's next block is still to come. The same arithmetic as a
    /// step after backward. Refused unless [`StepLoop::steps_given_now`].
    pub fn step_given_now(
        &mut self,
        store: &mut ChunkStore,
        tensor: TensorId,
        grad: Grads<'_>,
        sq_norm: f64,
        observe: Observer<'_>,
    ) -> Result<()> {
        self.check_poisoned()?;
        if !self.steps_given_now() || !sq_norm.is_finite() {
            return Err(TrainError::Protocol(format!(
                "{tensor} handed over to be stepped at once, which needs overlap = \
                 \"backward\", the step in place in the host pool and finite gradients"
            )));
        }
        let &i = self.by_tensor.get(&tensor).ok_or_else(|| {
            TrainError::Protocol(format!(
                "a gradient given for {tensor}, which is not stepped"
            ))
        })?;
        if grad.len() != self.entries[i].len {
            return Err(TrainError::Argument {
                tensor: self.entries[i].name.clone(),
                reason: format!(
                    "the gradient handed over: {} elements for a tensor of {}",
                    grad.len(),
                    self.entries[i].len
                ),
            });
        }
        self.grad_ready(tensor, sq_norm)?;
        let at = self.early_step();
        self.step_entry(store, i, at, observe, Some(grad))?;
        self.stats.tensors_overlapped += 1;
        Ok(())
    }

    /// Tensor steps still due from the last decision ([`Overlap::Forward`]).
    pub fn deferred(&self) -> usize {
        self.deferred.map_or(0, |(_, due)| due)
    }

    /// Makes `tensor`'s due step ([`Overlap::Forward`]), before anything reads its
    /// parameters or writes its gradient, with the due steps of every tensor of its group
    /// (whose gradients share its chunk, as their parameters do): a chunk is stepped
    /// whole before compute reads any of it, so it moves to compute once and is not
    /// written again behind compute's copy. Returns whether `tensor`'s step was due
    /// (nothing is for a tensor the loop does not step).
    pub fn step_deferred(
        &mut self,
        store: &mut ChunkStore,
        tensor: TensorId,
        observe: Observer<'_>,
    ) -> Result<bool> {
        let Some(&i) = self.by_tensor.get(&tensor) else {
            return Ok(false);
        };
        if !self.entries[i].due {
            return Ok(false);
        }
        self.check_poisoned()?;
        let members = self.groups[&self.entries[i].group].0.clone();
        for k in members {
            if !self.entries[k].due {
                continue;
            }
            let (at, due) = self.deferred.expect("a due entry has its step");
            self.step_tensor(store, k, at, observe, None)?;
            self.entries[k].due = false;
            self.deferred = (due > 1).then_some((at, due - 1));
            self.stats.tensors_deferred += 1;
        }
        Ok(true)
    }

    /// Makes every due step ([`Overlap::Forward`]), in registration order: before the
    /// optimizer state is read whole (a checkpoint, an export) or the run ends. Returns
    /// how many were made.
    pub fn complete_deferred(
        &mut self,
        store: &mut ChunkStore,
        observe: Observer<'_>,
    ) -> Result<usize> {
        let before = self.stats.tensors_deferred;
        for i in 0..self.entries.len() {
            if self.entries[i].due {
                let tensor = self.entries[i].spec.tensor;
                self.step_deferred(store, tensor, observe)?;
            }
        }
        Ok((self.stats.tensors_deferred - before) as usize)
    }
}
