//! Gradients into the step loop, and the step. [`Trainer::grad_written`] is the only
//! way a gradient stored in its place enters the step loop: [`Trainer::put_grad`]
//! writes the values into the gradient's place, takes their squared norm and calls it;
//! a front end that writes its gradients into the store itself (the bench, on the
//! device) calls it with the norm it took. [`Trainer::step_with_grad`] is the one way a
//! gradient enters without a place: stepped at once from the caller's memory.

use std::time::Instant;

use tidestore_chunk::{DType, ListKind, Place, TensorId, TensorState, TensorViewMut};
use tidestore_optimizer::Grads;
use tidestore_tiers::DeviceKind;

use super::values::{f32_view_mut, Values};
use super::{Precision, Trainer};
use crate::error::{Result, TrainError};
use crate::step::{Observer, StepOutcome, StepPlace};

impl Trainer {
    /// Where trainable parameter `i`'s gradient is: its fp32 `Grads` place (`F32`) or
    /// its bf16 copy's (`Bf16`).
    fn grad_place(&self, i: usize) -> (TensorId, ListKind) {
        (self.entries[i].id, self.precision.grad_place().list())
    }

    /// Writes one micro-batch's part of trainable parameter `i`'s gradient: the `first`
    /// part replaces what is there, later ones are added to it (`F32` only: in `Bf16` the
    /// gradient lies over the 16-bit parameters the next micro-batch reads). After the
    /// `last` part the gradient's squared norm is reported ([`Trainer::grad_written`]).
    /// A traced access of the gradient's place in the host pool, released
    /// `HoldAfterBwd`.
    pub fn put_grad(&mut self, i: usize, grad: Values<'_>, first: bool, last: bool) -> Result<()> {
        self.check_values(i, &grad, "gradient")?;
        self.check_grad_part(i, first)?;
        self.step_deferred(i)?;
        let sq = self.write_grad(i, grad, first)?;
        if last {
            self.grad_written(i, sq)?;
        }
        Ok(())
    }

    /// Steps trainable parameter `i` now, its whole and final gradient `grad` read where
    /// the caller holds it, when the step loop can ([`StepLoop::steps_given_now`]: the
    /// step overlapped with backward, in place in the host pool, every gradient so far
    /// finite) and `grad` is finite: its gradient place is then never written (no copy,
    /// no room in the pool, nothing spilled to NVMe) and the gradient counts as
    /// reported. Returns whether it did; `false` changes nothing, and the caller puts
    /// the gradient ([`Trainer::put_grad`]) as before. The same arithmetic as the step
    /// after backward.
    ///
    /// [`StepLoop::steps_given_now`]: crate::StepLoop::steps_given_now
    pub fn step_with_grad(&mut self, i: usize, grad: Values<'_>) -> Result<bool> {
        if !self.step.steps_given_now() {
            // The caller puts it, and `put_grad` checks it.
            return Ok(false);
        }
        self.check_values(i, &grad, "gradient")?;
        self.check_grad_part(i, true)?;
        let Some(g) = grad.as_grads() else {
            return Ok(false);
        };
        let sq = if self.step.needs_norms() {
            self.step.optimizer().cpu().grad_sq_norm(g)
        } else {
            0.0
        };
        if !sq.is_finite() {
            return Ok(false);
        }
        let id = self.entries[i].id;
        self.step
            .step_given_now(&mut self.store, id, g, sq, &mut |_| {})?;
        self.entries[i].reported = true;
        self.reported += 1;
        Ok(true)
    }

    /// Refuses a gradient part for a frozen parameter, an added part outside `F32`, or
    /// one after the gradient was reported final.
    fn check_grad_part(&self, i: usize, first: bool) -> Result<()> {
        let e = self.entry(i)?;
        if !e.spec.trainable {
            return Err(TrainError::Argument {
                tensor: e.spec.name.clone(),
                reason: "frozen: it takes no gradient".into(),
            });
        }
        if !first && self.precision != Precision::F32 {
            return Err(TrainError::Tensor {
                tensor: e.spec.name.clone(),
                reason: "gradients are accumulated only in f32 precision".into(),
            });
        }
        if e.reported {
            return Err(TrainError::Protocol(format!(
                "the gradient of `{}` was already given in this iteration (its last part \
                 came before): a gradient is final once per step",
                e.spec.name
            )));
        }
        Ok(())
    }

