//! [`TideParams`]: a candle model's parameters, gradients, fp32 master weights, Adam M
//! and V in a [`tidestore_train::Trainer`] — candle tensors on one side, the trainer on
//! the other. Everything about the store (layout, budgets, the gradient's way into the
//! step loop, the step, checkpoints) is the trainer's; this file only turns its values
//! into candle tensors and candle's gradients into its values.
//!
//! One training iteration with candle's full graph:
//! 1. **Forward.** [`ParamSource::param`] fetches the tensor from the trainer (accessed
//!    where compute reads it and released `HoldAfterFwd`) into a fresh candle tensor.
//!    Trainable tensors become [`Var`]s, so candle tracks their gradients; frozen ones (a
//!    LoRA base) are plain tensors.
//! 2. **Backward.** [`TideParams::backward`] runs candle's backward, then, in reverse
//!    registration order, puts each trainable tensor's gradient into the trainer.
//! 3. **Step.** [`TideParams::step`]: the trainer's step loop.
//!
//! The layer-streamed trainer ([`crate::streamed`]) uses [`TideParams::lend`] (or
//! [`TideParams::fetch`]) and [`TideParams::put_grad_part`] one block at a time instead.
//!
//! Copies made per iteration (the cost of the glue): full-graph forward, per parameter,
//! chunk bytes -> a `Vec<f32>` that candle takes over without copying (plus candle's
//! host -> GPU upload on a CUDA candle device); backward, per trainable parameter,
//! candle's gradient -> a `Vec<f32>` (a GPU -> host download on CUDA) -> the chunk. The
//! layer-streamed trainer on the CPU copies no weight matrix: the store lends it for the
//! block ([`TideParams::lend`]) and the products read it where the store keeps it (the
//! embedding's lookup reads only its rows); small tensors (norms, biases) are still
//! fetched, and each gradient is copied once, from candle's buffer into its chunk. On a
//! GPU it copies parameters from their device chunks into candle's memory and
//! gradients, cast there, into their places ([`TideParams::put_grad_tensor`]): nothing
//! goes through a `Vec`.

use candle_core::{Device, Tensor, Var};
use tidestore_train::{
    DType, DeviceView, HyperParams, Lease, Loan, NvmeTraffic, OverlapStats, Overlapped, Ranks,
    Shard, StepDecision, StoreStats, TensorState, TensorView, TensorViewMut, Trainer, Values,
};

use crate::error::{Error, Result};
use crate::source::{check_params, ParamSource};

pub use tidestore_train::{ParamSpec, Precision, TrainerConfig as TideConfig};

/// A model's parameters and optimizer state in a [`Trainer`]; see the module doc.
pub struct TideParams {
    trainer: Trainer,
    device: Device,
    /// Per parameter: the tensor handed out in this forward pass (full-graph mode).
    live: Vec<Option<Tensor>>,
    /// Gradients of a [`TideParams::backward`] wait for [`TideParams::step`].
    grads_pending: bool,
    /// The running block's loans ([`TideParams::lend`]), each with the state it ends in.
    loans: Vec<(Lease, TensorState)>,
    /// Loans ended so far: a loan's id is this plus its place in `loans`, so an id of an
    /// ended block never names a later block's loan.
    loans_ended: usize,
    /// Whole, final gradients (a reference to candle's buffer each) that
    /// [`TideParams::step_early`] steps from where they are
    /// ([`Trainer::step_with_grad`]) instead of copying them into the store.
    at_once: Vec<(usize, Tensor)>,
    /// This rank's part of a data-parallel run ([`TideParams::open_sharded`]).
    dp: Option<Sharded>,
}

/// A data-parallel rank's view of its parameters: the trainer registers this rank's
/// shard of each (see [`tidestore_train::ranks`]); compute and the front end see them
/// whole.
#[derive(Debug)]
struct Sharded {
    /// The ranks' collectives, the fetches' gathers started ahead and the gradients'
    /// reduce-scatters left behind ([`Ranks::ahead`]).
    collectives: Overlapped<(usize, TensorState)>,
    /// Each parameter as the model declares it, by the trainer's index.
    whole: Vec<ParamSpec>,
}

