//! `tidestore._tidestore.EngineCore`: the Python class over [`EngineCore`], and how its
//! store is configured — from a `tidestore.toml` (the facade decides every setting, as
//! for `tidestore finetune`) or from keyword arguments.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tidestore_train::ranks::DEFAULT_AHEAD;
use tidestore_train::{
    Budget, DType, DeviceChoice, HyperParams, Overlap, ParamSpec, Precision, TrainerConfig,
};

use crate::adamw::{check_clip_and_dir, overlap_name, parse_overlap, parse_states, CoreConfig};
use crate::buffer::{held_grad, parse_dtype, with_input};
use crate::engine::{EngineCore, Shard};
use crate::error::{Error, Result};
use crate::f32_bytes;

/// Engines opened by this process, for their swap directories' names.
static OPENED: AtomicU64 = AtomicU64::new(0);

/// The run's own swap directory under `nvme_dir`.
fn own_swap_dir(nvme_dir: &std::path::Path) -> PathBuf {
    let n = OPENED.fetch_add(1, Ordering::Relaxed);
    nvme_dir.join(format!("tidestore-engine-{}-{n}", std::process::id()))
}

/// The store's settings from keyword arguments (no config file).
#[derive(Debug)]
struct Keywords {
    precision: Precision,
    hp: HyperParams,
    states: String,
    nvme_dir: PathBuf,
    host_budget: Option<u64>,
    device_budget: Option<u64>,
    /// The CUDA GPU the modules compute on (the device tier, `device_budget` of it).
    gpu: Option<usize>,
    max_grad_norm: Option<f32>,
    overlap: Overlap,
    threads: usize,
    chunk_elements: Option<u64>,
}

impl Keywords {
    /// The checks and settings [`CoreConfig`] shares with `tidestore.AdamW`, then this
    /// engine's precision and device budget; the swap file in a directory of its own.
    fn trainer_config(self) -> Result<TrainerConfig> {
        check_clip_and_dir(self.max_grad_norm, &self.nvme_dir)?;
        let store = CoreConfig {
            hp: self.hp,
            moments: parse_states(&self.states)?,
            host_budget_bytes: self.host_budget,
            max_grad_norm: self.max_grad_norm,
            overlap: self.overlap,
            threads: self.threads,
            chunk_elements: self.chunk_elements,
            check_finite: true,
            nvme_dir: self.nvme_dir,
        };
        // A GPU asked for is the device tier (where one can be opened: the caller
        // checks that it was). Else a device budget asks for the simulated device
        // standing in for a GPU (modules bound in its memory, the GPU's traffic
        // exercised); without one nothing is placed there: modules are bound in the host
        // pool, where the step writes, with no copy between two kinds of host memory (and
        // no device working set to fit), and no GPU is opened even where there is one.
        let device = match (self.gpu, self.device_budget) {
            (Some(_), _) => DeviceChoice::Auto,
            (None, Some(_)) => DeviceChoice::Sim,
            (None, None) => DeviceChoice::Cpu,
        };
        Ok(TrainerConfig {
            precision: self.precision,
            device_budget: self.device_budget.map_or(Budget::Chunks(4), Budget::Bytes),
            device,
            gpu_ordinal: self.gpu.unwrap_or(0),
            ..store.trainer_config(own_swap_dir(&store.nvme_dir))
        })
    }
}

fn parse_precision(s: &str) -> Result<Precision> {
    match s {
        "f32" | "fp32" | "float32" => Ok(Precision::F32),
        "bf16" | "bfloat16" => Ok(Precision::Bf16),
        _ => Err(Error::bad(
            "precision",
            format!("`{s}` is not one of f32, bf16"),
        )),
    }
}

