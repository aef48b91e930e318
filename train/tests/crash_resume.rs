//! Guards against losing training to a crash: a trainer killed with SIGKILL at random
//! moments — in forward, backward, the optimizer step, the end-of-iteration write-back
//! and while writing a checkpoint — and resumed each time from the newest checkpoint in
//! its directory must end bit-identical to a run that was never interrupted, and no kill
//! may cost a checkpoint that was already complete.
//!
//! The trainer is this test binary itself: [`crash_child_trainer`] (ignored in normal
//! runs) trains a small model through a [`ChunkStore`] whose host pool is small enough
//! that master, M and V chunks live on NVMe, announcing each phase on stdout. The parent
//! runs it once to the end for the reference (keeping every checkpoint), then again in
//! another directory, killing it at a seeded-random point of a phase chosen round-robin
//! and restarting it until it finishes. After every kill each checkpoint left in the
//! directory must be byte-identical to the reference's of the same step, and the newest
//! must be at least the newest one the child reported saved.
//!
//! The child's update is the train crate's [`StepLoop`]: gradients written over the
//! 16-bit parameters during backward and reported with `grad_ready`, the step made on
//! the (simulated) device by `finish` with clipping and a dynamic loss scaler, and the
//! stepped chunks written back off the device at the end of the iteration.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use half::bf16;
use tidestore_chunk::{
    ChunkStore, DType, Layout, LayoutConfig, ListKind, NvmeSource, Place, StoreConfig, TensorId,
    TensorSpec, TensorState,
};
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HybridAdamW, HyperParams, LossScalerConfig, OptimError, StepDecision,
};
use tidestore_tiers::{Device, DeviceConfig};
use tidestore_train::{
    checkpoint, CheckpointDir, CheckpointState, GradPlace, Overlap, StepConfig, StepLoop,
    StepPlace, StepTensor,
};

/// Iterations of a whole run; a checkpoint every `CKPT_EVERY`.
const ITERS: u64 = 80;
const CKPT_EVERY: u64 = 4;
/// Kills before the run may finish.
const KILLS: usize = 25;
const PHASES: [&str; 5] = ["forward", "backward", "step", "write-back", "checkpoint"];
const ENV_DIR: &str = "TIDESTORE_CRASH_DIR";
const ENV_KEEP: &str = "TIDESTORE_CRASH_KEEP";
const LAYERS: usize = 6;
const W_ELEMENTS: usize = 64 * 1024;
const B_ELEMENTS: usize = 1000;
/// A chunk holds one layer: its weight and its bias.
const CHUNK_ELEMENTS: u64 = (W_ELEMENTS + 4096) as u64;
/// The simulated host <-> device link.
const LINK_BYTES_PER_S: u64 = 512 << 20;
const CURSOR_KEY: &str = "data.cursor";
/// Seed of the kill schedule.
const SEED: u64 = 0x7E1D_E570_2E00_0001;

// ------------------------------------------------------------------ the trainer

fn specs() -> Vec<TensorSpec> {
    (0..LAYERS)
        .flat_map(|l| {
            [
                TensorSpec::new(format!("layers.{l}.w"), &[64, 1024], DType::BF16, true),
                TensorSpec::new(format!("layers.{l}.b"), &[B_ELEMENTS], DType::BF16, true),
            ]
        })
        .collect()
}

fn layout() -> Layout {
    Layout::new(LayoutConfig::new(CHUNK_ELEMENTS), specs()).expect("layout")
}

fn tensor_ids() -> Vec<TensorId> {
    (0..2 * LAYERS as u32).map(TensorId).collect()
}

/// Four chunks in use at once (a step holds a tensor's four lists) and room for six on
/// the host: most of the 24 chunks live on NVMe.
fn open_store(swap: &Path) -> ChunkStore {
    let layout = layout();
    let slot = layout.chunk_bytes(ListKind::Master);
    let nvme = NvmeSource::Dir {
        dir: swap.to_path_buf(),
        bytes: 40 * slot,
        io: common::io_cfg(),
    };
    let cfg = StoreConfig::new(4 * slot, 6 * slot, nvme).with_working_set_chunks(4);
    // A PCIe-like link that is slow for these small chunks, so that writing the stepped
    // chunks back off the device takes long enough to be killed in.
    let device_cfg = DeviceConfig {
        sim_link_bytes_per_s: Some(LINK_BYTES_PER_S),
        ..DeviceConfig::new(4 * slot)
    };
    let device = Device::sim(&device_cfg).expect("simulated device");
    ChunkStore::open(layout, cfg, device).expect("store")
}