impl Sharded {
    fn ranks(&self) -> &Ranks {
        self.collectives.ranks()
    }
}

impl std::fmt::Debug for TideParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TideParams")
            .field("trainer", &self.trainer)
            .finish()
    }
}

impl TideParams {
    /// Registers `params` (spec and initial values, in forward order) in a new trainer
    /// and writes their values. Candle tensors are made on `device`. Budgets the store
    /// cannot work in are refused here, with the bytes needed and available.
    pub fn open(
        params: &[(ParamSpec, Vec<f32>)],
        config: &TideConfig,
        device: &Device,
    ) -> Result<Self> {
        check_params(params)?;
        let specs: Vec<ParamSpec> = params.iter().map(|(p, _)| p.clone()).collect();
        let mut this = Self::open_specs(&specs, config, device)?;
        for (i, (_, values)) in params.iter().enumerate() {
            this.trainer.set_values(i, values)?;
        }
        Ok(this)
    }

    /// As [`TideParams::open`], with every parameter zero: the values are then written
    /// one parameter at a time ([`TideParams::set_param`]), so a model larger than
    /// memory is never whole in RAM.
    pub fn open_specs(specs: &[ParamSpec], config: &TideConfig, device: &Device) -> Result<Self> {
        let trainer = Trainer::open(specs, config)?;
        Ok(TideParams {
            live: vec![None; trainer.len()],
            trainer,
            device: device.clone(),
            grads_pending: false,
            loans: Vec::new(),
            loans_ended: 0,
            at_once: Vec::new(),
            dp: None,
        })
    }

    /// As [`TideParams::open_specs`], as rank `ranks.rank()` of a data-parallel run
    /// (Gemini's layout, [`tidestore_train::ranks`]): the trainer registers this rank's
    /// flat, zero-padded shard of every parameter, so its store holds `1/world` of the
    /// parameters, master copies, M and V. Everything else takes and gives parameters
    /// whole:
    /// - a fetch all-gathers the parameter (nothing is lent), with the gathers of the
    ///   next fetches started ahead as the last step's order foresees
    ///   ([`Overlapped`], [`Ranks::with_ahead`]);
    /// - a gradient is reduce-scattered, the ranks' average of it put as this rank's
    ///   shard (some gradients later, and all before the step reads them);
    /// - the step's norm is summed over the ranks (the step loop's
    ///   [`tidestore_train::NormPeers`]), so every rank clips and skips alike;
    /// - [`TideParams::set_param`] cuts this rank's shard of the whole values it is given,
    ///   and [`TideParams::values`], [`TideParams::moments`] and
    ///   [`TideParams::grad_values`] gather them whole.
    ///
    /// Each of those is a collective: every rank calls them in the same order. The
    /// registration is checked alike on every rank first (names, shapes, what trains).
    pub fn open_sharded(
        specs: &[ParamSpec],
        config: &TideConfig,
        device: &Device,
        ranks: Ranks,
    ) -> Result<Self> {
        ranks.check_specs(specs)?;
        let layout = ranks.layout();
        let shards: Vec<ParamSpec> = specs
            .iter()
            .map(|s| ParamSpec::new(s.name.clone(), &[layout.len(s.elements())], s.trainable))
            .collect();
        let mut this = Self::open_specs(&shards, config, device)?;
        this.trainer.set_norm_peers(Box::new(ranks.clone()));
        let depth = ranks.ahead();
        this.dp = Some(Sharded {
            collectives: Overlapped::new(ranks, depth),
            whole: specs.to_vec(),
        });
        Ok(this)
    }

    /// What a data-parallel run's collectives overlapped so far ([`Overlapped`]);
    /// `None` for one rank.
    pub fn overlap_stats(&self) -> Option<OverlapStats> {
        self.dp.as_ref().map(|d| d.collectives.stats())
    }

    /// The ranks of a data-parallel run ([`TideParams::open_sharded`]); `None` for one
    /// rank.
    pub fn ranks(&self) -> Option<&Ranks> {
        self.dp.as_ref().map(Sharded::ranks)
    }

