//! The layer-streamed driver, [`train_step`]: a step's forward and backward passes over
//! [`Blocks`], their parameters fetched or lent block by block and cached for a pass,
//! their gradients put as soon as final, the activations held counted before every
//! block (see the module doc of `blocks`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tidestore_optimizer::StepDecision;

use super::contract::{
    BlockParams, BlockSchedule, Blocks, Loan, MicroBatchOrder, SavedInputs, StepTimes,
    StreamedStep, Upstream,
};
use crate::error::TrainError;

/// `params` with the time of every fetch and gradient put added to `store`, and of the
/// optimizer's steps during backward or forward to `early`.
struct Timed<'a, P: ?Sized> {
    params: &'a mut P,
    store: Duration,
    early: Duration,
}

impl<B: Blocks + ?Sized, P: BlockParams<B> + ?Sized> BlockParams<B> for Timed<'_, P> {
    fn fetch(&mut self, name: &str, backward: bool) -> Result<B::Tensor, B::Error> {
        let started = Instant::now();
        let t = self.params.fetch(name, backward);
        self.store += started.elapsed();
        t
    }

    fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>, B::Error> {
        let started = Instant::now();
        let loan = self.params.lend(name, backward);
        self.store += started.elapsed();
        loan
    }

    fn lent(&self, loan: &Loan) -> Result<&[f32], B::Error> {
        self.params.lent(loan)
    }

    fn end_loans(&mut self) -> Result<(), B::Error> {
        let started = Instant::now();
        let r = self.params.end_loans();
        self.store += started.elapsed();
        r
    }

    fn put_grad(
        &mut self,
        name: &str,
        grad: &B::Tensor,
        first: bool,
        last: bool,
    ) -> Result<(), B::Error> {
        let started = Instant::now();
        let r = self.params.put_grad(name, grad, first, last);
        self.store += started.elapsed();
        r
    }

    fn step_early(&mut self) -> Result<(), B::Error> {
        let started = Instant::now();
        let r = self.params.step_early();
        self.early += started.elapsed();
        r
    }

    fn step_deferred(&mut self, names: &[String]) -> Result<(), B::Error> {
        let started = Instant::now();
        let r = self.params.step_deferred(names);
        self.early += started.elapsed();
        r
    }

    fn hold_activations(&mut self, bytes: u64) -> Result<(), B::Error> {
        self.params.hold_activations(bytes)
    }

    fn step(&mut self) -> Result<StepDecision, B::Error> {
        self.params.step()
    }
}

/// The earliest block each parameter is used in: its gradient is final after that
/// block's backward.
fn first_use<B: Blocks + ?Sized>(model: &B) -> HashMap<String, usize> {
    let mut first = HashMap::new();
    for b in (0..model.block_count()).rev() {
        for name in model.block_params(b) {
            first.insert(name, b);
        }
    }
    first
}

/// One training step of `model` over `batches` (micro-batches of inputs and targets),
/// layer-streamed through `params`, micro-batches and saved inputs as `schedule` says
/// (a [`MicroBatchOrder`] alone keeps the inputs where the blocks compute; see the
/// module doc).
pub fn train_step<B, P>(
    params: &mut P,
    model: &B,
    batches: &[(B::Tensor, B::Tensor)],
    schedule: impl Into<BlockSchedule>,
) -> Result<StreamedStep, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B> + ?Sized,
{
    check_step(model, batches)?;
    let started = Instant::now();
    let first = first_use(model);
    let mut timed = Timed {
        params,
        store: Duration::ZERO,
        early: Duration::ZERO,
    };
    let parts = batches.len();
    let scale = 1.0 / parts as f64;
    let BlockSchedule {
        order,
        saved_inputs: saved,
    } = schedule.into();
    let loss_sum = match order {
        MicroBatchOrder::Vertical => {
            let whole = Part {
                first: true,
                last: true,
                scale,
                saved,
            };
            passes(&mut timed, model, batches, &first, whole)?
        }
        // One micro-batch's passes after another: the same passes over one each, their
        // gradients the step's first part, a middle one or its last.
        MicroBatchOrder::Horizontal => {
            let mut loss_sum = 0.0;
            for (k, batch) in batches.iter().enumerate() {
                let part = Part {
                    first: k == 0,
                    last: k + 1 == parts,
                    scale,
                    saved,
                };
                loss_sum += passes(&mut timed, model, std::slice::from_ref(batch), &first, part)?;
            }
            loss_sum
        }
    };
    let compute_and_store = started.elapsed();
    let step_started = Instant::now();
    let decision = timed.params.step()?;
    Ok(StreamedStep {
        loss: loss_sum / parts as f32,
        decision,
        times: StepTimes {
            compute: compute_and_store.saturating_sub(timed.store + timed.early),
            store: timed.store,
            optimizer: step_started.elapsed() + timed.early,
        },
    })
}