/// The train crate's step loop over every tensor, on the (simulated) device, after
/// backward, with global-norm clipping and a dynamic loss scaler that grows every third
/// step: its state is part of what a resume must restore.
fn step_loop(store: &ChunkStore, tensors: &[TensorId]) -> StepLoop {
    let cpu = AdamW::new(CpuConfig {
        threads: 1,
        ..CpuConfig::default()
    })
    .expect("adamw");
    let no_gpu = OptimError::NoGpu {
        reason: "the crash test steps on the simulated device".into(),
    };
    let cfg = StepConfig {
        hp: HyperParams {
            lr: 1e-2,
            ..HyperParams::default()
        },
        max_grad_norm: Some(1.0),
        loss_scaler: Some(LossScalerConfig {
            init_scale: 256.0,
            growth_interval: 3,
            max_scale: 65536.0,
            ..LossScalerConfig::default()
        }),
        place: StepPlace::Device,
        overlap: Overlap::Off,
        check_finite: true,
    };
    let tensors = tensors
        .iter()
        .map(|&tensor| StepTensor {
            tensor,
            grad: GradPlace::InParam16,
        })
        .collect();
    StepLoop::new(store, HybridAdamW::cpu_only(cpu, no_gpu), tensors, cfg).expect("step loop")
}

/// The regression target of element `i` of tensor `t` for batch `cursor`.
fn target(t: TensorId, i: usize, cursor: u64) -> f32 {
    (0.001 * i as f32 + 0.7 * t.0 as f32 + 0.1 * cursor as f32).sin()
}

/// Marks the child's protocol lines (libtest may print on the same line before them).
const MARK: &str = "@crash@ ";

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{MARK}{line}").expect("stdout");
    out.flush().expect("stdout");
}

struct Trainer {
    store: ChunkStore,
    tensors: Vec<TensorId>,
    step: StepLoop,
    ckpts: CheckpointDir,
    /// Batches consumed.
    cursor: u64,
}

impl Trainer {
    /// A fresh store (the swap file of a killed run is not reused), loaded from the
    /// newest checkpoint or initialised.
    fn start(work: &Path, keep: usize) -> Trainer {
        let swap = work.join("swap");
        if swap.exists() {
            std::fs::remove_dir_all(&swap).expect("removing the old swap directory");
        }
        std::fs::create_dir_all(&swap).expect("swap directory");
        let store = open_store(&swap);
        let tensors = tensor_ids();
        let mut t = Trainer {
            step: step_loop(&store, &tensors),
            store,
            tensors,
            ckpts: CheckpointDir::open(work.join("ckpt"), keep).expect("checkpoint dir"),
            cursor: 0,
        };
        match t.ckpts.load_latest(&mut t.store, &t.tensors).expect("load") {
            Some(st) => {
                t.step.restore(st.controller).expect("restore");
                t.cursor = st.metadata[CURSOR_KEY].parse().expect("cursor");
                say(&format!("resumed {} {}", st.controller.step, t.cursor));
            }
            None => {
                t.init();
                say("fresh");
            }
        }
        t
    }

    fn init(&mut self) {
        for &t in &self.tensors {
            let n = self
                .store
                .layout()
                .location(t, ListKind::Master)
                .unwrap()
                .elements;
            let master: Vec<f32> = (0..n as usize)
                .map(|i| 0.5 * (0.37 * i as f32 + t.0 as f32).cos())
                .collect();
            let p16: Vec<bf16> = master.iter().map(|&x| bf16::from_f32(x)).collect();
            let zeros = vec![0u8; n as usize * 4];
            let s = &mut self.store;
            s.write(t, ListKind::Master, bytemuck::cast_slice(&master))
                .unwrap();
            s.write(t, ListKind::Params, bytemuck::cast_slice(&p16))
                .unwrap();
            s.write(t, ListKind::Momentum, &zeros).unwrap();
            s.write(t, ListKind::Variance, &zeros).unwrap();
        }
    }