    /// Parameter `i` as the model declares it (whole under data parallelism).
    fn whole_spec(&self, i: usize) -> Result<&ParamSpec> {
        match &self.dp {
            Some(dp) => dp.whole.get(i).ok_or_else(|| Error::BadParam {
                name: format!("#{i}"),
                reason: "no such parameter".into(),
            }),
            None => Ok(self.trainer.spec(i)?),
        }
    }

    /// `shard` (parameter `i`'s, as this rank's trainer holds it) whole: gathered from
    /// every rank under data parallelism, else as it is.
    fn whole(&self, i: usize, shard: Vec<f32>) -> Result<Vec<f32>> {
        match &self.dp {
            Some(dp) => Ok(dp.ranks().gather(shard, self.whole_spec(i)?.elements())?),
            None => Ok(shard),
        }
    }

    /// Puts one micro-batch's part of parameter `i`'s whole gradient: under data
    /// parallelism, this rank's shard of the ranks' average.
    fn put_grad_values(&mut self, i: usize, values: &[f32], first: bool, last: bool) -> Result<()> {
        let spec = self.whole_spec(i)?;
        if values.len() != spec.elements() {
            return Err(Error::BadParam {
                name: spec.name.clone(),
                reason: format!(
                    "a gradient of {} elements for a parameter of {}",
                    values.len(),
                    spec.elements()
                ),
            });
        }
        match &mut self.dp {
            Some(dp) => {
                let mut put = put_shard(&mut self.trainer);
                dp.collectives
                    .scatter(i, values.to_vec(), (first, last), &mut put)?;
            }
            None => self.trainer.put_grad(i, Values::F32(values), first, last)?,
        }
        self.grads_pending = true;
        Ok(())
    }

    /// Puts every gradient still being reduce-scattered into the trainer, in the order
    /// they were given (before the step, or anything else, reads them).
    fn flush_grads(&mut self) -> Result<()> {
        if let Some(dp) = &mut self.dp {
            dp.collectives.flush(&mut put_shard(&mut self.trainer))?;
        }
        Ok(())
    }

    /// Parameter `i`, released to `to`, whole: under data parallelism gathered (ahead
    /// when the last iteration's order foresaw this fetch: [`Overlapped`]); a bf16
    /// copy crosses as its 16 bits.
    fn fetch_whole(&mut self, i: usize, to: TensorState) -> Result<Vec<f32>> {
        let Some(dp) = &mut self.dp else {
            return Ok(self.trainer.fetch(i, to)?);
        };
        let (trainer, whole) = (&mut self.trainer, &dp.whole);
        let mut read = |(j, to): (usize, TensorState)| {
            Ok(Shard {
                values: trainer.fetch(j, to)?,
                n: whole[j].elements(),
                bf16: trainer.compute_dtype(j)? == DType::BF16,
            })
        };
        Ok(dp.collectives.whole((i, to), &mut read)?)
    }

    /// Makes the candle tensors handed out from now on on `device` (where the blocks
    /// compute: the CPU, or candle's CUDA device on the GPU the store's device tier is
    /// on).
    pub fn set_compute_device(&mut self, device: &Device) {
        self.device = device.clone();
        // On a GPU the parameters are then read from the device tier, never the host.
        self.trainer.set_compute_on_device(device.is_cuda());
    }

    /// The device the candle tensors handed out are made on.
    pub fn compute_device(&self) -> &Device {
        &self.device
    }

