//! Guards against a bench run inheriting an earlier run's state through the swap file:
//! were the store to take chunks already in a swap file as their contents, a second run
//! in the same `nvme.dir` would start from the first run's M and V (and give another
//! checksum). Also: a swap file of another shape (another chunk size) is
//! replaced, and a run then gives what a run in a fresh folder gives.

use tidestore::Config;
use tidestore_app::bench::{self, BenchReport, NoProgress};

const SMALL: &str = "[io]\nblock_size = 4096\nqueue_depth = 8\n\
[chunk]\nsize = \"{chunk}\"\n\
[device]\nkind = \"sim\"\nbudget = \"512KiB\"\n\
[host]\nbudget = \"2MiB\"\n\
[nvme]\ndir = \"swap\"\nsize = \"16MiB\"\n\
[workload]\nmodel = \"custom\"\narch = \"gpt2\"\nlayers = 4\nhidden = 64\nheads = 4\n\
intermediate = 256\nvocab = 512\nsequence = 64\niterations = 2\n";

fn run_in(dir: &std::path::Path, chunk: &str) -> BenchReport {
    let path = dir.join("tidestore.toml");
    std::fs::write(&path, SMALL.replace("{chunk}", chunk)).expect("write config");
    let cfg = Config::load(&path).expect("config loads");
    bench::run(&cfg, &mut NoProgress).expect("bench runs")
}

#[test]
fn a_second_run_in_the_same_folder_starts_from_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = run_in(dir.path(), "auto");
    let swap = dir
        .path()
        .join("swap")
        .join(tidestore_chunk::SWAP_FILE_NAME);
    assert!(swap.exists(), "the run used {}", swap.display());
    let second = run_in(dir.path(), "auto");
    assert_eq!(first.checksum, second.checksum);
    assert_eq!(first.optimizer.grad_norm, second.optimizer.grad_norm);

    // Another chunk size: another slot size, so the file is replaced; the run gives what
    // it gives in a folder of its own.
    let resized = run_in(dir.path(), "256KiB");
    let fresh_dir = tempfile::tempdir().expect("temp dir");
    let fresh = run_in(fresh_dir.path(), "256KiB");
    assert_eq!(resized.checksum, fresh.checksum);
    assert_ne!(
        resized.chunks.slot_bytes, first.chunks.slot_bytes,
        "the two chunk sizes give two swap-file shapes"
    );
}