    fn iteration(&mut self) {
        self.cursor += 1;
        let c = self.cursor;
        say(&format!("phase {c} forward"));
        let loss = self.forward();
        assert!(loss.is_finite());
        say(&format!("phase {c} backward"));
        let sq_norm = self.backward();
        assert!(sq_norm.is_finite());
        say(&format!("phase {c} step"));
        let outcome = self.step.finish(&mut self.store, &mut |_| {}).unwrap();
        assert!(matches!(outcome.decision, StepDecision::Apply { .. }));
        say(&format!("phase {c} write-back"));
        self.store.end_iteration().unwrap();
        self.store.evict_device_all().unwrap();
        self.store.sync().unwrap();
        if c.is_multiple_of(CKPT_EVERY) {
            say(&format!("phase {c} checkpoint"));
            let state = CheckpointState {
                controller: self.step.controller_state(),
                metadata: BTreeMap::from([(CURSOR_KEY.to_string(), c.to_string())]),
            };
            self.ckpts
                .save(&mut self.store, &self.tensors, &state)
                .unwrap();
            say(&format!("saved {}", state.controller.step));
        }
    }

    /// The loss `sum (w - target)^2 / 2` over the 16-bit parameters on the device.
    fn forward(&mut self) -> f64 {
        let mut loss = 0.0f64;
        for &t in &self.tensors {
            let g = self
                .store
                .access(t, ListKind::Params, Place::Device)
                .unwrap();
            let w = self.store.read_f32(&g).unwrap();
            for (i, &x) in w.iter().enumerate() {
                loss += 0.5 * f64::from(x - target(t, i, self.cursor)).powi(2);
            }
            self.store.release(g, TensorState::HoldAfterFwd).unwrap();
        }
        loss
    }

    /// Gradients `loss_scale * (w - target)`, rounded to bf16 into the parameters'
    /// space, in reverse order; returns their squared norm.
    fn backward(&mut self) -> f64 {
        let scale = self.step.loss_scale();
        let mut sq_norm = 0.0f64;
        for &t in self.tensors.iter().rev() {
            let g = self
                .store
                .access(t, ListKind::Params, Place::Device)
                .unwrap();
            let w = self.store.read_f32(&g).unwrap();
            let grad: Vec<f32> = w
                .iter()
                .enumerate()
                .map(|(i, &x)| scale * (x - target(t, i, self.cursor)))
                .collect();
            self.store.write_f32(&g, &grad).unwrap();
            let rounded = self.store.read_f32(&g).unwrap();
            let sq = self
                .step
                .optimizer()
                .cpu()
                .grad_sq_norm(Grads::F32(&rounded));
            self.store.release(g, TensorState::HoldAfterBwd).unwrap();
            self.step.grad_ready(t, sq).unwrap();
            sq_norm += sq;
        }
        sq_norm
    }
}

/// The trainer process the crash test spawns; does nothing when run by hand without
/// its environment.
#[test]
#[ignore = "the child process of killed_at_random_moments_resumes_bit_identical"]
fn crash_child_trainer() {
    let Ok(work) = std::env::var(ENV_DIR) else {
        return;
    };
    let keep = std::env::var(ENV_KEEP)
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(2);
    let mut t = Trainer::start(Path::new(&work), keep);
    while t.cursor < ITERS {
        t.iteration();
    }
    say(&format!("done {}", t.cursor));
}

// ------------------------------------------------------------------ the parent

/// splitmix64: the kill schedule's seeded PRNG.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the bias is irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A running child and its stdout lines with their arrival times.
struct Run {
    child: Child,
    lines: Receiver<(Instant, String)>,
    stderr: PathBuf,
}

fn spawn(work: &Path, keep: usize) -> Run {
    let stderr = work.join("child.stderr");
    let child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "crash_child_trainer", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(ENV_DIR, work)
        .env(ENV_KEEP, keep.to_string())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("spawning the trainer");
    let mut child = child;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let Some(line) = line.strip_prefix(MARK).map(str::to_string) else {
                continue;
            };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    Run {
        child,
        lines,
        stderr,
    }
}

/// What one child run showed.
#[derive(Debug, Default)]
struct Seen {
    /// The last phase announced: what was running when the child died.
    phase: Option<String>,
    /// Steps of checkpoints the child reported complete.
    saved: Vec<u64>,
    resumed: Option<u64>,
    done: bool,
}