    /// Writes parameter `name`'s values (untraced; see [`TideParams::open_specs`]).
    /// Under data parallelism `values` are whole and this rank keeps its shard.
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.trainer.index(name)?;
        match &self.dp {
            Some(dp) => {
                let n = self.whole_spec(i)?.elements();
                if values.len() != n {
                    return Err(Error::BadParam {
                        name: name.into(),
                        reason: format!("{} values for a parameter of {n}", values.len()),
                    });
                }
                let shard = dp.ranks().layout().cut(values);
                Ok(self.trainer.set_values(i, &shard)?)
            }
            None => Ok(self.trainer.set_values(i, values)?),
        }
    }

    /// Runs candle's backward from `loss` and puts every trainable parameter's gradient
    /// into the trainer (a parameter the forward did not use gets a zero gradient).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        for i in (0..self.live.len()).rev() {
            let live = self.live[i].take();
            let spec = self.whole_spec(i)?;
            if !spec.trainable {
                continue;
            }
            let values = match live.as_ref().and_then(|t| grads.get(t)) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0.0; spec.elements()],
            };
            self.put_grad_values(i, &values, true, true)?;
        }
        Ok(())
    }

    /// Writes `values` as the final gradient of trainable parameter `name`.
    pub fn put_grad(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.put_grad_part(name, values, true, true)
    }

    /// Writes one micro-batch's part of `name`'s gradient (see
    /// [`Trainer::put_grad`]); after the `last` part the step loop is told.
    pub fn put_grad_part(
        &mut self,
        name: &str,
        values: &[f32],
        first: bool,
        last: bool,
    ) -> Result<()> {
        let i = self.trainer.index(name)?;
        self.put_grad_values(i, values, first, last)
    }

    /// Writes one micro-batch's part of `name`'s gradient from a candle tensor. From a
    /// CUDA device: cast to the place's dtype and its squared norm summed on the GPU, then
    /// copied into the gradient's place where the step reads it ([`Trainer::grad_view`]):
    /// device to device for a step on the device tier (nothing crosses the host), else
    /// straight into the host pool (pinned), half of f32's bytes for a bf16 place. From
    /// the CPU as [`TideParams::put_grad_part`]: a contiguous f32 tensor straight from
    /// candle's buffer, a strided view through one copy.
    pub fn put_grad_tensor(
        &mut self,
        name: &str,
        grad: &Tensor,
        first: bool,
        last: bool,
    ) -> Result<()> {
        if self.dp.is_some() {
            // Reduce-scattered from host memory (see `TideParams::open_sharded`).
            let values = grad.flatten_all()?.to_vec1::<f32>()?;
            return self.put_grad_part(name, &values, first, last);
        }
        if grad.device().is_cuda() {
            let i = self.trainer.index(name)?;
            let sq = self.trainer.grad_view(i, first, |view, dtype| {
                grad_to_view(view, dtype, grad, first)
            })??;
            if last {
                self.trainer.grad_written(i, sq)?;
            }
            self.grads_pending = true;
            return Ok(());
        }
        if first && last && self.trainer.step_loop().steps_given_now() && cpu_f32(grad).is_some() {
            // Stepped from candle's buffer by `step_early`, after the block's other
            // gradients: nothing is copied into the store.
            let i = self.trainer.index(name)?;
            self.at_once.push((i, grad.clone()));
            self.grads_pending = true;
            return Ok(());
        }
        if let Some(values) = cpu_f32(grad) {
            return self.put_grad_part(name, &values, first, last);
        }
        let values = grad.flatten_all()?.to_vec1::<f32>()?;
        self.put_grad_part(name, &values, first, last)
    }

    /// Parameter `name` as a fresh candle tensor (a variable when `as_var` and the
    /// parameter is trainable), fetched from the trainer and released to `to` at once;
    /// nothing is kept (the layer-streamed driver's source). Returns whether it is a
    /// variable.
    pub fn fetch(&mut self, name: &str, as_var: bool, to: TensorState) -> Result<(Tensor, bool)> {
        let i = self.trainer.index(name)?;
        let spec = self.trainer.spec(i)?;
        let var = as_var && spec.trainable;
        let whole = self.whole_spec(i)?;
        let (shape, spec_n) = (whole.shape.clone(), whole.elements());
        if self.dp.is_some() || self.device.is_cpu() {
            // Under data parallelism gathered whole in host memory, then made a tensor
            // where compute runs.
            let values = self.fetch_whole(i, to)?;
            debug_assert_eq!(values.len(), spec_n);
            // `from_vec` takes the vector over: no copy on the CPU.
            let device = &self.device;
            let t = if var {
                Var::from_vec(values, shape.as_slice(), device)?.into_inner()
            } else {
                Tensor::from_vec(values, shape.as_slice(), device)?
            };
            return Ok((t, var));
        }
        let device = &self.device;
        // The stored elements reach the device as they are (bf16: half of f32's bytes)
        // — copied there from the device tier when the parameter is on the GPU, else
        // uploaded from the host pool — and become f32 there.
        let t = self
            .trainer
            .fetch_view(i, to, |view, dtype| {
                to_device(view, dtype, shape.as_slice(), device)
            })??
            .to_dtype(candle_core::DType::F32)?;
        // A variable owns its storage: one copy on the device.
        let t = if var {
            Var::from_tensor(&t)?.into_inner()
        } else {
            t
        };
        Ok((t, var))
    }

    /// Parameter `name` lent for the block about to run: accessed where compute reads it
    /// and held there ([`Trainer::lease`]) until [`TideParams::end_loans`], its f32
    /// elements read in place by [`TideParams::lent`] — the copy into a candle tensor
    /// [`TideParams::fetch`] makes is not made. Lent only where that memory is what
    /// compute reads: candle on the CPU and elements in f32 (not a trainable parameter
    /// in bf16 precision); else `None`. The loan is `trainable` as `fetch` with
    /// `as_var = backward` makes a variable.
    pub fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>> {
        let i = self.trainer.index(name)?;
        let sharded = self.dp.is_some();
        if sharded || !self.device.is_cpu() || self.trainer.compute_dtype(i)? != DType::F32 {
            return Ok(None);
        }
        let spec = self.trainer.spec(i)?;
        let (shape, trainable) = (spec.shape.clone(), backward && spec.trainable);
        let to = if backward {
            TensorState::HoldAfterBwd
        } else {
            TensorState::HoldAfterFwd
        };
        let lease = self.trainer.lease(i)?;
        self.loans.push((lease, to));
        let loan = Loan {
            id: self.loans_ended + self.loans.len() - 1,
            shape,
            trainable,
        };
        // The view's checks (size, dtype, host memory) at once, not at the first read.
        self.lent(&loan)?;
        Ok(Some(loan))
    }

    /// The f32 elements of `loan`, in the store's memory (see [`TideParams::lend`]).
    pub fn lent(&self, loan: &Loan) -> Result<&[f32]> {
        let bad = |reason: &str| Error::BadParam {
            name: format!("loan {}", loan.id),
            reason: reason.into(),
        };
        let (lease, _) = loan
            .id
            .checked_sub(self.loans_ended)
            .and_then(|k| self.loans.get(k))
            .ok_or_else(|| bad("no such loan: its block's loans ended"))?;
        let (view, dtype) = self.trainer.lease_view(lease)?;
        let bytes = match view {
            TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => b,
            TensorView::Device(DeviceView::Cuda(_)) => return Err(bad("lent from GPU memory")),
        };
        if dtype != DType::F32 {
            return Err(bad("lent elements are not f32"));
        }
        bytemuck::try_cast_slice(bytes).map_err(|_| bad("lent elements not aligned for f32"))
    }

    /// Ends every loan (the running block is done): each parameter released to the
    /// state it was lent for; their chunks may move again. Every loan is ended even if
    /// one fails; the first error is returned.
    pub fn end_loans(&mut self) -> Result<()> {
        let mut first = Ok(());
        self.loans_ended += self.loans.len();
        for (lease, to) in self.loans.drain(..) {
            let r = self.trainer.end_lease(lease, to);
            if first.is_ok() {
                first = r;
            }
        }
        Ok(first?)
    }

    /// One AdamW step over every trainable parameter with the gradients put since the
    /// last one, by the trainer's step loop; ends the store's iteration. Returns the
    /// optimizer's decision (clipping coefficient, gradient norm).
    pub fn step(&mut self) -> Result<StepDecision> {
        if !self.grads_pending {
            return Err(Error::BadParam {
                name: String::new(),
                reason: "step() without backward() since the last step".into(),
            });
        }
        if !self.loans.is_empty() {
            return Err(Error::BadParam {
                name: String::new(),
                reason: "step() while a block's parameters are lent (end_loans first)".into(),
            });
        }
        self.step_at_once()?;
        self.flush_grads()?;
        self.grads_pending = false;
        let decision = self.trainer.step(&mut |_| {})?.decision;
        if let Some(dp) = &mut self.dp {
            dp.collectives.end_iteration()?;
        }
        Ok(decision)
    }

    /// Steps the gradients held for it from candle's buffers; one the trainer cannot
    /// step now (a non-finite gradient came first) is put into the store as before.
    fn step_at_once(&mut self) -> Result<()> {
        for (i, grad) in std::mem::take(&mut self.at_once) {
            let values = cpu_f32(&grad).expect("held only when contiguous f32 on the CPU");
            if !self.trainer.step_with_grad(i, Values::F32(&values))? {
                self.trainer.put_grad(i, Values::F32(&values), true, true)?;
            }
        }
        Ok(())
    }

    /// Steps, before backward ends, every parameter group whose gradients are all
    /// final (when the trainer was opened with `Overlap::Backward`; else nothing): the
    /// same step [`TideParams::step`] would make, made while the rest of backward is
    /// still to come, so the step's chunk I/O overlaps backward's compute.
    pub fn step_early(&mut self) -> Result<()> {
        self.step_at_once()?;
        self.flush_grads()?;
        self.trainer.step_ready(None, &mut |_| {})?;
        Ok(())
    }

    /// Makes parameter `name`'s step still due from the last [`TideParams::step`]
    /// (a trainer opened with `Overlap::Forward`; else nothing): every fetch or loan of
    /// the parameter does it first, and the layer-streamed driver calls it before the
    /// block that uses it, so that the step is timed as the optimizer's.
    pub fn step_deferred(&mut self, name: &str) -> Result<()> {
        let i = self.trainer.index(name)?;
        self.trainer.step_deferred(i)?;
        Ok(())
    }

    /// Sets the learning rate of the steps to come (a schedule's).
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        Ok(self.trainer.set_lr(lr)?)
    }

    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.trainer.step_count()
    }

    /// The optimizer's hyper-parameters.
    pub fn hyper_params(&self) -> &HyperParams {
        self.trainer.hyper_params()
    }

    /// The registered parameters, in forward order.
    pub fn specs(&self) -> impl Iterator<Item = &ParamSpec> {
        self.trainer.specs()
    }

    /// The trainer (its store's layout, residency, budgets and counters).
    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// The trainer, for what streams tensors in or out of its store (checkpoints,
    /// exports): between steps, with no forward pass in progress.
    pub fn trainer_mut(&mut self) -> &mut Trainer {
        &mut self.trainer
    }

    /// The store's counters.
    pub fn stats(&self) -> StoreStats {
        self.trainer.stats()
    }

    /// Bytes moved between host and NVMe per list since open (always counted: the
    /// trainer opened its store).
    pub fn nvme_traffic(&self) -> Option<&NvmeTraffic> {
        self.trainer.nvme_traffic()
    }

    /// A parameter's current fp32 values (the master copy of a trainable one); untraced.
    /// Whole, gathered from every rank under data parallelism.
    pub fn values(&mut self, name: &str) -> Result<Vec<f32>> {
        let i = self.trainer.index(name)?;
        let shard = self.trainer.values(i)?;
        self.whole(i, shard)
    }

    /// The first value of parameter `name` (its master copy, as [`TideParams::values`])
    /// that `bad` holds for, with its index in the whole tensor; `None` when there is
    /// none. Under data parallelism each rank reads only its own shard and the ranks
    /// exchange one finding each (every rank gets the same answer), so checking a
    /// model costs no gather of its weights.
    pub fn first_value_where(
        &mut self,
        name: &str,
        bad: impl Fn(f32) -> bool,
    ) -> Result<Option<(usize, f32)>> {
        let i = self.trainer.index(name)?;
        let shard = self.trainer.values(i)?;
        let mine = shard.iter().position(|&v| bad(v)).map(|at| (at, shard[at]));
        let Some(dp) = &self.dp else {
            return Ok(mine);
        };
        // Padding is 0.0: a finding is always inside the tensor's own elements.
        let start = dp
            .ranks()
            .layout()
            .range(self.whole_spec(i)?.elements())
            .start;
        let record = match mine {
            Some((at, v)) => [&((start + at) as u64).to_le_bytes()[..], &v.to_le_bytes()].concat(),
            None => Vec::new(),
        };
        let mut first: Option<(usize, f32)> = None;
        for (r, bytes) in dp.ranks().gather_bytes(&record)?.iter().enumerate() {
            let found = match bytes.len() {
                0 => continue,
                12 => {
                    let (at, v) = bytes.split_at(8);
                    let at = u64::from_le_bytes(at.try_into().unwrap_or_default());
                    (
                        at as usize,
                        f32::from_le_bytes(v.try_into().unwrap_or_default()),
                    )
                }
                n => {
                    return Err(tidestore_train::TrainError::Collective(format!(
                        "rank {r} sent a {n}-byte finding for `{name}` (want 0 or 12)"
                    ))
                    .into())
                }
            };
            if first.is_none_or(|(at, _)| found.0 < at) {
                first = Some(found);
            }
        }
        Ok(first)
    }

    /// The last gradient of trainable parameter `name` (`Precision::F32` only);
    /// untraced.
    pub fn grad_values(&mut self, name: &str) -> Result<Vec<f32>> {
        self.flush_grads()?;
        let i = self.trainer.index(name)?;
        let shard = self.trainer.grad_values(i)?;
        self.whole(i, shard)
    }

    /// A trainable parameter's Adam moments (M, V) as f32, decoded from their stored
    /// form; untraced.
    pub fn moments(&mut self, name: &str) -> Result<(Vec<f32>, Vec<f32>)> {
        let i = self.trainer.index(name)?;
        let (m, v) = self.trainer.moments(i)?;
        Ok((self.whole(i, m)?, self.whole(i, v)?))
    }

    /// Forward/gradient precision.
    pub fn precision(&self) -> Precision {
        self.trainer.precision()
    }

    /// Gradients of a [`TideParams::backward`] wait for [`TideParams::step`].
    pub(crate) fn grads_pending(&self) -> bool {
        self.grads_pending
    }

    /// A forward pass handed out tensors that its backward has not consumed yet.
    pub(crate) fn forward_in_progress(&self) -> bool {
        self.live.iter().any(Option::is_some)
    }
}

