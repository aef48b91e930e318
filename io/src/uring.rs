//! The io_uring backend: raw reads and writes of one file through one ring.
//!
//! [`UringBackend`] writes one SQE per [`RawOp`] and hands everything pushed to the kernel
//! in a single `io_uring_enter` per [`Backend::submit_and_reap`], so that adjacent blocks
//! of a chunk reach the block layer in one plug and merge into large requests. The file
//! is registered with the ring (`IOSQE_FIXED_FILE`) where the kernel allows it, and the
//! buffers of one [`BufferPool`] may be registered so that pool-backed operations become
//! `READ_FIXED` / `WRITE_FIXED` (no page pinning per request).
//!
//! Invariants:
//! - `in_flight` counts operations pushed and not yet returned by `submit_and_reap`
//!   (whether still in the SQ, in the kernel, or parked in `stash`); the ring is never
//!   freed while it is non-zero (`Drop` waits, and leaks the ring if it cannot);
//! - a registered pool is kept alive (a clone of its `Arc`) for as long as it is
//!   registered, so the kernel's view of the fixed buffers always names live memory;
//!   registration changes only while nothing is in flight;
//! - an operation is issued as a fixed one only when its pool id, buffer index and whole
//!   address range match the registered pool; anything else goes out as a plain read or
//!   write, so a stale or foreign `fixed` tag costs speed, never correctness.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

use io_uring::{cqueue, opcode, squeue, types, EnterFlags, IoUring};

use crate::backend::{Backend, BackendKind, RawCompletion, RawOp};
use crate::buffer::BufferPool;
use crate::config::QUEUE_DEPTH_MAX;
use crate::error::{IoError, Op, Result};

/// Largest buffer io_uring accepts for registration (`SZ_1G` in `io_uring/rsrc.c`).
pub const FIXED_BUF_BYTES_MAX: usize = 1 << 30;

/// Most buffers one ring can register (`IORING_MAX_REG_BUFFERS`).
pub const FIXED_BUF_COUNT_MAX: usize = 1 << 14;

/// Consecutive `io_uring_enter` calls that may make no progress (EBUSY/EAGAIN with nothing
/// to reap, or nothing submitted) before the ring is declared broken.
const STALLED_ENTERS_MAX: u32 = 10_000;

/// Counters of what the backend did, for benchmarks and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UringStats {
    /// Operations pushed.
    pub ops: u64,
    /// Of those, issued as `READ_FIXED` / `WRITE_FIXED`.
    pub ops_fixed: u64,
    /// `io_uring_enter` calls made (submits and waits, retries included).
    pub enters: u64,
    /// Completions reaped.
    pub completions: u64,
}

/// The pool registered as fixed buffers, kept alive while it is registered.
struct RegisteredPool {
    /// Holds the mapping the kernel has pinned; never read, only kept.
    _pool: BufferPool,
    id: u32,
    base_addr: usize,
    buf_bytes: usize,
    count: u32,
}

/// How SQEs name the file.
#[derive(Debug, Clone, Copy)]
enum FileTarget {
    /// Index 0 of the ring's registered file table.
    Fixed,
    /// The raw descriptor.
    Fd(RawFd),
}

