//! `AdamWCore`: the Rust side of `tidestore.AdamW`. A PyTorch model's parameters are
//! registered in a tidestore [`ChunkStore`] whose fp32 master copies, Adam M and V (and
//! an fp32 gradient companion per parameter) live in the host pool and spill to a swap
//! file on NVMe; tidestore's one step loop ([`StepLoop`]) steps them.
//!
//! What crosses the boundary is bytes: the Python layer hands each tensor's memory as a
//! flat `uint8` buffer with its dtype (see [`crate::buffer`]), so the core works on numpy
//! arrays as on CPU torch tensors and never imports torch. Per step:
//! 1. [`AdamWCore::put_grad`] per parameter: the gradient (fp32, bf16 or fp16) is widened
//!    into its fp32 companion in the store, its squared norm taken there, and the step
//!    loop told it is final. With `overlap`, the step loop steps every group whose
//!    gradients are all final right away (the Python layer calls this from
//!    `register_post_accumulate_grad_hook`, so it runs while backward goes on).
//! 2. [`AdamWCore::step`]: the step loop decides the step (global norm, clipping) and
//!    steps what is left, in the host pool, loading M and V from NVMe where the budget
//!    put them and writing them back behind.
//! 3. [`AdamWCore::read_param`] per parameter: the new master copy, rounded to the
//!    parameter's dtype, written into its memory.
//!
//! Layout: parameter `i` is the trainable fp32 tensor `param.i` (master, M, V); its
//! gradient is the frozen fp32 tensor `param.i#grad`, registered after every parameter so
//! the gradients fill chunks of their own (as the candle glue's fp32 precision does).
//! Every refusal (bad hyper-parameters, an unwritable `nvme_dir`, a budget the store
//! cannot work in, a buffer of the wrong size) is raised before anything is changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tidestore_chunk::{
    search_chunk_size, ChunkError, ChunkStore, DType, Layout, LayoutConfig, ListKind, MomentStates,
    NvmeSource, SearchConfig, StoreConfig, TensorId, TensorSpec, TensorState,
};
use tidestore_io::IoConfig;
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HybridAdamW, HyperParams, Mode, OptimError, StepDecision,
};
use tidestore_tiers::DeviceConfig;
use tidestore_train::checkpoint as ckpt;
use tidestore_train::{
    CheckpointState, GradPlace, Overlap, StepConfig, StepLoop, StepPlace, StepTensor,
};

use crate::error::{Error, Result};
use crate::moments::decode_moment;

/// How an [`AdamWCore`] is made (the Python constructor's arguments).
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// AdamW hyper-parameters (decoupled weight decay, as `torch.optim.AdamW`).
    pub hp: HyperParams,
    /// How M and V are stored.
    pub moments: MomentStates,
    /// Directory of the swap file.
    pub nvme_dir: PathBuf,
    /// Bytes of the host pool (rounded down to whole chunks); `None`: every chunk (plus
    /// a staging buffer) in RAM, nothing on NVMe but the swap file's header.
    pub host_budget_bytes: Option<u64>,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f32>,
    /// Step each group during backward as its gradients become final.
    pub overlap: bool,
    /// CPU AdamW threads (0: one per core).
    pub threads: usize,
    /// Chunk size in elements (`None`: searched).
    pub chunk_elements: Option<u64>,
}

#[derive(Debug)]
struct Param {
    shape: Vec<usize>,
    elements: usize,
    id: TensorId,
    grad_id: TensorId,
    /// Its gradient was reported in this iteration.
    reported: bool,
}

/// The optimizer state of one `tidestore.AdamW` (see the module doc).
pub struct AdamWCore {
    store: ChunkStore,
    step: StepLoop,
    params: Vec<Param>,
    reported: usize,
    host_budget_bytes: u64,
    chunk_elements: u64,
    /// The store's swap file, removed on drop: a store never takes a swap file's bytes
    /// from an earlier run as state, so nothing in it outlives the optimizer.
    swap_path: PathBuf,
}