/// The store's settings from a `tidestore.toml` (validated, its errors naming the key,
/// line and column); the swap directory under its `nvme.dir`. `local_gpu`: the CUDA
/// device of this process's rank (torch's current one under a process group), which
/// `device.ordinal = "auto"` resolves to.
/// `cpu_only` (a model that computes on the CPU whatever the machine has: under a
/// process group): `device.kind = "auto"` opens no GPU, and `"cuda"` is refused.
/// Also returns its `train.collectives_ahead`.
fn config_file(
    path: &std::path::Path,
    local_gpu: Option<usize>,
    cpu_only: bool,
) -> Result<(TrainerConfig, usize)> {
    use tidestore::config::DeviceKindName;
    let mut cfg = tidestore::config::Config::load(path)?;
    let gpu = cfg.device.ordinal.resolve(local_gpu);
    cfg.device.ordinal = tidestore::config::GpuOrdinal::Index(gpu);
    let swap = own_swap_dir(cfg.nvme_dir()?);
    let ahead = cfg.train.collectives_ahead as usize;
    let mut tc = cfg.trainer_config(swap)?;
    if cpu_only {
        match cfg.device.kind {
            DeviceKindName::Sim => {}
            DeviceKindName::Auto => tc.device = DeviceChoice::Cpu,
            DeviceKindName::Cuda => {
                return Err(Error::bad(
                    "device.kind",
                    "\"cuda\": under a process group the model computes on the CPU in this \
                     version (use \"auto\" or \"sim\")",
                ))
            }
        }
    }
    Ok((tc, ahead))
}

/// `tidestore._tidestore.EngineCore`: see [`crate::engine`].
#[pyclass(name = "EngineCore", module = "tidestore._tidestore")]
pub struct PyEngineCore {
    /// A mutex only so the class is `Sync`; every method has `&mut self` and reaches it
    /// with `get_mut`, no locking.
    core: Mutex<EngineCore>,
    precision: Precision,
    /// When tensors are stepped (the keyword's, or the config file's).
    overlap: Overlap,
    /// The CUDA GPU a GPU device tier opens.
    gpu_ordinal: usize,
    /// Under a process group, the collectives kept in flight beside compute (the
    /// keyword's, or the config file's `train.collectives_ahead`).
    collectives_ahead: usize,
}

