//! `tidestore finetune` as a library: a Hugging Face LLaMA directory fine-tuned on a text
//! file, layer-streamed through the chunk store ([`tidestore_candle::train_step`]), so
//! that neither the GPU nor the host has to hold the model: the store's budgets
//! (`[device]`, `[host]`, `[nvme]`) bound the parameters and optimizer state, and
//! candle holds one block's parameters and graph at a time plus the block inputs.
//!
//! A run: the model's `config.json` read and its weights imported into the store one
//! tensor at a time ([`model`]); the text tokenized with the directory's
//! `tokenizer.json` (byte-level when there is none); then `train.steps` steps of
//! `train.accumulation` micro-batches each, the learning rate from `train.schedule`;
//! checkpoints every `train.checkpoint_every` steps (and at the end) in the train
//! crate's format; `--resume` continues from the newest one, bit-identical to a run
//! never interrupted (the batches are a function of the step); at the end, the export.
//!
//! A run does what it says or stops, before step 1 where that can be known: settings
//! it cannot honour and tensors or tokens the model cannot use are refused
//! (`checks`), every output path is checked writable and the export kept out of the
//! model directory (`paths`), and the checkpoint directory is checked against the
//! run's identity (`identity`): a fresh run wants it free of checkpoints, a resumed
//! one its newest checkpoint of this run. A non-finite weight, loss or gradient stops
//! the run naming where; nothing non-finite is exported. The swap file lives in the
//! run's own `nvme.dir/finetune.PID/`, removed however the run ends
//! ([`crate::scratch`]); the temporaries of checkpoints and exports too.

mod checks;
mod compute;
mod data;
mod identity;
mod jsonl;
pub mod model;
mod paths;
mod ranked;

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use serde::Serialize;
use tidestore_candle::{checkpoint, train_step, TideConfig, TideParams};
use tidestore_chunk::{ListKind, StoreStats};
use tidestore_optimizer::StepDecision;
use tidestore_train::{
    BlockSchedule, CheckpointDir, OverlapStats, Ranks, SavedInputs, SentBytes, TrainError,
};

use crate::error::{Error, Result};
use crate::scratch::{self, Scratch};
use identity::RunIdentity;
use tidestore::config::Config;

pub use data::{DataSummary, Samples};
pub use tidestore::config::{
    DataFormat, ExportDtype, MicroBatchOrderName, PrecisionName, Schedule, TooLong, TrainSection,
};

/// The JSON schema name of [`FinetuneReport`].
pub const SCHEMA: &str = "tidestore.finetune.v1";

