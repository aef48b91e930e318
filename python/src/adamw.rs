//! `AdamWCore`: the Rust side of `tidestore.AdamW`. A PyTorch model's parameters are
//! registered in a [`Trainer`] (tidestore's one place where training meets the store):
//! their fp32 master copies, Adam M and V (and an fp32 gradient per parameter, in
//! the layout's `Grads` list) live in the host pool and spill to a swap file on NVMe; the trainer's
//! step loop steps them.
//!
//! What crosses the boundary is bytes: the Python layer hands each tensor's memory as a
//! flat `uint8` buffer with its dtype (see [`crate::buffer`]), so the core works on numpy
//! arrays as on CPU torch tensors and never imports torch. Per step:
//! 1. [`AdamWCore::put_grad`] per parameter: the gradient (fp32, bf16 or fp16) goes to
//!    [`Trainer::put_grad`] (widened into its fp32 `Grads` place, its norm taken, reported
//!    to the step loop). With `overlap`, every group whose gradients are all final is
//!    stepped right away (the Python layer calls this from
//!    `register_post_accumulate_grad_hook`, so it runs while backward goes on).
//! 2. [`AdamWCore::step`]: the trainer's step: decided (global norm, clipping), the
//!    rest stepped in the host pool, M and V loaded from NVMe where the budget put them
//!    and written back behind.
//! 3. [`AdamWCore::read_param`] per parameter: the new master copy, rounded to the
//!    parameter's dtype, written into its memory.
//!
//! Layout: parameter `i` is the trainable tensor `param.i` in the trainer's `f32`
//! precision (master, M, V and an fp32 gradient, chunk `i` of each list holding the
//! same parameters).
//! Every refusal (bad hyper-parameters, an unwritable `nvme_dir`, a budget the store
//! cannot work in, a buffer of the wrong size) is raised before anything is changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tidestore_train::{
    Budget, ChunkError, DType, DeviceChoice, HyperParams, IoConfig, MomentForm, NormPeers, Overlap,
    ParamSpec, Precision, StepDecision, TrainError, Trainer, TrainerConfig, Values,
};

use crate::error::{Error, Result};

/// How an [`AdamWCore`] is made (the Python constructor's arguments); `EngineCore`'s
/// keywords of the same names make its store the same way.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// AdamW hyper-parameters (decoupled weight decay, as `torch.optim.AdamW`).
    pub hp: HyperParams,
    /// How M and V are stored.
    pub moments: MomentForm,
    /// Directory of the swap file.
    pub nvme_dir: PathBuf,
    /// Bytes of the host pool (rounded down to whole chunks); `None`: every chunk (plus
    /// a staging buffer) in RAM, nothing on NVMe but the swap file's header.
    pub host_budget_bytes: Option<u64>,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f32>,
    /// When tensors are stepped: after backward, each group during backward as its
    /// gradients become final, or in the next forward.
    pub overlap: Overlap,
    /// CPU AdamW threads (0: one per core).
    pub threads: usize,
    /// Chunk size in elements (`None`: searched).
    pub chunk_elements: Option<u64>,
    /// Skip a step whose gradients are not all finite (`false`: apply it as torch does,
    /// and take no gradient norms; refused with clipping).
    pub check_finite: bool,
}

/// The optimizer state of one `tidestore.AdamW` (see the module doc).
pub struct AdamWCore {
    trainer: Trainer,
}

/// Unlinks the store's swap file (and then `dir`, the run's own directory) as soon as the
/// store has it open. A store never takes a swap file's bytes from an earlier run as
/// state (checkpoints resume a run), and it reads and writes the file through the
/// descriptor it holds, so nothing needs the name: the space comes back when the
/// process closes the file — when the core is dropped, at exit, or when the process is
/// killed. A failure is logged, and the file then stays behind.
pub(crate) fn unlink_swap(trainer: &Trainer, dir: Option<&Path>) {
    let file = trainer.swap_path();
    let mut unlinked = vec![(file, std::fs::remove_file(file))];
    if let Some(dir) = dir {
        unlinked.push((dir, std::fs::remove_dir(dir)));
    }
    for (gone, res) in unlinked {
        if let Err(e) = res {
            tracing::warn!(path = %gone.display(), error = %e, "tidestore: swap space not unlinked");
        }
    }
}

