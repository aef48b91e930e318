//! The in-memory backend: a byte vector behind the [`Backend`] trait, with a seeded
//! fault injector, so every layer above can be tested for what real disks do.
//!
//! Faults, each drawn per operation from a seeded PRNG (same seed, same faults):
//! EIO on reads or writes, transient EINTR/EAGAIN, short transfers, ENOSPC once a number
//! of bytes has been written, bits flipped in data read (transient) or stored
//! (persistent), completions returned out of order and held back across calls,
//! latency, failing syncs, and completions held back until the caller waits. [`FaultCounters`] records what was injected, so a test can check its faults
//! really happened.
//!
//! Invariant: every pushed operation completes exactly once; its memory effect (the copy)
//! happens before its completion is returned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Backend, BackendKind, RawCompletion, RawOp};
use crate::error::{IoError, Op, Result};

/// What to inject, and how often. Rates are probabilities per operation.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    pub seed: u64,
    pub eio_read_rate: f64,
    pub eio_write_rate: f64,
    /// EINTR or EAGAIN: the engine must retry.
    pub transient_rate: f64,
    /// A transfer moves only part of what was asked.
    pub short_rate: f64,
    /// Total bytes the device accepts before answering ENOSPC.
    pub enospc_after_bytes: Option<u64>,
    /// One bit flipped in the data handed back by a read (the stored bytes stay good).
    pub bitflip_read_rate: f64,
    /// One bit flipped in the data stored by a write.
    pub bitflip_write_rate: f64,
    /// Complete operations in a shuffled order, holding some back for a later call.
    pub reorder: bool,
    /// Upper bound of a random delay per submission.
    pub latency_max: Duration,
    /// `sync_data` succeeds this many times, then fails with EIO from then on (a device
    /// that lost its write cache).
    pub sync_eio_after: Option<u32>,
    /// Completions go back only to a caller that waits, and then only as many as it
    /// must take (in submission order); a poll gets none. A disk that is slow next to
    /// its caller: requests pile up to the queue depth unless someone blocks, so a test
    /// can count what a pipeline keeps in flight and when it issues reads.
    pub hold_until_wait: bool,
}

impl FaultConfig {
    /// No faults at all.
    pub fn none() -> Self {
        FaultConfig {
            seed: 0,
            eio_read_rate: 0.0,
            eio_write_rate: 0.0,
            transient_rate: 0.0,
            short_rate: 0.0,
            enospc_after_bytes: None,
            bitflip_read_rate: 0.0,
            bitflip_write_rate: 0.0,
            reorder: false,
            latency_max: Duration::ZERO,
            sync_eio_after: None,
            hold_until_wait: false,
        }
    }

    /// No faults, but a seed for the ones set afterwards.
    pub fn seeded(seed: u64) -> Self {
        FaultConfig {
            seed,
            ..FaultConfig::none()
        }
    }
}

/// How many faults of each kind were injected.
#[derive(Debug, Default)]
pub struct FaultCounters {
    pub eio: AtomicU64,
    pub transient: AtomicU64,
    pub short: AtomicU64,
    pub enospc: AtomicU64,
    pub bitflip_read: AtomicU64,
    pub bitflip_write: AtomicU64,
    pub reordered: AtomicU64,
}

