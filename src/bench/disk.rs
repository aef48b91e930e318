//! The disk's rates, measured at the start of a bench run through the same I/O engine and
//! settings as the store (`[io]`), on a file beside the swap file: sequential writes,
//! sequential reads, and reads and writes interleaved (the optimizer's mix). The bench's
//! bound divides the NVMe bytes of an iteration by these, so the yardstick is this disk
//! now, not a figure from elsewhere.

use std::path::Path;
use std::time::Instant;

use tidestore_io::{BufferPool, Engine, IoConfig, IoRequest, Op};

use crate::error::{Error, Result};

/// Bytes per request of the probe.
const REQUEST_BYTES: usize = 8 << 20;
/// Requests in flight.
const IN_FLIGHT: usize = 8;

/// Bytes per second of each access pattern.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskRates {
    /// Sequential reads.
    pub read_bytes_per_s: f64,
    /// Sequential writes.
    pub write_bytes_per_s: f64,
    /// Reads and writes interleaved one for one, both directions counted.
    pub mixed_bytes_per_s: f64,
}

impl DiskRates {
    /// Seconds the disk needs to read `read` and write `write` bytes: each direction at
    /// its own rate, both together no faster than the mixed rate.
    pub fn seconds(&self, read: u64, write: u64) -> f64 {
        let r = read as f64 / self.read_bytes_per_s;
        let w = write as f64 / self.write_bytes_per_s;
        let both = (read + write) as f64 / self.mixed_bytes_per_s;
        if read > 0 && write > 0 {
            r.max(w).max(both)
        } else {
            r + w
        }
    }
}

/// Measures the rates with `bytes` per pass in a file in `dir` (removed afterwards).
pub fn probe(dir: &Path, io: &IoConfig, bytes: u64) -> Result<DiskRates> {
    let path = dir.join("tidestore-bench-probe.dat");
    let requests = (bytes as usize / REQUEST_BYTES).max(2 * IN_FLIGHT);
    let file_bytes = (requests * REQUEST_BYTES) as u64;
    let result = (|| {
        let mut engine = Engine::open(&path, io, true)?;
        engine.allocate(file_bytes)?;
        let pool = BufferPool::new(REQUEST_BYTES, IN_FLIGHT)?;
        if io.fixed_buffers {
            engine.register_pool(&pool)?;
        }
        let write = pass(&mut engine, &pool, requests, |_| Op::Write)?;
        let read = pass(&mut engine, &pool, requests, |_| Op::Read)?;
        let mixed = pass(&mut engine, &pool, requests, |k| {
            if k % 2 == 0 {
                Op::Read
            } else {
                Op::Write
            }
        })?;
        let rate = |secs: f64| file_bytes as f64 / secs.max(1e-9);
        Ok(DiskRates {
            read_bytes_per_s: rate(read),
            write_bytes_per_s: rate(write),
            mixed_bytes_per_s: rate(mixed),
        })
    })();
    if let Err(e) = std::fs::remove_file(&path) {
        tracing::warn!(path = %path.display(), error = %e, "bench: disk probe file not removed");
    }
    result
}

/// One pass over `requests` requests of the file, `op_of(k)` for request `k`, at most
/// [`IN_FLIGHT`] in flight; seconds it took.
fn pass(
    engine: &mut Engine,
    pool: &BufferPool,
    requests: usize,
    op_of: impl Fn(usize) -> Op,
) -> Result<f64> {
    let mut free: Vec<_> = std::iter::from_fn(|| pool.try_take()).collect();
    let started = Instant::now();
    let (mut next, mut outstanding) = (0, 0);
    let mut first_error = None;
    while next < requests || outstanding > 0 {
        while next < requests && first_error.is_none() {
            let Some(buf) = free.pop() else { break };
            engine.submit(IoRequest {
                op: op_of(next),
                offset_bytes: (next * REQUEST_BYTES) as u64,
                len_bytes: REQUEST_BYTES,
                buf,
                user_data: next as u64,
            });
            next += 1;
            outstanding += 1;
        }
        if first_error.is_some() && outstanding == 0 {
            break;
        }
        engine.flush();
        let done = engine.wait().ok_or_else(|| {
            Error::Bench(format!(
                "disk probe: no completion with {outstanding} requests outstanding"
            ))
        })?;
        outstanding -= 1;
        free.push(done.buf);
        if let Err(e) = done.result {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e.into()),
        None => Ok(started.elapsed().as_secs_f64()),
    }
}
