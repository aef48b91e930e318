//! The disk's rates, measured at the start of a bench run through the same I/O engine and
//! settings as the store (`[io]`): sequential writes, sequential reads, and reads and
//! writes interleaved (the optimizer's mix) on a fresh file beside the swap file, and
//! reads of the chunks the swap file holds once the model is written (the bytes the
//! phases read, where they lie). The bench's bound divides the NVMe bytes of an
//! iteration by these, so the yardstick is this disk now, not a figure from elsewhere.
//!
//! Why both reads: a file read back just after it was written can be served from a
//! cache below the guest (a virtual disk's host), faster than the disk reads chunks
//! written long before; the swap-file pass reads what the phases read, and the bound's
//! read rate is the slower of the two.

use std::path::Path;
use std::time::Instant;

use tidestore_io::{BufferPool, Engine, IoConfig, IoRequest, Op, ALIGN_BYTES};

use crate::error::{Error, Result};

/// Bytes per request of the probe.
const REQUEST_BYTES: usize = 8 << 20;
/// Requests in flight.
const IN_FLIGHT: usize = 8;

/// Bytes per second of each access pattern.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskRates {
    /// Reads, as the bound counts them: the slower of the fresh file's sequential reads
    /// and the swap file's chunks (where it stores any).
    pub read_bytes_per_s: f64,
    /// Sequential reads of the fresh probe file, just written.
    pub fresh_read_bytes_per_s: f64,
    /// Reads of chunks stored in the swap file, after the model was written (0: none
    /// stored, not measured).
    pub swap_read_bytes_per_s: f64,
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
        let at = |k: usize| ((k * REQUEST_BYTES) as u64, REQUEST_BYTES);
        let write = pass(&mut engine, &pool, requests, |k| (Op::Write, at(k)))?;
        let read = pass(&mut engine, &pool, requests, |k| (Op::Read, at(k)))?;
        let mixed = pass(&mut engine, &pool, requests, |k| {
            let op = if k % 2 == 0 { Op::Read } else { Op::Write };
            (op, at(k))
        })?;
        let rate = |secs: f64| file_bytes as f64 / secs.max(1e-9);
        Ok(DiskRates {
            read_bytes_per_s: rate(read),
            fresh_read_bytes_per_s: rate(read),
            swap_read_bytes_per_s: 0.0,
            write_bytes_per_s: rate(write),
            mixed_bytes_per_s: rate(mixed),
        })
    })();
    if let Err(e) = std::fs::remove_file(&path) {
        tracing::warn!(path = %path.display(), error = %e, "bench: disk probe file not removed");
    }
    result
}

impl DiskRates {
    /// These rates with reads of the swap file's chunks measured too (see the module
    /// doc): `regions` are the chunks' `(offset, bytes)` in the file at `path`; at most
    /// `bytes` are read, from chunks spread over the file, in requests of up to
    /// [`REQUEST_BYTES`] within each chunk. No region: unchanged.
    pub fn with_swap_reads(
        mut self,
        path: &Path,
        io: &IoConfig,
        regions: &[(u64, u64)],
        bytes: u64,
    ) -> Result<Self> {
        let requests = swap_requests(regions, bytes);
        let total: u64 = requests.iter().map(|&(_, len)| len as u64).sum();
        if total == 0 {
            return Ok(self);
        }
        let mut engine = Engine::open(path, io, false)?;
        let pool = BufferPool::new(REQUEST_BYTES, IN_FLIGHT)?;
        if io.fixed_buffers {
            engine.register_pool(&pool)?;
        }
        let secs = pass(&mut engine, &pool, requests.len(), |k| {
            (Op::Read, requests[k])
        })?;
        self.swap_read_bytes_per_s = total as f64 / secs.max(1e-9);
        self.read_bytes_per_s = self.fresh_read_bytes_per_s.min(self.swap_read_bytes_per_s);
        Ok(self)
    }
}