impl ParamSource for TideParams {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        let i = self.trainer.index(name)?;
        if let Some(t) = &self.live[i] {
            return Ok(t.clone());
        }
        let (t, _) = self.fetch(name, true, TensorState::HoldAfterFwd)?;
        self.live[i] = Some(t.clone());
        Ok(t)
    }
}

/// Where a data-parallel rank's reduce-scattered gradient shards go: into `trainer`,
/// as [`Trainer::put_grad`] takes them.
fn put_shard(
    trainer: &mut Trainer,
) -> impl FnMut(usize, &[f32], bool, bool) -> tidestore_train::Result<()> + '_ {
    |j, shard, first, last| trainer.put_grad(j, Values::F32(shard), first, last)
}

/// A parameter's stored elements, wherever the trainer read them, as a tensor of
/// `shape` on `device` (in their stored dtype).
fn to_device(
    view: TensorView<'_>,
    dtype: DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    match view {
        TensorView::Host(bytes) | TensorView::Device(DeviceView::Host(bytes)) => {
            upload(bytes, dtype, shape, device)
        }
        #[cfg(feature = "gpu")]
        TensorView::Device(DeviceView::Cuda(span)) => {
            crate::cuda::tensor_from_span(&span, dtype, shape, device)
        }
        #[cfg(not(feature = "gpu"))]
        TensorView::Device(DeviceView::Cuda(_)) => Err(Error::BadParam {
            name: String::new(),
            reason: "a parameter on the GPU, in a build without candle's CUDA backend".into(),
        }),
    }
}

