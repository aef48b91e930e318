//! `EngineCore`: the Rust side of `tidestore.offload`, the engine that trains a whole
//! `torch.nn.Module` out of the store. Every parameter of the model is a tensor of a
//! [`Trainer`] (registered in forward order; 16-bit or fp32 copy, fp32 master, M and V
//! in the store's chunk lists), so the model's weights live where the store puts them —
//! the simulated device, the host pool, the swap file on NVMe — and never all in memory.
//!
//! What the Python layer does with it, per module and iteration:
//! 1. before a module runs, [`EngineCore::acquire`] each of its parameters: the store
//!    accesses it where compute reads it and keeps it there ([`Trainer::lease`]); the
//!    address, length and dtype it returns become a torch tensor over that memory
//!    (no copy: numpy's array interface, then `torch.from_numpy`; on a GPU device tier
//!    the parameter is handed out of the device tier and becomes a CUDA tensor through
//!    the CUDA array interface). Acquiring a parameter
//!    that is already held (a tied weight, a module called twice) counts one more hold;
//! 2. after the module, [`EngineCore::release`]: when the last hold goes, the lease ends
//!    (`HoldAfterFwd` in forward, `HoldAfterBwd` in backward) and the chunk may move
//!    again — the Python layer has dropped every tensor over it before it calls this;
//! 3. a final gradient goes in with [`EngineCore::put_grad`] (widened into its fp32
//!    `Grads` place, or over the bf16 copy in bf16 precision; its norm taken and reported to
//!    the step loop), and with overlap on [`EngineCore::step_ready`] steps the groups
//!    whose gradients are all final while backward goes on;
//! 4. [`EngineCore::step`]: the trainer's step and the end of the store's iteration (the
//!    first is the warm-up trace the schedule of the later ones is learnt from).
//!
//! Memory safety across the boundary: the address handed out stays valid while the
//! lease is held, because a leased tensor's chunk does not move (the store's access
//! contract). The Python layer keeps the engine alive while any tensor over its memory
//! exists, and releases a parameter only after rebinding it to an empty tensor; a
//! parameter still held when its value is written ([`EngineCore::set_values`]) or
//! stepped is refused here, never raced.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tidestore_train::hf::HfWeights;
use tidestore_train::{
    DType, DeviceView, HyperParams, Lease, ParamSpec, ShardLayout, TensorState, TensorView,
    Trainer, TrainerConfig, Values,
};

use crate::adamw::{norm_and_clip, unlink_swap};
use crate::error::{Error, Result};

/// This rank's part of every parameter in a data-parallel run that shards them, laid out
/// as `python/tidestore/_shards.py` lays it out ([`ShardLayout`]: a parameter of `n`
/// elements is cut into `world` shards of `ceil(n / world)`, rank `r` owning shard `r`,
/// the last ones zero-padded).
pub struct Shard {
    /// This rank's place.
    pub layout: ShardLayout,
    /// Each parameter's whole shape, as the files hold it.
    pub shapes: Vec<Vec<usize>>,
}

/// A parameter held for compute: its lease and how many holds it has.
#[derive(Debug)]
struct Held {
    lease: Lease,
    holds: u32,
}

/// Where a held parameter's elements are: address, bytes, element dtype, and whether
/// the address is host memory or a CUDA GPU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// Address of the first element: in this process, or on the GPU `gpu` names.
    pub addr: usize,
    /// Bytes of the parameter.
    pub len: usize,
    /// Element dtype (f32, or bf16 for a trainable parameter in bf16 precision).
    pub dtype: DType,
    /// The CUDA ordinal of the GPU whose memory `addr` is in (unified addressing: one
    /// address space with the host's); `None`: host memory.
    pub gpu: Option<usize>,
}

/// One model's training state in a store (see the module doc).
#[derive(Debug)]
pub struct EngineCore {
    trainer: Trainer,
    /// The GPU the store's device tier is, when it is one: compute reads parameters
    /// there and they are bound as CUDA tensors.
    gpu: Option<usize>,
    held: HashMap<usize, Held>,
    /// Time spent in the store and in the optimizer since open.
    times: Times,
}