/// One step, as run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepRecord {
    /// 1-based.
    pub step: u32,
    /// Mean cross-entropy of the step's micro-batches before it.
    pub loss: f32,
    /// Learning rate of the step.
    pub lr: f64,
    /// Token positions computed (padding included).
    pub tokens: u64,
    /// Of which targets that carry loss.
    pub loss_tokens: u64,
    /// Wall time.
    pub seconds: f64,
    /// Of which candle's forward, recompute and backward.
    pub compute_seconds: f64,
    /// Of which getting parameters from and gradients into the store.
    pub store_seconds: f64,
    /// Of which the optimizer step.
    pub optimizer_seconds: f64,
    /// Bytes read from NVMe during the step.
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe during the step.
    pub nvme_written_bytes: u64,
    /// Seconds of the step with at least one NVMe request in flight (the swap file's
    /// I/O thread samples it every 200 µs): the disk's time for the step's bytes, to
    /// hold against `compute_seconds` and `store_seconds`.
    pub nvme_busy_seconds: f64,
    /// Global gradient norm (0 for a skipped step).
    pub grad_norm: f64,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct FinetuneReport {
    /// [`SCHEMA`].
    pub schema: String,
    /// The model in one line.
    pub model: String,
    /// How Adam's moments were stored (`optimizer.states`: fp32, bf16 or int8).
    pub states: String,
    /// Where the blocks computed: `cpu`, or `cuda` (candle's CUDA backend).
    pub compute: String,
    /// Where the blocks read the parameters: `device` (the device tier: a GPU's memory,
    /// or the simulated device standing in for one, `device.kind = "sim"`) or `host` (the
    /// host pool: computing on the CPU with no GPU found, `device.kind = "auto"`).
    pub compute_reads: String,
    /// What computed their matrix products: on the CPU OpenBLAS (its build and library)
    /// or candle's gemm (see `tidestore_candle::blas`), on a GPU cuBLAS.
    pub matmul: String,
    /// Where the optimizer step ran (`optimizer.device`): `device` (the GPU kernel, or
    /// the CPU kernel over the simulated device's memory), `host` (the host pool), or
    /// `split` (some tensors on the device, the others in the host pool).
    pub optimizer: String,
    /// Why there, in one phrase.
    pub optimizer_reason: String,
    /// Parameters.
    pub params: u64,
    /// Trained parameters.
    pub params_trainable: u64,
    /// Tokens in the text (input positions of padded JSONL samples).
    pub text_tokens: u64,
    /// What the data file gave: records, samples, the dropped and truncated ones,
    /// tokens that carry loss and padding.
    pub data: DataSummary,
    /// The step a resumed run continued from (`None`: from the start).
    pub resumed_from: Option<u64>,
    /// Every step run.
    pub steps: Vec<StepRecord>,
    /// Checkpoints written by this run and still there (the last two are kept).
    pub checkpoints: Vec<PathBuf>,
    /// Where the model was exported.
    pub export: Option<PathBuf>,
    /// Where the LoRA run was exported merged into its base.
    pub export_merged: Option<PathBuf>,
    /// The run's swap directory in `nvme.dir` (removed when the run ends).
    pub swap_dir: PathBuf,
    /// The store's counters over the run.
    #[serde(skip)]
    pub store: StoreStats,
    /// Bytes moved NVMe -> host and host -> NVMe over the run.
    pub nvme_bytes: (u64, u64),
    /// The same per chunk list (`param16`, `master`, `m`, `v`, `grads`), where the store
    /// counted them; lists that moved nothing are left out.
    pub nvme_bytes_by_list: std::collections::BTreeMap<&'static str, (u64, u64)>,
    /// Bytes the store keeps of the optimizer's state, per list (`master_bytes`,
    /// `m_bytes`, `v_bytes`): this rank's shards under data parallelism.
    pub state_bytes: std::collections::BTreeMap<&'static str, u64>,
    /// Most bytes in use per tier over the run: device, host, NVMe.
    pub peak_tier_bytes: (u64, u64, u64),
    /// Most bytes the blocks' activations took at once where they compute, as the
    /// layer-streamed driver counts them (see `tidestore_train::Blocks::working_bytes`).
    pub activation_peak_bytes: u64,
    /// Peak resident memory of the process (`VmHWM`), where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// A data-parallel run's ranks (`None`: one process); the tier and NVMe figures
    /// above are then this rank's.
    pub data_parallel: Option<DataParallel>,
}

/// A data-parallel run, as one rank saw it (see [`crate::ranks`]).
#[derive(Debug, Clone, Serialize)]
pub struct DataParallel {
    /// Ranks in the run.
    pub ranks: usize,
    /// The rank this report is of.
    pub rank: usize,
    /// The collectives' engine (`mpi`).
    pub engine: String,
    /// Bytes this rank sent into each kind of collective over the run.
    pub sent: SentBytes,
    /// Seconds this rank waited for collectives' results over the run: what compute
    /// did not hide (`train.collectives_ahead`).
    pub collective_wait_s: f64,
    /// What its collectives overlapped with compute.
    pub overlapped: OverlapStats,
    /// Every rank's own figures, in rank order (rank 0's report gathers them).
    pub per_rank: Vec<RankFigures>,
}

/// What one rank of a data-parallel run kept and moved.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Bytes its store keeps of master, M and V (`master_bytes`, `m_bytes`, `v_bytes`).
    pub state_bytes: std::collections::BTreeMap<String, u64>,
    /// Bytes it moved NVMe -> host and host -> NVMe, per chunk list.
    pub nvme_bytes_by_list: std::collections::BTreeMap<String, (u64, u64)>,
    /// Most bytes in use per tier: device, host, NVMe.
    pub peak_tier_bytes: (u64, u64, u64),
    /// Bytes it sent into each kind of collective.
    pub sent: SentBytes,
    /// Seconds it waited for collectives' results.
    pub collective_wait_s: f64,
}

