//! Guards against the bench's device step (`optimizer.device = "gpu"`) taking the wrong
//! views, offsets or chunks, dropping a write, or not running where it says: on the
//! simulated device it runs the CPU kernel over the simulated device memory, so a run
//! must give the same checksum (every byte read in forward and backward of every
//! iteration, which depends on every earlier step's writes) and the same gradient norm
//! as the host-pool run (`cpu`) of the same config, while its optimizer phase really
//! works on the device (chunks copied there) and the report says "gpu", simulated.
//! Also: `auto` on the simulated device is the host step, and says why.

use tidestore::Config;
use tidestore_app::bench::{self, BenchReport, NoProgress};

/// A small workload whose chunks live on all three tiers; the simulated device is
/// large enough to hold a tensor's four chunks during the step.
const SMALL: &str = "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[device]\nkind = \"sim\"\nbudget = \"512KiB\"\nsim_memory = \"8MiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
[optimizer]\ndevice = \"{device}\"\n\
[workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 3\n";

fn run(device: &str) -> BenchReport {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tidestore.toml");
    std::fs::write(&path, SMALL.replace("{device}", device)).expect("write config");
    let cfg = Config::load(&path).expect("config loads");
    bench::run(&cfg, &mut NoProgress).expect("bench runs")
}

fn optimizer_phase(r: &BenchReport) -> &bench::PhaseReport {
    r.phases
        .iter()
        .find(|p| p.name == "optimizer")
        .expect("optimizer phase")
}

#[test]
fn gpu_step_on_the_simulated_device_matches_the_host_step() {
    let cpu = run("cpu");
    let gpu = run("gpu");

    assert_eq!(cpu.optimizer.placement, "cpu");
    assert!(!cpu.optimizer.simulated);
    assert_eq!(gpu.optimizer.placement, "gpu");
    assert!(
        gpu.optimizer.simulated,
        "the sim device's step is simulated"
    );
    assert!(
        gpu.optimizer.placement_reason.contains("gpu"),
        "{}",
        gpu.optimizer.placement_reason
    );
    assert_eq!(gpu.optimizer.steps_applied, 3);

    // The chunks really were stepped on the device: master, M and V copied there.
    let (c, g) = (optimizer_phase(&cpu), optimizer_phase(&gpu));
    assert_eq!(
        c.host_to_device_bytes, 0,
        "the host step moves nothing to the device"
    );
    assert!(
        g.host_to_device_bytes > 0 && g.peak_device_bytes > 0,
        "the device step uses the device: {g:?}"
    );

    // Same data everywhere: every byte read, and the gradients.
    assert_eq!(gpu.checksum, cpu.checksum, "checksum of every byte read");
    assert_eq!(
        gpu.optimizer.grad_norm.to_bits(),
        cpu.optimizer.grad_norm.to_bits(),
        "grad norm {} vs {}",
        gpu.optimizer.grad_norm,
        cpu.optimizer.grad_norm
    );
    assert!(cpu.optimizer.grad_norm > 0.0);
}

#[test]
fn auto_on_the_simulated_device_steps_on_the_host_and_says_why() {
    let auto = run("auto");
    assert_eq!(auto.optimizer.placement, "cpu");
    assert!(!auto.optimizer.simulated);
    assert!(
        auto.optimizer.placement_reason.contains("simulated"),
        "{}",
        auto.optimizer.placement_reason
    );
    assert_eq!(optimizer_phase(&auto).host_to_device_bytes, 0);
}