impl std::fmt::Debug for AdamWCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamWCore")
            .field("trainer", &self.trainer)
            .finish()
    }
}

/// The name of parameter `i` in the store and in checkpoints.
pub fn param_name(i: usize) -> String {
    format!("param.{i}")
}

impl AdamWCore {
    /// Registers parameters of `shapes` (values zero until [`AdamWCore::set_param`]).
    pub fn new(shapes: &[Vec<usize>], cfg: &CoreConfig) -> Result<Self> {
        check_config(shapes, cfg)?;
        let specs: Vec<ParamSpec> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| ParamSpec::new(param_name(i), s, true))
            .collect();
        let trainer = Trainer::open(&specs, &trainer_config(cfg)).map_err(open_error)?;
        unlink_swap(&trainer, None);
        Ok(AdamWCore { trainer })
    }

    /// Registered shape of parameter `i`.
    pub fn shape(&self, i: usize) -> Result<&[usize]> {
        Ok(&self.trainer.spec(i)?.shape)
    }

    /// Number of registered parameters.
    pub fn param_count(&self) -> usize {
        self.trainer.len()
    }

    /// Writes parameter `i`'s values (elements of `dtype`) as its master copy.
    pub fn set_param(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<()> {
        Ok(self.trainer.set_master(i, bytes(src, dtype))?)
    }

    /// Compares parameter `i`'s values with its master copy rounded to `dtype`; when
    /// they differ (the caller changed the parameter outside the optimizer), the values
    /// become the master copy. Returns whether they did.
    pub fn sync_param(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<bool> {
        Ok(self.trainer.sync_master(i, bytes(src, dtype))?)
    }

    /// Where parameter `i`'s master copy stays for the optimizer's life (address and
    /// bytes of its fp32 elements), for the Python layer to make the parameter's own
    /// memory; `None` when the store may move it (a host budget below the state).
    pub fn resident_master(&mut self, i: usize) -> Result<Option<(usize, usize)>> {
        Ok(self
            .trainer
            .resident_master(i)?
            .map(|r| (r.addr, 4 * r.len)))
    }

    /// Writes parameter `i`'s master copy, rounded to `dtype`, into `out`.
    pub fn read_param(&mut self, i: usize, out: &mut [u8], dtype: DType) -> Result<()> {
        Ok(self.trainer.read_master(i, out, dtype)?)
    }

    /// Parameter `i`'s gradient for this step (elements of `dtype`), final. With
    /// overlap, stepped now from where torch holds it when the trainer can
    /// ([`Trainer::step_with_grad`]), else put into the trainer, and ready groups are
    /// stepped now; without, put into the trainer.
    pub fn put_grad(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<()> {
        let grad = bytes(src, dtype);
        if self.trainer.step_with_grad(i, grad)? {
            return Ok(());
        }
        self.trainer.put_grad(i, grad, true, true)?;
        if self.trainer.step_loop().overlap() == Overlap::Backward {
            self.trainer.step_ready(None, &mut |_| {})?;
        }
        Ok(())
    }

    /// The step with every parameter's gradient given here (elements of its dtype, in
    /// parameter order), read where it is when the store steps in place in RAM (no copy
    /// into the store), else put as by [`AdamWCore::put_grad`]; as [`AdamWCore::step`]
    /// otherwise. For `overlap = False` (with overlap the gradients arrive one by one).
    pub fn step_given(&mut self, grads: &[(&[u8], DType)]) -> Result<Option<(f64, f64)>> {
        let values: Vec<Option<Values<'_>>> =
            grads.iter().map(|&(b, d)| Some(bytes(b, d))).collect();
        Ok(norm_and_clip(
            self.trainer.step_given(&values, &mut |_| {})?.decision,
        ))
    }

    /// Makes this core one rank of a data-parallel run that steps its shards: the
    /// step is decided from the norm `peers` sums over the ranks (see
    /// [`tidestore_train::peers`]).
    pub fn set_norm_peers(&mut self, peers: Box<dyn NormPeers>) {
        self.trainer.set_norm_peers(peers);
    }

    /// Gradients given since the last step.
    pub fn reported(&self) -> usize {
        self.trainer.reported()
    }

    /// Ends the step: decides it, steps every parameter not stepped during backward and
    /// ends the store's iteration. Returns the global gradient norm (unclipped) and the
    /// clipping coefficient; `None` when the step was skipped (a non-finite gradient).
    pub fn step(&mut self) -> Result<Option<(f64, f64)>> {
        Ok(norm_and_clip(self.trainer.step(&mut |_| {})?.decision))
    }

    /// Sets the hyper-parameters of the steps to come (the param groups' values).
    pub fn set_hyper_params(&mut self, hp: HyperParams) -> Result<()> {
        Ok(self.trainer.set_hyper_params(hp)?)
    }

    /// The hyper-parameters the next step uses.
    pub fn hyper_params(&self) -> HyperParams {
        *self.trainer.hyper_params()
    }

    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.trainer.step_count()
    }

    /// Parameter `i`'s master copy as f32.
    pub fn master(&mut self, i: usize) -> Result<Vec<f32>> {
        Ok(self.trainer.values(i)?)
    }

    /// Parameter `i`'s Adam moments (M, V) as f32, decoded from their stored form.
    pub fn moments(&mut self, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok(self.trainer.moments(i)?)
    }

    /// Streams every parameter's master, M and V (and the step count and `metadata`)
    /// into a tidestore checkpoint at `path`, one tensor at a time, atomically.
    pub fn save(&mut self, path: &Path, metadata: BTreeMap<String, String>) -> Result<()> {
        Ok(self.trainer.save(path, metadata)?)
    }

    /// The caller's metadata of the checkpoint at `path` (its header only).
    pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
        Ok(Trainer::read_metadata(path)?)
    }

    /// Loads the checkpoint at `path` (verified whole before anything changes) and the
    /// step count it holds; returns its metadata.
    pub fn load(&mut self, path: &Path) -> Result<BTreeMap<String, String>> {
        Ok(self.trainer.load(path)?)
    }

    /// Counters of the store and the step loop, by name.
    pub fn stats(&self) -> BTreeMap<&'static str, u64> {
        self.trainer.counters()
    }
}