/// A CUDA gradient into its place (see [`TideParams::put_grad_tensor`]); its squared
/// norm.
#[cfg(feature = "gpu")]
fn grad_to_view(view: TensorViewMut<'_>, dtype: DType, grad: &Tensor, first: bool) -> Result<f64> {
    use crate::cuda::GradDst;
    let dst = match view {
        TensorViewMut::Device(tidestore_train::DeviceViewMut::Cuda(span)) => GradDst::Device(span),
        TensorViewMut::Host(bytes)
        | TensorViewMut::Device(tidestore_train::DeviceViewMut::Host(bytes)) => {
            GradDst::Host(bytes)
        }
    };
    crate::cuda::write_grad(dst, dtype, grad, first)
}

/// Without candle's CUDA backend no gradient is on a GPU.
#[cfg(not(feature = "gpu"))]
fn grad_to_view(_: TensorViewMut<'_>, _: DType, _: &Tensor, _: bool) -> Result<f64> {
    Err(Error::BadParam {
        name: String::new(),
        reason: "a gradient on the GPU, in a build without candle's CUDA backend".into(),
    })
}

/// `bytes` (little-endian elements of `dtype`) as a tensor of `shape` on `device`.
fn upload(
    bytes: &[u8],
    dtype: tidestore_train::DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    use tidestore_train::DType as Stored;
    match dtype {
        Stored::F32 => upload_as::<f32>(bytes, shape, device),
        Stored::BF16 => upload_as::<half::bf16>(bytes, shape, device),
        Stored::F16 => upload_as::<half::f16>(bytes, shape, device),
        other => Err(Error::BadParam {
            name: String::new(),
            reason: format!("a parameter stored as {other:?} cannot be computed with"),
        }),
    }
}