/// Where an engine's time went, in nanoseconds since open: what the Python layer
/// subtracts from a step's wall time to get its compute.
#[derive(Debug, Default, Clone, Copy)]
struct Times {
    /// Waiting on the store: parameters made current where compute reads them (loads
    /// from NVMe, moves between tiers), leases ended, gradients written into it.
    store_ns: u64,
    /// The optimizer: tensors stepped during backward and at the step.
    optimizer_ns: u64,
}

/// Runs `f`, adding its wall time to `*ns`.
fn timed<R>(ns: &mut u64, f: impl FnOnce() -> R) -> R {
    let started = std::time::Instant::now();
    let r = f();
    *ns += started.elapsed().as_nanos() as u64;
    r
}

impl EngineCore {
    /// Registers `specs` (forward order; values zero until set or imported) in a store
    /// laid out as `cfg` says. `cfg.swap_dir` is the run's own directory, made here and
    /// unlinked with the swap file in it as soon as the store has the file open (see
    /// [`crate::adamw::unlink_swap`]): no run leaves it behind, however it ends.
    pub fn open(specs: &[ParamSpec], cfg: &TrainerConfig) -> Result<Self> {
        std::fs::create_dir_all(&cfg.swap_dir).map_err(|source| Error::Os {
            path: cfg.swap_dir.display().to_string(),
            source,
        })?;
        let mut trainer = Trainer::open(specs, cfg).inspect_err(|_| {
            // Nothing of the run is left: the store removes what it made.
            let _ = std::fs::remove_dir(&cfg.swap_dir);
        })?;
        unlink_swap(&trainer, Some(&cfg.swap_dir));
        // On a GPU the modules compute there: parameters are handed out of the device
        // tier, never through the host pool.
        let gpu = trainer.device_is_gpu().then_some(cfg.gpu_ordinal);
        trainer.set_compute_on_device(gpu.is_some());
        Ok(EngineCore {
            trainer,
            gpu,
            held: HashMap::new(),
            times: Times::default(),
        })
    }

    /// Parameters registered.
    pub fn len(&self) -> usize {
        self.trainer.len()
    }

    /// Whether no parameter is registered (never: a store needs one).
    pub fn is_empty(&self) -> bool {
        self.trainer.is_empty()
    }

    /// Parameter `i`'s spec.
    pub fn spec(&self, i: usize) -> Result<&ParamSpec> {
        Ok(self.trainer.spec(i)?)
    }

    /// Holds parameter `i` where compute reads it (one more hold if it is held) and
    /// says where its elements are.
    pub fn acquire(&mut self, i: usize) -> Result<Binding> {
        if let Some(h) = self.held.get_mut(&i) {
            h.holds += 1;
        } else {
            let trainer = &mut self.trainer;
            let lease = timed(&mut self.times.store_ns, || trainer.lease(i))?;
            self.held.insert(i, Held { lease, holds: 1 });
        }
        let lease = &self.held[&i].lease;
        let (view, dtype) = self.trainer.lease_view(lease)?;
        // The chunk is current where the view says (the store waited for its copy), so
        // any stream may read it until the lease ends.
        let (addr, len, gpu) = match view {
            TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => {
                (b.as_ptr() as usize, b.len(), None)
            }
            TensorView::Device(DeviceView::Cuda(span)) => {
                let Some(gpu) = self.gpu else {
                    return Err(Error::Protocol(format!(
                        "`{}` was handed out in GPU memory by a store whose device tier is \
                         not a GPU",
                        self.trainer.spec(i)?.name
                    )));
                };
                (span.ptr() as usize, span.len_bytes(), Some(gpu))
            }
        };
        Ok(Binding {
            addr,
            len,
            dtype,
            gpu,
        })
    }

    /// The CUDA ordinal of the GPU the store's device tier is (parameters are bound
    /// there), or `None` where it is the simulation (bound in host memory).
    pub fn gpu(&self) -> Option<usize> {
        self.gpu
    }

    /// Drops one hold of parameter `i`; the last ends its lease (to `HoldAfterBwd` when
    /// `backward`, else `HoldAfterFwd`). Returns the holds left.
    pub fn release(&mut self, i: usize, backward: bool) -> Result<u32> {
        let Some(mut h) = self.held.remove(&i) else {
            return Err(Error::Protocol(format!(
                "`{}` released but not held",
                self.trainer.spec(i)?.name
            )));
        };
        h.holds -= 1;
        if h.holds > 0 {
            let left = h.holds;
            self.held.insert(i, h);
            return Ok(left);
        }
        let lease = h.lease;
        let to = if backward {
            TensorState::HoldAfterBwd
        } else {
            TensorState::HoldAfterFwd
        };
        let trainer = &mut self.trainer;
        timed(&mut self.times.store_ns, || trainer.end_lease(lease, to))?;
        Ok(0)
    }