fn check_config(shapes: &[Vec<usize>], cfg: &CoreConfig) -> Result<()> {
    if shapes.is_empty() {
        return Err(Error::bad("params", "no parameters to optimize"));
    }
    if let Some((i, s)) = shapes
        .iter()
        .enumerate()
        .find(|(_, s)| s.iter().product::<usize>() == 0)
    {
        return Err(Error::bad(
            param_name(i),
            format!("shape {s:?} has no elements"),
        ));
    }
    check_clip_and_dir(cfg.max_grad_norm, &cfg.nvme_dir)
}

/// Refuses a `max_grad_norm` that is not a positive finite number and an `nvme_dir`
/// that cannot be written (both Python classes take these keywords).
pub(crate) fn check_clip_and_dir(max_grad_norm: Option<f32>, nvme_dir: &Path) -> Result<()> {
    if let Some(n) = max_grad_norm.filter(|n| !(n.is_finite() && *n > 0.0)) {
        return Err(Error::bad(
            "max_grad_norm",
            format!("{n} is not a positive finite number"),
        ));
    }
    tidestore_train::aio::check_writable_dir("nvme_dir", nvme_dir).map_err(|e| Error::Io {
        path: nvme_dir.display().to_string(),
        source: e,
    })?;
    Ok(())
}

/// The trainer's settings: fp32 with an fp32 gradient list, a simulated device of the
/// step's four chunks (unused: the step runs in the host pool), the host pool of
/// `host_budget_bytes` (every chunk when not given), a swap file for the rest, written
/// in the I/O engine's default blocks.
fn trainer_config(cfg: &CoreConfig) -> TrainerConfig {
    TrainerConfig {
        io: IoConfig::default(),
        ..cfg.trainer_config(cfg.nvme_dir.clone())
    }
}