/// [`upload`] for one element type: copied to the device straight from the slice when
/// it is aligned for `T`, else through one aligned copy.
fn upload_as<T: bytemuck::Pod + candle_core::WithDType>(
    bytes: &[u8],
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    Ok(match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(v) => Tensor::from_slice(v, shape, device)?,
        Err(_) => {
            let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            Tensor::from_vec(v, shape, device)?
        }
    })
}

/// The elements of a contiguous f32 CPU tensor, in candle's buffer; `None` for any
/// other.
fn cpu_f32(t: &Tensor) -> Option<impl std::ops::Deref<Target = [f32]> + '_> {
    let (storage, layout) = t.storage_and_layout();
    let (from, to) = layout.contiguous_offsets()?;
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    cpu.as_slice::<f32>().ok()?;
    Some(CpuSlice { storage, from, to })
}

/// A range of a CPU tensor's f32 storage, held by its read lock.
struct CpuSlice<'a> {
    storage: candle_core::StorageRef<'a>,
    from: usize,
    to: usize,
}

impl std::ops::Deref for CpuSlice<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &*self.storage {
            candle_core::Storage::Cpu(cpu) => {
                &cpu.as_slice::<f32>().expect("checked f32 when made")[self.from..self.to]
            }
            _ => unreachable!("checked CPU when made"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored elements become the tensor the f32 path makes, from an aligned slice
    /// and from one that is not (the bytes one past an aligned start).
    #[test]
    fn upload_gives_the_stored_values_aligned_or_not() {
        let values: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        for (dtype, bytes) in [
            (
                tidestore_train::DType::BF16,
                values
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
            (
                tidestore_train::DType::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        ] {
            let want: Vec<f32> = match dtype {
                tidestore_train::DType::BF16 => values
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect(),
                _ => values.clone(),
            };
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            for b in [&bytes[..], &shifted[1..]] {
                let t = upload(b, dtype, &[37], &Device::Cpu).unwrap();
                let got = t
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .to_vec1::<f32>();
                assert_eq!(got.unwrap(), want, "{dtype:?}");
            }
        }
        assert!(upload(&[0; 4], tidestore_train::DType::Q8, &[4], &Device::Cpu).is_err());
    }
}