impl RankFigures {
    fn of(report: &FinetuneReport, ranks: &Ranks) -> RankFigures {
        fn owned<V: Copy>(
            m: &std::collections::BTreeMap<&'static str, V>,
        ) -> std::collections::BTreeMap<String, V> {
            m.iter().map(|(k, v)| (k.to_string(), *v)).collect()
        }
        RankFigures {
            rank: ranks.rank(),
            state_bytes: owned(&report.state_bytes),
            nvme_bytes_by_list: owned(&report.nvme_bytes_by_list),
            peak_tier_bytes: report.peak_tier_bytes,
            sent: ranks.sent(),
            collective_wait_s: ranks.waited().as_secs_f64(),
        }
    }
}

impl FinetuneReport {
    /// Where `trainer`'s compute reads the parameters, and where its optimizer step
    /// runs and why (`Trainer::step_placement`).
    fn set_placement(&mut self, trainer: &tidestore_train::Trainer) {
        let place = |device: bool| if device { "device" } else { "host" }.to_string();
        self.compute_reads = place(trainer.compute_reads_device());
        let (on_device, why) = trainer.step_placement();
        let step = trainer.step_loop();
        self.optimizer = if on_device && step.on_device_count() < step.tensor_count() {
            "split".into()
        } else {
            place(on_device)
        };
        self.optimizer_reason = why.into();
    }

    fn new(
        cfg: &Config,
        loaded: &model::Loaded,
        samples: &Samples,
        resumed_from: Option<u64>,
    ) -> FinetuneReport {
        FinetuneReport {
            schema: SCHEMA.into(),
            model: loaded.describe(),
            states: cfg.optimizer.states.moments().to_string(),
            compute: "cpu".into(),
            compute_reads: String::new(),
            matmul: String::new(),
            optimizer: String::new(),
            optimizer_reason: String::new(),
            params: loaded.params(),
            params_trainable: loaded.params_trainable(),
            text_tokens: samples.len() as u64,
            data: samples.summary().clone(),
            resumed_from,
            steps: Vec::new(),
            checkpoints: Vec::new(),
            export: None,
            export_merged: None,
            swap_dir: PathBuf::new(),
            store: StoreStats::default(),
            nvme_bytes: (0, 0),
            nvme_bytes_by_list: Default::default(),
            state_bytes: Default::default(),
            peak_tier_bytes: (0, 0, 0),
            activation_peak_bytes: 0,
            peak_rss_bytes: None,
            data_parallel: None,
        }
    }

    /// The store's counters and the process's peak memory, at the end of the run.
    fn finish(&mut self, params: &TideParams, swap_dir: PathBuf) {
        let st = params.stats();
        self.nvme_bytes = (st.nvme_to_host_bytes, st.host_to_nvme_bytes);
        if let Some(t) = params.nvme_traffic() {
            self.nvme_bytes_by_list = ListKind::ALL
                .into_iter()
                .map(|l| (l.as_str(), (t.read_bytes(l), t.written_bytes(l))))
                .filter(|&(_, rw)| rw != (0, 0))
                .collect();
        }
        self.state_bytes = params.trainer().counters();
        self.activation_peak_bytes = self.state_bytes["activation_peak_bytes"];
        self.state_bytes
            .retain(|k, _| matches!(*k, "master_bytes" | "m_bytes" | "v_bytes"));
        self.peak_tier_bytes = (st.device.peak_bytes, st.host.peak_bytes, st.nvme.peak_bytes);
        self.store = st;
        self.peak_rss_bytes = peak_rss_bytes();
        self.swap_dir = swap_dir;
        self.data_parallel = params.ranks().map(|r| DataParallel {
            ranks: r.world(),
            rank: r.rank(),
            engine: r.engine().into(),
            sent: r.sent(),
            collective_wait_s: r.waited().as_secs_f64(),
            overlapped: params.overlap_stats().unwrap_or_default(),
            per_rank: Vec::new(),
        });
    }
}