/// Requests `(offset, bytes)` reading at most `bytes` of `regions` (4096-aligned chunk
/// starts), from chunks spread evenly over them in file order; each request lies inside
/// one chunk and is a whole number of 4096-byte pages.
fn swap_requests(regions: &[(u64, u64)], bytes: u64) -> Vec<(u64, usize)> {
    let mut regions: Vec<(u64, u64)> = regions
        .iter()
        .map(|&(off, len)| (off, len - len % ALIGN_BYTES as u64))
        .filter(|&(_, len)| len > 0)
        .collect();
    regions.sort_unstable();
    let total: u64 = regions.iter().map(|r| r.1).sum();
    if total == 0 || bytes == 0 {
        return Vec::new();
    }
    // Every `stride`-th chunk, so the pass samples the whole file.
    let stride = total.div_ceil(bytes).max(1) as usize;
    let mut out = Vec::new();
    let mut left = bytes;
    for &(off, len) in regions.iter().step_by(stride) {
        let mut at = 0;
        while at < len && left > 0 {
            let n = (len - at)
                .min(REQUEST_BYTES as u64)
                .min(left.max(ALIGN_BYTES as u64));
            let n = n - n % ALIGN_BYTES as u64;
            if n == 0 {
                break;
            }
            out.push((off + at, n as usize));
            at += n;
            left = left.saturating_sub(n);
        }
        if left == 0 {
            break;
        }
    }
    out
}

/// One pass over `requests` requests of the file, `op_of(k)` for request `k` (its
/// operation, offset and length), at most [`IN_FLIGHT`] in flight; seconds it took.
fn pass(
    engine: &mut Engine,
    pool: &BufferPool,
    requests: usize,
    op_of: impl Fn(usize) -> (Op, (u64, usize)),
) -> Result<f64> {
    let mut free: Vec<_> = std::iter::from_fn(|| pool.try_take()).collect();
    let started = Instant::now();
    let (mut next, mut outstanding) = (0, 0);
    let mut first_error = None;
    while next < requests || outstanding > 0 {
        while next < requests && first_error.is_none() {
            let Some(buf) = free.pop() else { break };
            let (op, (offset_bytes, len_bytes)) = op_of(next);
            engine.submit(IoRequest {
                op,
                offset_bytes,
                len_bytes,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_requests_sample_whole_pages_of_chunks_spread_over_the_file() {
        let mb = 1u64 << 20;
        // Ten chunks of 20 MiB + 100 bytes (the tail page is left out), out of order.
        let regions: Vec<(u64, u64)> = (0..10u64)
            .rev()
            .map(|i| (i * 32 * mb, 20 * mb + 100))
            .collect();
        let reqs = swap_requests(&regions, 40 * mb);
        let total: u64 = reqs.iter().map(|r| r.1 as u64).sum();
        assert_eq!(total, 40 * mb);
        // Every fifth chunk (200 MiB stored / 40 MiB asked): chunks 0 and 5.
        let starts: Vec<u64> = reqs.iter().map(|r| r.0 / (32 * mb)).collect();
        assert_eq!(starts, vec![0, 0, 0, 5, 5, 5]);
        for &(off, len) in &reqs {
            assert_eq!(off % ALIGN_BYTES as u64, 0);
            assert!(len.is_multiple_of(ALIGN_BYTES) && len <= REQUEST_BYTES);
            let chunk = off / (32 * mb) * 32 * mb;
            assert!(off + len as u64 <= chunk + 20 * mb);
        }
        assert!(swap_requests(&regions, 0).is_empty());
        assert!(swap_requests(&[(0, 100)], mb).is_empty());
        // Less stored than asked: everything, once.
        let all: u64 = swap_requests(&regions, 1 << 40)
            .iter()
            .map(|r| r.1 as u64)
            .sum();
        assert_eq!(all, 10 * 20 * mb);
    }
}