/// Refuses a step without micro-batches or of a model without blocks.
fn check_step<B: Blocks + ?Sized>(
    model: &B,
    batches: &[(B::Tensor, B::Tensor)],
) -> Result<(), B::Error> {
    if batches.is_empty() {
        return Err(TrainError::Config {
            key: "batches",
            reason: "a step needs at least one micro-batch".into(),
        }
        .into());
    }
    if model.block_count() == 0 {
        return Err(TrainError::Protocol("the model has no blocks".into()).into());
    }
    Ok(())
}

/// Which micro-batch of the step, its loss factor, and where saved inputs wait.
#[derive(Debug, Clone, Copy)]
struct Part {
    first: bool,
    last: bool,
    scale: f64,
    saved: SavedInputs,
}

/// A block input kept for backward, and whether it waits in host memory.
struct Saved<T> {
    t: T,
    on_host: bool,
}

/// Per micro-batch, the inputs of the blocks it went through.
type SavedInputsOf<T> = Vec<Vec<Saved<T>>>;

/// What a forward pass leaves for backward: the saved inputs, and what the block
/// before the head kept.
type Forwarded<B> = (
    SavedInputsOf<<B as Blocks>::Tensor>,
    Option<<B as Blocks>::Kept>,
);

/// Gradients of one block's backward: summed into `pending` for parameters an earlier
/// block uses too, put for the others.
fn put_block_grads<B, P>(
    params: &mut P,
    model: &B,
    grads: Vec<(String, B::Tensor)>,
    block: usize,
    first: &HashMap<String, usize>,
    pending: &mut HashMap<String, B::Tensor>,
    part: Part,
) -> Result<(), B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B>,
{
    for (name, g) in grads {
        let g = match pending.remove(&name) {
            Some(earlier) => model.add(&earlier, &g)?,
            None => g,
        };
        if first.get(&name).is_some_and(|&b| b < block) {
            pending.insert(name, g);
            continue;
        }
        params.put_grad(&name, &g, part.first, part.last)?;
    }
    Ok(())
}

/// A block's parameters fetched (or lent) once and handed out again for every
/// micro-batch of the pass (one, in [`MicroBatchOrder::Horizontal`]).
struct BlockCache<'a, B: Blocks + ?Sized, P: ?Sized> {
    params: &'a mut P,
    fetched: Vec<(String, B::Tensor)>,
    lent: Vec<(String, Option<Loan>)>,
}

impl<'a, B: Blocks + ?Sized, P: BlockParams<B> + ?Sized> BlockCache<'a, B, P> {
    fn new(params: &'a mut P) -> Self {
        BlockCache {
            params,
            fetched: Vec::new(),
            lent: Vec::new(),
        }
    }

    /// Ends the block: its loans end whether or not `done` (the block's work) failed;
    /// the first error is returned.
    fn finish<T>(self, done: Result<T, B::Error>) -> Result<T, B::Error> {
        let ended = self.params.end_loans();
        let t = done?;
        ended?;
        Ok(t)
    }
}