    /// Where the step reads trainable parameter `i`'s gradient: the device tier when it
    /// is stepped there, else the host pool.
    fn grad_at(&self, i: usize) -> Place {
        match self.step.place_of(self.entries[i].id) {
            StepPlace::Device => Place::Device,
            StepPlace::Host => Place::Host,
        }
    }

    /// Trainable parameter `i`'s gradient place, accessed where the step reads it (on
    /// the device tier when the step runs there — host bytes on the simulated device, a
    /// device pointer on a GPU — else in the host pool), handed to `f` writable with its
    /// dtype and released `HoldAfterBwd`: for a front end that writes gradients from its
    /// own device memory, so that they never cross the host. `f` writes the `first`
    /// part, or adds a later one (`F32` only, as [`Trainer::put_grad`]); the front end
    /// then reports the final gradient with its squared norm ([`Trainer::grad_written`]).
    /// A traced access of the iteration.
    pub fn grad_view<R>(
        &mut self,
        i: usize,
        first: bool,
        f: impl FnOnce(TensorViewMut<'_>, DType) -> R,
    ) -> Result<R> {
        self.check_grad_part(i, first)?;
        self.step_deferred(i)?;
        let (tensor, list) = self.grad_place(i);
        let g = self.store.access(tensor, list, self.grad_at(i))?;
        let dtype = g.dtype();
        let out = self.store.view_mut(&g).map(|v| f(v, dtype));
        self.store.release(g, TensorState::HoldAfterBwd)?;
        Ok(out?)
    }

    /// Writes (`first`) or adds the gradient into its place; the squared norm of what
    /// the place holds afterwards, taken from the f32 values before any rounding to the
    /// place's dtype.
    fn write_grad(&mut self, i: usize, grad: Values<'_>, first: bool) -> Result<f64> {
        let (tensor, list) = self.grad_place(i);
        let n = grad.elements()?;
        let cpu = self.step.optimizer().cpu();
        // Host values go where the step reads them where that memory is host-addressable
        // (the host pool, the simulated device); on a GPU into the host pool, from where
        // the store takes them up for a step on the device.
        let at = match self.store.device().kind() {
            DeviceKind::Sim => self.grad_at(i),
            DeviceKind::Cuda => Place::Host,
        };
        let g = self.store.access(tensor, list, at)?;
        let written: Result<f64> = if first && g.dtype() == DType::F32 {
            // Widened straight into the fp32 place, its norm taken in the same pass.
            self.store
                .bytes_mut(&g)
                .map_err(TrainError::from)
                .and_then(|b| {
                    let dst = f32_view_mut(b)?;
                    match grad.as_grads() {
                        Some(src) => Ok(cpu.widen_grads(src, dst)?),
                        None => {
                            grad.widen_into(dst);
                            Ok(cpu.grad_sq_norm(Grads::F32(dst)))
                        }
                    }
                })
        } else {
            let mut sum = vec![0.0; n];
            grad.widen_into(&mut sum);
            let earlier = if first {
                Ok(None)
            } else {
                self.store.read_f32(&g).map(Some)
            };
            earlier
                .and_then(|earlier| {
                    if let Some(earlier) = earlier {
                        sum.iter_mut().zip(earlier).for_each(|(s, e)| *s += e);
                    }
                    self.store.write_f32(&g, &sum)
                })
                .map(|()| cpu.grad_sq_norm(Grads::F32(&sum)))
                .map_err(TrainError::from)
        };
        self.store.release(g, TensorState::HoldAfterBwd)?;
        written
    }

    /// Trainable parameter `i`'s gradient is final in the store, with squared L2 norm
    /// `sq_norm`: reported to the step loop (the only way a gradient enters it). Once
    /// per parameter and iteration.
    pub fn grad_written(&mut self, i: usize, sq_norm: f64) -> Result<()> {
        let e = self.entry(i)?;
        if !e.spec.trainable {
            return Err(TrainError::Tensor {
                tensor: e.spec.name.clone(),
                reason: "frozen: it has no gradient to report".into(),
            });
        }
        if e.reported {
            return Err(TrainError::Protocol(format!(
                "the gradient of `{}` reported final twice in one iteration",
                e.spec.name
            )));
        }
        let id = e.id;
        self.step.grad_ready(id, sq_norm)?;
        self.entries[i].reported = true;
        self.reported += 1;
        Ok(())
    }

    /// Whether trainable parameter `i`'s gradient was reported final in this iteration.
    pub fn grad_reported(&self, i: usize) -> Result<bool> {
        Ok(self.entry(i)?.reported)
    }

    /// Steps groups whose gradients are all final (`Overlap::Backward`) until
    /// `deadline` (all of them without one); returns how many tensors were stepped.
    pub fn step_ready(
        &mut self,
        deadline: Option<Instant>,
        observe: Observer<'_>,
    ) -> Result<usize> {
        self.step.step_ready(&mut self.store, deadline, observe)
    }

    /// The optimizer step over every trainable parameter not stepped during backward,
    /// decided from every gradient's norm (clipping, overflow); every trainable
    /// parameter's gradient must have been reported. Does not end the store's iteration
    /// ([`Trainer::end_iteration`]; [`Trainer::step`] does both).
    pub fn finish_step(&mut self, observe: Observer<'_>) -> Result<StepOutcome> {
        self.finish_given(observe, &[])
    }

    /// The whole step with every gradient given here, one per parameter in order
    /// (`None` for a frozen one), instead of [`Trainer::put_grad`]: each one's norm is
    /// taken where it is, and where the step loop can ([`StepLoop::reads_given`]) the
    /// kernel reads it there too, so nothing is copied into the store (`tidestore.AdamW`
    /// hands torch's `.grad` tensors over this way). Otherwise, or for bytes not
    /// aligned for their dtype, a gradient is put into its place as by `put_grad`.
    /// Refused, before anything changes, after a gradient was put in this iteration.
    /// Ends the store's iteration, as [`Trainer::step`].
    ///
    /// [`StepLoop::reads_given`]: crate::StepLoop::reads_given
    pub fn step_given(
        &mut self,
        grads: &[Option<Values<'_>>],
        observe: Observer<'_>,
    ) -> Result<StepOutcome> {
        self.check_given(grads)?;
        let reads = self.step.reads_given();
        let mut given = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            match g.as_grads().filter(|_| reads) {
                Some(view) => given.push((i, view)),
                None => self.put_grad(i, *g, true, true)?,
            }
        }
        let cpu = self.step.optimizer().cpu();
        let needs = self.step.needs_norms();
        let norms: Vec<f64> = given
            .iter()
            .map(|&(_, g)| if needs { cpu.grad_sq_norm(g) } else { 0.0 })
            .collect();
        for (&(i, _), sq) in given.iter().zip(norms) {
            self.grad_written(i, sq)?;
        }
        let given: Vec<_> = given
            .into_iter()
            .map(|(i, g)| (self.entries[i].id, g))
            .collect();
        let outcome = self.finish_given(observe, &given)?;
        self.end_iteration()?;
        Ok(outcome)
    }

    /// `grads` has one gradient per trainable parameter, of its size, none for a frozen
    /// one, and no gradient was put in this iteration.
    fn check_given(&self, grads: &[Option<Values<'_>>]) -> Result<()> {
        if grads.len() != self.entries.len() {
            return Err(TrainError::Protocol(format!(
                "{} gradients given for {} parameters",
                grads.len(),
                self.entries.len()
            )));
        }
        if let Some(e) = self.entries.iter().find(|e| e.reported) {
            return Err(TrainError::Protocol(format!(
                "gradients given to the step after the gradient of `{}` was put",
                e.spec.name
            )));
        }
        for (i, (e, g)) in self.entries.iter().zip(grads).enumerate() {
            match (e.spec.trainable, g) {
                (true, Some(g)) => self.check_values(i, g, "gradient")?,
                (true, None) => {
                    return Err(TrainError::Argument {
                        tensor: e.spec.name.clone(),
                        reason: "no gradient given".into(),
                    })
                }
                (false, Some(_)) => {
                    return Err(TrainError::Argument {
                        tensor: e.spec.name.clone(),
                        reason: "frozen: it takes no gradient".into(),
                    })
                }
                (false, None) => {}
            }
        }
        Ok(())
    }

    /// Drops the iteration under way (`what`: why it cannot be finished — a backward
    /// that raised half way, say): the gradients written and reported so far are
    /// dropped, nothing is stepped, and the next iteration is traced afresh. `Ok` when
    /// training goes on; [`TrainError::Poisoned`] where tensors were already stepped
    /// during backward (the step is half made: load a checkpoint).
    pub fn abandon_iteration(&mut self, what: &str) -> Result<()> {
        match self.abandon(&mut |_| {}, what)? {
            e @ TrainError::Poisoned { .. } => Err(e),
            _ => Ok(()),
        }
    }

    /// Abandons the iteration (see [`Trainer::abandon_iteration`]); returns the error
    /// that says so.
    fn abandon(&mut self, observe: Observer<'_>, what: &str) -> Result<TrainError> {
        let abandoned = self.step.abandon(&mut self.store, observe, what);
        self.clear_reports();
        self.began_with_due = self.step.deferred() > 0;
        self.store.end_iteration_retrace()?;
        Ok(abandoned)
    }

    /// [`Trainer::finish_step`], the gradients of `given` read where they are.
    fn finish_given(
        &mut self,
        observe: Observer<'_>,
        given: &[(TensorId, Grads<'_>)],
    ) -> Result<StepOutcome> {
        if let Some(e) = self
            .entries
            .iter()
            .find(|e| e.spec.trainable && !e.reported)
        {
            // The iteration cannot be finished: dropped (or, half stepped, poisoned),
            // and the next one traced afresh.
            let what = format!(
                "step before the gradient of `{}` was given (a trainable tensor takes a \
                 gradient every step: freeze one that gets none)",
                e.spec.name
            );
            return Err(self.abandon(observe, &what)?);
        }
        let outcome = self.step.finish_given(&mut self.store, observe, given);
        self.clear_reports();
        outcome
    }

    /// No gradient reported: the iteration was stepped or dropped.
    fn clear_reports(&mut self) {
        self.entries.iter_mut().for_each(|e| e.reported = false);
        self.reported = 0;
    }

    /// Ends the store's iteration (the first one is the warm-up trace). An iteration
    /// that began without steps due from the last one and leaves some for the next
    /// (`Overlap::Forward`'s first step), or the other way round, is not what the next
    /// iteration repeats: its trace is dropped and the next one is traced instead.
    pub fn end_iteration(&mut self) -> Result<()> {
        let leaves_due = self.step.deferred() > 0;
        let same_shape = leaves_due == self.began_with_due;
        self.began_with_due = leaves_due;
        if same_shape {
            Ok(self.store.end_iteration()?)
        } else {
            Ok(self.store.end_iteration_retrace()?)
        }
    }

    /// Makes parameter `i`'s step still due from the last decision
    /// (`Overlap::Forward`), if one is; returns whether one was. Every access of the
    /// parameter for compute and of its gradient does it first; a front end may call it
    /// before the block that uses `i` runs, to have the step timed apart from the
    /// block's fetches.
    pub fn step_deferred(&mut self, i: usize) -> Result<bool> {
        if self.step.deferred() == 0 {
            return Ok(false);
        }
        let id = self.entry(i)?.id;
        self.step.step_deferred(&mut self.store, id, &mut |_| {})
    }

    /// Makes every step still due (`Overlap::Forward`); returns how many. Whatever reads
    /// or writes the optimizer state outside forward and backward (values, moments,
    /// master copies, checkpoints, exports) does it first; a front end that ends its run
    /// without any of them calls it, or the last step's updates are not in the store.
    pub fn complete_step(&mut self) -> Result<usize> {
        if self.step.deferred() == 0 {
            return Ok(0);
        }
        self.step.complete_deferred(&mut self.store, &mut |_| {})
    }

    /// [`Trainer::finish_step`] then [`Trainer::end_iteration`].
    pub fn step(&mut self, observe: Observer<'_>) -> Result<StepOutcome> {
        let outcome = self.finish_step(observe)?;
        self.end_iteration()?;
        Ok(outcome)
    }

    /// Zeroes the store's and the step loop's counters.
    pub fn reset_stats(&mut self) {
        self.store.reset_stats();
        self.step.reset_stats();
    }
}