/// Progress of a run, for a progress bar.
pub trait FinetuneProgress {
    /// Steps `first..=last` are about to run.
    fn begin(&mut self, first: u32, last: u32);
    /// A step finished.
    fn step(&mut self, record: &StepRecord);
    /// The run ended.
    fn end(&mut self);
}

/// No progress reporting.
#[derive(Debug, Default)]
pub struct NoProgress;

impl FinetuneProgress for NoProgress {
    fn begin(&mut self, _: u32, _: u32) {}
    fn step(&mut self, _: &StepRecord) {}
    fn end(&mut self) {}
}

/// The store's settings from the config (the facade decides them for every front end),
/// its swap file in this run's own directory under `nvme.dir`.
fn tide_config(cfg: &Config) -> Result<TideConfig> {
    Ok(cfg.trainer_config(swap_dir(cfg)?)?)
}

/// Peak resident memory of this process, from `/proc/self/status`.
pub fn peak_rss_bytes() -> Option<u64> {
    checks::proc_bytes("/proc/self/status", "VmHWM:")
}

/// Runs the fine-tuning the configuration describes (see the module doc); `resume`
/// continues from the newest checkpoint in `train.checkpoint_dir`. Before step 1: the
/// settings finetune cannot honour are refused, every output path is checked, the
/// weights and tokens are checked, and the checkpoint directory is checked against
/// the run's identity (`identity`).
pub fn run(
    cfg: &Config,
    resume: bool,
    progress: &mut dyn FinetuneProgress,
) -> Result<FinetuneReport> {
    run_with_ranks(cfg, resume, progress, None)
}

/// [`run`] as one of `ranks` of a data-parallel run (`None`: the only process); see
/// `ranked` for what differs.
pub fn run_with_ranks(
    cfg: &Config,
    resume: bool,
    progress: &mut dyn FinetuneProgress,
    ranks: Option<Ranks>,
) -> Result<FinetuneReport> {
    let t = &cfg.train;
    checks::refuse_unread_settings(cfg)?;
    paths::check_outputs(t)?;
    let swap = open_swap_dir(cfg)?;
    let loaded = model::open(t)?;
    let samples = match t.data_format {
        DataFormat::Text => model::text_samples(t, &loaded)?,
        DataFormat::Jsonl | DataFormat::Chat => jsonl::samples(t, &loaded)?,
    };
    let mut params = open_params(cfg, &loaded, ranks.clone())?;
    let (compute, matmul) = set_up_compute(cfg, &loaded, &mut params)?;
    let model_fingerprint = model::import(t, &loaded, &mut params)?;
    let world = ranks.as_ref().map_or(1, Ranks::world);
    let id = RunIdentity::new(cfg, &model_fingerprint, samples.fingerprint()).with_ranks(world);
    if let Some(r) = &ranks {
        // Not part of the identity (a checkpoint resumes under any depth), but the
        // ranks must start their gathers ahead alike for their collectives to match.
        let mut facts = id.settings();
        facts.push((
            "train.collectives_ahead".into(),
            t.collectives_ahead.to_string(),
        ));
        r.check_alike(&facts)?;
    }
    let (ckpt_dir, resumed_from) = open_checkpoints(t, &id, resume, &mut params)?;
    let first = resumed_from.map_or(1, |s| s as u32 + 1);
    let mut report = FinetuneReport::new(cfg, &loaded, &samples, resumed_from);
    report.compute = compute::name(&compute).into();
    report.matmul = matmul;
    report.set_placement(params.trainer());
    progress.begin(first, t.steps);
    for step in first..=t.steps {
        let record = one_step(cfg, &loaded, &samples, &mut params, step)?;
        progress.step(&record);
        report.steps.push(record);
        let due = t.checkpoint_every > 0 && (step % t.checkpoint_every == 0 || step == t.steps);
        if let (Some(dir), true) = (&ckpt_dir, due) {
            let path = dir.path(u64::from(step));
            let _temps = Scratch::temps_in(dir.dir());
            checkpoint::save_with(&mut params, &path, id.metadata())?;
            dir.prune()?;
            report.checkpoints.push(path);
            report.checkpoints.retain(|p| p.exists());
        }
    }
    progress.end();
    if let Some(dir) = &t.export_dir {
        export_checked(t, &loaded, &mut params, dir, false)?;
        report.export = Some(dir.clone());
    }
    if let Some(dir) = &t.export_merged {
        export_checked(t, &loaded, &mut params, dir, true)?;
        report.export_merged = Some(dir.clone());
    }
    report.finish(&params, swap.target().to_path_buf());
    if let Some(r) = params.ranks() {
        let all = ranked::every_rank(RankFigures::of(&report, r), r)?;
        if let Some(dp) = &mut report.data_parallel {
            dp.per_rank = all;
        }
    }
    Ok(report)
}

