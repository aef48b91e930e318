//! Guards data-parallel `tidestore finetune` as a user launches it: `mpirun -np 2
//! tidestore finetune` on the tiny LLaMA, each rank a process holding its shard of every
//! parameter and of the optimizer state, must train as one process with the doubled
//! batch (`train.accumulation` twice as large): the same losses (≤ 1e-5 relative, fp32)
//! and the same export, full and LoRA, with the step in the next forward and clipping;
//! each rank keeps half of master, M and V; the gradients' reduce-scatter moves the
//! bytes the layout predicts. A rank killed with -9 ends the job within seconds, and a
//! resume from what the ranks wrote is bit-identical to the run never stopped. Ranks
//! with different configs, and a resume on another world size, are refused naming why.
//!
//! These need the `mpi` feature and Open MPI's `mpirun` (`.ci/run` installs both and runs
//! them); without them they print why and pass nothing. Without the feature, a binary
//! launched as a rank refuses to run alone (that test always runs). Launched by torchrun's
//! variables, a binary joins over NCCL: without the `nccl` feature, or without a GPU, it
//! says why and trains nothing (the NCCL ranks themselves run in `.ci/gpu-check`).

use std::path::Path;
use std::process::Command;

mod common;

use common::{bin, ok};

const TEXT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/data/genesis-kjv.txt"
);

/// What a case adds to the config: lines of `[optimizer]` and of `[train]`.
#[derive(Debug, Clone, Copy)]
struct Extra {
    optimizer: &'static str,
    train: &'static str,
}

const PLAIN: Extra = Extra {
    optimizer: "",
    train: "",
};

/// The config: `accumulation` micro-batches of 2 a step, with `extra`.
fn config(accumulation: u32, extra: Extra) -> String {
    let Extra { optimizer, train } = extra;
    format!(
        "[device]\nkind = \"sim\"\nbudget = \"16MiB\"\n[host]\nbudget = \"16MiB\"\n\
         [nvme]\ndir = \"swap\"\nsize = \"256MiB\"\n[optimizer]\nlr = 1e-3\nthreads = 1\n\
         {optimizer}\
         [train]\nmodel_dir = \"model\"\ntext = \"{TEXT}\"\nsteps = 6\nsequence = 32\n\
         micro_batch = 2\naccumulation = {accumulation}\ncheckpoint_every = 2\n\
         checkpoint_dir = \"ckpt\"\nexport_dir = \"export\"\n{train}"
    )
}

/// A directory with the tiny model and `tidestore.toml`.
fn setup(accumulation: u32, extra: Extra) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("swap")).unwrap();
    ok(dir.path(), common::TINY_MODEL_ARGS);
    std::fs::write(
        dir.path().join("tidestore.toml"),
        config(accumulation, extra),
    )
    .unwrap();
    dir
}

#[test]
fn launched_as_a_rank_without_mpi_it_refuses_to_run_alone() {
    if cfg!(feature = "mpi") {
        eprintln!("skipped: this build has the `mpi` feature (the MPI tests below run)");
        return;
    }
    let d = setup(1, PLAIN);
    let out = Command::new(bin())
        .current_dir(d.path())
        .args(["finetune"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("one of 2 ranks") && err.contains("--features mpi"),
        "{err}"
    );
    assert!(!d.path().join("ckpt").exists(), "nothing was trained");
}

#[test]
fn launched_by_torchrun_it_joins_over_nccl_or_says_why_not() {
    let cuda = [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
    ];
    if cfg!(feature = "nccl") && cuda.iter().any(|p| Path::new(p).exists()) {
        eprintln!("skipped: this machine has libcuda (.ci/gpu-check runs NCCL ranks on GPUs)");
        return;
    }
    let d = setup(1, PLAIN);
    let out = Command::new(bin())
        .current_dir(d.path())
        .args(["finetune"])
        .envs([("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")])
        .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let why = if cfg!(feature = "nccl") {
        "libcuda cannot be loaded"
    } else {
        "built without NCCL"
    };
    assert!(err.contains(why), "{err}");
    assert!(!d.path().join("ckpt").exists(), "nothing was trained");
}

/// Where `mpirun` is, when this build can use it; else why not.
fn mpirun() -> Result<&'static str, String> {
    if !cfg!(feature = "mpi") {
        return Err("this build has no `mpi` feature (cargo test --features mpi)".into());
    }
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => Ok("mpirun"),
        _ => Err("no `mpirun` on PATH (Debian: openmpi-bin)".into()),
    }
}