impl<B: Blocks + ?Sized, P: BlockParams<B> + ?Sized> BlockParams<B> for BlockCache<'_, B, P> {
    fn fetch(&mut self, name: &str, backward: bool) -> Result<B::Tensor, B::Error> {
        if let Some((_, t)) = self.fetched.iter().find(|(n, _)| n == name) {
            return Ok(t.clone());
        }
        let t = self.params.fetch(name, backward)?;
        self.fetched.push((name.to_string(), t.clone()));
        Ok(t)
    }

    fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>, B::Error> {
        if let Some((_, loan)) = self.lent.iter().find(|(n, _)| n == name) {
            return Ok(loan.clone());
        }
        let loan = self.params.lend(name, backward)?;
        self.lent.push((name.to_string(), loan.clone()));
        Ok(loan)
    }

    fn lent(&self, loan: &Loan) -> Result<&[f32], B::Error> {
        self.params.lent(loan)
    }

    // `end_loans` is the trait's default, which ends none: loans end with the block
    // ([`BlockCache::finish`]), not when a micro-batch asks.

    fn put_grad(
        &mut self,
        name: &str,
        grad: &B::Tensor,
        first: bool,
        last: bool,
    ) -> Result<(), B::Error> {
        self.params.put_grad(name, grad, first, last)
    }

    fn hold_activations(&mut self, bytes: u64) -> Result<(), B::Error> {
        self.params.hold_activations(bytes)
    }

    fn step(&mut self) -> Result<StepDecision, B::Error> {
        self.params.step()
    }
}

/// The forward and backward passes of `batches`, every micro-batch through a block
/// before the next block (see the module doc); each block's gradients, summed over the
/// micro-batches, put as `part` of the step's; returns the sum of their unscaled losses.
fn passes<B, P>(
    params: &mut P,
    model: &B,
    batches: &[(B::Tensor, B::Tensor)],
    first: &HashMap<String, usize>,
    part: Part,
) -> Result<f32, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B>,
{
    let head = model.block_count() - 1;
    let (mut inputs, mut kept) = forward_pass(params, model, batches, part.saved)?;
    let mut pending: HashMap<String, B::Tensor> = HashMap::new();
    let mut upstream: Vec<Option<B::Tensor>> = vec![None; batches.len()];
    let mut loss_sum = 0.0;
    for b in (0..=head).rev() {
        if b == head {
            // The head runs first in backward: its parameters' due steps now.
            params.step_deferred(&model.block_params(b))?;
        }
        let mut cache = BlockCache::<B, P>::new(&mut *params);
        let (ins, ups) = (&mut inputs, &mut upstream);
        let keep = if b + 1 == head { kept.take() } else { None };
        let flowing = Flowing {
            scale: part.scale,
            pending_bytes: pending.values().map(|g| model.tensor_bytes(g)).sum(),
            kept_before: if b == head { kept.as_ref() } else { None },
        };
        let done = block_backward(&mut cache, model, b, batches, (ins, keep), ups, flowing);
        let (sums, loss) = cache.finish(done)?;
        loss_sum += loss;
        put_block_grads(params, model, sums, b, first, &mut pending, part)?;
        params.step_early()?;
    }
    params.hold_activations(0)?;
    if let Some(name) = pending.keys().next() {
        return Err(TrainError::Protocol(format!(
            "the gradient of `{name}` was left pending after the first block"
        ))
        .into());
    }
    Ok(loss_sum)
}

/// The forward pass of [`passes`]: per micro-batch, the input of every block (the
/// checkpoints; where `saved` says, each moved to host memory once its block is done),
/// and what the last block before the head kept of its last micro-batch's activations
/// (its backward comes right after the head's, and needs no recompute then).
fn forward_pass<B, P>(
    params: &mut P,
    model: &B,
    batches: &[(B::Tensor, B::Tensor)],
    saved: SavedInputs,
) -> Result<Forwarded<B>, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B>,
{
    let head = model.block_count() - 1;
    let on_compute = |t: B::Tensor| Saved { t, on_host: false };
    let mut inputs: SavedInputsOf<B::Tensor> = batches
        .iter()
        .map(|(t, _)| vec![on_compute(t.clone())])
        .collect();
    let last = batches.len() - 1;
    let mut kept: Option<B::Kept> = None;
    for b in 0..head {
        params.step_deferred(&model.block_params(b))?;
        let mut cache = BlockCache::<B, P>::new(&mut *params);
        let done = (0..inputs.len()).try_for_each(|k| {
            let held = live_bytes(model, &inputs, &[], None);
            cache.hold_activations(held + model.working_bytes(b, &inputs[k][b].t))?;
            let x = &mut inputs[k];
            let y = if b + 1 == head && k == last {
                let (y, keep) = model.forward_keeping(b, &mut cache, &x[b].t)?;
                kept = keep;
                y
            } else {
                model.forward(b, &mut cache, &x[b].t)?
            };
            if saved == SavedInputs::Host {
                x[b] = Saved {
                    t: model.to_host(&x[b].t)?,
                    on_host: true,
                };
            }
            x.push(on_compute(y));
            Ok(())
        });
        cache.finish(done)?;
    }
    Ok((inputs, kept))
}