/// Checks the store against the machine (the swap file's size, the device asked for)
/// and sets where the blocks compute; returns that device and what computes the
/// matrix products.
fn set_up_compute(
    cfg: &Config,
    loaded: &model::Loaded,
    params: &mut TideParams,
) -> Result<(Device, String)> {
    let (swap_bytes, swap_path) = params
        .trainer()
        .store()
        .nvme()
        .with_swap_file(|f| (f.file_bytes(), f.path().to_path_buf()));
    checks::check_nvme_size(cfg.nvme.size, swap_bytes, &swap_path)?;
    checks::check_device(cfg.device.kind, params.trainer().store().device().kind())?;
    let ordinal = tidestore::session::device_ordinal(cfg);
    let compute = compute::compute_device(params.trainer().store().device().kind(), ordinal)?;
    params.set_compute_device(&compute);
    let matmul = compute::matmul(&compute)?;
    if compute.is_cuda() {
        activation_room(cfg, loaded, params)?;
    } else {
        host_activation_room(cfg, loaded)?;
    }
    Ok((compute, matmul))
}

/// Before step 1 on the CPU: the blocks' activations must fit in the memory this
/// machine has available (see [`checks::check_host_activation_room`]); skipped, logged,
/// where that is not known.
fn host_activation_room(cfg: &Config, loaded: &model::Loaded) -> Result<()> {
    let Some(available) = checks::mem_available_bytes() else {
        tracing::debug!("MemAvailable unknown: the activations are not checked against memory");
        return Ok(());
    };
    let need = activation_need(cfg, loaded, SavedInputs::Compute);
    checks::check_host_activation_room(cfg, available, need)
}

/// The lower bound of the blocks' activations for this run's micro-batches where they
/// compute, the saved inputs `saved` (on the CPU every one is in host memory anyway).
fn activation_need(cfg: &Config, loaded: &model::Loaded, saved: SavedInputs) -> u64 {
    let t = &cfg.train;
    let kept = match t.micro_batch_order {
        tidestore::config::MicroBatchOrderName::Vertical => t.accumulation,
        tidestore::config::MicroBatchOrderName::Horizontal => 1,
    };
    loaded.model.activation_bytes_at_least(
        t.micro_batch as usize,
        t.sequence as usize,
        kept as usize,
        saved,
    )
}

/// The store for `loaded`'s parameters (this rank's shards of them, with `ranks`); a
/// budget too small is explained against the config.
fn open_params(cfg: &Config, loaded: &model::Loaded, ranks: Option<Ranks>) -> Result<TideParams> {
    let (specs, mut tide) = (loaded.model.specs(), tide_config(cfg)?);
    // A simulated device standing in for a GPU has the activations' room beside the
    // budget, as `device.sim_memory = "auto"` gives the bench's.
    tide.sim_activation_bytes = activation_need(cfg, loaded, cfg.train.saved_inputs.place());
    let opened = match ranks {
        Some(r) => {
            let r = r.with_ahead(cfg.train.collectives_ahead as usize);
            TideParams::open_sharded(&specs, &tide, &Device::Cpu, r)
        }
        None => TideParams::open_specs(&specs, &tide, &Device::Cpu),
    };
    match opened {
        Ok(p) => Ok(p),
        Err(tidestore_candle::Error::Train(TrainError::Store(e))) => {
            Err(tidestore::session::budget_error(e, cfg).into())
        }
        Err(e) => Err(e.into()),
    }
}

