//! `tidestore io-bench`: sequential write then read of one file through the chunk I/O
//! engine, with the configuration's engine, block size and queue depth.
//!
//! The file lives in `nvme.dir` (created, preallocated, and removed afterwards unless it
//! was there before or `--keep-file` is given). It is moved in chunks: every chunk is one
//! request to the engine, which splits it into block-size pieces and keeps up to
//! `queue_depth` of them in flight. Enough chunks are outstanding at once that the queue
//! never runs dry between chunks.
//!
//! Invariants of a measured pass:
//! - every buffer comes from one [`BufferPool`] made (and registered with the engine)
//!   before the first pass: nothing is allocated between the start and the stop of the
//!   clock except what the progress bar does;
//! - a pass ends only when every request it submitted has completed, so its buffers are
//!   all back in the free list, even when a request failed;
//! - the device counters (`/sys/block/<dev>/stat`) are sampled just outside each pass,
//!   so the average request size printed beside a figure is that pass's.
//!
//! `--compare-fio` alternates our passes with fio's on the same file and settings;
//! `--tune` sweeps block size x queue depth with short runs and prints the best as TOML.

use std::path::{Path, PathBuf};

use crate::scratch::Scratch;
use std::time::Instant;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use tidestore::io::{AlignedBuf, BufferPool, Engine, IoConfig, IoRequest, Op};
use tidestore::{Config, EngineName, Size};

use super::blockdev::{BlockDev, DiskStat};
use super::stats::{mb_per_s, request_kib, Summary};
use super::{fio, Error};

/// Name of the benchmark's file inside `nvme.dir`.
const FILE_NAME: &str = "tidestore-io-bench.dat";

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Block sizes and queue depths `--tune` tries.
const TUNE_BLOCK_BYTES: [u64; 5] = [256 * KIB, 512 * KIB, MIB, 2 * MIB, 4 * MIB];
const TUNE_QUEUE_DEPTHS: [u32; 6] = [2, 4, 8, 16, 32, 64];

/// Chunks kept outstanding beyond those the queue holds, so the next chunk's pieces are
/// already waiting when one finishes.
const SPARE_CHUNKS: u64 = 2;

/// `--engine` values (the names of `io.engine`).
#[derive(Debug, Clone, Copy, ValueEnum)]
enum EngineArg {
    Auto,
    #[value(name = "io_uring")]
    IoUring,
    Threads,
}

impl From<EngineArg> for EngineName {
    fn from(e: EngineArg) -> Self {
        match e {
            EngineArg::Auto => EngineName::Auto,
            EngineArg::IoUring => EngineName::IoUring,
            EngineArg::Threads => EngineName::Threads,
        }
    }
}

/// Options of `io-bench`. Sizes take units: 4096, 64MiB, 4GiB, 1.5GB.
#[derive(Debug, clap::Args)]
pub struct IoBenchArgs {
    /// Bytes of the test file [default: 4GiB, or 1GiB with --tune].
    #[arg(long, value_name = "SIZE")]
    file_size: Option<Size>,

    /// Bytes of one request to the engine (a chunk) [default: chunk.size of the config].
    #[arg(long, value_name = "SIZE")]
    chunk_size: Option<Size>,

    /// Measured write and read passes [default: 5, or 1 per setting with --tune].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeats: Option<u32>,

    /// Override io.block_size.
    #[arg(long, value_name = "SIZE")]
    block_size: Option<Size>,

    /// Override io.queue_depth.
    #[arg(long, value_name = "N")]
    queue_depth: Option<u32>,

    /// Override io.engine.
    #[arg(long, value_enum, value_name = "ENGINE")]
    engine: Option<EngineArg>,

    /// Test file [default: nvme.dir/tidestore-io-bench.dat]. Its contents are overwritten.
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,

    /// Keep the test file afterwards (it is removed if this run created it).
    #[arg(long)]
    keep_file: bool,

    /// Alternate each of our passes with fio on the same file, block size, depth and
    /// O_DIRECT (ioengine=io_uring), and print ours/fio ratios. Needs fio installed.
    #[arg(long, conflicts_with = "tune")]
    compare_fio: bool,

    /// Sweep block size {256K..4M} x queue depth {2..64} with short runs and print the
    /// best as a TOML snippet for [io].
    #[arg(long)]
    tune: bool,
}

