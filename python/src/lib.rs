//! tidestore for PyTorch users: the Rust core of the `tidestore` Python package.
//!
//! - [`adamw`]: `AdamWCore`, the optimizer state of `tidestore.AdamW` in a chunk store,
//!   stepped by tidestore's step loop;
//! - [`aio`]: `AioHandle`, asynchronous tensor reads and writes through the I/O engine;
//! - [`engine`]: `EngineCore`, a whole torch model's training state in a chunk store,
//!   its parameters bound to torch tensors over the store's memory (`tidestore.offload`);
//! - [`buffer`]: tensor memory from Python's buffer protocol, checked;
//! - [`error`]: the crate's error type and the Python exceptions it becomes.
//!
//! The Python layer (`python/tidestore/`) is thin: it turns torch tensors and numpy
//! arrays into byte buffers, checks what only it can see (contiguity, dtype, device,
//! shape changes), and calls in here. Every call that works on tensors releases the GIL
//! while Rust runs.

pub mod adamw;
pub mod aio;
pub mod buffer;
pub mod engine;
pub mod error;
mod py_engine;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tidestore_train::aio::{EngineChoice, IoConfig, Op};
use tidestore_train::{DType, HyperParams};

use crate::adamw::{parse_states, AdamWCore, CoreConfig};
use crate::aio::{AioConfig, Memory, Worker};
use crate::buffer::{held_grad, parse_dtype, with_input, Bytes};
use crate::error::{ConfigError, Error, TidestoreError, TidestoreIoError};

/// The other ranks' gradient norms through a Python callable (the step calls it with
/// the GIL released; it takes the GIL back for the call).
pub(crate) struct PyNormPeers(pub(crate) Py<PyAny>);

impl tidestore_train::NormPeers for PyNormPeers {
    fn sum_sq_norm(&mut self, local: f64) -> tidestore_train::Result<f64> {
        Python::with_gil(|py| self.0.call1(py, (local,))?.extract::<f64>(py))
            .map_err(|e| tidestore_train::TrainError::Collective(e.to_string()))
    }
}

/// `tidestore._tidestore.AdamWCore`: see [`adamw`].
#[pyclass(name = "AdamWCore", module = "tidestore._tidestore")]
struct PyAdamWCore {
    /// A mutex only so the class is `Sync` (the store's trait objects are `Send`, not
    /// `Sync`); every method has `&mut self` and reaches it with `get_mut`, no locking.
    core: Mutex<AdamWCore>,
}

impl PyAdamWCore {
    fn core(&mut self) -> &mut AdamWCore {
        // A poisoned mutex would need a panic while a guard is held; none is ever taken.
        self.core.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) fn f32_bytes<'py>(py: Python<'py>, v: &[f32]) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    PyBytes::new(py, &out)
}