/// Before step 1 on a GPU: the blocks' activations must fit beside the chunk slab
/// (see [`checks::check_activation_room`]).
fn activation_room(cfg: &Config, loaded: &model::Loaded, params: &TideParams) -> Result<()> {
    let device = params.trainer().store().device();
    let total = device.mem_info()?.total_bytes;
    let beside_slab = total
        .saturating_sub(device.slab_bytes())
        .saturating_sub(device.non_model_bytes()?);
    let need = activation_need(cfg, loaded, cfg.train.saved_inputs.place());
    checks::check_activation_room(cfg, total, beside_slab, need)
}

/// The prefix of a finetune run's swap directory in `nvme.dir`: `finetune.PID`.
const SWAP_DIR_PREFIX: &str = "finetune.";

/// This run's swap directory (`nvme.dir/finetune.PID`): made now, removed when the run
/// ends however it ends (its guard; the binary's signal handler). What a killed run
/// left there (`finetune.PID` of a dead process) is removed first.
fn open_swap_dir(cfg: &Config) -> Result<Scratch> {
    let nvme = cfg.nvme_dir()?;
    paths::check_writable_dir("nvme.dir", nvme)?;
    scratch::remove_dead(nvme, SWAP_DIR_PREFIX);
    let dir = swap_dir(cfg)?;
    let guard = Scratch::path(&dir);
    std::fs::create_dir(&dir)
        .map_err(|e| Error::config("nvme.dir", format!("{}: {e}", dir.display())))?;
    Ok(guard)
}

fn swap_dir(cfg: &Config) -> Result<PathBuf> {
    Ok(cfg.nvme_dir()?.join(scratch::own_name(SWAP_DIR_PREFIX)))
}

/// The checkpoint directory (its stale temporaries removed), checked against the run's
/// identity, and the newest checkpoint loaded when resuming; returns its step.
fn open_checkpoints(
    t: &TrainSection,
    id: &RunIdentity,
    resume: bool,
    params: &mut TideParams,
) -> Result<(Option<CheckpointDir>, Option<u64>)> {
    let Some(dir) = &t.checkpoint_dir else {
        if resume {
            return Err(Error::config(
                "train.checkpoint_dir",
                "missing: --resume continues from the newest checkpoint there",
            ));
        }
        return Ok((None, None));
    };
    let dir = CheckpointDir::open(ranked::checkpoint_dir(dir, params.ranks())?, 2)?;
    id.check_dir(&dir, resume)?;
    if !resume {
        return Ok((Some(dir), None));
    }
    let latest = match params.ranks() {
        Some(r) => ranked::common_latest(&dir, r)?,
        None => dir.latest()?,
    };
    let Some((step, path)) = latest else {
        return Err(Error::config(
            "train.checkpoint_dir",
            format!(
                "--resume: no checkpoint found to resume from in {} (no \
                 ckpt-NNNNNN.safetensors there); run without --resume to start afresh",
                dir.dir().display()
            ),
        ));
    };
    check_recorded_step(&path, step)?;
    checkpoint::load(params, &path)?;
    Ok((Some(dir), Some(step)))
}

/// Refuses a checkpoint whose name's step (`ckpt-000005.safetensors`) is not the step
/// it records (a renamed file would otherwise skip or repeat steps), before it loads.
fn check_recorded_step(path: &std::path::Path, named: u64) -> Result<()> {
    let recorded = tidestore_train::checkpoint::read_tensors(path, |_| false)?
        .0
        .controller
        .step;
    if recorded != named {
        return Err(Error::Finetune(format!(
            "checkpoint {}: its name says step {named}, but it records step {recorded} \
             (renamed?); give it its own step's name, ckpt-{recorded:06}.safetensors",
            path.display()
        )));
    }
    Ok(())
}

