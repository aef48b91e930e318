//! `Trainer::resident_master`: the fp32 master copy a front end makes its own tensor's
//! memory (`tidestore.AdamW` binds CPU fp32 parameters to it). It is handed out only
//! where nothing can move it, it is what the steps update in place, and compute reads
//! from the host pool once one is out, so it holds the master's values after any number
//! of steps, an import and a checkpoint load.

use tidestore_train::{
    Budget, DeviceChoice, HyperParams, ParamSpec, Resident, TensorState, Trainer, TrainerConfig,
    Values,
};

const SHAPES: [&[usize]; 3] = [&[300, 70], &[70], &[12000]];

fn config(dir: &std::path::Path, host_budget: Budget) -> TrainerConfig {
    let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-2, (0.9, 0.999), 1e-8, 0.1), dir);
    cfg.device = DeviceChoice::Sim;
    cfg.chunk_elements = Some(32768); // two chunks a list
    cfg.host_budget = host_budget;
    cfg.optimizer_threads = 2;
    cfg
}

fn open(dir: &std::path::Path, host_budget: Budget) -> Trainer {
    let specs: Vec<ParamSpec> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("p{i}"), s, true))
        .collect();
    let mut t = Trainer::open(&specs, &config(dir, host_budget)).unwrap();
    for (i, shape) in SHAPES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|k| ((k * 7 + i) % 13) as f32 * 0.1 - 0.6)
            .collect();
        t.set_values(i, &v).unwrap();
    }
    t
}

/// The values at a resident master's address.
fn at(r: Resident) -> Vec<f32> {
    // SAFETY: `resident_master` promises `len` initialised f32 at `addr` for the
    // trainer's life, and every trainer this reads from is alive and not stepping.
    unsafe { std::slice::from_raw_parts(r.addr as *const f32, r.len) }.to_vec()
}

fn step(t: &mut Trainer, k: usize) {
    for (i, shape) in SHAPES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let g: Vec<f32> = (0..n)
            .map(|j| ((j + 3 * k + i) % 11) as f32 * 0.01 - 0.05)
            .collect();
        t.put_grad(i, Values::F32(&g), true, true).unwrap();
    }
    t.step(&mut |_| {}).unwrap();
}

#[test]
fn a_resident_master_is_stepped_in_place_and_never_moves() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), Budget::AllChunks);
    let resident: Vec<Resident> = (0..SHAPES.len())
        .map(|i| {
            t.resident_master(i)
                .unwrap()
                .expect("every chunk fits the host pool")
        })
        .collect();
    // Asking for compute on the device changes nothing now: a fetch would otherwise
    // take the chunk to the device tier.
    t.set_compute_on_device(true);
    for k in 0..4 {
        step(&mut t, k);
        let fetched = t.fetch(1, TensorState::HoldAfterFwd).unwrap();
        assert_eq!(
            fetched,
            at(resident[1]),
            "step {k}: compute read another copy"
        );
    }
    for (i, r) in resident.iter().enumerate() {
        assert_eq!(
            at(*r),
            t.values(i).unwrap(),
            "p{i}: the master moved or was copied"
        );
        assert_eq!(
            t.resident_master(i).unwrap(),
            Some(*r),
            "p{i}'s address changed"
        );
    }
    assert_eq!(t.counters()["host_evictions"], 0);

    // A checkpoint loaded lands in the same memory.
    let ckpt = dir.path().join("c.safetensors");
    t.save(&ckpt, Default::default()).unwrap();
    let saved = at(resident[0]);
    step(&mut t, 9);
    assert_ne!(at(resident[0]), saved, "the step changed nothing");
    t.load(&ckpt).unwrap();
    assert_eq!(
        at(resident[0]),
        saved,
        "the load did not reach the resident memory"
    );
}

#[test]
fn a_master_the_host_pool_cannot_keep_is_not_handed_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = open(dir.path(), Budget::Chunks(5));
    assert_eq!(t.resident_master(0).unwrap(), None);
    // Nothing changed: the trainer still trains.
    step(&mut t, 0);
}
