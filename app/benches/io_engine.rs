//! Benchmarks of the engine's submit/complete path: what one request costs when the
//! device does not dominate.
//!
//! - `uring_fixed` / `uring_heap`: 4 KiB reads at scattered offsets of a page-cached file
//!   (buffered, not O_DIRECT, so every read is a memory copy in the kernel) through
//!   [`Engine`] over io_uring, from registered pool buffers or from heap buffers;
//!   `batch32` keeps 32 requests in flight per submit, `single` does one `read_at` at a
//!   time (one submit and one wait per request);
//! - `memory`: the same batch over [`MemoryBackend`], which isolates the engine's own
//!   bookkeeping (splitting, slabs, completion handling) from the kernel.
//!
//! Throughput is reported in requests, so criterion's `thrpt` is requests per second and
//! `time / 32` is the cost of one request in a batch.

use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use tidestore_io::uring::UringBackend;
use tidestore_io::{AlignedBuf, BufferPool, Engine, FaultConfig, IoRequest, MemoryBackend, Op};

const REQ_BYTES: usize = 4096;
const FILE_BYTES: usize = 16 << 20;
const BATCH: usize = 32;
const QUEUE_DEPTH: u32 = 32;

/// Scattered, 4096-aligned offsets inside the file (xorshift: no extra dependency).
fn offsets() -> Vec<u64> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let blocks = (FILE_BYTES / REQ_BYTES) as u64;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * REQ_BYTES as u64
        })
        .collect()
}

/// Submit one read per buffer in `bufs`, wait for all of them, put the buffers back.
fn read_batch(
    engine: &mut Engine,
    bufs: &mut Vec<AlignedBuf>,
    offsets: &[u64],
    cursor: &mut usize,
) {
    for buf in bufs.drain(..) {
        engine.submit(IoRequest {
            op: Op::Read,
            offset_bytes: offsets[*cursor % offsets.len()],
            len_bytes: REQ_BYTES,
            buf,
            user_data: *cursor as u64,
        });
        *cursor += 1;
    }
    while let Some(c) = engine.wait() {
        if let Err(e) = c.result {
            panic!("bench read failed: {e}");
        }
        bufs.push(c.buf);
    }
}

fn heap_bufs() -> Vec<AlignedBuf> {
    (0..BATCH)
        .map(|_| AlignedBuf::new_zeroed(REQ_BYTES).expect("heap buffer"))
        .collect()
}

/// A file of `FILE_BYTES` written (and so page-cached) through the ordinary write path.
fn cached_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("bench-io-engine");
    let data: Vec<u8> = (0..FILE_BYTES).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &data).expect("write bench file");
    // Read it once more so every page is resident even after writeback.
    let _ = std::fs::read(&path).expect("read bench file");
    path
}

fn uring_engine(path: &Path) -> Option<Engine> {
    let (file, _direct) = tidestore_io::file::open(path, false, false).expect("open bench file");
    match UringBackend::new(file, QUEUE_DEPTH) {
        Ok(backend) => Some(Engine::new(Box::new(backend), REQ_BYTES, false).expect("engine")),
        Err(e) => {
            println!("skipped: io_uring unavailable: {e}");
            None
        }
    }
}

pub fn bench(c: &mut Criterion) {
    let offsets = offsets();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = cached_file(dir.path());

    let mut group = c.benchmark_group("io_engine");
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));

    if let Some(mut engine) = uring_engine(&path) {
        group.throughput(Throughput::Elements(BATCH as u64));
        let pool = BufferPool::new(REQ_BYTES, BATCH).expect("pool");
        match engine.register_pool(&pool) {
            Ok(true) => {}
            Ok(false) => println!("note: pool not registered; uring_fixed runs plain reads"),
            Err(e) => {
                println!("note: registering the pool failed ({e}); uring_fixed runs plain reads")
            }
        }
        let mut bufs: Vec<AlignedBuf> = (0..BATCH)
            .map(|_| pool.try_take().expect("pool holds BATCH buffers"))
            .collect();
        let mut cursor = 0;
        group.bench_function("uring_fixed/batch32", |b| {
            b.iter(|| read_batch(&mut engine, &mut bufs, &offsets, &mut cursor))
        });
        drop(bufs);

        let mut bufs = heap_bufs();
        group.bench_function("uring_heap/batch32", |b| {
            b.iter(|| read_batch(&mut engine, &mut bufs, &offsets, &mut cursor))
        });

        group.throughput(Throughput::Elements(1));
        let mut buf = Some(bufs.pop().expect("a heap buffer"));
        group.bench_function("uring_heap/single", |b| {
            b.iter(|| {
                let offset_bytes = offsets[cursor % offsets.len()];
                cursor += 1;
                let (r, back) =
                    engine.read_at(offset_bytes, buf.take().expect("buffer is back"), REQ_BYTES);
                if let Err(e) = r {
                    panic!("bench read failed: {e}");
                }
                buf = Some(back);
            })
        });
    }

    let mut engine = Engine::new(
        Box::new(MemoryBackend::new(
            FILE_BYTES as u64,
            QUEUE_DEPTH as usize,
            FaultConfig::none(),
        )),
        REQ_BYTES,
        true,
    )
    .expect("memory engine");
    let fill = AlignedBuf::new_zeroed(FILE_BYTES).expect("fill buffer");
    let (r, _) = engine.write_at(0, fill, FILE_BYTES);
    if let Err(e) = r {
        panic!("filling the memory backend failed: {e}");
    }
    let mut bufs = heap_bufs();
    let mut cursor = 0;
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("memory/batch32", |b| {
        b.iter(|| read_batch(&mut engine, &mut bufs, &offsets, &mut cursor))
    });
    group.finish();
}