/// The export, after every weight is checked finite (and within f16's range for an f16
/// export): a model that is not is never written. Stale temporaries of a killed export
/// to the same target are removed first; this one's are removed if it is interrupted.
fn export_checked(
    t: &TrainSection,
    loaded: &model::Loaded,
    params: &mut TideParams,
    dir: &std::path::Path,
    merged: bool,
) -> Result<()> {
    let names: Vec<String> = params.specs().map(|s| s.name.clone()).collect();
    let limit = match t.export_dtype {
        ExportDtype::F16 => f32::from(half::f16::MAX),
        ExportDtype::Bf16 | ExportDtype::F32 => f32::MAX,
    };
    for name in names {
        // Each rank checks its own shard under data parallelism: nothing is gathered.
        if let Some((at, value)) =
            params.first_value_where(&name, |v| !v.is_finite() || v.abs() > limit)?
        {
            return Err(Error::Finetune(format!(
                "not exported to {}: `{name}` holds {value} at index {at}, which \
                 train.export_dtype = {:?} cannot hold; the checkpoints are untouched",
                dir.display(),
                t.export_dtype
            )));
        }
    }
    if params.ranks().is_some_and(|r| r.rank() != 0) {
        // Rank 0 writes the export; this rank gathers with it.
        return model::export(t, loaded, params, dir, merged);
    }
    let parent = paths::parent_of(dir);
    if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
        scratch::remove_dead(&parent, &format!(".{name}.tmp."));
    }
    let _temps = Scratch::temps_in(&parent);
    model::export(t, loaded, params, dir, merged)
}

/// Nanoseconds the store's swap file has had a request in flight since it opened.
fn nvme_busy_ns(params: &TideParams) -> u64 {
    params.trainer().store().nvme().activity().busy_ns
}

/// Step `step`: its micro-batches through the streamed trainer, at its learning rate.
fn one_step(
    cfg: &Config,
    loaded: &model::Loaded,
    samples: &Samples,
    params: &mut TideParams,
    step: u32,
) -> Result<StepRecord> {
    let t = &cfg.train;
    let started = Instant::now();
    let before = params.stats();
    let busy_before = nvme_busy_ns(params);
    let lr = t.lr_at(step, cfg.optimizer.lr);
    params.set_lr(lr as f32)?;
    let mut loss_tokens = 0;
    let mut batches = Vec::with_capacity(t.accumulation as usize);
    let device = params.compute_device().clone();
    for k in 0..u64::from(t.accumulation) {
        let k = ranked::micro_batch(k, params.ranks());
        let (batch, n) = samples.batch(u64::from(step), k, &device)?;
        loss_tokens += n;
        batches.push(batch);
    }
    let schedule = BlockSchedule {
        order: t.micro_batch_order.order(),
        saved_inputs: t.saved_inputs.place(),
    };
    let mut s = train_step(params, &loaded.model, &batches, schedule)?;
    (s.loss, loss_tokens) = ranked::across_ranks(s.loss, loss_tokens, params.ranks())?;
    if !s.loss.is_finite() || matches!(s.decision, StepDecision::Skip { .. }) {
        let tensor = params.trainer().step_loop().last_skip_tensor();
        let applied = matches!(s.decision, StepDecision::Apply { .. });
        return Err(checks::non_finite_step(step, s.loss, tensor, applied));
    }
    let world = params.ranks().map_or(1, Ranks::world) as u64;
    let tokens =
        world * u64::from(t.accumulation) * u64::from(t.micro_batch) * u64::from(t.sequence);
    let after = params.stats();
    Ok(StepRecord {
        step,
        loss: s.loss,
        lr,
        tokens,
        loss_tokens,
        seconds: started.elapsed().as_secs_f64(),
        compute_seconds: s.times.compute.as_secs_f64(),
        store_seconds: s.times.store.as_secs_f64(),
        optimizer_seconds: s.times.optimizer.as_secs_f64(),
        nvme_read_bytes: after.nvme_to_host_bytes - before.nvme_to_host_bytes,
        nvme_written_bytes: after.host_to_nvme_bytes - before.host_to_nvme_bytes,
        nvme_busy_seconds: nvme_busy_ns(params).saturating_sub(busy_before) as f64 / 1e9,
        grad_norm: match s.decision {
            StepDecision::Apply { grad_norm, .. } => grad_norm,
            StepDecision::Skip { .. } => 0.0,
        },
    })
}