impl Drop for AdamWCore {
    fn drop(&mut self) {
        // Unlinked while the store still has it open: its space is freed when the store
        // (dropped right after this) closes it.
        if let Err(e) = std::fs::remove_file(&self.swap_path) {
            tracing::warn!(path = %self.swap_path.display(), error = %e, "tidestore.AdamW: swap file not removed");
        }
    }
}

impl std::fmt::Debug for AdamWCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamWCore")
            .field("params", &self.params.len())
            .field("step", &self.step.step_count())
            .finish()
    }
}

/// The name of parameter `i` in the store and in checkpoints.
pub fn param_name(i: usize) -> String {
    format!("param.{i}")
}

const GRAD_SUFFIX: &str = "#grad";

impl AdamWCore {
    /// Registers parameters of `shapes` (values zero until [`AdamWCore::set_param`]).
    pub fn new(shapes: &[Vec<usize>], cfg: &CoreConfig) -> Result<Self> {
        check_config(shapes, cfg)?;
        let layout = layout(shapes, cfg)?;
        let chunk_elements = layout.chunk_elements();
        let store = open_store(layout, cfg)?;
        let params = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let id = store.layout().tensor_id(&param_name(i));
                let grad_id = store
                    .layout()
                    .tensor_id(&format!("{}{GRAD_SUFFIX}", param_name(i)));
                match (id, grad_id) {
                    (Some(id), Some(grad_id)) => Ok(Param {
                        shape: shape.clone(),
                        elements: shape.iter().product(),
                        id,
                        grad_id,
                        reported: false,
                    }),
                    _ => Err(Error::Protocol(format!(
                        "{} missing from the layout just built",
                        param_name(i)
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let step = step_loop(&store, &params, cfg)?;
        let plan = store.capacity_plan();
        let host_budget_bytes = plan.host_buffers * plan.slot_bytes;
        Ok(AdamWCore {
            store,
            step,
            params,
            reported: 0,
            host_budget_bytes,
            chunk_elements,
            swap_path: cfg.nvme_dir.join(tidestore_chunk::SWAP_FILE_NAME),
        })
    }

    fn param(&self, i: usize) -> Result<&Param> {
        self.params.get(i).ok_or_else(|| {
            Error::bad(
                "param",
                format!("index {i} out of range ({} parameters)", self.params.len()),
            )
        })
    }

    /// Registered shape of parameter `i`.
    pub fn shape(&self, i: usize) -> Result<&[usize]> {
        Ok(&self.param(i)?.shape)
    }

    /// Number of registered parameters.
    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    /// Elements of parameter `i`, checking `bytes` holds exactly that many of `dtype`.
    fn check_len(&self, i: usize, bytes: usize, dtype: DType, what: &str) -> Result<()> {
        let p = self.param(i)?;
        let want = p.elements * dtype.size_bytes() as usize;
        if bytes != want {
            return Err(Error::bad(
                format!("{} ({what})", param_name(i)),
                format!(
                    "{bytes} bytes, expected {want} ({} elements of {dtype}, shape {:?})",
                    p.elements, p.shape
                ),
            ));
        }
        Ok(())
    }

    /// Writes parameter `i`'s values (elements of `dtype`) as its master copy.
    pub fn set_param(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<()> {
        self.check_len(i, src.len(), dtype, "values")?;
        let id = self.params[i].id;
        self.store
            .with_host_views(&[(id, ListKind::MasterF32)], TensorState::Hold, |v| {
                widen(src, dtype, &mut v[0][..])
            })?;
        Ok(())
    }

    /// Compares parameter `i`'s values with its master copy rounded to `dtype`; when
    /// they differ (the caller changed the parameter outside the optimizer), the values
    /// become the master copy. Returns whether they did.
    pub fn sync_param(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<bool> {
        self.check_len(i, src.len(), dtype, "values")?;
        let id = self.params[i].id;
        let changed =
            self.store
                .with_host_views(&[(id, ListKind::MasterF32)], TensorState::Hold, |v| {
                    let master = &mut v[0][..];
                    let differs = match dtype {
                        DType::F32 => master[..] != src[..],
                        _ => src
                            .chunks_exact(2)
                            .zip(master.chunks_exact(4))
                            .any(|(s, m)| {
                                narrow_one(f32::from_le_bytes([m[0], m[1], m[2], m[3]]), dtype)
                                    != [s[0], s[1]]
                            }),
                    };
                    if differs {
                        widen(src, dtype, master);
                    }
                    differs
                })?;
        Ok(changed)
    }

    /// Writes parameter `i`'s master copy, rounded to `dtype`, into `out`.
    pub fn read_param(&mut self, i: usize, out: &mut [u8], dtype: DType) -> Result<()> {
        self.check_len(i, out.len(), dtype, "output")?;
        let id = self.params[i].id;
        self.store
            .with_host_views(&[(id, ListKind::MasterF32)], TensorState::Hold, |v| {
                narrow(&v[0][..], dtype, out)
            })?;
        Ok(())
    }

    /// Parameter `i`'s gradient for this step (elements of `dtype`): widened into its
    /// fp32 place, reported final; with overlap, ready groups are stepped now.
    pub fn put_grad(&mut self, i: usize, src: &[u8], dtype: DType) -> Result<()> {
        self.check_len(i, src.len(), dtype, "gradient")?;
        if self.params[i].reported {
            return Err(Error::Protocol(format!(
                "the gradient of {} was already given in this step (with overlap=True a \
                 parameter's gradient must be final once per step: no gradient \
                 accumulation over several backward passes)",
                param_name(i)
            )));
        }
        let grad_id = self.params[i].grad_id;
        let cpu = self.step.optimizer().cpu();
        let sq = self.store.with_host_views(
            &[(grad_id, ListKind::Param16)],
            TensorState::HoldAfterBwd,
            |v| {
                let dst = &mut v[0][..];
                widen(src, dtype, dst);
                f32_view(dst).map(|g| cpu.grad_sq_norm(Grads::F32(g)))
            },
        )??;
        self.step.grad_ready(self.params[i].id, sq)?;
        self.params[i].reported = true;
        self.reported += 1;
        if self.step.overlap() == Overlap::Backward {
            self.step.step_ready(&mut self.store, None, &mut |_| {})?;
        }
        Ok(())
    }

    /// Gradients given since the last step.
    pub fn reported(&self) -> usize {
        self.reported
    }

    /// Ends the step: decides it, steps every parameter not stepped during backward and
    /// ends the store's iteration. Returns the global gradient norm (unclipped) and the
    /// clipping coefficient; `None` when the step was skipped (a non-finite gradient).
    pub fn step(&mut self) -> Result<Option<(f64, f64)>> {
        if let Some(i) = self.params.iter().position(|p| !p.reported) {
            return Err(Error::Protocol(format!(
                "step() before the gradient of {} was given",
                param_name(i)
            )));
        }
        let outcome = self.step.finish(&mut self.store, &mut |_| {});
        for p in &mut self.params {
            p.reported = false;
        }
        self.reported = 0;
        let outcome = outcome?;
        self.store.end_iteration()?;
        Ok(match outcome.decision {
            StepDecision::Apply {
                grad_norm,
                clip_coef,
                ..
            } => Some((grad_norm, clip_coef)),
            StepDecision::Skip { .. } => None,
        })
    }

    /// Sets the learning rate of the steps to come.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        Ok(self.step.set_lr(lr)?)
    }

    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.step.step_count()
    }

    /// Parameter `i`'s master copy as f32.
    pub fn master(&mut self, i: usize) -> Result<Vec<f32>> {
        let id = self.param(i)?.id;
        let bytes = self.store.read(id, ListKind::MasterF32)?;
        let mut out = vec![0.0; bytes.len() / 4];
        tidestore_chunk::typed::decode_f32(&bytes, DType::F32, &mut out);
        Ok(out)
    }

    /// Parameter `i`'s Adam moments (M, V) as f32, decoded from their stored form.
    pub fn moments(&mut self, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (id, n) = (self.param(i)?.id, self.param(i)?.elements);
        let dtype = self
            .store
            .layout()
            .location(id, ListKind::MomentumF32)
            .map_or(DType::F32, |l| l.dtype);
        let m = self.store.read(id, ListKind::MomentumF32)?;
        let v = self.store.read(id, ListKind::VarianceF32)?;
        Ok((
            decode_moment(&m, dtype, n, true),
            decode_moment(&v, dtype, n, false),
        ))
    }

    fn between_steps(&self, path: &Path, what: &str) -> Result<()> {
        if self.reported > 0 {
            return Err(Error::Protocol(format!(
                "checkpoint `{}` cannot be {what} after {} gradients were given and before \
                 step(); step first",
                path.display(),
                self.reported
            )));
        }
        Ok(())
    }

    /// Streams every parameter's master, M and V (and the step count and `metadata`)
    /// into a tidestore checkpoint at `path`, one tensor at a time, atomically.
    pub fn save(&mut self, path: &Path, metadata: BTreeMap<String, String>) -> Result<()> {
        self.between_steps(path, "saved")?;
        let ids: Vec<TensorId> = self.params.iter().map(|p| p.id).collect();
        let state = CheckpointState {
            controller: self.step.controller_state(),
            metadata,
        };
        ckpt::save(&mut self.store, &ids, &state, path)?;
        Ok(())
    }

    /// The caller's metadata of the checkpoint at `path` (its header only).
    pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
        let (state, _) = ckpt::read_tensors(path, |_| false)?;
        Ok(state.metadata)
    }

    /// Loads the checkpoint at `path` (verified whole before anything changes) and the
    /// step count it holds; returns its metadata.
    pub fn load(&mut self, path: &Path) -> Result<BTreeMap<String, String>> {
        self.between_steps(path, "loaded")?;
        let ids: Vec<TensorId> = self.params.iter().map(|p| p.id).collect();
        let state = ckpt::load(&mut self.store, &ids, path)?;
        self.step.restore(state.controller)?;
        Ok(state.metadata)
    }

    /// Counters of the store and the step loop, by name.
    pub fn stats(&self) -> BTreeMap<&'static str, u64> {
        let s = self.store.stats();
        BTreeMap::from([
            ("nvme_read_bytes", s.nvme_to_host_bytes),
            ("nvme_written_bytes", s.host_to_nvme_bytes),
            ("host_budget_bytes", self.host_budget_bytes),
            ("host_buffers", self.store.capacity_plan().host_buffers),
            ("chunk_elements", self.chunk_elements),
            ("step_in_place", u64::from(self.step.in_place())),
            ("steps", self.step.step_count()),
            ("tensors_overlapped", self.step.stats().tensors_overlapped),
            ("host_evictions", s.host_evictions),
        ])
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
    cfg.hp.validate()?;
    if let Some(n) = cfg.max_grad_norm {
        if !(n.is_finite() && n > 0.0) {
            return Err(Error::bad(
                "max_grad_norm",
                format!("{n} is not a positive finite number"),
            ));
        }
        if cfg.overlap {
            return Err(Error::bad(
                "overlap",
                "overlap=True steps parameters during backward, before the last gradient \
                 exists, and max_grad_norm (global-norm clipping) needs every gradient \
                 first; pass max_grad_norm=None or overlap=False",
            ));
        }
    }
    tidestore_io::check_writable_dir("nvme_dir", &cfg.nvme_dir).map_err(|e| Error::Io {
        path: cfg.nvme_dir.display().to_string(),
        source: e,
    })?;
    Ok(())
}

/// Parameters first (trainable, fp32 master), then their fp32 gradient companions.
fn layout(shapes: &[Vec<usize>], cfg: &CoreConfig) -> Result<Layout> {
    let mut tensors: Vec<TensorSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| TensorSpec::new(param_name(i), s, DType::F32, true))
        .collect();
    tensors.extend(shapes.iter().enumerate().map(|(i, s)| {
        TensorSpec::new(
            format!("{}{GRAD_SUFFIX}", param_name(i)),
            s,
            DType::F32,
            false,
        )
    }));
    let layout_cfg = LayoutConfig::new(1)
        .with_param16_dtype(DType::BF16)
        .with_moments(cfg.moments);
    let chunk_elements = match cfg.chunk_elements {
        Some(c) => c,
        None => {
            let mut search = SearchConfig::new(swap_io().block_bytes as u64);
            search.cap_factor = 2;
            search_chunk_size(&tensors, &layout_cfg, &search)?
                .chosen
                .chunk_elements
        }
    };
    Layout::new(
        LayoutConfig {
            chunk_elements,
            ..layout_cfg
        },
        tensors,
    )
    .map_err(|e| match e {
        e @ (ChunkError::TensorTooLarge { .. } | ChunkError::InvalidChunkSize { .. }) => {
            Error::bad(
                "chunk_elements",
                format!(
                    "{e} (a parameter's fp32 gradient takes two slots per element:                      chunk_elements must be at least twice the largest parameter)"
                ),
            )
        }
        e => Error::Store(e),
    })
}

fn swap_io() -> IoConfig {
    IoConfig::default()
}

/// The store: a simulated device tier of the step's four chunks (unused: the step runs
/// in the host pool), the host pool of `host_budget_bytes`, a swap file for the rest.
fn open_store(layout: Layout, cfg: &CoreConfig) -> Result<ChunkStore> {
    let chunk_max_bytes = layout.dense_chunk_bytes().into_iter().max().unwrap_or(0);
    let slot_bytes = tidestore_io::align_up(chunk_max_bytes as usize) as u64;
    let chunks: u64 = layout
        .lists()
        .iter()
        .map(|&l| layout.list_chunk_count(l))
        .sum();
    let device_budget_bytes = 4 * slot_bytes;
    let host_budget_bytes = cfg.host_budget_bytes.unwrap_or((chunks + 1) * slot_bytes);
    // Slots for what the host pool cannot hold (and two to spare): all in RAM, the swap
    // file stays small.
    let host_slots = host_budget_bytes / slot_bytes.max(1);
    let nvme_bytes = ((chunks + 2).saturating_sub(host_slots)).max(2) * slot_bytes;
    tracing::info!(
        chunks,
        slot_bytes,
        host_budget_bytes,
        nvme_bytes,
        "tidestore.AdamW: layout"
    );
    let device = tidestore_tiers::Device::sim(&DeviceConfig::new(device_budget_bytes))
        .map_err(|e| ChunkError::tier("opening the device tier", None, e))?;
    let store_cfg = StoreConfig::new(
        device_budget_bytes,
        host_budget_bytes,
        NvmeSource::Dir {
            dir: cfg.nvme_dir.clone(),
            bytes: nvme_bytes,
            io: swap_io(),
        },
    )
    .with_working_set_chunks(4);
    ChunkStore::open(layout, store_cfg, device).map_err(|e| match e {
        e @ (ChunkError::BudgetTooSmall { .. } | ChunkError::ModelTooLarge { .. }) => {
            Error::bad("host_budget", e.to_string())
        }
        e => Error::Store(e),
    })
}

fn step_loop(store: &ChunkStore, params: &[Param], cfg: &CoreConfig) -> Result<StepLoop> {
    let cpu = AdamW::new(CpuConfig {
        threads: cfg.threads,
        ..CpuConfig::default()
    })?;
    let opt = HybridAdamW::cpu_only(
        cpu,
        OptimError::NoGpu {
            reason: "tidestore.AdamW steps in the host pool".into(),
        },
    );
    let tensors = params
        .iter()
        .map(|p| StepTensor {
            tensor: p.id,
            grad: GradPlace::Separate {
                grad: p.grad_id,
                write_param16: false,
            },
        })
        .collect();
    let step_cfg = StepConfig {
        hp: cfg.hp,
        max_grad_norm: cfg.max_grad_norm,
        loss_scaler: None,
        place: StepPlace::Host,
        overlap: if cfg.overlap {
            Overlap::Backward
        } else {
            Overlap::Off
        },
    };
    Ok(StepLoop::new(store, opt, tensors, step_cfg)?)
}

/// AdamW hyper-parameters as `torch.optim.AdamW` takes them (decoupled weight decay).
pub fn hyper_params(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> HyperParams {
    HyperParams {
        lr,
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay,
        mode: Mode::AdamW,
    }
}

/// The store's fp32 bytes as f32 (chunk places are 4-byte aligned).
fn f32_view(bytes: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::Protocol(format!("an fp32 place in the store is misaligned: {e}")))
}

/// `src` (elements of `dtype`, little endian) widened into `dst` (f32 bytes).
fn widen(src: &[u8], dtype: DType, dst: &mut [u8]) {
    match dtype {
        DType::F32 => dst.copy_from_slice(src),
        _ => {
            for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
                let v = match dtype {
                    DType::BF16 => half::bf16::from_le_bytes([s[0], s[1]]).to_f32(),
                    _ => half::f16::from_le_bytes([s[0], s[1]]).to_f32(),
                };
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// One f32 rounded to a 16-bit `dtype` (nearest even, as torch's `.to()`).
fn narrow_one(v: f32, dtype: DType) -> [u8; 2] {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_le_bytes(),
        _ => half::f16::from_f32(v).to_le_bytes(),
    }
}

/// `src` (f32 bytes) rounded into `out` (elements of `dtype`).
fn narrow(src: &[u8], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::F32 => out.copy_from_slice(src),
        _ => {
            for (s, d) in src.chunks_exact(4).zip(out.chunks_exact_mut(2)) {
                d.copy_from_slice(&narrow_one(
                    f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
                    dtype,
                ));
            }
        }
    }
}

/// Parses `states` (`fp32`, `bf16`, `int8`).
pub fn parse_states(s: &str) -> Result<MomentStates> {
    match s {
        "fp32" | "float32" => Ok(MomentStates::F32),
        "bf16" | "bfloat16" => Ok(MomentStates::Bf16),
        "int8" => Ok(MomentStates::Int8),
        other => Err(Error::bad(
            "states",
            format!("`{other}` is not one of fp32, bf16, int8"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_and_narrow_round_trip_16_bit_values() {
        for dtype in [DType::BF16, DType::F16] {
            let values = [0.0f32, 1.5, -2.25, 1e-3, 65000.0];
            let mut bits = vec![0u8; values.len() * 2];
            let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            narrow(&src, dtype, &mut bits);
            let mut wide = vec![0u8; values.len() * 4];
            widen(&bits, dtype, &mut wide);
            let mut again = vec![0u8; bits.len()];
            narrow(&wide, dtype, &mut again);
            assert_eq!(bits, again, "{dtype}");
        }
    }

    #[test]
    fn overlap_with_clipping_is_refused_before_the_store_opens() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CoreConfig {
            hp: hyper_params(1e-3, (0.9, 0.999), 1e-8, 0.0),
            moments: MomentStates::F32,
            nvme_dir: dir.path().to_path_buf(),
            host_budget_bytes: None,
            max_grad_norm: Some(1.0),
            overlap: true,
            threads: 1,
            chunk_elements: None,
        };
        let e = AdamWCore::new(&[vec![4, 4]], &cfg).unwrap_err();
        assert!(
            matches!(&e, Error::BadInput { what, .. } if what == "overlap"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