impl FaultCounters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Sum of every injected fault.
    pub fn total(&self) -> u64 {
        [
            &self.eio,
            &self.transient,
            &self.short,
            &self.enospc,
            &self.bitflip_read,
            &self.bitflip_write,
            &self.reordered,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

struct Staged(RawOp);

// SAFETY: the pointer is dereferenced only by the backend that owns the op, under
// `Backend::push`'s contract (valid and unshared until the completion is reaped).
unsafe impl Send for Staged {}

/// A file held in memory, with faults.
pub struct MemoryBackend {
    data: Vec<u8>,
    capacity_bytes: u64,
    queue_depth: usize,
    faults: FaultConfig,
    rng: StdRng,
    written_bytes: u64,
    syncs: u32,
    staged: Vec<Staged>,
    held: Vec<RawCompletion>,
    counters: Arc<FaultCounters>,
}

impl MemoryBackend {
    /// A device of at most `capacity_bytes` that starts empty (length 0).
    pub fn new(capacity_bytes: u64, queue_depth: usize, faults: FaultConfig) -> Self {
        let queue_depth = queue_depth.max(1);
        MemoryBackend {
            data: Vec::new(),
            capacity_bytes,
            queue_depth,
            rng: StdRng::seed_from_u64(faults.seed),
            faults,
            written_bytes: 0,
            syncs: 0,
            staged: Vec::with_capacity(queue_depth),
            held: Vec::with_capacity(queue_depth),
            counters: Arc::new(FaultCounters::default()),
        }
    }

    /// The counters of injected faults (keep a handle before boxing the backend).
    pub fn counters(&self) -> Arc<FaultCounters> {
        Arc::clone(&self.counters)
    }

    fn chance(&mut self, rate: f64) -> bool {
        rate > 0.0 && self.rng.random_bool(rate.min(1.0))
    }

    /// How many bytes of `len` a short transfer moves: at least one, less than `len`,
    /// a multiple of 512 where the length allows it.
    fn short_len(&mut self, len: usize) -> usize {
        if len >= 1024 {
            self.rng.random_range(1..len / 512) * 512
        } else {
            self.rng.random_range(1..len)
        }
    }

    /// The fault injected into an `op` of `len` bytes before it runs, if any: a
    /// transient error or EIO to return at once (`Some`), or `len` cut short.
    fn injected_fault(&mut self, op: Op, len: &mut usize) -> Option<i32> {
        if self.chance(self.faults.transient_rate) {
            FaultCounters::bump(&self.counters.transient);
            return Some(if self.rng.random_bool(0.5) {
                -libc::EINTR
            } else {
                -libc::EAGAIN
            });
        }
        let eio_rate = match op {
            Op::Read => self.faults.eio_read_rate,
            Op::Write => self.faults.eio_write_rate,
        };
        if self.chance(eio_rate) {
            FaultCounters::bump(&self.counters.eio);
            return Some(-libc::EIO);
        }
        if *len > 1 && self.chance(self.faults.short_rate) {
            FaultCounters::bump(&self.counters.short);
            *len = self.short_len(*len);
        }
        None
    }

    fn execute(&mut self, op: RawOp) -> i32 {
        let mut len = op.len_bytes as usize;
        if let Some(err) = self.injected_fault(op.op, &mut len) {
            return err;
        }
        let Ok(start) = usize::try_from(op.offset_bytes) else {
            return -libc::EINVAL;
        };
        match op.op {
            Op::Read => {
                let end = (start + len).min(self.data.len());
                if start >= end {
                    return 0;
                }
                let n = end - start;
                // SAFETY: `push`'s contract: `ptr..ptr+len_bytes` is valid and unshared
                // until this completion is reaped, and `n <= len <= len_bytes`.
                let dst = unsafe { std::slice::from_raw_parts_mut(op.ptr, n) };
                dst.copy_from_slice(&self.data[start..end]);
                if self.chance(self.faults.bitflip_read_rate) {
                    FaultCounters::bump(&self.counters.bitflip_read);
                    let bit = self.rng.random_range(0..n * 8);
                    dst[bit / 8] ^= 1 << (bit % 8);
                }
                n as i32
            }
            Op::Write => {
                let end = start as u64 + len as u64;
                if end > self.capacity_bytes {
                    FaultCounters::bump(&self.counters.enospc);
                    return -libc::ENOSPC;
                }
                if let Some(limit) = self.faults.enospc_after_bytes {
                    let room = limit.saturating_sub(self.written_bytes) as usize;
                    if room == 0 {
                        FaultCounters::bump(&self.counters.enospc);
                        return -libc::ENOSPC;
                    }
                    len = len.min(room);
                }
                let end = start + len;
                if self.data.len() < end {
                    self.data.resize(end, 0);
                }
                // SAFETY: as for reads; the region is only read here.
                let src = unsafe { std::slice::from_raw_parts(op.ptr as *const u8, len) };
                self.data[start..end].copy_from_slice(src);
                if self.chance(self.faults.bitflip_write_rate) {
                    FaultCounters::bump(&self.counters.bitflip_write);
                    let bit = self.rng.random_range(0..len * 8);
                    self.data[start + bit / 8] ^= 1 << (bit % 8);
                }
                self.written_bytes += len as u64;
                len as i32
            }
        }
    }
}

impl Backend for MemoryBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    unsafe fn push(&mut self, op: RawOp) -> Result<()> {
        if self.staged.len() + self.held.len() >= self.queue_depth {
            return Err(IoError::InvalidRequest {
                reason: format!(
                    "memory backend queue full ({} operations)",
                    self.queue_depth
                ),
            });
        }
        self.staged.push(Staged(op));
        Ok(())
    }

    fn submit_and_reap(&mut self, min_complete: usize, out: &mut Vec<RawCompletion>) -> Result<()> {
        if !self.faults.latency_max.is_zero() && !self.staged.is_empty() {
            let nanos = self
                .rng
                .random_range(0..=self.faults.latency_max.as_nanos() as u64);
            std::thread::sleep(Duration::from_nanos(nanos));
        }
        let mut staged = std::mem::take(&mut self.staged);
        for Staged(op) in staged.drain(..) {
            let result = self.execute(op);
            self.held.push(RawCompletion { id: op.id, result });
        }
        self.staged = staged;
        if self.faults.hold_until_wait {
            let give = min_complete.min(self.held.len());
            out.extend(self.held.drain(..give));
        } else if self.faults.reorder && self.held.len() > 1 {
            // Fisher–Yates on the held completions, then keep back a random tail beyond
            // what the caller must get now.
            for i in (1..self.held.len()).rev() {
                let j = self.rng.random_range(0..=i);
                self.held.swap(i, j);
            }
            FaultCounters::bump(&self.counters.reordered);
            let must = min_complete.min(self.held.len()).max(1);
            let give = self.rng.random_range(must..=self.held.len());
            out.extend(self.held.drain(..give));
        } else {
            out.append(&mut self.held);
        }
        Ok(())
    }

    fn sync_data(&mut self) -> Result<()> {
        let failing = self.faults.sync_eio_after.is_some_and(|n| self.syncs >= n);
        self.syncs += 1;
        if failing {
            FaultCounters::bump(&self.counters.eio);
            return Err(IoError::Device {
                op: Op::Write,
                offset_bytes: 0,
                len_bytes: 0,
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        Ok(())
    }

    fn len_bytes(&self) -> Result<u64> {
        Ok(self.data.len() as u64)
    }

    fn allocate(&mut self, len_bytes: u64) -> Result<()> {
        if len_bytes > self.capacity_bytes {
            return Err(IoError::NoSpace {
                offset_bytes: 0,
                len_bytes: len_bytes as usize,
            });
        }
        let len = usize::try_from(len_bytes).map_err(|_| IoError::InvalidRequest {
            reason: format!("{len_bytes} bytes does not fit in memory"),
        })?;
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
        Ok(())
    }
}
