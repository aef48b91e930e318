//! Guards against the bench's GPU path computing anything other than the host path:
//! on a CUDA GPU, the checksum kernel must give the host's sum for ranges of every
//! alignment and length, the gradient-fill kernel the host generator's bf16 bits, and a
//! whole bench with `device.kind = "cuda"` (forward/backward through the kernels, the
//! step on the GPU with `optimizer.device = "gpu"`, and `auto`) the same checksum and
//! gradient norm as the simulated device with the host step.
//!
//! Built without the `cuda` feature, or where there is no libcuda or no GPU, each test
//! prints `skipped: <reason>` and returns: it never fails for missing hardware and never
//! passes without having run.

#[cfg(feature = "cuda")]
mod on_gpu {
    use tidestore::Config;
    use tidestore_app::bench::{self, BenchReport, NoProgress};
    use tidestore_app::gpu::{self, BenchKernels};

    /// The bench's kernels on GPU 0, or why not (printed as the skip reason).
    fn kernels() -> Result<BenchKernels, String> {
        if !gpu::cuda_available() {
            return Err("libcuda not found".into());
        }
        BenchKernels::new(0).map_err(|e| format!("the GPU kernels cannot run here: {e}"))
    }

    /// A deterministic byte pattern.
    fn bytes(n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (bench::splitmix64(3, i) >> 56) as u8)
            .collect()
    }

    #[test]
    fn kernels_match_the_host_bit_for_bit() {
        let mut k = match kernels() {
            Ok(k) => k,
            Err(why) => {
                println!("skipped: {why}");
                return;
            }
        };
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 1000, (1 << 20) + 3] {
            let data = bytes(len);
            for lead in 0..8 {
                let got = k
                    .checksum_of_host_bytes(&data, lead)
                    .expect("checksum kernel");
                assert_eq!(
                    got,
                    bench::checksum(&data),
                    "checksum of {len} bytes starting {lead} bytes past an 8-aligned address"
                );
            }
        }
        for (first, n) in [(5u64, 0usize), (0, 1), (977, 4096), (131, (1 << 20) + 5)] {
            let got = k
                .grad_bits(bench::GRAD_SEED, first, n, bench::GRAD_SCALE)
                .expect("gradient-fill kernel");
            for (j, &bits) in got.iter().enumerate() {
                let want = bench::grad_value(bench::GRAD_SEED, first + j as u64, bench::GRAD_SCALE);
                assert_eq!(bits, want.to_bits(), "element {j} from {first}");
            }
        }
    }

    const SMALL: &str = "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[device]\nkind = \"{kind}\"\nbudget = \"{budget}\"\nsim_memory = \"8MiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
[optimizer]\ndevice = \"{device}\"\n\
[workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 3\n";

    /// The bench on `kind` with `optimizer.device = device` and `device.budget = budget`
    /// (on a GPU the chunk slab: the step's four chunks of a tensor must fit it).
    fn run(kind: &str, device: &str, budget: &str) -> tidestore_app::Result<BenchReport> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("tidestore.toml");
        let body = SMALL
            .replace("{kind}", kind)
            .replace("{device}", device)
            .replace("{budget}", budget);
        std::fs::write(&path, body).expect("write config");
        let cfg = Config::load(&path).expect("config loads");
        bench::run(&cfg, &mut NoProgress)
    }

    #[test]
    fn bench_on_the_gpu_matches_the_simulated_host_run() {
        if let Err(why) = kernels() {
            println!("skipped: {why}");
            return;
        }
        let reference = run("sim", "cpu", "512KiB").expect("sim + cpu bench");
        // "gpu" with a slab that holds one tensor's four chunks (evicting the rest),
        // "auto" with one that holds all the trainable state.
        for (device, budget) in [("gpu", "2MiB"), ("auto", "8MiB")] {
            let r = run("cuda", device, budget).expect("cuda bench");
            assert_eq!(r.budgets.device_kind, "cuda");
            assert_eq!(
                r.optimizer.placement, "gpu",
                "{device}: {}",
                r.optimizer.placement_reason
            );
            assert!(!r.optimizer.simulated, "{device}: a real GPU step");
            assert_eq!(
                r.checksum, reference.checksum,
                "{device}: checksum of every byte read"
            );
            assert_eq!(
                r.optimizer.grad_norm.to_bits(),
                reference.optimizer.grad_norm.to_bits(),
                "{device}: grad norm"
            );
        }
        // The host step on the GPU device: forward/backward through the kernels only.
        let r = run("cuda", "cpu", "512KiB").expect("cuda + cpu bench");
        assert_eq!(r.optimizer.placement, "cpu");
        assert_eq!(r.checksum, reference.checksum, "cpu step: checksum");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn kernels_match_the_host_bit_for_bit() {
    println!("skipped: built without the `cuda` feature");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn bench_on_the_gpu_matches_the_simulated_host_run() {
    println!("skipped: built without the `cuda` feature");
}