impl Seen {
    fn take(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["phase", _, name] => self.phase = Some((*name).to_string()),
            ["saved", s] => self.saved.push(s.parse().expect("saved step")),
            ["resumed", s, _] => self.resumed = Some(s.parse().expect("resumed step")),
            ["fresh"] => self.resumed = Some(0),
            ["done", _] => self.done = true,
            _ => {}
        }
    }
}

fn child_failed(run: &Run, why: &str) -> ! {
    let err = std::fs::read_to_string(&run.stderr).unwrap_or_default();
    panic!("trainer {why}; its stderr:\n{err}");
}

/// Runs the reference to the end; returns the mean duration of each phase.
fn reference(work: &Path) -> BTreeMap<String, Duration> {
    let mut run = spawn(work, 1000);
    let mut seen = Seen::default();
    let mut spans: BTreeMap<String, (Duration, u32)> = BTreeMap::new();
    let mut open: Option<(String, Instant)> = None;
    for (at, line) in run.lines.iter() {
        if let Some((name, since)) = open.take() {
            let e = spans.entry(name).or_default();
            e.0 += at - since;
            e.1 += 1;
        }
        seen.take(&line);
        if line.starts_with("phase ") {
            open = Some((seen.phase.clone().unwrap_or_default(), at));
        }
    }
    let status = run.child.wait().expect("waiting for the reference");
    if !status.success() || !seen.done {
        child_failed(&run, "reference run failed");
    }
    spans
        .into_iter()
        .map(|(k, (d, n))| (k, d / n.max(1)))
        .collect()
}

/// One trial: a child resumed from the directory's newest checkpoint, killed once it
/// announced `phase` of iteration `cursor` and a further `delay` passed (not killed
/// when `kill` is `None`).
fn trial(work: &Path, kill: Option<(u64, &str, Duration)>) -> (Seen, bool) {
    let mut run = spawn(work, 2);
    let mut seen = Seen::default();
    let target = kill.map(|(c, p, _)| format!("phase {c} {p}"));
    let mut killed = false;
    loop {
        match run.lines.recv_timeout(Duration::from_secs(60)) {
            Ok((_, line)) => {
                seen.take(&line);
                if Some(&line) == target.as_ref() {
                    if let Some((_, _, delay)) = kill {
                        std::thread::sleep(delay);
                    }
                    run.child.kill().expect("SIGKILL");
                    killed = true;
                    break;
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => child_failed(&run, "hung"),
        }
    }
    for (_, line) in run.lines.iter() {
        seen.take(&line);
    }
    let status = run.child.wait().expect("waiting for the trainer");
    if !killed && (!status.success() || !seen.done) {
        child_failed(&run, &format!("exited with {status} before finishing"));
    }
    (seen, killed)
}

/// Checks the directory after a kill: nothing complete lost, everything left complete
/// and identical to the reference. Returns the newest step and the temporary files
/// the kill left.
fn check_dir(work: &Path, ref_ckpt: &Path, durable: Option<u64>) -> (Option<u64>, usize) {
    let dir = work.join("ckpt");
    let temps = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter(|e| {
                let e = e.as_ref().expect("dir entry");
                e.file_name().to_string_lossy().contains(".tmp.")
            })
            .count()
        })
        .unwrap_or(0);
    let ckpts = CheckpointDir::open(&dir, 2).expect("checkpoint dir");
    let list = ckpts.list().expect("listing checkpoints");
    let latest = list.last().map(|(s, _)| *s);
    if let Some(d) = durable {
        assert!(
            latest.is_some_and(|l| l >= d),
            "checkpoint of step {d} was reported saved, the directory's newest is {latest:?}"
        );
    }
    for (step, path) in &list {
        let want = std::fs::read(ref_ckpt.join(path.file_name().unwrap())).expect("reference");
        let got = std::fs::read(path).expect("checkpoint");
        assert!(
            got == want,
            "checkpoint of step {step} differs from the reference"
        );
    }
    if let Some((step, path)) = list.last() {
        let st = checkpoint::verify(&layout(), &tensor_ids(), path).expect("verify");
        assert_eq!(st.controller.step, *step);
    }
    (latest, temps)
}