/// Tensors by parameter name, in the order the block gave them.
type Named<T> = Vec<(String, T)>;

/// Block `b`'s saved input for one micro-batch, popped from `saved` (this micro-batch's
/// inputs) and brought back where `like` is when it waits in host memory, after telling
/// `cache` what the activations take then: `held` by the driver, and what the block
/// allocates (and the input brought back, where it is).
fn take_saved<B, P>(
    cache: &mut BlockCache<'_, B, P>,
    model: &B,
    b: usize,
    saved: &mut Vec<Saved<B::Tensor>>,
    held: u64,
    like: &B::Tensor,
) -> Result<B::Tensor, B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B> + ?Sized,
{
    let working = saved.last().map_or(0, |x| {
        let back = if x.on_host {
            model.tensor_bytes(&x.t)
        } else {
            0
        };
        model.working_bytes(b, &x.t) + back
    });
    cache.hold_activations(held + working)?;
    let x = saved
        .pop()
        .ok_or_else(|| TrainError::Protocol(format!("block {b}: its saved input is missing")))?;
    if x.on_host {
        model.to_place_of(&x.t, like)
    } else {
        Ok(x.t)
    }
}

/// `grads` added to `sums` by name, new names appended in order.
fn add_to<B: Blocks + ?Sized>(
    model: &B,
    sums: &mut Named<B::Tensor>,
    grads: Named<B::Tensor>,
) -> Result<(), B::Error> {
    for (name, g) in grads {
        match sums.iter_mut().find(|(n, _)| *n == name) {
            Some((_, sum)) => *sum = model.add(sum, &g)?,
            None => sums.push((name, g)),
        }
    }
    Ok(())
}

/// The bytes the driver holds where the blocks compute: the saved `inputs` not waiting
/// in host memory, the `upstream` gradients and what a forward `kept`.
fn live_bytes<B: Blocks + ?Sized>(
    model: &B,
    inputs: &SavedInputsOf<B::Tensor>,
    upstream: &[Option<B::Tensor>],
    kept: Option<&B::Kept>,
) -> u64 {
    let there = inputs.iter().flatten().filter(|s| !s.on_host);
    let saved: u64 = there.map(|s| model.tensor_bytes(&s.t)).sum();
    let flowing: u64 = upstream
        .iter()
        .flatten()
        .map(|g| model.tensor_bytes(g))
        .sum();
    saved + flowing + kept.map_or(0, |k| model.kept_bytes(k))
}

/// What a block's backward is given beside its inputs and upstream gradients: the
/// loss's factor, and for the activations' count the bytes of the tied gradients
/// pending from later blocks and what a forward kept for the block after this one.
struct Flowing<'a, K> {
    scale: f64,
    pending_bytes: u64,
    kept_before: Option<&'a K>,
}

/// Block `b`'s backward for every micro-batch, its parameters from `cache`, from its
/// saved input (popped from `inputs`; the last micro-batch's from what its forward
/// `kept`, where it kept something) and `upstream` (replaced by the gradient of the
/// block's input), the loss times `flowing.scale`: its parameters' gradients summed
/// over the micro-batches in first-seen order, and the sum of the micro-batches' losses
/// (the last block's; 0 for the others). Before each micro-batch it tells `cache` what
/// the activations take.
fn block_backward<B, P>(
    cache: &mut BlockCache<'_, B, P>,
    model: &B,
    b: usize,
    batches: &[(B::Tensor, B::Tensor)],
    (inputs, mut kept): (&mut SavedInputsOf<B::Tensor>, Option<B::Kept>),
    upstream: &mut [Option<B::Tensor>],
    flowing: Flowing<'_, B::Kept>,
) -> Result<(Named<B::Tensor>, f32), B::Error>
where
    B: Blocks + ?Sized,
    P: BlockParams<B> + ?Sized,
{
    let mut sums: Vec<(String, B::Tensor)> = Vec::new();
    let mut loss_sum = 0.0;
    for (k, (_, targets)) in batches.iter().enumerate() {
        // The input about to be popped is alive until its backward is done.
        let kept_now = kept.as_ref().or(flowing.kept_before);
        let held = live_bytes(model, inputs, upstream, kept_now) + flowing.pending_bytes;
        let input = take_saved(cache, model, b, &mut inputs[k], held, targets)?;
        let up = match &upstream[k] {
            None => Upstream::Loss {
                targets,
                scale: flowing.scale,
            },
            Some(g) => Upstream::Grad(g),
        };
        let keep = if k + 1 == batches.len() {
            kept.take()
        } else {
            None
        };
        let grads = match keep {
            Some(kept) => model.backward_kept(b, cache, kept, up)?,
            None => model.backward(b, cache, &input, up)?,
        };
        if b + 1 == model.block_count() {
            loss_sum += grads
                .loss
                .ok_or_else(|| TrainError::Protocol("the last block gave no loss".into()))?;
        }
        add_to(model, &mut sums, grads.params)?;
        upstream[k] = match grads.input {
            Some(g) => Some(g),
            None if b > 0 => {
                return Err(TrainError::Protocol(format!(
                    "block {b}: its output does not depend on its input"
                ))
                .into())
            }
            None => None,
        };
    }
    Ok((sums, loss_sum))
}

