//! One streamed AdamW step over N parameters whose M and V (and, by default, master
//! parameters) live in a swap file on the real disk, with a bounded host budget; and, in
//! the same run, the disk's simultaneous read+write rate measured by fio, so the step
//! time can be set against the time the disk alone needs to move the same bytes.
//!
//! ```text
//! cargo run --release -p tidestore-optimizer --example stream_step -- \
//!     [--params 1000000000] [--budget-mib 1024] [--dir ./.tidestore-swap] \
//!     [--group-params 8388608] [--master nvme|host] [--steps 1] [--threads 0] \
//!     [--fio-seconds 20] [--keep]
//! ```
//! Peak RSS: run it under `/usr/bin/time -v`. Gradients (bf16) and the updated bf16
//! parameters use one group-sized buffer each, reused for every group (standing in for
//! the GPU copies), so host memory is the ring plus two group buffers (plus the master
//! parameters with `--master host`). The swap file and fio's file are deleted at the end
//! unless `--keep`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use tidestore_io::{Compression, IoConfig, SwapFile};
use tidestore_optimizer::half::bf16;
use tidestore_optimizer::stream::{
    GroupSpec, MasterPlace, Order, StreamConfig, StreamingOptimizer,
};
use tidestore_optimizer::{AdamW, CpuConfig, Grads, HyperParams, ParamOut, StepState};

struct Args {
    params: usize,
    budget_mib: u64,
    dir: PathBuf,
    group_params: usize,
    master: MasterPlace,
    steps: u64,
    threads: usize,
    fio_seconds: u64,
    keep: bool,
}

fn parse() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        params: 1_000_000_000,
        budget_mib: 1024,
        dir: PathBuf::from("./.tidestore-swap"),
        group_params: 8 << 20,
        master: MasterPlace::Nvme,
        steps: 1,
        threads: 0,
        fio_seconds: 20,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--params" => a.params = val()?.replace('_', "").parse()?,
            "--budget-mib" => a.budget_mib = val()?.parse()?,
            "--dir" => a.dir = PathBuf::from(val()?),
            "--group-params" => a.group_params = val()?.replace('_', "").parse()?,
            "--master" => {
                a.master = match val()?.as_str() {
                    "nvme" => MasterPlace::Nvme,
                    "host" => MasterPlace::Host,
                    other => return Err(format!("--master {other}: nvme or host").into()),
                }
            }
            "--steps" => a.steps = val()?.parse()?,
            "--threads" => a.threads = val()?.parse()?,
            "--fio-seconds" => a.fio_seconds = val()?.parse()?,
            "--keep" => a.keep = true,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    Ok(a)
}