/// Put the flags that override the config into it and validate again; an impossible
/// value is reported against the flag that set it.
fn apply_overrides(cfg: &mut Config, args: &IoBenchArgs) -> Result<(), Error> {
    if let Some(b) = args.block_size {
        cfg.io.block_size = b;
    }
    if let Some(q) = args.queue_depth {
        cfg.io.queue_depth = q;
    }
    if let Some(e) = args.engine {
        cfg.io.engine = e.into();
    }
    cfg.validate().map_err(|e| {
        let flag = match e.key() {
            Some("io.block_size") if args.block_size.is_some() => Some("--block-size"),
            Some("io.queue_depth") if args.queue_depth.is_some() => Some("--queue-depth"),
            _ => None,
        };
        match (flag, &e) {
            (Some(flag), tidestore::Error::Config { reason, .. }) => Error::Usage {
                flag,
                reason: reason.clone(),
            },
            _ => Error::Tidestore(e),
        }
    })
}

/// File and chunk bytes from the flags and the config, checked.
fn sizes(cfg: &Config, args: &IoBenchArgs) -> Result<(u64, u64), Error> {
    let align = tidestore::io::ALIGN_BYTES as u64;
    let default_file = if args.tune { GIB } else { 4 * GIB };
    let file_bytes = args.file_size.map_or(default_file, Size::bytes);
    if file_bytes == 0 || !file_bytes.is_multiple_of(align) {
        return Err(Error::Usage {
            flag: "--file-size",
            reason: format!("{file_bytes} bytes is not a positive multiple of {align} (O_DIRECT)"),
        });
    }
    let mut chunk_bytes = args
        .chunk_size
        .or(cfg.chunk.size.fixed())
        .unwrap_or(Size::from_mib(64))
        .bytes();
    if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(align) {
        return Err(Error::Usage {
            flag: "--chunk-size",
            reason: format!("{chunk_bytes} bytes is not a positive multiple of {align} (O_DIRECT)"),
        });
    }
    if usize::try_from(chunk_bytes).is_err() || chunk_bytes > u64::from(u32::MAX) {
        return Err(Error::Usage {
            flag: "--chunk-size",
            reason: format!(
                "{} is larger than one request may be",
                Size::from_bytes(chunk_bytes)
            ),
        });
    }
    if chunk_bytes > file_bytes {
        if args.chunk_size.is_some() {
            return Err(Error::Usage {
                flag: "--chunk-size",
                reason: format!(
                    "{} is larger than the file ({}, --file-size)",
                    Size::from_bytes(chunk_bytes),
                    Size::from_bytes(file_bytes)
                ),
            });
        }
        tracing::info!(
            chunk = %Size::from_bytes(chunk_bytes),
            file = %Size::from_bytes(file_bytes),
            "chunk.size is larger than the file; using one chunk of the file's size"
        );
        chunk_bytes = file_bytes;
    }
    Ok((file_bytes, chunk_bytes))
}

/// One measured pass (ours or fio's).
#[derive(Debug, Clone, Copy)]
struct Measure {
    mb_s: f64,
    /// What the device saw during the pass (zero when it is unknown).
    disk: DiskStat,
}

/// Measures of one kind (ours or fio's, write or read) across repeats.
#[derive(Debug, Default)]
struct Series {
    mb_s: Vec<f64>,
    disk: DiskStat,
    disk_known: bool,
}

impl Series {
    fn push(&mut self, m: Measure, disk_known: bool) {
        self.mb_s.push(m.mb_s);
        self.disk = self.disk.plus(&m.disk);
        self.disk_known = disk_known;
    }

    fn avg_request_bytes(&self, write: bool) -> Option<f64> {
        self.disk_known
            .then(|| self.disk.avg_request_bytes(write))
            .flatten()
    }
}

/// Everything a pass needs, made once.
struct Bench {
    path: PathBuf,
    file_bytes: u64,
    chunk_bytes: u64,
    pool: BufferPool,
    free: Vec<AlignedBuf>,
    device: Option<BlockDev>,
    bar_style: ProgressStyle,
}