#[cfg(test)]
mod tests {
    //! A toy framework: tensors are `Vec<f64>`, block `b < last` computes `y = w_b · x`
    //! (one weight per block, the last hidden block sharing block 0's weight, as a tied
    //! embedding does), the last block the loss `sum((w_h · x - t)^2)`. The counting
    //! params record every fetch and put, to check what each order asks of the store.
    use super::*;
    use crate::blocks::BlockGrads;

    #[derive(Debug)]
    struct Chain {
        blocks: usize,
        /// A block whose forward fails after taking its weight.
        fails: Option<usize>,
        /// Backward passes run from what a forward kept (its input).
        kept: std::cell::Cell<usize>,
    }

    /// The weight of a block: lent where the params lend, else fetched.
    fn take(
        params: &mut dyn BlockParams<Chain>,
        name: &str,
        backward: bool,
    ) -> Result<f64, TrainError> {
        match params.lend(name, backward)? {
            Some(loan) => Ok(f64::from(params.lent(&loan)?[0])),
            None => Ok(params.fetch(name, backward)?[0]),
        }
    }

    fn weight_of(chain: &Chain, b: usize) -> String {
        if b + 2 == chain.blocks {
            "w0".into() // tied to block 0's weight
        } else {
            format!("w{b}")
        }
    }

    impl Blocks for Chain {
        type Tensor = Vec<f64>;
        type Error = TrainError;
        type Kept = Vec<f64>;

        fn block_count(&self) -> usize {
            self.blocks
        }

        fn block_params(&self, block: usize) -> Vec<String> {
            vec![weight_of(self, block)]
        }

        fn forward(
            &self,
            block: usize,
            params: &mut dyn BlockParams<Self>,
            input: &Vec<f64>,
        ) -> Result<Vec<f64>, TrainError> {
            let w = take(params, &weight_of(self, block), false)?;
            if self.fails == Some(block) {
                return Err(TrainError::Protocol(format!("block {block} fails")));
            }
            Ok(input.iter().map(|x| w * x).collect())
        }

        fn backward(
            &self,
            block: usize,
            params: &mut dyn BlockParams<Self>,
            input: &Vec<f64>,
            upstream: Upstream<'_, Vec<f64>>,
        ) -> Result<BlockGrads<Vec<f64>>, TrainError> {
            let name = weight_of(self, block);
            let w = take(params, &name, true)?;
            let (dy, loss) = match upstream {
                Upstream::Loss { targets, scale } => {
                    let d: Vec<f64> = input.iter().zip(targets).map(|(x, t)| w * x - t).collect();
                    let loss = d.iter().map(|e| e * e).sum::<f64>();
                    (
                        d.iter().map(|e| 2.0 * e * scale).collect(),
                        Some(loss as f32),
                    )
                }
                Upstream::Grad(g) => (g.clone(), None),
            };
            let dw = dy.iter().zip(input).map(|(g, x)| g * x).sum::<f64>();
            Ok(BlockGrads {
                input: (block > 0).then(|| dy.iter().map(|g| g * w).collect()),
                params: vec![(name, vec![dw])],
                loss,
            })
        }