impl PyEngineCore {
    fn core(&mut self) -> &mut EngineCore {
        // A poisoned mutex would need a panic while a guard is held; none is ever taken.
        self.core.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    fn name(&mut self, i: usize) -> PyResult<String> {
        Ok(self.core().spec(i)?.name.clone())
    }
}

#[pymethods]
impl PyEngineCore {
    /// `params`: (name, shape, trainable) in forward order. Either `config` (a
    /// tidestore.toml) or the keywords decide the store.
    #[new]
    #[pyo3(signature = (params, *, config=None, precision="f32", lr=1e-3, betas=(0.9, 0.999),
        eps=1e-8, weight_decay=0.0, states="fp32", nvme_dir=None, host_budget=None,
        device_budget=None, gpu=None, max_grad_norm=None, overlap="off", threads=0,
        chunk_elements=None, local_gpu=None, cpu_only=false, collectives_ahead=DEFAULT_AHEAD))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        params: Vec<(String, Vec<usize>, bool)>,
        config: Option<PathBuf>,
        precision: &str,
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        states: &str,
        nvme_dir: Option<PathBuf>,
        host_budget: Option<u64>,
        device_budget: Option<u64>,
        gpu: Option<usize>,
        max_grad_norm: Option<f32>,
        overlap: &str,
        threads: usize,
        chunk_elements: Option<u64>,
        local_gpu: Option<usize>,
        cpu_only: bool,
        collectives_ahead: usize,
    ) -> PyResult<Self> {
        let (tc, collectives_ahead) = match config {
            Some(path) => config_file(&path, local_gpu, cpu_only)?,
            None => (
                Keywords {
                    precision: parse_precision(precision)?,
                    hp: HyperParams::adamw(lr, betas, eps, weight_decay),
                    states: states.to_string(),
                    nvme_dir: nvme_dir.ok_or_else(|| {
                        Error::bad("nvme_dir", "missing: the folder of the swap file")
                    })?,
                    host_budget,
                    device_budget,
                    gpu,
                    max_grad_norm,
                    overlap: parse_overlap(overlap)?,
                    threads,
                    chunk_elements,
                }
                .trainer_config()?,
                // (checked by `tidestore.offload`, against `MAX_COLLECTIVES_AHEAD`)
                collectives_ahead,
            ),
        };
        let specs: Vec<ParamSpec> = params
            .iter()
            .map(|(n, s, t)| ParamSpec::new(n.clone(), s, *t))
            .collect();
        let (precision, overlap) = (tc.precision, tc.overlap);
        let core = py.allow_threads(|| EngineCore::open(&specs, &tc))?;
        Ok(PyEngineCore {
            core: Mutex::new(core),
            precision,
            overlap,
            gpu_ordinal: tc.gpu_ordinal,
            collectives_ahead,
        })
    }

    /// Under a process group, the collectives kept in flight beside compute: parameters
    /// gathered this many binds ahead, gradients reduce-scattered this many behind.
    #[getter]
    fn collectives_ahead(&self) -> usize {
        self.collectives_ahead
    }

    /// The CUDA GPU a GPU device tier opens: the config file's `device.ordinal`, or with
    /// `"auto"` the `local_gpu` given (0 without).
    #[getter]
    fn gpu_ordinal(&self) -> usize {
        self.gpu_ordinal
    }

    fn __len__(&mut self) -> usize {
        self.core().len()
    }

    /// (name, shape, trainable) of parameter `i`.
    fn spec(&mut self, i: usize) -> PyResult<(String, Vec<usize>, bool)> {
        let s = self.core().spec(i)?;
        Ok((s.name.clone(), s.shape.clone(), s.trainable))
    }

    /// "f32" or "bf16".
    #[getter]
    fn precision(&self) -> &'static str {
        self.precision.as_str()
    }

    /// When tensors are stepped: "off", "backward" or "forward".
    #[getter]
    fn overlap(&self) -> &'static str {
        overlap_name(self.overlap)
    }

    /// The store's AdamW hyper-parameters (lr, betas, eps, weight_decay).
    fn hyper_params<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let hp = self.core().hyper_params();
        let d = PyDict::new(py);
        d.set_item("lr", hp.lr)?;
        d.set_item("betas", (hp.beta1, hp.beta2))?;
        d.set_item("eps", hp.eps)?;
        d.set_item("weight_decay", hp.weight_decay)?;
        Ok(d)
    }

    /// Holds parameter `i` for compute: (address, bytes, dtype name, GPU) of its
    /// elements; GPU: the CUDA ordinal whose memory the address is in, `None` for host
    /// memory.
    #[allow(clippy::type_complexity)]
    fn acquire(
        &mut self,
        py: Python<'_>,
        i: usize,
    ) -> PyResult<(usize, usize, &'static str, Option<usize>)> {
        let core = self.core();
        let b = py.allow_threads(|| core.acquire(i))?;
        Ok((b.addr, b.len, torch_name(b.dtype), b.gpu))
    }

    /// The CUDA ordinal of the GPU the store's device tier is, where modules then
    /// compute (parameters bound as CUDA tensors); `None`: the CPU.
    #[getter]
    fn gpu(&mut self) -> Option<usize> {
        self.core().gpu()
    }

    /// Drops one hold of parameter `i`; returns the holds left.
    #[pyo3(signature = (i, backward=false))]
    fn release(&mut self, py: Python<'_>, i: usize, backward: bool) -> PyResult<u32> {
        let core = self.core();
        Ok(py.allow_threads(|| core.release(i, backward))?)
    }

    /// Indices of the parameters held now.
    fn held(&mut self) -> Vec<usize> {
        self.core().held()
    }

    /// Writes parameter `i`'s values (a uint8 buffer of `dtype` elements).
    fn set_values(
        &mut self,
        py: Python<'_>,
        i: usize,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<()> {
        let what = self.name(i)?;
        with_input(py, self.core(), &what, buf, dtype, |c, src, d| {
            c.set_values(i, src, d)
        })
    }

    /// Parameter `i`'s values as f32 little-endian bytes.
    fn values<'py>(&mut self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyBytes>> {
        let core = self.core();
        let v = py.allow_threads(|| core.values(i))?;
        Ok(f32_bytes(py, &v))
    }

    /// Imports the registered parameters from a Hugging Face model directory; `skip`:
    /// names the files need not hold. With `shapes` (each parameter's whole shape),
    /// every parameter is registered as shard `rank` of `world` and that shard is taken
    /// (see `engine::Shard`). Returns the tensors written.
    #[pyo3(signature = (dir, skip=Vec::new(), shapes=None, rank=0, world=1))]
    fn import_dir(
        &mut self,
        py: Python<'_>,
        dir: PathBuf,
        skip: Vec<String>,
        shapes: Option<Vec<Vec<usize>>>,
        rank: usize,
        world: usize,
    ) -> PyResult<usize> {
        let layout = tidestore_train::ShardLayout::new(rank, world).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "rank {rank} of {world} ranks: a rank is below the world size"
            ))
        })?;
        let shard = shapes.map(|shapes| Shard { layout, shapes });
        let core = self.core();
        Ok(py.allow_threads(|| core.import_dir(&dir, &skip, shard.as_ref()))?)
    }

    /// One micro-batch's part of parameter `i`'s gradient; `last` reports it final.
    #[pyo3(signature = (i, buf, dtype, first=true, last=true))]
    fn put_grad(
        &mut self,
        py: Python<'_>,
        i: usize,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        first: bool,
        last: bool,
    ) -> PyResult<()> {
        let what = format!("{}.grad", self.name(i)?);
        with_input(py, self.core(), &what, buf, dtype, |c, src, d| {
            c.put_grad(i, src, d, first, last)
        })
    }

    /// Makes this core one rank of a data-parallel run that steps its shards (as
    /// `AdamWCore.set_norm_peers`).
    fn set_norm_peers(&mut self, all_reduce: Py<PyAny>) {
        self.core()
            .set_norm_peers(Box::new(crate::PyNormPeers(all_reduce)));
    }

    /// Steps the groups whose gradients are all final; returns the tensors stepped.
    fn step_ready(&mut self, py: Python<'_>) -> PyResult<usize> {
        let core = self.core();
        Ok(py.allow_threads(|| core.step_ready())?)
    }

    /// The step; (grad_norm, clip_coef), or None when skipped.
    fn step(&mut self, py: Python<'_>) -> PyResult<Option<(f64, f64)>> {
        let core = self.core();
        Ok(py.allow_threads(|| core.step())?)
    }

    /// Drops the iteration under way (`what`: why): its gradients dropped, nothing
    /// stepped; a `TidestoreError` (poisoned) where tensors were stepped during backward.
    fn abandon_iteration(&mut self, py: Python<'_>, what: &str) -> PyResult<()> {
        let core = self.core();
        Ok(py.allow_threads(|| core.abandon_iteration(what))?)
    }

    /// Whether `step_given` reads the gradients where they are (see
    /// `EngineCore::reads_given` in Rust).
    fn reads_given(&mut self) -> bool {
        self.core().reads_given()
    }

    /// The step with every parameter's gradient given: per parameter in order a (uint8
    /// buffer, dtype) pair, or None for a frozen one (see `EngineCore::step_given`).
    fn step_given(
        &mut self,
        py: Python<'_>,
        grads: Vec<Option<(Bound<'_, PyAny>, String)>>,
    ) -> PyResult<Option<(f64, f64)>> {
        let mut held = Vec::with_capacity(grads.len());
        for (i, g) in grads.iter().enumerate() {
            held.push(match g {
                Some((buf, dtype)) => {
                    Some(held_grad(buf, dtype, &format!("{}.grad", self.name(i)?))?)
                }
                None => None,
            });
        }
        let views: Vec<Option<(&[u8], DType)>> = held
            .iter()
            .map(|g| g.as_ref().map(|(b, d)| (b.as_slice(), *d)))
            .collect();
        let core = self.core();
        Ok(py.allow_threads(|| core.step_given(&views))?)
    }

    /// Gradients reported since the last step.
    fn reported(&mut self) -> usize {
        self.core().reported()
    }

    /// Sets the hyper-parameters of the steps to come (the param groups' values).
    fn set_hyper_params(
        &mut self,
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
    ) -> PyResult<()> {
        let hp = HyperParams::adamw(lr, betas, eps, weight_decay);
        Ok(self.core().set_hyper_params(hp)?)
    }

    fn step_count(&mut self) -> u64 {
        self.core().step_count()
    }

    /// Streams the training state into a tidestore checkpoint at `path`.
    #[pyo3(signature = (path, metadata=BTreeMap::new()))]
    fn save(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        metadata: BTreeMap<String, String>,
    ) -> PyResult<()> {
        let core = self.core();
        Ok(py.allow_threads(|| core.save(&path, metadata))?)
    }

    /// Loads a checkpoint (verified whole first); returns its metadata.
    fn load(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<BTreeMap<String, String>> {
        let core = self.core();
        Ok(py.allow_threads(|| core.load(&path))?)
    }

    /// Writes every parameter as safetensors shards of `dtype` in `dir` (atomically),
    /// with `config_json` as config.json; returns the weight files written.
    #[pyo3(signature = (dir, dtype="bfloat16", max_shard_bytes=5_000_000_000, config_json=None))]
    fn export_dir(
        &mut self,
        py: Python<'_>,
        dir: PathBuf,
        dtype: &str,
        max_shard_bytes: u64,
        config_json: Option<String>,
    ) -> PyResult<Vec<String>> {
        let dtype = parse_dtype("dtype", dtype)?;
        let core = self.core();
        Ok(py.allow_threads(|| {
            core.export_dir(&dir, dtype, max_shard_bytes, config_json.as_deref())
        })?)
    }

    /// Refuses an export while a parameter is held for compute (see
    /// `export_tensors_from`, which writes without the core).
    fn check_exportable(&mut self) -> PyResult<()> {
        Ok(self.core().check_exportable()?)
    }

    fn stats(&mut self) -> BTreeMap<&'static str, u64> {
        self.core().stats()
    }
}