pub fn run(config_path: &Path, args: &IoBenchArgs) -> Result<(), Error> {
    let mut cfg = Config::load(config_path)?;
    apply_overrides(&mut cfg, args)?;
    let io = cfg.io_config()?;
    let (file_bytes, chunk_bytes) = sizes(&cfg, args)?;
    let repeats = args.repeats.unwrap_or(if args.tune { 1 } else { 5 });
    let dir = cfg.nvme_dir()?.to_path_buf();
    let path = args.file.clone().unwrap_or_else(|| dir.join(FILE_NAME));
    // Fail before any work when fio is asked for and missing.
    let fio_version = if args.compare_fio {
        Some(fio::check_installed()?)
    } else {
        None
    };

    // The pool is sized for the deepest setting of this run: enough chunks to cover the
    // bytes the queue holds, plus spares.
    let queue_bytes_max = if args.tune {
        TUNE_BLOCK_BYTES[TUNE_BLOCK_BYTES.len() - 1]
            * u64::from(TUNE_QUEUE_DEPTHS[TUNE_QUEUE_DEPTHS.len() - 1])
    } else {
        io.block_bytes as u64 * u64::from(io.queue_depth)
    };
    let chunks_in_file = file_bytes.div_ceil(chunk_bytes);
    let chunks_in_flight =
        (queue_bytes_max.div_ceil(chunk_bytes) + SPARE_CHUNKS).min(chunks_in_file);
    let buf_count =
        usize::try_from(chunks_in_flight).map_err(|_| Error::IoBench("too many buffers".into()))?;
    // Checked in `sizes`: a chunk fits in usize.
    let chunk_usize = chunk_bytes as usize;
    let pool = BufferPool::new(chunk_usize, buf_count)?;
    let mut free = Vec::with_capacity(buf_count);
    for i in 0..buf_count {
        let mut buf = pool
            .try_take()
            .ok_or_else(|| Error::IoBench("fresh pool has fewer buffers than asked".into()))?;
        fill_pattern(&mut buf, i as u64 + 1);
        free.push(buf);
    }

    // Removed at the end, on an error and on SIGINT/SIGTERM, if this run creates it
    // and --keep-file is not given.
    let guard = (!path.exists() && !args.keep_file).then(|| Scratch::path(&path));
    let device_dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(&dir)
        .to_path_buf();
    let device = match BlockDev::under(&device_dir) {
        Ok(d) => Some(d),
        Err(why) => {
            tracing::info!(%why, "no block device statistics; request sizes show as n/a");
            None
        }
    };
    let bar_style = ProgressStyle::with_template(
        "{prefix:>16} [{bar:32}] {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());

    let mut bench = Bench {
        path,
        file_bytes,
        chunk_bytes,
        pool,
        free,
        device,
        bar_style,
    };

    out!(
        "io-bench: file {} ({}), chunks of {}, at most {} outstanding ({} of buffers)",
        bench.path.display(),
        Size::from_bytes(file_bytes),
        Size::from_bytes(chunk_bytes),
        buf_count,
        Size::from_bytes(chunk_bytes * buf_count as u64),
    );
    match &bench.device {
        Some(d) => out!(
            "device:   {} ({}), largest request {}",
            d.name,
            d.dev,
            d.max_request_kib
                .map_or("unknown".to_string(), |k| format!("{k} KiB"))
        ),
        None => out!(
            "device:   none found under {} (request sizes n/a)",
            device_dir.display()
        ),
    }
    if let Some(v) = &fio_version {
        out!("fio:      {v}");
    }

    let result = if args.tune {
        bench.tune(&io, repeats)
    } else {
        bench.measure(&io, repeats, args.compare_fio)
    };
    drop(guard);
    result
}

/// Fill `buf` with a xorshift sequence: incompressible, different per buffer.
fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for word in buf.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&x.to_le_bytes());
    }
}

impl Bench {
    /// Open the file with `io`, make it `file_bytes` long, register the pool.
    fn open(&self, io: &IoConfig) -> Result<(Engine, bool), Error> {
        let mut engine = Engine::open(&self.path, io, true)?;
        engine.allocate(self.file_bytes)?;
        let fixed = io.fixed_buffers && engine.register_pool(&self.pool)?;
        Ok((engine, fixed))
    }

    fn sample(&self) -> DiskStat {
        self.device
            .as_ref()
            .and_then(BlockDev::sample)
            .unwrap_or_default()
    }

    fn bar(&self, prefix: String) -> ProgressBar {
        let bar = ProgressBar::new(self.file_bytes);
        bar.set_style(self.bar_style.clone());
        bar.set_prefix(prefix);
        bar
    }