        fn forward_keeping(
            &self,
            block: usize,
            params: &mut dyn BlockParams<Self>,
            input: &Vec<f64>,
        ) -> Result<(Vec<f64>, Option<Vec<f64>>), TrainError> {
            Ok((self.forward(block, params, input)?, Some(input.clone())))
        }

        fn backward_kept(
            &self,
            block: usize,
            params: &mut dyn BlockParams<Self>,
            kept: Vec<f64>,
            upstream: Upstream<'_, Vec<f64>>,
        ) -> Result<BlockGrads<Vec<f64>>, TrainError> {
            self.kept.set(self.kept.get() + 1);
            self.backward(block, params, &kept, upstream)
        }

        fn add(&self, a: &Vec<f64>, b: &Vec<f64>) -> Result<Vec<f64>, TrainError> {
            Ok(a.iter().zip(b).map(|(x, y)| x + y).collect())
        }

        fn tensor_bytes(&self, t: &Vec<f64>) -> u64 {
            8 * t.len() as u64
        }

        fn kept_bytes(&self, kept: &Vec<f64>) -> u64 {
            8 * kept.len() as u64
        }

        /// 1000 bytes per block number, counted from 1: told apart from what is held.
        fn working_bytes(&self, block: usize, _input: &Vec<f64>) -> u64 {
            1000 * (block as u64 + 1)
        }
    }

    #[derive(Debug, Default)]
    struct Counting {
        fetches: usize,
        /// Per parameter: the gradient as the store would hold it, and its puts.
        grads: HashMap<String, (f64, usize)>,
        /// Lend instead of being fetched from.
        lends: bool,
        /// The loans not ended yet (their one element each).
        live: Vec<f32>,
        /// Calls to step early.
        early: usize,
        /// Loans made, loans ended, and the most live at once.
        made: usize,
        ended: usize,
        most_live: usize,
        /// What the driver said the activations take, in order.
        held: Vec<u64>,
    }

    /// The value of weight `name`.
    fn value(name: &str) -> f32 {
        0.5 + name[1..].parse::<f32>().unwrap_or(0.0) / 10.0
    }

    impl BlockParams<Chain> for Counting {
        fn fetch(&mut self, name: &str, _backward: bool) -> Result<Vec<f64>, TrainError> {
            self.fetches += 1;
            Ok(vec![f64::from(value(name))])
        }

        fn lend(&mut self, name: &str, backward: bool) -> Result<Option<Loan>, TrainError> {
            if !self.lends {
                return Ok(None);
            }
            self.live.push(value(name));
            self.made += 1;
            self.most_live = self.most_live.max(self.live.len());
            Ok(Some(Loan {
                id: self.live.len() - 1,
                shape: vec![1],
                trainable: backward,
            }))
        }

        fn lent(&self, loan: &Loan) -> Result<&[f32], TrainError> {
            self.live
                .get(loan.id..=loan.id)
                .ok_or_else(|| TrainError::Protocol(format!("loan {} ended", loan.id)))
        }

        fn end_loans(&mut self) -> Result<(), TrainError> {
            self.ended += self.live.len();
            self.live.clear();
            Ok(())
        }

        fn step_early(&mut self) -> Result<(), TrainError> {
            self.early += 1;
            Ok(())
        }

        fn put_grad(
            &mut self,
            name: &str,
            g: &Vec<f64>,
            first: bool,
            _last: bool,
        ) -> Result<(), TrainError> {
            let e = self.grads.entry(name.into()).or_default();
            e.0 = if first { g[0] } else { e.0 + g[0] };
            e.1 += 1;
            Ok(())
        }

        fn hold_activations(&mut self, bytes: u64) -> Result<(), TrainError> {
            self.held.push(bytes);
            Ok(())
        }

        fn step(&mut self) -> Result<StepDecision, TrainError> {
            Ok(StepDecision::Apply {
                state: tidestore_optimizer::StepState::new(1),
                grad_norm: 0.0,
                clip_coef: 1.0,
            })
        }
    }

    fn batches(parts: usize) -> Vec<(Vec<f64>, Vec<f64>)> {
        (0..parts)
            .map(|k| (vec![1.0 + k as f64, -0.5], vec![0.25, k as f64]))
            .collect()
    }

