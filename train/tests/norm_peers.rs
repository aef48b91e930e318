//! Data-parallel ranks as the step loop sees them (`NormPeers`): a rank that steps its
//! shards of the tensors decides the step from the whole gradient's norm.
//! - Two ranks, each stepping one half of every tensor with the half of the gradient,
//!   give the master copies one trainer gives stepping whole tensors: bit for bit
//!   without clipping, and with global-norm clipping to float rounding (the norm is a
//!   sum of two partial sums), with the same reported norm.
//! - A non-finite norm on the other rank skips this rank's step too.
//! - A failed all-reduce is `TrainError::Collective` and poisons the loop.
//!
//! The two ranks run on threads and meet through an in-process double of the
//! all-reduce (a barrier and two slots).

use std::sync::{Arc, Barrier, Mutex};

use tidestore_train::{
    Budget, DeviceChoice, HyperParams, NormPeers, ParamSpec, Precision, TrainError, Trainer,
    TrainerConfig, Values,
};

const LENS: [usize; 3] = [21000, 70, 12000];
const STEPS: usize = 3;

fn config(dir: &std::path::Path, clip: Option<f32>) -> TrainerConfig {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.1), dir);
    cfg.max_grad_norm = clip;
    cfg.device = DeviceChoice::Sim;
    cfg.chunk_elements = Some(32768);
    cfg.host_budget = Budget::AllChunks;
    cfg.precision = Precision::F32;
    cfg.optimizer_threads = 1;
    cfg
}

fn initial(i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|k| ((k * 7 + i) % 13) as f32 * 0.1 - 0.6)
        .collect()
}

fn grad(step: usize, i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| ((j * 5 + 3 * step + i) % 11) as f32 * 0.03 - 0.15)
        .collect()
}

/// Rank `rank` of `world`'s part of a tensor of `n` elements (the halves of the tests).
fn part(rank: usize, world: usize, n: usize) -> std::ops::Range<usize> {
    let s = n.div_ceil(world);
    (rank * s).min(n)..((rank + 1) * s).min(n)
}

/// A trainer over `rank`'s parts of the tensors, their initial values set.
fn open(dir: &std::path::Path, clip: Option<f32>, rank: usize, world: usize) -> Trainer {
    let specs: Vec<ParamSpec> = LENS
        .iter()
        .enumerate()
        .map(|(i, &n)| ParamSpec::new(format!("p{i}"), &[part(rank, world, n).len()], true))
        .collect();
    let mut t = Trainer::open(&specs, &config(dir, clip)).unwrap();
    for (i, &n) in LENS.iter().enumerate() {
        t.set_values(i, &initial(i, n)[part(rank, world, n)])
            .unwrap();
    }
    t
}

/// `STEPS` steps of `rank`'s parts; its masters and reported norms after them.
fn train(t: &mut Trainer, rank: usize, world: usize) -> (Vec<Vec<f32>>, Vec<f64>) {
    let mut norms = Vec::new();
    for step in 0..STEPS {
        for (i, &n) in LENS.iter().enumerate() {
            let g = grad(step, i, n);
            t.put_grad(i, Values::F32(&g[part(rank, world, n)]), true, true)
                .unwrap();
        }
        t.step(&mut |_| {}).unwrap();
        norms.push(t.step_loop().stats().grad_norm);
    }
    let masters = (0..LENS.len()).map(|i| t.values(i).unwrap()).collect();
    (masters, norms)
}

/// The in-process all-reduce double: each rank writes its value into its slot, waits
/// for the other, and sums both (in rank order, the same sum on both).
struct Exchange {
    rank: usize,
    slots: Arc<Mutex<[f64; 2]>>,
    barrier: Arc<Barrier>,
}

impl NormPeers for Exchange {
    fn sum_sq_norm(&mut self, local: f64) -> tidestore_train::Result<f64> {
        self.slots.lock().unwrap()[self.rank] = local;
        self.barrier.wait();
        let [a, b] = *self.slots.lock().unwrap();
        self.barrier.wait();
        Ok(a + b)
    }
}