#[pymethods]
impl PyAdamWCore {
    #[new]
    #[pyo3(signature = (shapes, *, lr, betas, eps, weight_decay, states, nvme_dir,
        host_budget, max_grad_norm=None, overlap=false, threads=0, chunk_elements=None,
        check_finite=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        shapes: Vec<Vec<usize>>,
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        states: &str,
        nvme_dir: PathBuf,
        host_budget: Option<u64>,
        max_grad_norm: Option<f32>,
        overlap: bool,
        threads: usize,
        chunk_elements: Option<u64>,
        check_finite: bool,
    ) -> PyResult<Self> {
        let cfg = CoreConfig {
            hp: HyperParams::adamw(lr, betas, eps, weight_decay),
            moments: parse_states(states)?,
            nvme_dir,
            host_budget_bytes: host_budget,
            max_grad_norm,
            overlap: if overlap {
                tidestore_train::Overlap::Backward
            } else {
                tidestore_train::Overlap::Off
            },
            threads,
            chunk_elements,
            check_finite,
        };
        let core = py.allow_threads(|| AdamWCore::new(&shapes, &cfg))?;
        Ok(PyAdamWCore {
            core: Mutex::new(core),
        })
    }

    /// Number of parameters.
    fn __len__(&mut self) -> usize {
        self.core().param_count()
    }

    /// Registered shape of parameter `i`.
    fn shape(&mut self, i: usize) -> PyResult<Vec<usize>> {
        Ok(self.core().shape(i)?.to_vec())
    }

    /// Writes parameter `i`'s values (a uint8 buffer of `dtype` elements) as its master.
    fn set_param(
        &mut self,
        py: Python<'_>,
        i: usize,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<()> {
        with_input(
            py,
            self.core(),
            &adamw::param_name(i),
            buf,
            dtype,
            |c, src, d| c.set_param(i, src, d),
        )
    }

    /// Replaces parameter `i`'s master with its values when they differ from the master
    /// rounded to `dtype`; returns whether they did.
    fn sync_param(
        &mut self,
        py: Python<'_>,
        i: usize,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<bool> {
        with_input(
            py,
            self.core(),
            &adamw::param_name(i),
            buf,
            dtype,
            |c, src, d| c.sync_param(i, src, d),
        )
    }

    /// (address, bytes) of parameter `i`'s fp32 master copy where it stays while this
    /// core lives, or None when the store may move it (see `AdamW`'s adoption).
    fn resident_master(&mut self, py: Python<'_>, i: usize) -> PyResult<Option<(usize, usize)>> {
        let core = self.core();
        Ok(py.allow_threads(|| core.resident_master(i))?)
    }

    /// Writes parameter `i`'s master, rounded to `dtype`, into `out` (a writable uint8
    /// buffer).
    fn read_param(
        &mut self,
        py: Python<'_>,
        i: usize,
        out: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<()> {
        let dtype = parse_dtype("dtype", dtype)?;
        let mut bytes = Bytes::new(out, &adamw::param_name(i), true)?;
        let dst = bytes.as_mut_slice()?;
        let core = self.core();
        Ok(py.allow_threads(|| core.read_param(i, dst, dtype))?)
    }

    /// Parameter `i`'s gradient for this step (a uint8 buffer of `dtype` elements).
    fn put_grad(
        &mut self,
        py: Python<'_>,
        i: usize,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<()> {
        with_input(
            py,
            self.core(),
            &format!("{}.grad", adamw::param_name(i)),
            buf,
            dtype,
            |c, src, d| c.put_grad(i, src, d),
        )
    }

    /// Gradients given since the last step.
    fn reported(&mut self) -> usize {
        self.core().reported()
    }

    /// Ends the step; returns (grad_norm, clip_coef), or None when it was skipped.
    fn step(&mut self, py: Python<'_>) -> PyResult<Option<(f64, f64)>> {
        let core = self.core();
        Ok(py.allow_threads(|| core.step())?)
    }

    /// The step with every parameter's gradient given: a list of (uint8 buffer, dtype)
    /// in parameter order, read where they are when the store can (see
    /// `AdamWCore::step_given` in Rust).
    fn step_given(
        &mut self,
        py: Python<'_>,
        grads: Vec<(Bound<'_, PyAny>, String)>,
    ) -> PyResult<Option<(f64, f64)>> {
        let mut held = Vec::with_capacity(grads.len());
        for (i, (buf, dtype)) in grads.iter().enumerate() {
            held.push(held_grad(
                buf,
                dtype,
                &format!("{}.grad", adamw::param_name(i)),
            )?);
        }
        let views: Vec<(&[u8], DType)> = held.iter().map(|(b, d)| (b.as_slice(), *d)).collect();
        let core = self.core();
        Ok(py.allow_threads(|| core.step_given(&views))?)
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

    /// Makes this core one rank of a data-parallel run that steps its shards:
    /// `all_reduce(local_sq_norm) -> float` sums this rank's squared gradient norm with
    /// the other ranks' (e.g. through `torch.distributed`); the step is decided from
    /// that sum. An exception it raises fails the step and stops the core.
    fn set_norm_peers(&mut self, all_reduce: Py<PyAny>) {
        self.core()
            .set_norm_peers(Box::new(PyNormPeers(all_reduce)));
    }

    fn step_count(&mut self) -> u64 {
        self.core().step_count()
    }

    /// Parameter `i`'s master copy (f32 little-endian bytes).
    fn master<'py>(&mut self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyBytes>> {
        let core = self.core();
        let v = py.allow_threads(|| core.master(i))?;
        Ok(f32_bytes(py, &v))
    }

    /// Parameter `i`'s (M, V) as f32 little-endian bytes.
    fn moments<'py>(
        &mut self,
        py: Python<'py>,
        i: usize,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let core = self.core();
        let (m, v) = py.allow_threads(|| core.moments(i))?;
        Ok((f32_bytes(py, &m), f32_bytes(py, &v)))
    }

    /// Streams the state into a tidestore checkpoint (safetensors) at `path`.
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

    /// The metadata of the checkpoint at `path` (header only).
    #[staticmethod]
    fn read_metadata(py: Python<'_>, path: PathBuf) -> PyResult<BTreeMap<String, String>> {
        Ok(py.allow_threads(|| AdamWCore::read_metadata(&path))?)
    }

    fn stats(&mut self) -> BTreeMap<&'static str, u64> {
        self.core().stats()
    }
}

/// `tidestore._tidestore.AioHandle`: see [`aio`]. Fields drop in order: the worker is
/// joined before the buffers of unfinished transfers are given back.
#[pyclass(name = "AioHandle", module = "tidestore._tidestore")]
struct PyAioHandle {
    worker: Worker,
    pending: HashMap<u64, Bytes>,
    next_id: u64,
    cfg: AioConfig,
}

impl PyAioHandle {
    fn queue(
        &mut self,
        op: Op,
        buf: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: i64,
    ) -> PyResult<u64> {
        // Python ints are signed: a negative offset is a value error naming it, not an
        // `OverflowError` from the conversion.
        let offset = u64::try_from(offset).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "offset {offset} is negative: a file offset is a byte count >= 0 ({})",
                path.display()
            ))
        })?;
        let what = format!("buffer for {}", path.display());
        let mut bytes = Bytes::new(buf, &what, op == Op::Read)?;
        let mem = match op {
            Op::Read => {
                let s = bytes.as_mut_slice()?;
                Memory {
                    addr: s.as_mut_ptr() as usize,
                    len: s.len(),
                }
            }
            Op::Write => {
                let s = bytes.as_slice();
                Memory {
                    addr: s.as_ptr() as usize,
                    len: s.len(),
                }
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        // SAFETY: `bytes` (the export that keeps `mem` alive, in place and writable for a
        // read) goes into `pending` and leaves it only in `wait`, once the worker has sent
        // this id's result; dropping the handle joins the worker before `pending` (field
        // order). The Python layer documents that the buffer must not be used until
        // `wait` returns.
        unsafe { self.worker.submit(id, op, path, offset, mem)? };
        self.pending.insert(id, bytes);
        Ok(id)
    }

    /// Queues one transfer and waits for it and every earlier one; its bytes.
    fn queue_and_wait(
        &mut self,
        py: Python<'_>,
        op: Op,
        buf: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: i64,
    ) -> PyResult<usize> {
        let id = self.queue(op, buf, path, offset)?;
        let done = self.wait_all(py)?;
        Ok(done.iter().find(|d| d.0 == id).map_or(0, |d| d.1))
    }

    /// Waits for every queued transfer; their results by id, the first error raised.
    fn wait_all(&mut self, py: Python<'_>) -> PyResult<Vec<(u64, usize)>> {
        let mut done = Vec::with_capacity(self.pending.len());
        let mut first_error: Option<Error> = None;
        while !self.pending.is_empty() {
            let worker = &self.worker;
            let (id, r) = py.allow_threads(|| worker.recv())?;
            self.pending.remove(&id);
            match r {
                Ok(n) => done.push((id, n)),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(done),
        }
    }
}

#[pymethods]
impl PyAioHandle {
    #[new]
    #[pyo3(signature = (block_size=1<<20, queue_depth=32, direct=true, engine="auto",
        bounce_size=8<<20, bounce_buffers=4))]
    fn new(
        block_size: usize,
        queue_depth: u32,
        direct: bool,
        engine: &str,
        bounce_size: usize,
        bounce_buffers: usize,
    ) -> PyResult<Self> {
        let engine: EngineChoice = engine.parse().map_err(|e| Error::Io {
            path: "aio handle".into(),
            source: e,
        })?;
        let cfg = AioConfig {
            io: IoConfig {
                engine,
                block_bytes: block_size,
                queue_depth,
                direct,
                ..IoConfig::default()
            },
            bounce_bytes: bounce_size,
            bounce_count: bounce_buffers,
        };
        Ok(PyAioHandle {
            worker: Worker::start(cfg.clone())?,
            pending: HashMap::new(),
            next_id: 0,
            cfg,
        })
    }

    /// Queues a read of `len(buffer)` bytes of `filename` at `offset` into `buffer`.
    #[pyo3(signature = (buffer, filename, offset=0))]
    fn async_pread(
        &mut self,
        buffer: &Bound<'_, PyAny>,
        filename: PathBuf,
        offset: i64,
    ) -> PyResult<()> {
        self.queue(Op::Read, buffer, filename, offset).map(|_| ())
    }

    /// Queues a write of `buffer` to `filename` at `offset` (created if missing, never
    /// truncated).
    #[pyo3(signature = (buffer, filename, offset=0))]
    fn async_pwrite(
        &mut self,
        buffer: &Bound<'_, PyAny>,
        filename: PathBuf,
        offset: i64,
    ) -> PyResult<()> {
        self.queue(Op::Write, buffer, filename, offset).map(|_| ())
    }

    /// Waits for every queued transfer; returns how many finished. Raises the first
    /// error once all have finished.
    fn wait(&mut self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.wait_all(py)?.len())
    }

    /// Reads into `buffer` and waits (for earlier queued transfers too); returns bytes.
    #[pyo3(signature = (buffer, filename, offset=0))]
    fn sync_pread(
        &mut self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        filename: PathBuf,
        offset: i64,
    ) -> PyResult<usize> {
        self.queue_and_wait(py, Op::Read, buffer, filename, offset)
    }

    /// Writes `buffer` and waits (for earlier queued transfers too); returns bytes.
    #[pyo3(signature = (buffer, filename, offset=0))]
    fn sync_pwrite(
        &mut self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        filename: PathBuf,
        offset: i64,
    ) -> PyResult<usize> {
        self.queue_and_wait(py, Op::Write, buffer, filename, offset)
    }

    /// Transfers queued and not yet waited for.
    fn pending(&self) -> usize {
        self.pending.len()
    }

    fn get_block_size(&self) -> usize {
        self.cfg.io.block_bytes
    }

    fn get_queue_depth(&self) -> u32 {
        self.cfg.io.queue_depth
    }
}

#[pymodule]
fn _tidestore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyAdamWCore>()?;
    m.add_class::<PyAioHandle>()?;
    m.add_class::<py_engine::PyEngineCore>()?;
    m.add_function(wrap_pyfunction!(py_engine::export_tensors_from, m)?)?;
    // The collectives a sharded engine keeps in flight: by default, and at the most.
    m.add(
        "DEFAULT_COLLECTIVES_AHEAD",
        tidestore_train::ranks::DEFAULT_AHEAD,
    )?;
    m.add("MAX_COLLECTIVES_AHEAD", tidestore_train::ranks::MAX_AHEAD)?;
    m.add("TidestoreError", py.get_type::<TidestoreError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("IoError", py.get_type::<TidestoreIoError>())?;
    Ok(())
}