    fn run_with(schedule: impl Into<BlockSchedule>, parts: usize, lends: bool) -> (Counting, f32) {
        let chain = Chain {
            blocks: 5,
            fails: None,
            kept: Default::default(),
        };
        let mut p = Counting {
            lends,
            ..Counting::default()
        };
        let s = train_step(&mut p, &chain, &batches(parts), schedule).unwrap();
        (p, s.loss)
    }

    fn run(order: MicroBatchOrder, parts: usize) -> (Counting, f32) {
        run_with(order, parts, false)
    }

    /// The block before the loss is differentiated once a pass from what its forward
    /// kept (the last micro-batch's; the others recompute): once a step in vertical
    /// order, once a micro-batch in horizontal. Giving another micro-batch's values
    /// would change the losses and gradients both orders share (checked below).
    #[test]
    fn the_block_before_the_loss_backs_from_what_its_forward_kept_once_a_pass() {
        for (order, parts, passes) in [
            (MicroBatchOrder::Vertical, 1, 1),
            (MicroBatchOrder::Vertical, 3, 1),
            (MicroBatchOrder::Horizontal, 3, 3),
        ] {
            let chain = Chain {
                blocks: 5,
                fails: None,
                kept: Default::default(),
            };
            let mut p = Counting::default();
            train_step(&mut p, &chain, &batches(parts), order).unwrap();
            assert_eq!(chain.kept.get(), passes, "{order:?}, {parts} micro-batches");
        }
    }

    /// Lent weights give what fetched ones give, bit for bit; a block's loans are made
    /// once per pass however many micro-batches share them, and end with the block:
    /// never more than the block's one weight live, none left after the step.
    #[test]
    fn lent_weights_give_what_fetched_ones_give_and_end_with_their_block() {
        for order in [MicroBatchOrder::Vertical, MicroBatchOrder::Horizontal] {
            for parts in [1, 3] {
                let (f, lf) = run_with(order, parts, false);
                let (l, ll) = run_with(order, parts, true);
                assert_eq!(lf.to_bits(), ll.to_bits(), "{order:?}, {parts}: loss");
                for (name, (g, _)) in &f.grads {
                    assert_eq!(g.to_bits(), l.grads[name].0.to_bits(), "{name}");
                }
                let passes = if order == MicroBatchOrder::Vertical {
                    1
                } else {
                    parts
                };
                assert_eq!((l.fetches, l.made), (0, 9 * passes), "{order:?}, {parts}");
                assert_eq!((l.ended, l.most_live, l.live.len()), (l.made, 1, 0));
            }
        }
    }

    /// A block that fails still ends its loans: nothing stays held by a failed step.
    #[test]
    fn a_failing_block_ends_its_loans() {
        let chain = Chain {
            blocks: 5,
            fails: Some(2),
            kept: Default::default(),
        };
        let mut p = Counting {
            lends: true,
            ..Counting::default()
        };
        let e = train_step(&mut p, &chain, &batches(2), MicroBatchOrder::Vertical);
        assert!(matches!(e, Err(TrainError::Protocol(_))), "{e:?}");
        assert_eq!((p.made, p.ended, p.live.len()), (3, 3, 0));
    }

    #[test]
    fn vertical_fetches_each_block_once_per_pass_whatever_the_micro_batches() {
        for parts in [1, 4, 8] {
            let (v, _) = run(MicroBatchOrder::Vertical, parts);
            let (h, _) = run(MicroBatchOrder::Horizontal, parts);
            // 4 blocks forward without the head, 5 in backward.
            assert_eq!(v.fetches, 9, "vertical, {parts} micro-batches");
            assert_eq!(h.fetches, 9 * parts, "horizontal, {parts} micro-batches");
            // The optimizer may step early after each block's backward.
            assert_eq!((v.early, h.early), (5, 5 * parts));
            assert!(
                v.grads.values().all(|&(_, puts)| puts == 1),
                "{:?}",
                v.grads
            );
            assert!(
                h.grads.values().all(|&(_, puts)| puts == parts),
                "{:?}",
                h.grads
            );
        }
    }