/// Where trial `kills` kills: in phase `PHASES[kills % 5]` of an iteration at most
/// two checkpoints past the newest one `latest` (so kills spread over the whole run and
/// never reach its end), after a delay within the phase's mean duration.
fn kill_point(
    rng: &mut SplitMix64,
    spans: &BTreeMap<String, Duration>,
    kills: usize,
    latest: u64,
) -> (u64, &'static str, Duration) {
    let mut phase = PHASES[kills % PHASES.len()];
    let mut cursor = (latest + 1 + rng.below(2 * CKPT_EVERY)).min(ITERS - 1);
    if phase == "checkpoint" {
        cursor = cursor.div_ceil(CKPT_EVERY) * CKPT_EVERY;
        if cursor >= ITERS {
            (phase, cursor) = ("forward", ITERS - 1);
        }
    }
    let span = spans.get(phase).copied().unwrap_or_default();
    let delay = Duration::from_micros(rng.below(span.as_micros() as u64 * 4 / 5 + 1));
    (cursor, phase, delay)
}

#[test]
fn killed_at_random_moments_resumes_bit_identical() {
    let t0 = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let (ref_work, work) = (root.path().join("reference"), root.path().join("crashed"));
    std::fs::create_dir_all(&ref_work).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let spans = reference(&ref_work);
    let ref_time = t0.elapsed();
    let ref_ckpt = ref_work.join("ckpt");
    let mut rng = SplitMix64(SEED);
    let (mut kills, mut trials, mut temps_left) = (0usize, 0usize, 0usize);
    let mut hits: BTreeMap<String, usize> = BTreeMap::new();
    let mut at: Vec<u64> = Vec::new();
    let mut durable: Option<u64> = None;
    let mut latest: u64 = 0;
    loop {
        trials += 1;
        let kill = (kills < KILLS).then(|| kill_point(&mut rng, &spans, kills, latest));
        at.extend(kill.map(|k| k.0));
        let (seen, killed) = trial(&work, kill);
        assert_eq!(
            seen.resumed,
            Some(latest),
            "resumed from the newest checkpoint"
        );
        if let Some(&s) = seen.saved.iter().max() {
            durable = durable.max(Some(s));
        }
        if !killed {
            break;
        }
        kills += 1;
        *hits
            .entry(seen.phase.unwrap_or_else(|| "start-up".into()))
            .or_default() += 1;
        let (newest, temps) = check_dir(&work, &ref_ckpt, durable);
        temps_left += temps;
        latest = newest.unwrap_or(0);
        assert!(latest < ITERS, "a kill trial reached the end");
    }
    let name = format!("ckpt-{ITERS:06}.safetensors");
    let got = std::fs::read(work.join("ckpt").join(&name)).expect("final checkpoint");
    let want = std::fs::read(ref_ckpt.join(&name)).expect("reference final checkpoint");
    assert_final_identical(&got, &want);
    let leftovers = std::fs::read_dir(work.join("ckpt")).unwrap().count();
    assert_eq!(leftovers, 2, "two checkpoints kept, no temporary file left");
    eprintln!(
        "crash_resume: {trials} runs, {kills} kills, per phase {hits:?}, at iterations \
         {at:?}; {temps_left} half-written temporary files left by kills (removed on \
         resume); reference run {ref_time:.2?}, phase means {spans:?}; total {:.2?}",
        t0.elapsed()
    );
    assert!(kills >= 20);
    for p in PHASES {
        assert!(
            hits.get(p).copied().unwrap_or(0) > 0,
            "no kill during {p}: {hits:?}"
        );
    }
}

/// The final checkpoints are the same bytes; on a difference, names the first tensor
/// (or the metadata) that differs.
fn assert_final_identical(got: &[u8], want: &[u8]) {
    if got == want {
        return;
    }
    let g = safetensors::SafeTensors::deserialize(got).expect("final checkpoint parses");
    let w = safetensors::SafeTensors::deserialize(want).expect("reference parses");
    for (name, t) in w.tensors() {
        let mine = g.tensor(&name).expect("tensor present");
        assert!(
            mine.data() == t.data(),
            "final `{name}` differs from the uninterrupted run"
        );
    }
    panic!("final checkpoint differs from the uninterrupted run outside the tensors (metadata)");
}