/// How these tests launch ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// `mpirun`, where this build has the `mpi` feature and Open MPI is installed.
    Mpi,
    /// One process per rank with torchrun's variables, where this build has the `nccl`
    /// feature and the machine two GPUs (`.ci/gpu-check`).
    Nccl,
}

impl Engine {
    /// The engine's name in the report.
    fn name(self) -> &'static str {
        match self {
            Engine::Mpi => "mpi",
            Engine::Nccl => "nccl",
        }
    }
}

/// The engine ranks run with here; else why none can.
fn engine() -> Result<Engine, String> {
    let mpi_why = match mpirun() {
        Ok(_) => return Ok(Engine::Mpi),
        Err(why) => why,
    };
    if !cfg!(feature = "nccl") {
        return Err(mpi_why);
    }
    let gpus = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| {
            let list = String::from_utf8_lossy(&o.stdout).into_owned();
            list.lines().filter(|l| l.starts_with("GPU ")).count()
        })
        .unwrap_or(0);
    match gpus {
        2.. => Ok(Engine::Nccl),
        n => Err(format!("{mpi_why}; NCCL ranks need two GPUs, {n} here")),
    }
}

/// The engine, or `None` after printing why this test cannot run here.
fn ranks_engine() -> Option<Engine> {
    engine().map_err(|why| eprintln!("skipped: {why}")).ok()
}

/// Whether this test, which launches through `mpirun` itself, cannot run here (it
/// printed why).
fn skipped_without_mpi() -> bool {
    match mpirun() {
        Ok(_) => false,
        Err(why) => {
            eprintln!("skipped: {why}");
            true
        }
    }
}

/// `mpirun` of `ranks` ranks of the binary with `args`, in `dir`.
fn launch(dir: &Path, ranks: usize, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.current_dir(dir)
        .args(["--oversubscribe", "-np", &ranks.to_string()])
        .arg(bin())
        .args(args)
        // CI runs as root; Open MPI asks for both to be set.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RUST_LOG", "warn");
    c
}