/// Two ranks on threads, each over its halves; what each trained.
fn two_ranks(clip: Option<f32>) -> Vec<(Vec<Vec<f32>>, Vec<f64>)> {
    let slots = Arc::new(Mutex::new([0.0; 2]));
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (slots, barrier) = (slots.clone(), barrier.clone());
            std::thread::spawn(move || {
                let dir = tempfile::tempdir().unwrap();
                let mut t = open(dir.path(), clip, rank, 2);
                t.set_norm_peers(Box::new(Exchange {
                    rank,
                    slots,
                    barrier,
                }));
                train(&mut t, rank, 2)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn one_rank(clip: Option<f32>) -> (Vec<Vec<f32>>, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), clip, 0, 1);
    train(&mut t, 0, 1)
}

/// The largest relative difference between the ranks' halves, put together, and the
/// one trainer's whole tensors.
fn worst_rel(ranks: &[(Vec<Vec<f32>>, Vec<f64>)], whole: &[Vec<f32>]) -> f64 {
    let mut worst = 0.0f64;
    for (i, w) in whole.iter().enumerate() {
        let joined: Vec<f32> = ranks.iter().flat_map(|r| r.0[i].clone()).collect();
        assert_eq!(joined.len(), w.len());
        for (a, b) in joined.iter().zip(w) {
            let rel = ((a - b).abs() / b.abs().max(1e-3)) as f64;
            worst = worst.max(rel);
        }
    }
    worst
}

#[test]
fn sharded_steps_without_clipping_are_bit_identical() {
    let ranks = two_ranks(None);
    let (whole, _) = one_rank(None);
    assert_eq!(worst_rel(&ranks, &whole), 0.0);
}

#[test]
fn sharded_steps_clip_by_the_whole_gradients_norm() {
    // The gradients' norm is ~4.5 a step: a clip at 0.5 scales every step.
    let ranks = two_ranks(Some(0.5));
    let (whole, norms) = one_rank(Some(0.5));
    let worst = worst_rel(&ranks, &whole);
    assert!(worst < 1e-6, "sharded and whole differ by {worst:e}");
    for r in &ranks {
        for (a, b) in r.1.iter().zip(&norms) {
            assert!((a - b).abs() <= 1e-9 * b, "norm {a} on a rank, {b} whole");
        }
    }
    assert!(
        norms.iter().all(|&n| n > 1.0),
        "the clip must bite: {norms:?}"
    );
    // Without the other rank's norm, each rank would clip by its half's norm alone.
    let dir = tempfile::tempdir().unwrap();
    let mut alone = open(dir.path(), Some(0.5), 0, 2);
    let (masters, _) = train(&mut alone, 0, 2);
    assert_ne!(masters, ranks[0].0, "the peers' norm changed nothing");
}

/// Peers that answer `reply(local)`.
struct Fixed<F: FnMut(f64) -> tidestore_train::Result<f64> + Send>(F);

impl<F: FnMut(f64) -> tidestore_train::Result<f64> + Send> NormPeers for Fixed<F> {
    fn sum_sq_norm(&mut self, local: f64) -> tidestore_train::Result<f64> {
        (self.0)(local)
    }
}

#[test]
fn a_non_finite_norm_elsewhere_skips_the_step_here() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), None, 0, 2);
    t.set_norm_peers(Box::new(Fixed(|local| Ok(local + f64::INFINITY))));
    let before: Vec<Vec<f32>> = (0..LENS.len()).map(|i| t.values(i).unwrap()).collect();
    for (i, &n) in LENS.iter().enumerate() {
        let g = grad(0, i, n);
        t.put_grad(i, Values::F32(&g[part(0, 2, n)]), true, true)
            .unwrap();
    }
    t.step(&mut |_| {}).unwrap();
    let stats = t.step_loop().stats();
    assert_eq!((stats.steps_applied, stats.steps_skipped), (0, 1));
    let after: Vec<Vec<f32>> = (0..LENS.len()).map(|i| t.values(i).unwrap()).collect();
    assert_eq!(before, after);
}

#[test]
fn a_failed_all_reduce_poisons_the_loop() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), None, 0, 2);
    t.set_norm_peers(Box::new(Fixed(|_| {
        Err(TrainError::Collective(
            "rank 1 closed the connection".into(),
        ))
    })));
    for (i, &n) in LENS.iter().enumerate() {
        let g = grad(0, i, n);
        t.put_grad(i, Values::F32(&g[part(0, 2, n)]), true, true)
            .unwrap();
    }
    let e = t.step(&mut |_| {}).unwrap_err();
    assert!(
        matches!(&e, TrainError::Collective(m) if m.contains("rank 1")),
        "{e}"
    );
    assert!(t.step_loop().is_poisoned());
    assert_eq!(t.step_loop().stats().steps_applied, 0);
}
