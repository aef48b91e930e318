//! The optimizer step on the device tier (`TrainerConfig::step_device`), on the simulated
//! device, where everything above the device trait runs as on a GPU:
//! - `Gpu` trains bit for bit as `Cpu` (the same CPU kernel, over the device's memory),
//!   in f32 and bf16 precision, with gradients given by `put_grad` or written through
//!   `Trainer::grad_view`;
//! - with every chunk on the device, an iteration after the first moves no byte between
//!   host and device: compute reads the parameters there and the gradients are written
//!   where the step reads them. Fails if a gradient (or anything else) takes a host
//!   round trip; the host step, beside it, moves every gradient;
//! - a simulation left where `DeviceChoice::Auto` found no GPU is not a stand-in for
//!   one: compute reads where the step writes (the host pool, or the device when the
//!   step was asked there), no byte crosses between host and device, and it trains bit
//!   for bit as the stand-in (`DeviceChoice::Sim`), which is read as a GPU would be;
//!   and no device budget is asked of it (one the stand-in refuses opens);
//! - `Auto` on the simulated device steps in the host pool, saying why; `Gpu` with a
//!   device budget below the largest tensor's chunks is refused at open, naming
//!   `optimizer.device` and the bytes short.

mod common;

use tidestore_tiers::DeviceKind;
use tidestore_train::{
    typed, Budget, DType, DeviceChoice, DeviceViewMut, HyperParams, ParamSpec, Precision,
    StepDevice, TensorState, TensorViewMut, TrainError, Trainer, TrainerConfig, Values,
};

const SHAPES: [&[usize]; 3] = [&[300, 70], &[70], &[12000]];

fn config(dir: &std::path::Path, precision: Precision, step_device: StepDevice) -> TrainerConfig {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.1), dir);
    cfg.max_grad_norm = Some(0.5);
    cfg.device = DeviceChoice::Sim;
    cfg.chunk_elements = Some(32768); // two chunks a list
    cfg.device_budget = Budget::AllChunks;
    cfg.host_budget = Budget::Chunks(5);
    cfg.optimizer_threads = 2;
    cfg.precision = precision;
    cfg.step_device = step_device;
    cfg
}

fn open(cfg: &TrainerConfig) -> Trainer {
    common::pattern_trainer(cfg, &SHAPES)
}

/// Step `k`'s gradient of parameter `i` (of `n` elements).
fn grad(k: usize, i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| ((j * 5 + 3 * k + i) % 11) as f32 * 0.03 - 0.15)
        .collect()
}

/// How an iteration hands its gradients over.
#[derive(Debug, Clone, Copy)]
enum Hand {
    Put,
    View,
}

/// One iteration: every parameter read for compute (forward, then backward's
/// recompute), its gradient handed over, then the step.
fn iteration(t: &mut Trainer, k: usize, hand: Hand) {
    for i in 0..SHAPES.len() {
        t.fetch(i, TensorState::HoldAfterFwd).unwrap();
    }
    for i in (0..SHAPES.len()).rev() {
        t.fetch(i, TensorState::HoldAfterBwd).unwrap();
        let g = grad(k, i, t.spec(i).unwrap().elements());
        match hand {
            Hand::Put => t.put_grad(i, Values::F32(&g), true, true).unwrap(),
            Hand::View => {
                let sq = t
                    .grad_view(i, true, |v, dtype| write(v, dtype, &g))
                    .unwrap();
                t.grad_written(i, sq).unwrap();
            }
        }
    }
    t.step(&mut |_| {}).unwrap();
}