    /// Parameters held now, by index.
    pub fn held(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.held.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn refuse_held(&self, i: usize, what: &str) -> Result<()> {
        if self.held.contains_key(&i) {
            return Err(Error::Protocol(format!(
                "{what} `{}` while a module holds it",
                self.trainer.spec(i)?.name
            )));
        }
        Ok(())
    }

    /// Writes parameter `i`'s values (fp32, bf16 or fp16 bytes): its master copy (and
    /// 16-bit copy) when trainable, its stored copy when frozen. Untraced.
    pub fn set_values(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<()> {
        self.refuse_held(i, "writing")?;
        let values = widened(src, dtype)?;
        Ok(self.trainer.set_values(i, &values)?)
    }

    /// Parameter `i`'s current values as f32 (the master copy of a trainable one).
    pub fn values(&mut self, i: usize) -> Result<Vec<f32>> {
        Ok(self.trainer.values(i)?)
    }

    /// Imports every registered parameter from the Hugging Face model directory `dir`
    /// (safetensors shards and their index, through memory maps, one tensor at a time:
    /// the files are never all in memory). Everything is checked before anything is
    /// written: each parameter present, with its shape, in a dtype tidestore reads.
    /// `skip` names parameters the files need not hold (adapters the caller initialises).
    /// With `shard`, each parameter is registered as this rank's shard of it and the
    /// files hold it whole (see [`Shard`]). Returns how many tensors were written.
    pub fn import_dir(
        &mut self,
        dir: &Path,
        skip: &[String],
        shard: Option<&Shard>,
    ) -> Result<usize> {
        let wanted: Vec<(usize, String, Vec<usize>)> = (0..self.trainer.len())
            .map(|i| {
                let spec = self.trainer.spec(i)?;
                let shape = match shard {
                    Some(s) => s.shapes.get(i).cloned().ok_or_else(|| {
                        Error::Protocol(format!("no whole shape given for `{}`", spec.name))
                    })?,
                    None => spec.shape.clone(),
                };
                Ok((i, spec.name.clone(), shape))
            })
            .collect::<Result<_>>()?;
        let wanted: Vec<_> = wanted
            .into_iter()
            .filter(|(_, name, _)| !skip.contains(name))
            .collect();
        let expected = wanted
            .iter()
            .map(|(_, n, s)| (n.clone(), s.clone()))
            .collect();
        let weights = HfWeights::open_tensors(dir, expected, None)?;
        for (i, name, _) in &wanted {
            self.refuse_held(*i, "importing")?;
            let values = weights.tensor_f32(name).ok_or_else(|| {
                Error::Protocol(format!("`{name}` checked present, then missing"))
            })?;
            match shard {
                Some(s) => self.trainer.set_values(*i, &s.layout.cut(&values))?,
                None => self.trainer.set_values(*i, &values)?,
            }
            weights.release(name);
        }
        tracing::info!(dir = %dir.display(), tensors = wanted.len(), "tidestore engine: imported");
        Ok(wanted.len())
    }

    /// Writes one micro-batch's part of trainable parameter `i`'s gradient (see
    /// [`Trainer::put_grad`]); the `last` part reports it to the step loop.
    pub fn put_grad(
        &mut self,
        i: usize,
        src: &[u8],
        dtype: DType,
        first: bool,
        last: bool,
    ) -> Result<()> {
        self.refuse_held(i, "the gradient of")?;
        let (trainer, values) = (&mut self.trainer, Values::Bytes { bytes: src, dtype });
        Ok(timed(&mut self.times.store_ns, || {
            trainer.put_grad(i, values, first, last)
        })?)
    }

    /// Whether the caller should keep its gradients to the step and hand them to
    /// [`EngineCore::step_given`]: the step reads them where they are (in place in the
    /// host pool, no 16-bit copy to write: f32 precision) and the host pool holds every
    /// chunk, so what the caller keeps is memory a budget below the training state
    /// would not have (there every gradient goes into the store as it comes, to be
    /// spilled with the rest). Never on a GPU: the gradients are torch's CUDA tensors.
    pub fn reads_given(&self) -> bool {
        self.gpu.is_none()
            && self.trainer.step_loop().reads_given()
            && self.trainer.host_pool_holds_every_chunk()
    }

    /// The step with every parameter's whole gradient given here (elements of its
    /// dtype; `None` for a frozen parameter), read where it is when
    /// [`EngineCore::reads_given`] — no copy into the store — else put as by
    /// [`EngineCore::put_grad`]; as [`EngineCore::step`] otherwise. Refused, with nothing
    /// changed, for a missing or misshapen gradient, or after one was put.
    pub fn step_given(&mut self, grads: &[Option<(&[u8], DType)>]) -> Result<Option<(f64, f64)>> {
        if let Some(&i) = self.held().first() {
            self.refuse_held(i, "the step with")?;
        }
        let values: Vec<Option<Values<'_>>> = grads
            .iter()
            .map(|g| g.map(|(bytes, dtype)| Values::Bytes { bytes, dtype }))
            .collect();
        let trainer = &mut self.trainer;
        let outcome = timed(&mut self.times.optimizer_ns, || {
            trainer.step_given(&values, &mut |_| {})
        })?;
        Ok(norm_and_clip(outcome.decision))
    }

    /// Makes this core one rank of a data-parallel run that steps its shards (see
    /// [`tidestore_train::peers`]).
    pub fn set_norm_peers(&mut self, peers: Box<dyn tidestore_train::NormPeers>) {
        self.trainer.set_norm_peers(peers);
    }

    /// Steps every group whose gradients are all final (overlap); how many tensors.
    pub fn step_ready(&mut self) -> Result<usize> {
        let trainer = &mut self.trainer;
        Ok(timed(&mut self.times.optimizer_ns, || {
            trainer.step_ready(None, &mut |_| {})
        })?)
    }

    /// The step: decided (global norm, clipping), the rest stepped, the store's
    /// iteration ended. Every parameter must be released. Returns the global gradient
    /// norm and the clipping coefficient; `None` when skipped (a non-finite gradient).
    pub fn step(&mut self) -> Result<Option<(f64, f64)>> {
        if let Some(&i) = self.held().first() {
            self.refuse_held(i, "the step with")?;
        }
        let trainer = &mut self.trainer;
        let outcome = timed(&mut self.times.optimizer_ns, || trainer.step(&mut |_| {}))?;
        Ok(norm_and_clip(outcome.decision))
    }

    /// Drops the iteration under way (`what`: why — a backward that raised half way):
    /// the gradients put so far are dropped, nothing is stepped (see
    /// [`Trainer::abandon_iteration`]). Every parameter must be released.
    pub fn abandon_iteration(&mut self, what: &str) -> Result<()> {
        if let Some(&i) = self.held().first() {
            self.refuse_held(i, "dropping the iteration with")?;
        }
        Ok(self.trainer.abandon_iteration(what)?)
    }

    /// Gradients reported in this iteration.
    pub fn reported(&self) -> usize {
        self.trainer.reported()
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

    /// Streams the training state into a tidestore checkpoint at `path`.
    pub fn save(&mut self, path: &Path, metadata: BTreeMap<String, String>) -> Result<()> {
        Ok(self.trainer.save(path, metadata)?)
    }

    /// Loads a checkpoint (verified whole first); returns its metadata.
    pub fn load(&mut self, path: &Path) -> Result<BTreeMap<String, String>> {
        if let Some(&i) = self.held().first() {
            self.refuse_held(i, "loading a checkpoint over")?;
        }
        Ok(self.trainer.load(path)?)
    }

    /// Writes every parameter under its name as safetensors shards of `dtype` (at most
    /// `max_shard_bytes` each, with their index) in `dir`, atomically, streamed one
    /// tensor at a time; `config_json` becomes `config.json`. Returns the files written.
    pub fn export_dir(
        &mut self,
        dir: &Path,
        dtype: DType,
        max_shard_bytes: u64,
        config_json: Option<&str>,
    ) -> Result<Vec<String>> {
        self.check_exportable()?;
        let opts = export_options(dtype, max_shard_bytes);
        Ok(self.trainer.export_tensors(config_json, dir, &opts)?.shards)
    }

    /// Refuses an export while a parameter is held for compute (its bytes may be
    /// changing).
    pub fn check_exportable(&self) -> Result<()> {
        match self.held().first() {
            Some(&i) => self.refuse_held(i, "exporting"),
            None => Ok(()),
        }
    }

    /// Counters of the store and the step loop, and where the engine's time went since
    /// open (`store_ns`, `optimizer_ns`: see [`EngineCore`]'s fields), by name.
    pub fn stats(&self) -> BTreeMap<&'static str, u64> {
        let mut c = self.trainer.counters();
        c.insert("store_ns", self.times.store_ns);
        c.insert("optimizer_ns", self.times.optimizer_ns);
        c
    }
}

/// The options of an export of tensors alone (no files copied along) in `dtype`.
pub fn export_options(dtype: DType, max_shard_bytes: u64) -> tidestore_train::hf::ExportOptions {
    tidestore_train::hf::ExportOptions {
        dtype,
        max_shard_bytes,
        copy_from: None,
    }
}

/// `src` (`dtype` elements, little endian) as f32.
fn widened(src: &[u8], dtype: DType) -> Result<Vec<f32>> {
    let n = match dtype {
        DType::F32 | DType::BF16 | DType::F16 => src.len() / dtype.size_bytes() as usize,
        other => return Err(Error::bad("dtype", format!("{other}: not a float dtype"))),
    };
    let mut out = vec![0f32; n];
    tidestore_train::typed::decode_f32(src, dtype, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidestore_train::{Budget, DeviceChoice, HyperParams};

    fn engine(dir: &Path) -> EngineCore {
        let specs = [
            ParamSpec::new("a", &[4, 8], true),
            ParamSpec::new("b", &[8], false),
        ];
        let mut cfg = TrainerConfig::new(
            HyperParams::adamw(0.1, (0.9, 0.999), 1e-8, 0.0),
            dir.join("run"),
        );
        cfg.device = DeviceChoice::Sim;
        cfg.host_budget = Budget::AllChunks;
        EngineCore::open(&specs, &cfg).unwrap()
    }

    #[test]
    fn a_held_parameter_is_bound_in_place_and_refused_to_writes_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path());
        let vals: Vec<u8> = (0..32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        e.set_values(0, &vals, DType::F32).unwrap();
        let b = e.acquire(0).unwrap();
        // The simulated device: host memory, no GPU to compute on.
        assert_eq!(
            (b.len, b.dtype, b.gpu, e.gpu()),
            (128, DType::F32, None, None)
        );
        // A second hold (a tied weight) binds the same memory.
        assert_eq!(e.acquire(0).unwrap(), b);
        assert!(e.set_values(0, &vals, DType::F32).is_err());
        assert_eq!(e.release(0, false).unwrap(), 1);
        assert!(e.put_grad(0, &vals, DType::F32, true, true).is_err());
        assert_eq!(e.release(0, false).unwrap(), 0);
        assert!(e.release(0, false).is_err(), "released twice");
        e.put_grad(0, &vals, DType::F32, true, true).unwrap();
        e.step().unwrap();
        // lr 0.1, Adam's first step moves every weight by ~lr against its gradient.
        let after = e.values(0).unwrap();
        assert!((after[5] - (5.0 - 0.1)).abs() < 1e-4, "{}", after[5]);
        drop(e);
        assert!(
            !dir.path().join("run").exists(),
            "the run's swap directory is removed"
        );
    }

    #[test]
    fn time_in_the_store_and_the_optimizer_is_counted_where_it_is_spent() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path());
        let times = |e: &EngineCore| (e.stats()["store_ns"], e.stats()["optimizer_ns"]);
        assert_eq!(times(&e), (0, 0));
        e.acquire(0).unwrap();
        e.release(0, false).unwrap();
        let (store, opt) = times(&e);
        assert!(store > 0 && opt == 0, "acquire/release: {store} / {opt}");
        let grad: Vec<u8> = (0..32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        e.put_grad(0, &grad, DType::F32, true, true).unwrap();
        assert!(times(&e).0 > store && times(&e).1 == 0, "put_grad");
        let store = times(&e).0;
        e.step().unwrap();
        assert!(times(&e).0 == store && times(&e).1 > 0, "step");
    }
}