/// fio's simultaneous read+write rate (bytes/s, read + write) on a file in `dir`, with
/// the engine's block size and queue depth.
fn fio_rate(
    dir: &Path,
    block_bytes: usize,
    depth: u32,
    seconds: u64,
) -> Result<(f64, f64), String> {
    let file = dir.join("fio.test");
    let size_mib = 4096;
    let out = Command::new("fio")
        .args([
            "--name=rw",
            &format!("--filename={}", file.display()),
            "--rw=rw",
            "--rwmixread=50",
            "--direct=1",
            "--ioengine=io_uring",
            &format!("--bs={block_bytes}"),
            &format!("--iodepth={depth}"),
            &format!("--size={size_mib}M"),
            &format!("--runtime={seconds}"),
            "--time_based",
            "--output-format=json",
        ])
        .output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(|e| format!("fio not runnable: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("fio json: {e}"))?;
    let job = &v["jobs"][0];
    let r = job["read"]["bw_bytes"].as_f64().unwrap_or(0.0);
    let w = job["write"]["bw_bytes"].as_f64().unwrap_or(0.0);
    Ok((r, w))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse()?;
    std::fs::create_dir_all(&a.dir)?;
    let n_groups = a.params.div_ceil(a.group_params);
    let groups: Vec<GroupSpec> = (0..n_groups)
        .map(|i| GroupSpec {
            len: a.group_params.min(a.params - i * a.group_params),
            hp: HyperParams::default(),
        })
        .collect();
    let (slot_bytes, slots) = StreamingOptimizer::swap_shape(&groups, a.master);
    let io = IoConfig::default();
    let swap_path = a.dir.join("stream_step.swap");
    if swap_path.exists() {
        std::fs::remove_file(&swap_path)?;
    }
    let t = Instant::now();
    let swap = SwapFile::create(&swap_path, slot_bytes, slots, &io, Compression::Off)?;
    let cfg = StreamConfig {
        host_budget_bytes: a.budget_mib << 20,
        master: a.master,
        ..StreamConfig::default()
    };
    let cpu = AdamW::new(CpuConfig {
        threads: a.threads,
        ..CpuConfig::default()
    })?;
    let mut opt = StreamingOptimizer::new(cpu, groups.clone(), swap, cfg)?;
    println!(
        "params {} in {n_groups} groups of {}; master {:?}; engine {}; ring {} groups x {} buffers of {} MiB = {} MiB (budget {} MiB); kernel {:?} x{} threads",
        a.params,
        a.group_params,
        a.master,
        opt.swap().engine().kind(),
        opt.ring_groups(),
        opt.ring().count() / opt.ring_groups(),
        opt.ring().buf_bytes() >> 20,
        (opt.ring().count() * opt.ring().buf_bytes()) >> 20,
        a.budget_mib,
        opt.cpu().simd_level(),
        opt.cpu().threads(),
    );
    opt.initialize(|g, p| {
        for (j, x) in p.iter_mut().enumerate() {
            *x = ((g * 31 + j) % 1000) as f32 * 1e-3;
        }
    })?;
    println!(
        "initialised the swap file ({:.1} GB) in {:.1} s",
        opt.swap().file_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );

    let grads: Vec<bf16> = (0..a.group_params)
        .map(|j| bf16::from_f32(((j % 97) as f32 - 48.0) * 1e-4))
        .collect();
    let mut out = vec![bf16::ZERO; a.group_params];
    let mut times = Vec::new();
    for step in 1..=a.steps {
        opt.reset_stats();
        let t = Instant::now();
        let mut s = opt.begin(StepState::new(step), Order::Ascending)?;
        for (i, g) in groups.iter().enumerate() {
            s.update_group(
                i,
                Grads::Bf16(&grads[..g.len]),
                Some(ParamOut::Bf16(&mut out[..g.len])),
            )?;
        }
        s.finish()?;
        let secs = t.elapsed().as_secs_f64();
        times.push(secs);
        let st = opt.stats();
        println!(
            "step {step}: {secs:.3} s; read {:.2} GB, wrote {:.2} GB ({:.2} GB/s combined); waited for reads {:.3} s, kernel {:.3} s, final drain {:.3} s; ring buffers peak {}/{}",
            st.bytes_read as f64 / 1e9,
            st.bytes_written as f64 / 1e9,
            (st.bytes_read + st.bytes_written) as f64 / secs / 1e9,
            st.read_wait_ns as f64 / 1e9,
            st.compute_ns as f64 / 1e9,
            st.drain_ns as f64 / 1e9,
            st.buffers_in_use_peak,
            opt.ring().count(),
        );
    }
    let st = opt.stats();
    let moved = (st.bytes_read + st.bytes_written) as f64;
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    drop(opt);
    if !a.keep {
        std::fs::remove_file(&swap_path)?;
    }
    match fio_rate(&a.dir, io.block_bytes, io.queue_depth, a.fio_seconds) {
        Ok((r, w)) => {
            let rate = r + w;
            let bound16 = 16.0 * a.params as f64 / rate;
            let bound_moved = moved / rate;
            println!(
                "fio rw=rw 50/50 direct io_uring bs={} iodepth={}: read {:.2} GB/s + write {:.2} GB/s = {:.2} GB/s",
                io.block_bytes,
                io.queue_depth,
                r / 1e9,
                w / 1e9,
                rate / 1e9
            );
            println!(
                "disk-bound time: 16 B/param -> {bound16:.3} s (step/bound = {:.3}x); bytes actually moved ({:.1} B/param) -> {bound_moved:.3} s (step/bound = {:.3}x)",
                best / bound16,
                moved / a.params as f64,
                best / bound_moved
            );
        }
        Err(e) => println!("no disk-bound time: {e}"),
    }
    Ok(())
}