    /// One timed pass over the whole file through `engine`.
    fn pass(&mut self, engine: &mut Engine, op: Op, label: String) -> Result<Measure, Error> {
        let bar = self.bar(label);
        let before = self.sample();
        let start = Instant::now();
        let mut next_bytes = 0u64;
        let mut outstanding = 0usize;
        let mut first_error = None;
        loop {
            let mut submitted = false;
            while next_bytes < self.file_bytes && first_error.is_none() {
                let Some(buf) = self.free.pop() else { break };
                // At most chunk_bytes, which fits in usize (checked in `sizes`).
                let len_bytes = self.chunk_bytes.min(self.file_bytes - next_bytes) as usize;
                engine.submit(IoRequest {
                    op,
                    offset_bytes: next_bytes,
                    len_bytes,
                    buf,
                    user_data: next_bytes,
                });
                next_bytes += len_bytes as u64;
                outstanding += 1;
                submitted = true;
            }
            if outstanding == 0 {
                break;
            }
            if submitted {
                engine.flush();
            }
            let Some(done) = engine.wait() else {
                return Err(Error::IoBench(format!(
                    "the engine returned no completion with {outstanding} requests outstanding"
                )));
            };
            outstanding -= 1;
            self.free.push(done.buf);
            match done.result {
                Ok(()) => bar.inc(done.len_bytes as u64),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let disk = self.sample().since(&before);
        bar.finish_and_clear();
        if let Some(e) = first_error {
            return Err(e.into());
        }
        Ok(Measure {
            mb_s: mb_per_s(self.file_bytes, secs),
            disk,
        })
    }

    /// One fio job with the same settings.
    fn fio_pass(&self, io: &IoConfig, write: bool, label: String) -> Result<Measure, Error> {
        let bar = ProgressBar::new_spinner();
        bar.set_prefix(label);
        bar.set_message("fio running");
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        let before = self.sample();
        let result = fio::run(
            &self.path,
            write,
            io.block_bytes,
            io.queue_depth,
            self.file_bytes,
        );
        let disk = self.sample().since(&before);
        bar.finish_and_clear();
        Ok(Measure {
            mb_s: result? / 1e6,
            disk,
        })
    }

    /// `repeats` write and read passes with `io`, alternating with fio if asked.
    fn measure(&mut self, io: &IoConfig, repeats: u32, compare_fio: bool) -> Result<(), Error> {
        let (mut engine, fixed) = self.open(io)?;
        out!(
            "engine:   {} ({}), block {}, queue depth {}, fixed buffers {}",
            engine.kind(),
            if engine.aligned_only() {
                "O_DIRECT"
            } else {
                "buffered"
            },
            Size::from_bytes(io.block_bytes as u64),
            io.queue_depth,
            if fixed { "registered" } else { "no" },
        );
        if !engine.aligned_only() {
            out!("note:     the filesystem refused O_DIRECT; figures include the page cache");
        }
        let known = self.device.is_some();
        let mut ours_w = Series::default();
        let mut ours_r = Series::default();
        let mut fio_w = Series::default();
        let mut fio_r = Series::default();
        let line = |r: u32, op: &str, who: &str, m: &Measure, write: bool| {
            let req = known.then(|| m.disk.avg_request_bytes(write)).flatten();
            out!(
                "run {r:>2}/{repeats:<2} {op:<5} {who:<4} {:>9.1} MB/s   avg request {}",
                m.mb_s,
                request_kib(req)
            );
        };
        for r in 1..=repeats {
            for (op, name, write, ours, fio) in [
                (Op::Write, "write", true, &mut ours_w, &mut fio_w),
                (Op::Read, "read", false, &mut ours_r, &mut fio_r),
            ] {
                let m = self.pass(&mut engine, op, format!("{name} {r}/{repeats}"))?;
                if write {
                    // Not timed, as fio does not sync either; makes the next pass start clean.
                    engine.sync_data()?;
                }
                line(r, name, "ours", &m, write);
                ours.push(m, known);
                if compare_fio {
                    let m = self.fio_pass(io, write, format!("fio {name} {r}/{repeats}"))?;
                    line(r, name, "fio", &m, write);
                    fio.push(m, known);
                }
            }
        }
        drop(engine);

        out!();
        out!("summary of {repeats} runs: MB/s median [min, max], average request the device saw");
        let mut rows = vec![
            ("write", "ours", &ours_w, true),
            ("read", "ours", &ours_r, false),
        ];
        if compare_fio {
            rows.insert(1, ("write", "fio", &fio_w, true));
            rows.push(("read", "fio", &fio_r, false));
        }
        for (op, who, series, write) in rows {
            if let Some(s) = Summary::of(&series.mb_s) {
                out!(
                    "{op:<5} {who:<4} {:>9.1} MB/s [{:.1}, {:.1}]   avg request {}",
                    s.median,
                    s.min,
                    s.max,
                    request_kib(series.avg_request_bytes(write))
                );
            }
        }
        if compare_fio {
            let ratio = |ours: &Series, theirs: &Series| match (
                Summary::of(&ours.mb_s),
                Summary::of(&theirs.mb_s),
            ) {
                (Some(o), Some(t)) if t.median > 0.0 => format!("{:.2}", o.median / t.median),
                _ => "n/a".to_string(),
            };
            out!(
                "ours/fio (medians): write {}   read {}",
                ratio(&ours_w, &fio_w),
                ratio(&ours_r, &fio_r)
            );
        }
        Ok(())
    }

    /// Sweep block size x queue depth and print the best setting as TOML.
    fn tune(&mut self, io: &IoConfig, repeats: u32) -> Result<(), Error> {
        struct Row {
            block_bytes: u64,
            queue_depth: u32,
            write: f64,
            read: f64,
        }
        let known = self.device.is_some();
        out!(
            "tune:     {} block sizes x {} queue depths, {repeats} pass(es) each way",
            TUNE_BLOCK_BYTES.len(),
            TUNE_QUEUE_DEPTHS.len()
        );
        out!();
        out!(
            "{:>8} {:>6} {:>12} {:>12} {:>12} {:>12}",
            "block",
            "depth",
            "write MB/s",
            "request",
            "read MB/s",
            "request"
        );
        let mut rows = Vec::with_capacity(TUNE_BLOCK_BYTES.len() * TUNE_QUEUE_DEPTHS.len());
        let mut kind = None;
        for &block_bytes in &TUNE_BLOCK_BYTES {
            for &queue_depth in &TUNE_QUEUE_DEPTHS {
                let setting = IoConfig {
                    block_bytes: block_bytes as usize,
                    queue_depth,
                    ..io.clone()
                };
                let (mut engine, _) = self.open(&setting)?;
                kind.get_or_insert(engine.kind());
                let mut w = Series::default();
                let mut r = Series::default();
                let tag = format!("{}x{queue_depth}", Size::from_bytes(block_bytes));
                for i in 1..=repeats {
                    let m = self.pass(&mut engine, Op::Write, format!("{tag} write {i}"))?;
                    engine.sync_data()?;
                    w.push(m, known);
                    let m = self.pass(&mut engine, Op::Read, format!("{tag} read {i}"))?;
                    r.push(m, known);
                }
                let (Some(ws), Some(rs)) = (Summary::of(&w.mb_s), Summary::of(&r.mb_s)) else {
                    continue;
                };
                out!(
                    "{:>8} {:>6} {:>12.1} {:>12} {:>12.1} {:>12}",
                    Size::from_bytes(block_bytes).to_string(),
                    queue_depth,
                    ws.median,
                    request_kib(w.avg_request_bytes(true)),
                    rs.median,
                    request_kib(r.avg_request_bytes(false)),
                );
                rows.push(Row {
                    block_bytes,
                    queue_depth,
                    write: ws.median,
                    read: rs.median,
                });
            }
        }
        let by = |f: fn(&Row) -> f64| {
            rows.iter()
                .max_by(|a, b| f(a).total_cmp(&f(b)))
                .ok_or_else(|| Error::IoBench("no setting was measured".into()))
        };
        let best = by(|r| (r.write * r.read).sqrt())?;
        let best_write = by(|r| r.write)?;
        let best_read = by(|r| r.read)?;
        out!();
        out!(
            "best (geometric mean of write and read, engine {}): {} MB/s write, {} MB/s read",
            kind.map_or("?".to_string(), |k| k.to_string()),
            best.write.round(),
            best.read.round()
        );
        out!(
            "# best for writes: block {} depth {} ({:.0} MB/s); for reads: block {} depth {} ({:.0} MB/s)",
            Size::from_bytes(best_write.block_bytes),
            best_write.queue_depth,
            best_write.write,
            Size::from_bytes(best_read.block_bytes),
            best_read.queue_depth,
            best_read.read
        );
        out!("[io]");
        out!("block_size = \"{}\"", Size::from_bytes(best.block_bytes));
        out!("queue_depth = {}", best.queue_depth);
        Ok(())
    }
}