/// `ranks` processes of the binary with `args` in `dir`, each with torchrun's variables
/// (a port of its own per launch, the NCCL id file in `dir`); rank 0's output, after
/// every rank ended (all are killed past 10 minutes).
fn launch_nccl(dir: &Path, ranks: usize, args: &[&str]) -> std::process::Output {
    static LAUNCHES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let port = (20000 + (std::process::id() * 7 + n) % 20000).to_string();
    let mut procs: Vec<std::process::Child> = (0..ranks)
        .map(|r| {
            let r = r.to_string();
            Command::new(bin())
                .current_dir(dir)
                .args(args)
                .envs([("RANK", r.as_str()), ("LOCAL_RANK", r.as_str())])
                .envs([
                    ("WORLD_SIZE", ranks.to_string()),
                    ("MASTER_PORT", port.clone()),
                ])
                .env("MASTER_ADDR", "127.0.0.1")
                .env("TIDESTORE_NCCL_ID_DIR", dir)
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while procs.iter_mut().any(|p| p.try_wait().unwrap().is_none()) {
        if std::time::Instant::now() > deadline {
            procs.iter_mut().for_each(|p| drop(p.kill()));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut outs: Vec<_> = procs
        .into_iter()
        .map(|p| p.wait_with_output().unwrap())
        .collect();
    if let Some(bad) = outs.iter().find(|o| !o.status.success()) {
        return bad.clone();
    }
    outs.swap_remove(0)
}

fn ranks_ok(engine: Engine, dir: &Path, ranks: usize, args: &[&str]) -> serde_json::Value {
    let out = match engine {
        Engine::Nccl => launch_nccl(dir, ranks, args),
        Engine::Mpi => launch(dir, ranks, args).output().unwrap(),
    };
    assert!(
        out.status.success(),
        "{args:?} on {ranks} ranks: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("rank 0's JSON report")
}

fn losses(report: &serde_json::Value) -> Vec<f64> {
    let steps = report["steps"].as_array().unwrap();
    steps.iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// The export's tensors, whole files by name.
fn exported(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("export"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// One process with `accumulation = 2` against two ranks with 1 over `engine`: the
/// reports of both.
fn one_against_two(engine: Engine, extra: Extra) -> (serde_json::Value, serde_json::Value) {
    let (one_dir, two_dir) = (setup(2, extra), setup(1, extra));
    let one: serde_json::Value =
        serde_json::from_str(&ok(one_dir.path(), &["finetune", "--json"])).unwrap();
    let two = ranks_ok(engine, two_dir.path(), 2, &["finetune", "--json"]);
    let (a, b) = (losses(&one), losses(&two));
    eprintln!("{extra:?}\n one process: {a:?}\n two ranks:   {b:?}");
    let d = max_rel(&a, &b);
    assert!(d <= 1e-5, "{extra:?}: max relative loss difference {d:e}");
    assert!(a[5] < a[0], "it learns");
    // The export, written by rank 0 from every rank's shards: the same model.
    let (ea, eb) = (exported(one_dir.path()), exported(two_dir.path()));
    assert_eq!(ea.len(), eb.len());
    assert!(
        ea == eb,
        "{extra:?}: the exports differ (within 1e-5 of loss they may round apart; \
         here each rank's average is exact)"
    );
    assert_eq!(two["data_parallel"]["ranks"], 2);
    assert_eq!(two["data_parallel"]["engine"], engine.name());
    (one, two)
}

#[test]
fn two_ranks_train_as_one_process_with_the_doubled_batch() {
    let Some(engine) = ranks_engine() else {
        return;
    };
    let (one, two) = one_against_two(engine, PLAIN);
    // Half of master, M and V on each rank (each tensor's shard, page-rounded per
    // chunk).
    let per_rank = two["data_parallel"]["per_rank"].as_array().unwrap();
    assert_eq!(
        per_rank.len(),
        2,
        "rank 0's report holds every rank's figures"
    );
    for (r, figures) in per_rank.iter().enumerate() {
        assert_eq!(figures["rank"], r);
        for key in ["master_bytes", "m_bytes", "v_bytes"] {
            let a = one["state_bytes"][key].as_f64().unwrap();
            let b = figures["state_bytes"][key].as_f64().unwrap();
            eprintln!("{key}: one process {a}, rank {r} of two {b}");
            assert!(
                (0.5..0.55).contains(&(b / a)),
                "{key}: rank {r} keeps {b} of {a}"
            );
        }
    }
    assert_eq!(per_rank[0]["state_bytes"], two["state_bytes"]);
    // Each trained tensor's gradient reduce-scattered once a step (the other rank's
    // shard sent: ceil(n/2) f32s); the norm, loss and token count summed in f64s.
    let sent = &two["data_parallel"]["sent"];
    let params = one["params"].as_u64().unwrap();
    let rs = sent["reduce_scatter"].as_u64().unwrap();
    eprintln!("rank 0 sent {sent} over 6 steps; {params} parameters");
    assert!(
        rs >= 6 * params * 2 && rs <= 6 * (params * 2 + 4 * 64),
        "{rs}"
    );
    assert_eq!(sent["all_reduce"], 6 * (8 + 16));
    // The collectives ran beside compute (`train.collectives_ahead`, 8 by default):
    // after step 1, which learns the order, every fetch but a step's first found its
    // all-gather started ahead.
    let overlapped = &two["data_parallel"]["overlapped"];
    eprintln!("rank 0's collectives overlapped: {overlapped}");
    let (ahead, at_call) = (
        overlapped["gathers_ahead"].as_u64().unwrap(),
        overlapped["gathers_at_call"].as_u64().unwrap(),
    );
    let per_step = (ahead + at_call) / 6;
    assert_eq!(per_step * 6, ahead + at_call, "{overlapped}");
    assert_eq!(ahead, 5 * (per_step - 1), "{overlapped}");
    assert_eq!(overlapped["gathers_discarded"], 0);
    assert!(overlapped["scatters_behind"].as_u64().unwrap() > 0);
}

#[test]
fn two_ranks_train_lora_and_clip_in_the_next_forward_as_one_process() {
    let Some(engine) = ranks_engine() else {
        return;
    };
    one_against_two(
        engine,
        Extra {
            optimizer: "",
            train: "mode = \"lora\"\nlora_rank = 4\n",
        },
    );
    one_against_two(
        engine,
        Extra {
            optimizer: "max_grad_norm = 0.5\noverlap = \"forward\"\n",
            train: "",
        },
    );
    // Every collective waiting where it is asked for: the same losses and export.
    let (_, two) = one_against_two(
        engine,
        Extra {
            optimizer: "",
            train: "collectives_ahead = 0\n",
        },
    );
    assert_eq!(two["data_parallel"]["overlapped"]["gathers_ahead"], 0);
}

/// The pid of a rank: each rank's swap directory is `swap/finetune.PID`.
fn rank_pids(dir: &Path) -> Vec<u32> {
    let Ok(read) = std::fs::read_dir(dir.join("swap")) else {
        return Vec::new();
    };
    read.filter_map(|e| {
        let name = e.ok()?.file_name().to_string_lossy().into_owned();
        name.strip_prefix("finetune.")?.parse().ok()
    })
    .collect()
}

fn wait_for(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {secs} s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_rank_killed_ends_the_job_and_the_resume_is_bit_identical() {
    if skipped_without_mpi() {
        return;
    }
    let whole_dir = setup(1, PLAIN);
    let whole = ranks_ok(Engine::Mpi, whole_dir.path(), 2, &["finetune", "--json"]);

    // The same run, one rank killed with -9 once both have written step 2's
    // checkpoint (mid-step 3 or later, possibly while writing step 4's).
    let d = setup(1, PLAIN);
    let mut job = launch(d.path(), 2, &["finetune", "--json", "--steps", "200"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ckpt = |r: usize| {
        d.path()
            .join(format!("ckpt/rank{r}/ckpt-000002.safetensors"))
    };
    wait_for("step 2's checkpoints", 120, || {
        ckpt(0).exists() && ckpt(1).exists()
    });
    let victim = rank_pids(d.path())[0];
    let killed = std::time::Instant::now();
    let sent = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    wait_for("the job's end after a rank died", 60, || {
        job.try_wait().unwrap().is_some()
    });
    let status = job.wait().unwrap();
    eprintln!(
        "the job ended {:?} after the kill: {status}",
        killed.elapsed()
    );
    assert!(!status.success());

    // Resumed on two ranks: the run never stopped, step for step, and its export.
    let resumed = ranks_ok(
        Engine::Mpi,
        d.path(),
        2,
        &["finetune", "--json", "--resume"],
    );
    let from = resumed["resumed_from"].as_u64().unwrap() as usize;
    eprintln!("resumed from step {from}");
    assert!(from >= 2);
    assert_eq!(losses(&resumed), losses(&whole)[from..]);
    assert!(
        exported(d.path()) == exported(whole_dir.path()),
        "the exports differ"
    );

    // One process, or another world size, is refused on those checkpoints.
    let alone = common::run(d.path(), &["finetune", "--resume"]);
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(err.contains("checkpoints of a data-parallel run"), "{err}");
    let three = launch(d.path(), 3, &["finetune", "--resume"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&three.stderr);
    assert!(!three.status.success());
    assert!(
        err.contains("data-parallel ranks: checkpoint 2, this run 3"),
        "{err}"
    );
}

#[test]
fn ranks_with_different_settings_are_refused_naming_the_setting() {
    if skipped_without_mpi() {
        return;
    }
    let d = setup(1, PLAIN);
    let differences = [
        (
            config(1, PLAIN).replace("lr = 1e-3", "lr = 2e-3"),
            "rank 1 differs from rank 0: optimizer.lr = 0.002 against 0.001",
        ),
        // Not part of a checkpoint's identity, but the ranks' collectives must match.
        (
            config(1, PLAIN) + "collectives_ahead = 0\n",
            "rank 1 differs from rank 0: train.collectives_ahead = 0 against 8",
        ),
    ];
    for (other, want) in differences {
        std::fs::write(d.path().join("other.toml"), other).unwrap();
        // Open MPI's MPMD form: rank 0 with one config, rank 1 with the other.
        let mut c = launch(d.path(), 1, &["finetune"]);
        c.args([":", "-np", "1"])
            .arg(bin())
            .args(["-c", "other.toml", "finetune"]);
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(want), "{err}");
    }
}