/// io_uring backend over one file.
pub struct UringBackend {
    /// Never dropped while `in_flight > 0` (see `Drop`); `ManuallyDrop` so a ring that
    /// cannot be drained can be leaked instead of freed under the kernel's feet.
    ring: ManuallyDrop<IoUring<squeue::Entry, cqueue::Entry>>,
    /// Dropped after the ring (fields drop after `Drop::drop`); ops name it by its fd.
    file: File,
    /// The file's path as `/proc/self/fd` tells it, for error messages.
    path: PathBuf,
    target: FileTarget,
    queue_depth: u32,
    /// Pushed and not yet handed out by `submit_and_reap`.
    in_flight: usize,
    /// Completions reaped while making room in a full SQ, handed out at the next reap.
    stash: Vec<RawCompletion>,
    pool: Option<RegisteredPool>,
    stats: UringStats,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend")
            .field("path", &self.path)
            .field("queue_depth", &self.queue_depth)
            .field("target", &self.target)
            .field("pool", &self.pool.as_ref().map(|p| p.id))
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl UringBackend {
    /// Set up a ring of `queue_depth` submission entries (rounded up to a power of two,
    /// with twice as many completion entries) over `file`, and register the file with it
    /// where the kernel allows.
    ///
    /// Returns [`IoError::Setup`] when the kernel refuses io_uring (ENOSYS on kernels
    /// without it, EPERM under seccomp or `kernel.io_uring_disabled`), so callers can fall
    /// back to another backend, and [`IoError::Config`] for a depth outside
    /// `1..=QUEUE_DEPTH_MAX`.
    pub fn new(file: File, queue_depth: u32) -> Result<Self> {
        if queue_depth == 0 || queue_depth > QUEUE_DEPTH_MAX {
            return Err(IoError::config(
                "io.queue_depth",
                format!("{queue_depth} is outside 1..={QUEUE_DEPTH_MAX}"),
            ));
        }
        let path = fd_path(&file);
        let sq_entries = queue_depth.next_power_of_two();
        let cq_entries = sq_entries * 2;
        let ring = build_ring(sq_entries, cq_entries).map_err(|source| {
            if source.raw_os_error() == Some(libc::EPERM) {
                let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_else(|_| "unknown".to_owned());
                tracing::debug!(io_uring_disabled = %disabled, "io_uring_setup: EPERM (seccomp or sysctl)");
            }
            IoError::Setup {
                what: "creating an io_uring for",
                path: path.clone(),
                source,
            }
        })?;
        let target = match ring.submitter().register_files(&[file.as_raw_fd()]) {
            Ok(()) => FileTarget::Fixed,
            Err(e) => {
                tracing::debug!(error = %e, path = %path.display(), "io_uring: file registration refused; using the plain descriptor");
                FileTarget::Fd(file.as_raw_fd())
            }
        };
        tracing::debug!(
            path = %path.display(),
            queue_depth,
            sq_entries = ring.params().sq_entries(),
            cq_entries = ring.params().cq_entries(),
            fixed_file = matches!(target, FileTarget::Fixed),
            "io_uring backend ready"
        );
        Ok(UringBackend {
            ring: ManuallyDrop::new(ring),
            file,
            path,
            target,
            queue_depth,
            in_flight: 0,
            stash: Vec::with_capacity(cq_entries as usize),
            pool: None,
            stats: UringStats::default(),
        })
    }

    /// What the backend has done so far.
    pub fn stats(&self) -> UringStats {
        self.stats
    }

    /// Whether the file is registered with the ring (SQEs use `IOSQE_FIXED_FILE`).
    pub fn fixed_file(&self) -> bool {
        matches!(self.target, FileTarget::Fixed)
    }

    /// Id of the pool registered as fixed buffers, if any.
    pub fn registered_pool_id(&self) -> Option<u32> {
        self.pool.as_ref().map(|p| p.id)
    }

    /// The registered buffer index `op` may use, when it names the registered pool and
    /// its whole range lies inside that buffer.
    fn fixed_index(&self, op: &RawOp) -> Option<u16> {
        let reg = self.pool.as_ref()?;
        let (pool_id, index) = op.fixed?;
        if pool_id != reg.id || index >= reg.count {
            return None;
        }
        let start = reg.base_addr + index as usize * reg.buf_bytes;
        let end = start + reg.buf_bytes;
        let addr = op.ptr as usize;
        if addr < start || addr.saturating_add(op.len_bytes as usize) > end {
            tracing::debug!(
                id = op.id,
                index,
                "op tagged with a fixed buffer lies outside it; issued as a plain op"
            );
            return None;
        }
        // `count <= FIXED_BUF_COUNT_MAX < 2^16`, checked at registration.
        u16::try_from(index).ok()
    }

    /// Move every CQE into `out`.
    fn reap(&mut self, out: &mut Vec<RawCompletion>) -> usize {
        let before = out.len();
        out.extend(self.ring.completion().map(|cqe| RawCompletion {
            id: cqe.user_data(),
            result: cqe.result(),
        }));
        let n = out.len() - before;
        self.in_flight = self.in_flight.saturating_sub(n);
        self.stats.completions += n as u64;
        n
    }

    fn enter_error(&self, source: std::io::Error) -> IoError {
        IoError::Setup {
            what: "entering the io_uring of",
            path: self.path.clone(),
            source,
        }
    }

    /// Wait for one completion without submitting (used when the kernel is busy).
    fn wait_one(&mut self) -> std::io::Result<()> {
        self.stats.enters += 1;
        // SAFETY: no SQEs are submitted (`to_submit == 0`) and no argument pointer is
        // passed (`None`, size of `sigset_t` ignored without EXT_ARG); the call only waits.
        let r = unsafe {
            self.ring
                .submitter()
                .enter::<libc::sigset_t>(0, 1, EnterFlags::GETEVENTS.bits(), None)
        };
        match r {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Create the ring, asking for the flags that help a single submitter (Linux 5.19+:
/// SUBMIT_ALL, COOP_TASKRUN, TASKRUN_FLAG) and retrying without them on older kernels.
fn build_ring(
    sq_entries: u32,
    cq_entries: u32,
) -> std::io::Result<IoUring<squeue::Entry, cqueue::Entry>> {
    let modern = IoUring::builder()
        .setup_cqsize(cq_entries)
        .setup_submit_all()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(sq_entries);
    match modern {
        Ok(ring) => Ok(ring),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::debug!("io_uring: kernel refuses SUBMIT_ALL/COOP_TASKRUN; plain ring");
            IoUring::builder()
                .setup_cqsize(cq_entries)
                .build(sq_entries)
        }
        Err(e) => Err(e),
    }
}

/// The path behind `file`, for messages; `<fd N>` where `/proc` cannot tell.
fn fd_path(file: &File) -> PathBuf {
    let fd = file.as_raw_fd();
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .unwrap_or_else(|_| PathBuf::from(format!("<fd {fd}>")))
}

/// Why a pool of `count` buffers of `buf_bytes` cannot be registered, if it cannot.
fn unregistrable_reason(buf_bytes: usize, count: usize) -> Option<String> {
    if buf_bytes > FIXED_BUF_BYTES_MAX {
        return Some(format!(
            "buffers of {buf_bytes} bytes exceed io_uring's {FIXED_BUF_BYTES_MAX}-byte limit per registered buffer"
        ));
    }
    if count > FIXED_BUF_COUNT_MAX {
        return Some(format!(
            "{count} buffers exceed io_uring's {FIXED_BUF_COUNT_MAX} registered buffers"
        ));
    }
    None
}

/// Build the SQE for `op` against `target`, fixed when `buf_index` is given.
fn build_entry(target: FileTarget, op: &RawOp, buf_index: Option<u16>) -> squeue::Entry {
    macro_rules! rw {
        ($t:expr) => {
            match (op.op, buf_index) {
                (Op::Read, Some(i)) => opcode::ReadFixed::new($t, op.ptr, op.len_bytes, i)
                    .offset(op.offset_bytes)
                    .build(),
                (Op::Read, None) => opcode::Read::new($t, op.ptr, op.len_bytes)
                    .offset(op.offset_bytes)
                    .build(),
                (Op::Write, Some(i)) => {
                    opcode::WriteFixed::new($t, op.ptr.cast_const(), op.len_bytes, i)
                        .offset(op.offset_bytes)
                        .build()
                }
                (Op::Write, None) => opcode::Write::new($t, op.ptr.cast_const(), op.len_bytes)
                    .offset(op.offset_bytes)
                    .build(),
            }
        };
    }
    let entry = match target {
        FileTarget::Fixed => rw!(types::Fixed(0)),
        FileTarget::Fd(fd) => rw!(types::Fd(fd)),
    };
    entry.user_data(op.id)
}

impl Backend for UringBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth as usize
    }

    /// Write one SQE (fixed when `op` names the registered pool); submits only when the
    /// SQ is full. The caller's contract is [`Backend::push`]'s.
    unsafe fn push(&mut self, op: RawOp) -> Result<()> {
        let buf_index = self.fixed_index(&op);
        let entry = build_entry(self.target, &op, buf_index);
        loop {
            // SAFETY: the entry names memory `op.ptr .. op.ptr + op.len_bytes` that the
            // caller keeps valid and untouched until its completion is returned (this
            // function's contract), and the file, which `self` owns and outlives the ring's
            // use of it (the ring is drained before it is dropped). A fixed entry names a
            // buffer of the registered pool, kept alive by `self.pool`.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // The SQ is full: submit what is there (completions parked in `stash`).
            let mut stash = std::mem::take(&mut self.stash);
            let r = self.submit_and_reap(0, &mut stash);
            self.stash = stash;
            r?;
        }
        self.in_flight += 1;
        self.stats.ops += 1;
        if buf_index.is_some() {
            self.stats.ops_fixed += 1;
        }
        Ok(())
    }

    fn submit_and_reap(&mut self, min_complete: usize, out: &mut Vec<RawCompletion>) -> Result<()> {
        let start = out.len();
        out.append(&mut self.stash);
        let mut entered = false;
        let mut stalled: u32 = 0;
        loop {
            self.reap(out);
            let reaped = out.len() - start;
            let (to_submit, kernel_wants_enter) = {
                let sq = self.ring.submission();
                (sq.len(), sq.taskrun() || sq.cq_overflow())
            };
            // Never wait for more than is out there: that would never return.
            let want = min_complete.saturating_sub(reaped).min(self.in_flight);
            if to_submit == 0 && want == 0 && (entered || !kernel_wants_enter) {
                return Ok(());
            }
            entered = true;
            self.stats.enters += 1;
            match self.ring.submitter().submit_and_wait(want) {
                Ok(submitted) => {
                    if submitted == 0 && to_submit > 0 {
                        // The kernel took nothing (no completion space?): reap and retry.
                        stalled += 1;
                        if stalled > STALLED_ENTERS_MAX {
                            return Err(self.enter_error(std::io::Error::other(
                                "the kernel accepts no submissions",
                            )));
                        }
                    } else {
                        stalled = 0;
                    }
                }
                Err(e) => match e.raw_os_error() {
                    // A signal arrived: what was submitted stays submitted; go round again.
                    Some(libc::EINTR) => {}
                    // Completion space or kernel resources are short: make room, retry.
                    Some(libc::EBUSY) | Some(libc::EAGAIN) => {
                        if self.reap(out) == 0 {
                            stalled += 1;
                            if stalled > STALLED_ENTERS_MAX {
                                return Err(self.enter_error(e));
                            }
                            let in_kernel =
                                self.in_flight.saturating_sub(self.ring.submission().len());
                            if in_kernel > 0 {
                                self.wait_one().map_err(|e| self.enter_error(e))?;
                            } else {
                                std::thread::yield_now();
                            }
                        }
                    }
                    _ => return Err(self.enter_error(e)),
                },
            }
        }
    }

    fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        if self.in_flight > 0 {
            return Err(IoError::InvalidRequest {
                reason: format!(
                    "registering buffer pool {} while {} operations are in flight",
                    pool.id(),
                    self.in_flight
                ),
            });
        }
        if self.pool.as_ref().is_some_and(|p| p.id == pool.id()) {
            return Ok(true);
        }
        if let Some(old) = self.pool.take() {
            if let Err(e) = self.ring.submitter().unregister_buffers() {
                tracing::debug!(error = %e, pool = old.id, "io_uring: unregistering the previous pool failed; keeping it");
                self.pool = Some(old);
                return Ok(false);
            }
            tracing::debug!(pool = old.id, "io_uring: previous pool unregistered");
        }
        if let Some(reason) = unregistrable_reason(pool.buf_bytes(), pool.count()) {
            tracing::debug!(pool = pool.id(), %reason, "io_uring: pool not registered");
            return Ok(false);
        }
        let (base, len_bytes) = pool.region();
        let buf_bytes = pool.buf_bytes();
        let iovecs: Vec<libc::iovec> = (0..pool.count())
            .map(|i| libc::iovec {
                // Inside the mapping: `i * buf_bytes + buf_bytes <= count * buf_bytes == len`.
                iov_base: base.wrapping_add(i * buf_bytes).cast(),
                iov_len: buf_bytes,
            })
            .collect();
        debug_assert_eq!(pool.count() * buf_bytes, len_bytes);
        // SAFETY: every iovec lies inside the pool's mapping (`region()` is the whole
        // mapping and buffer `i` spans `i * buf_bytes .. (i + 1) * buf_bytes` of it). The
        // mapping stays alive while it is registered: `self.pool` holds a clone of the pool
        // (an `Arc` of the mapping) until the buffers are unregistered, and the ring (whose
        // drop unregisters them) is dropped before that field.
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                tracing::debug!(
                    pool = pool.id(),
                    count = pool.count(),
                    buf_bytes,
                    "io_uring: pool registered as fixed buffers"
                );
                self.pool = Some(RegisteredPool {
                    _pool: pool.clone(),
                    id: pool.id(),
                    base_addr: base as usize,
                    buf_bytes,
                    count: pool.count() as u32,
                });
                Ok(true)
            }
            Err(e) => {
                tracing::debug!(
                    error = %e,
                    pool = pool.id(),
                    total_bytes = len_bytes,
                    "io_uring: pool not registered (ENOMEM: RLIMIT_MEMLOCK too low?); plain reads and writes"
                );
                Ok(false)
            }
        }
    }

    fn ops_fixed(&self) -> u64 {
        self.stats.ops_fixed
    }

    fn sync_data(&mut self) -> Result<()> {
        crate::file::sync_data(&self.file)
    }

    fn len_bytes(&self) -> Result<u64> {
        crate::file::len_bytes(&self.file)
    }

    fn allocate(&mut self, len_bytes: u64) -> Result<()> {
        crate::file::allocate(&self.file, len_bytes)
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        // Operations still in flight point into memory the kernel may still write: the ring
        // must outlive them. Submit what is queued and wait for every completion.
        let mut scratch = Vec::with_capacity(self.in_flight);
        while self.in_flight > 0 {
            scratch.clear();
            if let Err(e) = self.submit_and_reap(1, &mut scratch) {
                tracing::error!(
                    error = %e,
                    in_flight = self.in_flight,
                    "io_uring: cannot drain the ring; leaking it (and its registered pool) rather than freeing memory the kernel may still use"
                );
                if let Some(pool) = self.pool.take() {
                    std::mem::forget(pool);
                }
                return;
            }
        }
        // SAFETY: nothing is in flight (the loop above drained every pushed op), and the
        // ring is dropped exactly once, here; `self.ring` is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuf;
    use crate::engine::{Engine, IoRequest};
    use rand::rngs::StdRng;
    use rand::{Rng, RngCore, SeedableRng};
    use std::path::Path;

    /// Open `path` (O_DIRECT where allowed) and set up a backend, or print why not.
    fn backend_or_skip(path: &Path, queue_depth: u32) -> Option<(UringBackend, bool)> {
        let (file, direct) = crate::file::open(path, true, true).expect("open test file");
        match UringBackend::new(file, queue_depth) {
            Ok(b) => Some((b, direct)),
            Err(e) => {
                println!("skipped: io_uring unavailable: {e}");
                None
            }
        }
    }

    /// An engine of `block_bytes` over a fresh file `name` in a temporary directory (kept
    /// alive beside it), or `None` after printing why io_uring is unavailable.
    fn engine_or_skip(
        name: &str,
        queue_depth: u32,
        block_bytes: usize,
    ) -> Option<(tempfile::TempDir, Engine)> {
        let dir = tempfile::tempdir().unwrap();
        let (backend, direct) = backend_or_skip(&dir.path().join(name), queue_depth)?;
        let engine = Engine::new(Box::new(backend), block_bytes, direct).unwrap();
        Some((dir, engine))
    }

    fn random_buf(rng: &mut StdRng, len_bytes: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::new_zeroed(len_bytes).unwrap();
        rng.fill_bytes(&mut buf[..len_bytes]);
        buf
    }

    /// Write `chunks` (offset, bytes) all at once, then read them all back at once.
    fn round_trip(
        engine: &mut Engine,
        chunks: Vec<(u64, AlignedBuf, usize)>,
        read_bufs: Vec<AlignedBuf>,
    ) {
        let mut expected = Vec::new();
        for (i, (offset_bytes, buf, len_bytes)) in chunks.into_iter().enumerate() {
            engine.submit(IoRequest {
                op: Op::Write,
                offset_bytes,
                len_bytes,
                buf,
                user_data: i as u64,
            });
        }
        let mut written = 0;
        while let Some(c) = engine.wait() {
            c.result
                .unwrap_or_else(|e| panic!("write {} failed: {e}", c.user_data));
            expected.push((c.user_data, c.offset_bytes, c.len_bytes, c.buf));
            written += 1;
        }
        assert_eq!(written, expected.len());
        expected.sort_by_key(|e| e.0);
        for ((i, offset_bytes, len_bytes, _), buf) in expected.iter().zip(read_bufs) {
            engine.submit(IoRequest {
                op: Op::Read,
                offset_bytes: *offset_bytes,
                len_bytes: *len_bytes,
                buf,
                user_data: *i,
            });
        }
        let mut read = 0;
        while let Some(c) = engine.wait() {
            c.result
                .unwrap_or_else(|e| panic!("read {} failed: {e}", c.user_data));
            let (_, _, len_bytes, want) = &expected[c.user_data as usize];
            assert!(
                c.buf[..*len_bytes] == want[..*len_bytes],
                "chunk {} read back different bytes",
                c.user_data
            );
            read += 1;
        }
        assert_eq!(read, expected.len());
    }

    /// Non-overlapping chunks of random multiple-of-4096 sizes, each several blocks long.
    fn layout(
        rng: &mut StdRng,
        count: usize,
        block_bytes: usize,
        max_bytes: usize,
    ) -> Vec<(u64, usize)> {
        let mut offset_bytes = 0u64;
        (0..count)
            .map(|_| {
                let len_bytes = rng.random_range(block_bytes / 4096 + 1..=max_bytes / 4096) * 4096;
                let at = offset_bytes;
                offset_bytes += len_bytes as u64 + rng.random_range(0..4u64) * 4096;
                (at, len_bytes)
            })
            .collect()
    }

    /// `count` chunks of [`layout`] (seeded with `seed`) filled with random bytes in heap
    /// buffers, and a zeroed buffer to read each back into.
    fn heap_chunks(
        seed: u64,
        count: usize,
        block_bytes: usize,
        max_bytes: usize,
    ) -> (Vec<(u64, AlignedBuf, usize)>, Vec<AlignedBuf>) {
        let mut rng = StdRng::seed_from_u64(seed);
        let chunks: Vec<_> = layout(&mut rng, count, block_bytes, max_bytes)
            .into_iter()
            .map(|(off, len)| (off, random_buf(&mut rng, len), len))
            .collect();
        let reads = chunks
            .iter()
            .map(|c| AlignedBuf::new_zeroed(c.2).unwrap())
            .collect();
        (chunks, reads)
    }

    #[test]
    fn round_trip_heap_buffers() {
        let block_bytes = 64 << 10;
        let Some((_dir, mut engine)) = engine_or_skip("heap", 8, block_bytes) else {
            return;
        };
        let (chunks, reads) = heap_chunks(1, 12, block_bytes, 1 << 20);
        round_trip(&mut engine, chunks, reads);
    }

    #[test]
    fn round_trip_fixed_buffers() {
        let block_bytes = 64 << 10;
        let buf_bytes = 512 << 10;
        let pool = BufferPool::new(buf_bytes, 16).unwrap();
        let Some((_dir, mut engine)) = engine_or_skip("fixed", 8, block_bytes) else {
            return;
        };
        let registered = engine.register_pool(&pool).unwrap();
        if !registered {
            println!("note: pool not registered (memlock?); fixed path not exercised here");
        }
        let mut rng = StdRng::seed_from_u64(2);
        let chunks: Vec<_> = layout(&mut rng, 8, block_bytes, buf_bytes)
            .into_iter()
            .map(|(off, len)| {
                let mut buf = pool.try_take().unwrap();
                rng.fill_bytes(&mut buf[..len]);
                (off, buf, len)
            })
            .collect();
        let reads = (0..chunks.len())
            .map(|_| pool.try_take().unwrap())
            .collect();
        round_trip(&mut engine, chunks, reads);
    }

    #[test]
    fn fixed_ops_are_issued_only_for_the_registered_pool() {
        let dir = tempfile::tempdir().unwrap();
        let Some((mut backend, _)) = backend_or_skip(&dir.path().join("raw"), 4) else {
            return;
        };
        let pool = BufferPool::new(8192, 4).unwrap();
        let other = BufferPool::new(8192, 1).unwrap();
        if !backend.register_pool(&pool).unwrap() {
            println!("skipped: pool could not be registered (memlock?)");
            return;
        }
        assert_eq!(backend.registered_pool_id(), Some(pool.id()));
        let mut mine = pool.try_take().unwrap();
        let mut foreign = other.try_take().unwrap();
        mine.fill(0xa5);
        foreign.fill(0x5a);
        let ops = [
            RawOp {
                id: 1,
                op: Op::Write,
                offset_bytes: 0,
                ptr: mine.as_mut_ptr(),
                len_bytes: 8192,
                fixed: mine.fixed_index(),
            },
            RawOp {
                id: 2,
                op: Op::Write,
                offset_bytes: 8192,
                ptr: foreign.as_mut_ptr(),
                len_bytes: 8192,
                fixed: foreign.fixed_index(),
            },
        ];
        for op in ops {
            // SAFETY: both buffers outlive the reap below and are not touched until then.
            unsafe { backend.push(op).unwrap() };
        }
        let mut out = Vec::new();
        while out.len() < 2 {
            backend.submit_and_reap(2 - out.len(), &mut out).unwrap();
        }
        out.sort_by_key(|c| c.id);
        assert_eq!(
            out,
            vec![
                RawCompletion {
                    id: 1,
                    result: 8192
                },
                RawCompletion {
                    id: 2,
                    result: 8192
                }
            ]
        );
        let stats = backend.stats();
        assert_eq!((stats.ops, stats.ops_fixed), (2, 1));
        assert_eq!(
            stats.enters, 1,
            "both writes went out in one io_uring_enter"
        );
    }

    #[test]
    fn many_requests_outstanding_with_a_shallow_queue() {
        // 3 slots (ring of 4 entries) against 24 chunks x up to 16 blocks.
        let block_bytes = 16 << 10;
        let Some((_dir, mut engine)) = engine_or_skip("deep", 3, block_bytes) else {
            return;
        };
        let (chunks, reads) = heap_chunks(3, 24, block_bytes, 256 << 10);
        let pieces: usize = chunks.iter().map(|c| c.2.div_ceil(block_bytes)).sum();
        assert!(pieces > 3 * 10);
        round_trip(&mut engine, chunks, reads);
    }

    #[test]
    fn read_past_end_of_file_is_unexpected_eof() {
        let Some((_dir, mut engine)) = engine_or_skip("eof", 4, 16 << 10) else {
            return;
        };
        let mut rng = StdRng::seed_from_u64(4);
        let file_bytes = 40 << 10;
        let data = random_buf(&mut rng, file_bytes);
        let (r, _) = engine.write_at(
            0,
            data.try_clone_from_pool(&BufferPool::new(file_bytes, 1).unwrap())
                .unwrap(),
            file_bytes,
        );
        r.unwrap();
        assert_eq!(engine.len_bytes().unwrap(), file_bytes as u64);
        // 64 KiB from 32 KiB: the first 8 KiB exist, then the file ends.
        let start = 32 << 10;
        let (r, buf) = engine.read_at(
            start as u64,
            AlignedBuf::new_zeroed(64 << 10).unwrap(),
            64 << 10,
        );
        match r {
            Err(IoError::UnexpectedEof {
                op: Op::Read,
                offset_bytes,
                remaining_bytes,
            }) => {
                assert!(
                    offset_bytes >= file_bytes as u64,
                    "eof reported at {offset_bytes}"
                );
                assert!(remaining_bytes > 0);
            }
            other => panic!("expected UnexpectedEof, got {other:?}"),
        }
        assert!(
            buf[..8192] == data[start..file_bytes],
            "bytes before the end read back wrong"
        );
    }

    #[test]
    fn unaligned_requests_are_invalid() {
        let dir = tempfile::tempdir().unwrap();
        let Some((backend, direct)) = backend_or_skip(&dir.path().join("unaligned"), 4) else {
            return;
        };
        if !direct {
            println!("skipped: filesystem refuses O_DIRECT, so unaligned requests are legal");
            return;
        }
        let mut engine = Engine::new(Box::new(backend), 16 << 10, true).unwrap();
        for (offset_bytes, len_bytes) in [(100u64, 4096usize), (0, 1000), (4096, 6000)] {
            let (r, _) = engine.write_at(
                offset_bytes,
                AlignedBuf::new_zeroed(8192).unwrap(),
                len_bytes,
            );
            assert!(
                matches!(r, Err(IoError::InvalidRequest { .. })),
                "offset {offset_bytes} len {len_bytes}: {r:?}"
            );
        }
    }

    #[test]
    fn a_full_submission_queue_is_submitted_to_make_room() {
        let dir = tempfile::tempdir().unwrap();
        // Depth 1: a ring of one SQE and two CQEs; five ops overflow both.
        let Some((mut backend, _)) = backend_or_skip(&dir.path().join("full"), 1) else {
            return;
        };
        let mut bufs: Vec<AlignedBuf> = (0..5u8)
            .map(|i| {
                let mut b = AlignedBuf::new_zeroed(4096).unwrap();
                b.fill(i);
                b
            })
            .collect();
        for (i, buf) in bufs.iter_mut().enumerate() {
            let op = RawOp {
                id: i as u64,
                op: Op::Write,
                offset_bytes: i as u64 * 4096,
                ptr: buf.as_mut_ptr(),
                len_bytes: 4096,
                fixed: None,
            };
            // SAFETY: `bufs` outlives every completion, reaped below before it is dropped.
            unsafe { backend.push(op).unwrap() };
        }
        let mut out = Vec::new();
        while out.len() < 5 {
            backend.submit_and_reap(5 - out.len(), &mut out).unwrap();
        }
        out.sort_by_key(|c| c.id);
        let want: Vec<_> = (0..5)
            .map(|id| RawCompletion { id, result: 4096 })
            .collect();
        assert_eq!(out, want);
        assert_eq!(backend.len_bytes().unwrap(), 5 * 4096);
    }

    #[test]
    fn zero_queue_depth_is_a_config_error() {
        let file = tempfile::tempfile().unwrap();
        assert!(matches!(
            UringBackend::new(file, 0),
            Err(IoError::Config {
                key: "io.queue_depth",
                ..
            })
        ));
    }

    #[test]
    fn register_refuses_while_in_flight_and_drop_waits() {
        let dir = tempfile::tempdir().unwrap();
        let Some((mut backend, _)) = backend_or_skip(&dir.path().join("drop"), 4) else {
            return;
        };
        let mut buf = AlignedBuf::new_zeroed(1 << 20).unwrap();
        let op = RawOp {
            id: 7,
            op: Op::Write,
            offset_bytes: 0,
            ptr: buf.as_mut_ptr(),
            len_bytes: 1 << 20,
            fixed: None,
        };
        // SAFETY: `buf` outlives `backend`, whose drop waits for this write.
        unsafe { backend.push(op).unwrap() };
        let pool = BufferPool::new(4096, 1).unwrap();
        assert!(matches!(
            backend.register_pool(&pool),
            Err(IoError::InvalidRequest { .. })
        ));
        drop(backend);
        drop(buf);
    }

    #[test]
    fn pools_beyond_the_kernel_limits_are_not_registered() {
        assert!(unregistrable_reason(FIXED_BUF_BYTES_MAX, 4).is_none());
        assert!(unregistrable_reason(FIXED_BUF_BYTES_MAX + 4096, 1).is_some());
        assert!(unregistrable_reason(4096, FIXED_BUF_COUNT_MAX + 1).is_some());
    }
}