/// A stored element type as torch names it.
fn torch_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::Q8 => "uint8",
    }
}

/// Writes `tensors` (name and whole shape, in this order) as safetensors shards of
/// `dtype` in `dir` (atomically, as `EngineCore.export_dir`), each read from
/// `read(name)`, which returns its f32 values as bytes: rank 0 of a data-parallel run
/// writes the export while each tensor is gathered from the ranks' shards (`read` calls
/// the engine, so no engine is held here). An exception `read` raises stops the export and
/// is raised again here.
#[pyfunction]
#[pyo3(signature = (dir, tensors, read, dtype="bfloat16", max_shard_bytes=5_000_000_000,
    config_json=None))]
pub fn export_tensors_from(
    py: Python<'_>,
    dir: PathBuf,
    tensors: Vec<(String, Vec<usize>)>,
    read: PyObject,
    dtype: &str,
    max_shard_bytes: u64,
    config_json: Option<String>,
) -> PyResult<Vec<String>> {
    let opts = crate::engine::export_options(parse_dtype("dtype", dtype)?, max_shard_bytes);
    let mut raised: Option<PyErr> = None;
    let mut from_python = |name: &str| -> tidestore_train::Result<Vec<f32>> {
        let got = read
            .call1(py, (name,))
            .and_then(|b| b.extract::<Vec<u8>>(py));
        let bad = |reason: String| tidestore_train::TrainError::Tensor {
            tensor: name.into(),
            reason,
        };
        match got {
            Ok(bytes) if bytes.len() % 4 == 0 => {
                let mut out = vec![0f32; bytes.len() / 4];
                tidestore_train::typed::decode_f32(&bytes, DType::F32, &mut out);
                Ok(out)
            }
            Ok(bytes) => Err(bad(format!(
                "read gave {} bytes, not whole f32s",
                bytes.len()
            ))),
            Err(e) => {
                raised = Some(e);
                Err(bad("read raised".into()))
            }
        }
    };
    let written = tidestore_train::hf::export_tensors_from(
        &mut from_python,
        &tensors,
        config_json.as_deref(),
        &dir,
        &opts,
    );
    match (written, raised) {
        (_, Some(e)) => Err(e),
        (w, None) => Ok(w.map_err(Error::from)?.shards),
    }
}