    #[test]
    fn both_orders_give_the_same_losses_and_gradients() {
        for parts in [1, 3] {
            let (v, lv) = run(MicroBatchOrder::Vertical, parts);
            let (h, lh) = run(MicroBatchOrder::Horizontal, parts);
            assert_eq!(lv, lh);
            for (name, (g, _)) in &h.grads {
                let gv = v.grads[name].0;
                // The tied weight is summed in another order; the others bit for bit.
                if name == "w0" {
                    assert!(
                        (g - gv).abs() <= 1e-12 * g.abs().max(1.0),
                        "{name}: {g} {gv}"
                    );
                } else {
                    assert_eq!(g.to_bits(), gv.to_bits(), "{name}");
                }
            }
        }
    }

    /// Before each block runs for each micro-batch, the driver counts what it holds
    /// (saved inputs, gradients flowing back, what a forward kept, a tied gradient
    /// pending for block 0; every toy tensor 16 bytes, a gradient of one weight 8)
    /// plus the block's working bytes, and 0 once backward is done. Two micro-batches
    /// in vertical order, worked out by hand; in horizontal order each pass holds one
    /// micro-batch's, as vertical order with one does.
    #[test]
    fn the_activations_held_are_counted_before_every_block() {
        let (v, _) = run(MicroBatchOrder::Vertical, 2);
        #[rustfmt::skip]
        let expected = [
            // Forward: two tokens, then each block's outputs pile up.
            32 + 1000, 48 + 1000, 64 + 2000, 80 + 2000,
            96 + 3000, 112 + 3000, 128 + 4000, 144 + 4000,
            // The head: ten inputs and the last block's kept input; then one input
            // popped, one gradient flowing.
            176 + 5000, 176 + 5000,
            // Block 3 backs from the kept input for the last micro-batch.
            176 + 4000, 160 + 4000,
            // w0's gradient (8 bytes) pends from block 3 until block 0.
            136 + 3000, 120 + 3000, 104 + 2000, 88 + 2000,
            // Block 0 gives no input gradient: its micro-batch's flow ends.
            72 + 1000, 40 + 1000,
            0,
        ];
        assert_eq!(v.held, expected);
        let (one, _) = run(MicroBatchOrder::Vertical, 1);
        let (h, _) = run(MicroBatchOrder::Horizontal, 2);
        let peak = |c: &Counting| c.held.iter().copied().max().unwrap();
        assert_eq!(h.held.len(), 2 * one.held.len());
        assert_eq!(peak(&h), peak(&one));
        assert!(peak(&v) > peak(&h));
    }

    /// With the saved inputs in host memory, the compute device holds only the inputs
    /// the next block reads, and an input brought back for its block's backward; the
    /// losses and gradients are those of inputs kept where the blocks compute, bit for
    /// bit. Worked out by hand as above.
    #[test]
    fn saved_inputs_in_host_memory_leave_the_device_the_frontier() {
        let schedule = BlockSchedule {
            order: MicroBatchOrder::Vertical,
            saved_inputs: SavedInputs::Host,
        };
        let (p, loss) = run_with(schedule, 2, false);
        #[rustfmt::skip]
        let expected = [
            // Forward: each micro-batch's input to the block about to run.
            32 + 1000, 32 + 1000, 32 + 2000, 32 + 2000,
            32 + 3000, 32 + 3000, 32 + 4000, 32 + 4000,
            // The head reads the last inputs where they are, beside the kept one.
            48 + 5000, 48 + 5000,
            // Then each input is brought back (16) beside the flowing gradients.
            64 + 4000, 64 + 4000,
            56 + 3000, 56 + 3000, 56 + 2000, 56 + 2000,
            56 + 1000, 40 + 1000,
            0,
        ];
        assert_eq!(p.held, expected);
        let (c, compute_loss) = run(MicroBatchOrder::Vertical, 2);
        assert_eq!(loss.to_bits(), compute_loss.to_bits());
        for (name, (g, _)) in &c.grads {
            assert_eq!(g.to_bits(), p.grads[name].0.to_bits(), "{name}");
        }
    }

    #[test]
    fn a_step_needs_a_micro_batch() {
        let mut p = Counting::default();
        let chain = Chain {
            blocks: 3,
            fails: None,
            kept: Default::default(),
        };
        let e = train_step(&mut p, &chain, &[], MicroBatchOrder::Vertical);
        assert!(
            matches!(e, Err(TrainError::Config { key: "batches", .. })),
            "{e:?}"
        );
    }
}