/// Writes `g` into a host-addressable gradient view as its dtype; the squared norm.
fn write(view: TensorViewMut<'_>, dtype: DType, g: &[f32]) -> f64 {
    let bytes = match view {
        TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => b,
        TensorViewMut::Device(DeviceViewMut::Cuda(_)) => panic!("no GPU in this test"),
    };
    typed::encode_f32(g, dtype, bytes);
    g.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

fn state(t: &mut Trainer) -> Vec<Vec<u32>> {
    common::state_bits(t)
}

/// Bytes copied between host and device, both ways, since the last reset.
fn crossed(t: &Trainer) -> u64 {
    let s = t.stats();
    s.host_to_device_bytes + s.device_to_host_bytes
}

#[test]
fn the_step_on_the_device_trains_bit_for_bit_as_the_host_step() {
    for precision in [Precision::F32, Precision::Bf16] {
        for hand in [Hand::Put, Hand::View] {
            let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let mut host = open(&config(da.path(), precision, StepDevice::Cpu));
            let mut dev = open(&config(db.path(), precision, StepDevice::Gpu));
            assert!(!host.step_placement().0);
            let (on_device, why) = dev.step_placement();
            assert!(on_device, "{why}");
            assert!(why.contains("simulated"), "{why}");
            for k in 0..4 {
                iteration(&mut host, k, Hand::Put);
                iteration(&mut dev, k, hand);
            }
            assert_eq!(state(&mut host), state(&mut dev), "{precision:?}, {hand:?}");
        }
    }
}

#[test]
fn with_every_chunk_on_the_device_an_iteration_moves_nothing_between_host_and_device() {
    for precision in [Precision::F32, Precision::Bf16] {
        for hand in [Hand::Put, Hand::View] {
            let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let mut host = open(&config(da.path(), precision, StepDevice::Cpu));
            let mut dev = open(&config(db.path(), precision, StepDevice::Gpu));
            // The first iteration brings the chunks to the device (and traces).
            iteration(&mut host, 0, Hand::Put);
            iteration(&mut dev, 0, hand);
            host.reset_stats();
            dev.reset_stats();
            for k in 1..4 {
                iteration(&mut host, k, Hand::Put);
                iteration(&mut dev, k, hand);
            }
            assert_eq!(
                crossed(&dev),
                0,
                "{precision:?}, {hand:?}: the step on the device moved {:?}",
                dev.stats()
            );
            // The host step beside it takes every gradient and master, M and V to the
            // host pool: at least the gradients' bytes cross each iteration.
            let grad_bytes: u64 = SHAPES
                .iter()
                .map(|s| s.iter().product::<usize>() as u64)
                .sum::<u64>()
                * if precision == Precision::F32 { 4 } else { 2 };
            assert!(
                crossed(&host) >= 3 * grad_bytes,
                "{precision:?}: the host step moved only {} bytes",
                crossed(&host)
            );
        }
    }
}

/// A split step (`Trainer::split_step`: parameter 2 on the device, 0 and 1, whose
/// chunks they share, in the host pool) trains bit for bit as either whole step, in f32
/// and bf16, gradients put or written through their views (each where its own step
/// reads it); with every chunk on the device, an iteration after the first moves fewer
/// bytes between host and device than the host step — parameter 2's stay. Refused:
/// parameter 0 alone (its chunks are 1's too), splitting mid-iteration, and a step on
/// the device already.
#[test]
fn a_split_step_trains_bit_for_bit_and_moves_only_the_host_tensors() {
    for precision in [Precision::F32, Precision::Bf16] {
        for hand in [Hand::Put, Hand::View] {
            let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
            let mut host = open(&config(dirs[0].path(), precision, StepDevice::Cpu));
            let mut dev = open(&config(dirs[1].path(), precision, StepDevice::Gpu));
            let mut split = open(&config(dirs[2].path(), precision, StepDevice::Cpu));
            let e = split.split_step(&[0]).unwrap_err();
            assert!(
                matches!(&e, TrainError::Tensor { tensor, reason }
                if tensor == "p0" && reason.contains("`p1`")),
                "{e}"
            );
            split.split_step(&[2]).unwrap();
            let (on_device, why) = split.step_placement();
            assert!(on_device && why.contains("1 of 3"), "{why}");
            for t in [&mut host, &mut dev, &mut split] {
                iteration(t, 0, hand);
                t.reset_stats();
            }
            for k in 1..4 {
                iteration(&mut host, k, hand);
                iteration(&mut dev, k, hand);
                iteration(&mut split, k, hand);
            }
            // Before the state is read back (which brings it to the host).
            let (h, s) = (crossed(&host), crossed(&split));
            assert!(
                0 < s && s < h,
                "{precision:?}, {hand:?}: split {s}, host {h}"
            );
            let want = state(&mut host);
            assert_eq!(want, state(&mut dev), "{precision:?}, {hand:?}");
            assert_eq!(want, state(&mut split), "{precision:?}, {hand:?}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(&config(dir.path(), Precision::F32, StepDevice::Cpu));
    t.fetch(0, TensorState::HoldAfterBwd).unwrap();
    let g = grad(0, 0, t.spec(0).unwrap().elements());
    t.put_grad(0, Values::F32(&g), true, true).unwrap();
    assert!(matches!(t.split_step(&[1]), Err(TrainError::Protocol(_))));
    let dir = tempfile::tempdir().unwrap();
    let mut dev = open(&config(dir.path(), Precision::F32, StepDevice::Gpu));
    assert!(matches!(dev.split_step(&[1]), Err(TrainError::Protocol(_))));
    // What `auto` splits on a GPU with all but a byte of the state beside the 16-bit
    // parameters: parameter 2's run (see the GPU test below).
    let layout = dev.store().layout();
    let all = tidestore_train::DeviceShare::of(layout, |id| id.0 < 3, u64::MAX);
    let budget = all.params_bytes + all.state_bytes - 1;
    let share = tidestore_train::DeviceShare::of(layout, |id| id.0 < 3, budget);
    assert_eq!(share.tensors, [tidestore_train::TensorId(2)]);
}

#[test]
fn auto_on_the_simulated_device_steps_in_the_host_pool_and_a_short_budget_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = open(&config(dir.path(), Precision::Bf16, StepDevice::Auto));
    let (on_device, why) = t.step_placement();
    assert!(!on_device);
    assert!(why.contains("simulated"), "{why}");

    let mut cfg = config(dir.path(), Precision::F32, StepDevice::Gpu);
    cfg.device_budget = Budget::Bytes(64 * 1024);
    let specs = [ParamSpec::new("big", &[30_000], true)];
    match Trainer::open(&specs, &cfg) {
        Err(TrainError::Config { key, reason }) => {
            assert_eq!(key, "optimizer.device");
            assert!(
                reason.contains("`big`") && reason.contains("short"),
                "{reason}"
            );
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

/// `DeviceChoice::Cpu` (a front end that computes on the CPU by choice: the PyTorch
/// engine without `device="cuda"`) opens no GPU, even in a `cuda` build on a machine
/// with one: what `Auto` leaves without a GPU, never read by compute, nothing crossing,
/// the stand-in's state.
#[test]
fn a_trainer_asked_for_the_cpu_opens_no_gpu_and_trains_as_the_stand_in() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut stand_in = open(&config(da.path(), Precision::F32, StepDevice::Cpu));
    let mut cfg = config(db.path(), Precision::F32, StepDevice::Cpu);
    cfg.device = DeviceChoice::Cpu;
    cfg.device_budget = Budget::Bytes(8192);
    let mut cpu = open(&cfg);
    assert_eq!(cpu.store().device().kind(), DeviceKind::Sim);
    assert!(!cpu.device_is_gpu() && !cpu.compute_reads_device());
    for k in 0..4 {
        iteration(&mut stand_in, k, Hand::Put);
        iteration(&mut cpu, k, Hand::Put);
    }
    assert_eq!(crossed(&cpu), 0, "the device was used: {:?}", cpu.stats());
    assert_eq!(state(&mut stand_in), state(&mut cpu));
}

#[test]
fn a_simulation_left_without_a_gpu_is_not_read_by_compute_and_trains_as_the_stand_in() {
    for precision in [Precision::F32, Precision::Bf16] {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // The stand-in for a GPU (`DeviceChoice::Sim`) and what `Auto` leaves here.
        let mut stand_in = open(&config(da.path(), precision, StepDevice::Cpu));
        let mut cfg = config(db.path(), precision, StepDevice::Cpu);
        cfg.device = DeviceChoice::Auto;
        // Nothing is placed on it, so no budget is asked of it either: one the stand-in
        // refuses opens.
        cfg.device_budget = Budget::Bytes(8192);
        let mut left = open(&cfg);
        if left.store().device().kind() == DeviceKind::Cuda {
            eprintln!("skipped: `Auto` found a GPU, so nothing was left to the simulation");
            return;
        }
        assert!(stand_in.compute_reads_device());
        assert!(!left.compute_reads_device(), "{precision:?}");
        // A front end on the CPU says so; the place stays.
        left.set_compute_on_device(false);
        assert!(!left.compute_reads_device());
        for k in 0..4 {
            iteration(&mut stand_in, k, Hand::Put);
            iteration(&mut left, k, Hand::Put);
        }
        assert_eq!(
            crossed(&left),
            0,
            "{precision:?}: compute or the step used the device: {:?}",
            left.stats()
        );
        assert!(
            crossed(&stand_in) > 0,
            "{precision:?}: the stand-in is read"
        );
        assert_eq!(state(&mut stand_in), state(&mut left), "{precision:?}");
        cfg.device = DeviceChoice::Sim;
        match Trainer::open(&[ParamSpec::new("w", &[300, 70], true)], &cfg) {
            Err(TrainError::Store(e)) => assert!(e.to_string().contains("short"), "{e}"),
            Err(e) => panic!("expected the device budget refused, got {e}"),
            Ok(_) => panic!("expected the device budget refused"),
        }
    }
    // A step asked onto the device takes compute there too: it reads where the step
    // writes, with nothing crossing after the first iteration.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Precision::F32, StepDevice::Gpu);
    cfg.device = DeviceChoice::Auto;
    let mut t = open(&cfg);
    if t.store().device().kind() == DeviceKind::Sim {
        assert!(t.compute_reads_device());
        iteration(&mut t, 0, Hand::Put);
        t.reset_stats();
        iteration(&mut t, 1, Hand::Put);
        assert_eq!(crossed(&t), 0, "{:?}", t.stats());
    }
}

/// On a CUDA GPU (a `cuda` build; skipped elsewhere), `auto` with a device budget that
/// holds every 16-bit parameter chunk and all but one byte of the trainable state
/// splits the step: the last run of tensors sharing chunks that fits (parameter 2's)
/// is stepped by the GPU kernel, the others (0 and 1, sharing chunks) in the host pool;
/// the masters stay within 1e-5 (relative to their largest) of the host step's.
#[test]
fn auto_on_a_gpu_splits_the_step_where_part_of_the_state_fits() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Precision::Bf16, StepDevice::Cpu);
    cfg.device = DeviceChoice::Auto;
    let probe = open(&cfg);
    if probe.store().device().kind() != DeviceKind::Cuda {
        eprintln!("skipped: no CUDA GPU here (a `cuda` build on a machine with one splits)");
        return;
    }
    let layout = probe.store().layout();
    let all = tidestore_train::DeviceShare::of(layout, |id| id.0 < 3, u64::MAX);
    cfg.device_budget = Budget::Bytes(all.params_bytes + all.state_bytes - 1);
    cfg.step_device = StepDevice::Auto;
    let (dh, ds) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    cfg.swap_dir = ds.path().into();
    let mut split = open(&cfg);
    let (on_device, why) = split.step_placement();
    assert!(
        on_device && why.contains("split") && why.contains("1 of 3"),
        "{why}"
    );
    let mut host = open(&config(dh.path(), Precision::Bf16, StepDevice::Cpu));
    for k in 0..3 {
        iteration(&mut host, k, Hand::Put);
        iteration(&mut split, k, Hand::Put);
    }
    for i in 0..SHAPES.len() {
        let want = host.with_master(i, |m| m.to_vec()).unwrap();
        let got = split.with_master(i, |m| m.to_vec()).unwrap();
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-5 * scale, "parameter {i}: {worst} of {scale}");
    }
}