impl CoreConfig {
    /// The trainer's settings that both Python classes derive from their keywords the
    /// same way: fp32, clipping, the finiteness check, overlap, chunk size, a simulated
    /// device of four chunks, the host pool of `host_budget_bytes` (every chunk when not
    /// given), CPU threads and moment form; the swap file in `swap_dir`, the rest
    /// [`TrainerConfig::new`]'s.
    pub(crate) fn trainer_config(&self, swap_dir: PathBuf) -> TrainerConfig {
        TrainerConfig {
            precision: Precision::F32,
            max_grad_norm: self.max_grad_norm,
            overlap: self.overlap,
            chunk_elements: self.chunk_elements,
            check_finite: self.check_finite,
            device_budget: Budget::Chunks(4),
            host_budget: self
                .host_budget_bytes
                .map_or(Budget::AllChunks, Budget::Bytes),
            device: DeviceChoice::Sim,
            optimizer_threads: self.threads,
            moments: self.moments,
            ..TrainerConfig::new(self.hp, swap_dir)
        }
    }
}

/// The trainer's refusals at open, named as the Python constructor's arguments.
fn open_error(e: TrainError) -> Error {
    match e {
        TrainError::Config {
            key: "chunk_elements",
            reason,
        } => Error::bad("chunk_elements", reason),
        TrainError::Config {
            key: "optimizer.check_finite",
            reason,
        } => Error::bad(
            "check_finite",
            format!("{reason} (here: pass max_grad_norm=None or check_finite=True)"),
        ),
        TrainError::Config {
            key: "optimizer.overlap",
            reason,
        } => Error::bad(
            "overlap",
            format!("{reason} (here: pass max_grad_norm=None or overlap=False)"),
        ),
        TrainError::Store(
            e @ (ChunkError::BudgetTooSmall { .. } | ChunkError::ModelTooLarge { .. }),
        ) => Error::bad("host_budget", e.to_string()),
        e => Error::Train(e),
    }
}

/// A Python buffer of `dtype` elements, as the trainer takes values.
fn bytes(bytes: &[u8], dtype: DType) -> Values<'_> {
    Values::Bytes { bytes, dtype }
}

/// What Python gets of a step: the global gradient norm (unclipped) and the clipping
/// coefficient; `None` when the step was skipped (a non-finite gradient).
pub fn norm_and_clip(decision: StepDecision) -> Option<(f64, f64)> {
    match decision {
        StepDecision::Apply {
            grad_norm,
            clip_coef,
            ..
        } => Some((grad_norm, clip_coef)),
        StepDecision::Skip { .. } => None,
    }
}

/// `overlap` as the Python keywords spell it: off, backward or forward.
pub fn parse_overlap(s: &str) -> Result<Overlap> {
    match s {
        "off" => Ok(Overlap::Off),
        "backward" => Ok(Overlap::Backward),
        "forward" => Ok(Overlap::Forward),
        _ => Err(Error::bad(
            "overlap",
            format!("`{s}` is not one of off, backward, forward"),
        )),
    }
}

/// The name [`parse_overlap`] reads.
pub fn overlap_name(o: Overlap) -> &'static str {
    match o {
        Overlap::Off => "off",
        Overlap::Backward => "backward",
        Overlap::Forward => "forward",
    }
}

/// Parses `states` (`fp32`, `bf16`, `int8`; `float32`, `bfloat16`).
pub fn parse_states(s: &str) -> Result<MomentForm> {
    MomentForm::parse(s)
        .ok_or_else(|| Error::bad("states", format!("`{s}` is not one of fp32, bf16, int8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_with_clipping_is_refused_before_the_store_opens() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CoreConfig {
            hp: HyperParams::adamw(1e-3, (0.9, 0.999), 1e-8, 0.0),
            moments: MomentForm::F32,
            nvme_dir: dir.path().to_path_buf(),
            host_budget_bytes: None,
            max_grad_norm: Some(1.0),
            overlap: Overlap::Backward,
            threads: 1,
            chunk_elements: None,
            check_finite: true,
        };
        let e = AdamWCore::new(&[vec![4, 4]], &cfg).unwrap_err();
        assert!(
            matches!(&e, Error::BadInput { what, .. } if what == "overlap"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
