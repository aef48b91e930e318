//! The NVMe tier: chunks in the slots of the io crate's swap file.
//!
//! Invariants:
//! - the budget is the file's slots times the slot size, fixed when the file is made;
//!   every stored chunk (or chunk whose first write is in flight) holds one whole slot,
//!   so the bytes in use are counted from the file's own free-slot count and cannot
//!   drift; the peak is sampled at every write;
//! - a write that finds no free slot is [`TierError::OverBudget`] for the NVMe tier;
//! - every read is verified against the chunk's checksum by the swap file: a chunk comes
//!   back exactly as written or as an error, never changed;
//! - buffers pass into each request and come back in its [`NvmeCompletion`], as in the
//!   io engine; bytes moved are counted when a request succeeds;
//! - the host tier's pool may be registered with the swap file's engine
//!   ([`NvmeTier::register_pool`]): requests on its buffers then use io_uring fixed
//!   buffers, and requests on any other buffer work as before;
//! - the disk is kept busy whatever the caller does: a request starts in pieces of the
//!   I/O block size, at most the queue depth at once, and the next pieces start only
//!   when the engine is polled, so an I/O pump thread polls it every
//!   [`PUMP_INTERVAL`] while anything is in flight (and sleeps while nothing is). It
//!   keeps the completions it takes, in order, until the owner asks for them
//!   ([`NvmeTier::poll`], [`NvmeTier::wait`]); the swap file is behind a mutex that
//!   the owner's calls and the pump take in turn. [`NvmeActivity`] records what the
//!   device had in flight over time and how long the owner waited.

#![deny(unsafe_code)]

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tidestore_io::compress::Compression;
use tidestore_io::swapfile::{SwapCompletion, SwapFile};
use tidestore_io::{AlignedBuf, BufferPool, IoConfig, IoError, Op};

use crate::budget::{Budget, TierKind};
use crate::error::{Result, TierError};
use crate::stats::NvmeLinkStats;

/// A finished NVMe request: the buffer back, and what happened.
#[derive(Debug)]
pub struct NvmeCompletion {
    pub chunk: u64,
    pub op: Op,
    /// `Ok` when the chunk was written, or read and verified.
    pub result: Result<()>,
    /// The buffer handed in; after a good read its first `len_bytes` are the chunk.
    pub buf: AlignedBuf,
    /// The chunk's length in bytes (0 for a read refused before its length was known).
    pub len_bytes: usize,
}

/// How often the I/O pump polls the engine while requests are in flight: short
/// enough that a queue of 1 MiB pieces at a few GB/s never runs dry between polls.
pub const PUMP_INTERVAL: Duration = Duration::from_micros(200);

/// What the NVMe device had to do over time, accumulated since the tier was opened
/// (take differences for an interval).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvmeActivity {
    /// Pieces in flight integrated over time (piece-nanoseconds), sampled at every poll
    /// of the engine: divided by an interval's length, the average requests in flight.
    pub piece_ns: u64,
    /// Nanoseconds with at least one piece in flight.
    pub busy_ns: u64,
    /// Nanoseconds the owner spent blocked on NVMe requests (waiting for a completion,
    /// or in a synchronous read or write).
    pub wait_ns: u64,
    /// The most pieces in flight seen at once.
    pub pieces_max: u64,
}

/// The swap file and what the pump took from it, shared by the owner and the pump.
#[derive(Debug)]
struct State {
    file: SwapFile,
    /// Completions the pump took, in completion order, not yet handed to the owner.
    stash: VecDeque<SwapCompletion>,
    activity: NvmeActivity,
    /// When `pieces` was read, and the pieces in flight then.
    sampled_at: Instant,
    pieces: u64,
    stop: bool,
}

impl State {
    /// Integrates the pieces in flight since the last sample, and samples them anew.
    fn sample(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.sampled_at).as_nanos() as u64;
        self.activity.piece_ns = self.activity.piece_ns.saturating_add(self.pieces * dt);
        if self.pieces > 0 {
            self.activity.busy_ns = self.activity.busy_ns.saturating_add(dt);
        }
        self.sampled_at = now;
        self.pieces = self.file.engine().pieces_in_flight() as u64;
        self.activity.pieces_max = self.activity.pieces_max.max(self.pieces);
    }

    /// Counts the time since `started` as the owner's waiting, then samples.
    fn waited_since(&mut self, started: Instant) {
        self.activity.wait_ns = self
            .activity
            .wait_ns
            .saturating_add(started.elapsed().as_nanos() as u64);
        self.sample();
    }

    /// Requests submitted and not handed to the owner.
    fn outstanding(&self) -> usize {
        self.file.outstanding() + self.stash.len()
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a request is submitted (the pump sleeps while none is in flight)
    /// and when the tier closes.
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held leaves a state that is still whole (every
        // method leaves it consistent between calls into the swap file).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The pump: polls the engine every [`PUMP_INTERVAL`] while anything is in flight,
/// stashing the completions it takes.
fn pump(shared: Arc<Shared>) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        if st.file.outstanding() == 0 {
            st.sample();
            st = shared
                .wake
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            continue;
        }
        while let Some(c) = st.file.poll() {
            st.stash.push_back(c);
        }
        st.sample();
        drop(st);
        std::thread::sleep(PUMP_INTERVAL);
        st = shared.lock();
    }
}

/// The NVMe tier over one swap file.
#[derive(Debug)]
pub struct NvmeTier {
    shared: Arc<Shared>,
    pump: Option<JoinHandle<()>>,
    peak_bytes: u64,
    links: NvmeLinkStats,
}

impl Drop for NvmeTier {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(h) = self.pump.take() {
            if h.join().is_err() {
                tracing::error!("nvme tier: the I/O pump thread panicked");
            }
        }
    }
}

impl NvmeTier {
    /// Open the swap file at `path` if it exists (it must have this shape), else create
    /// it with `slot_count` slots of `slot_bytes`, reserving all its space now.
    pub fn open_or_create(
        path: &Path,
        slot_bytes: usize,
        slot_count: u32,
        cfg: &IoConfig,
        compression: Compression,
    ) -> Result<Self> {
        let file = SwapFile::open_or_create(path, slot_bytes, slot_count, cfg, compression)
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))?;
        Ok(NvmeTier::from_swap_file(file))
    }

    /// Use a swap file opened by the caller (for instance over the in-memory,
    /// fault-injecting engine).
    ///
    /// Starts the I/O pump thread; if the thread cannot be started, the tier works
    /// without it (requests then advance only when the owner polls or waits), and says
    /// so in the log.
    pub fn from_swap_file(file: SwapFile) -> Self {
        tracing::debug!(
            path = %file.path().display(),
            slots = file.slot_count(),
            slot_bytes = file.slot_bytes(),
            "nvme tier opened"
        );
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                file,
                stash: VecDeque::new(),
                activity: NvmeActivity::default(),
                sampled_at: Instant::now(),
                pieces: 0,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let pump = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tidestore-io-pump".into())
                .spawn(move || pump(shared))
        };
        let pump = match pump {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "nvme tier: no I/O pump thread; requests advance only when polled");
                None
            }
        };
        let mut tier = NvmeTier {
            shared,
            pump,
            peak_bytes: 0,
            links: NvmeLinkStats::default(),
        };
        tier.sample_peak();
        tier
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    /// Runs `f` on the swap file (for reports, tests and adoption).
    pub fn with_swap_file<R>(&self, f: impl FnOnce(&SwapFile) -> R) -> R {
        f(&self.lock().file)
    }

    /// What the device had in flight over time, and how long the owner waited.
    pub fn activity(&self) -> NvmeActivity {
        let mut st = self.lock();
        st.sample();
        st.activity
    }

    /// The most pieces the engine keeps in flight (the configured queue depth).
    pub fn queue_depth(&self) -> usize {
        self.lock().file.engine().queue_depth()
    }

    fn capacity_bytes(&self) -> u64 {
        let st = self.lock();
        st.file.slot_count() as u64 * st.file.slot_bytes() as u64
    }

    /// Bytes of slots held by chunks (stored, or first written now).
    pub fn used_bytes(&self) -> u64 {
        let st = self.lock();
        let free = st.file.free_slots() as u64;
        (st.file.slot_count() as u64).saturating_sub(free) * st.file.slot_bytes() as u64
    }

    fn sample_peak(&mut self) {
        self.peak_bytes = self.peak_bytes.max(self.used_bytes());
    }

    /// Capacity, used and peak bytes as a [`Budget`].
    pub fn budget(&self) -> Budget {
        Budget::from_parts(
            TierKind::Nvme,
            self.capacity_bytes(),
            self.used_bytes(),
            self.peak_bytes,
        )
    }

    /// Restart peak tracking from what is in use now.
    pub fn reset_peak(&mut self) {
        self.peak_bytes = self.used_bytes();
    }

    /// Bytes moved between host and NVMe.
    pub fn link_stats(&self) -> NvmeLinkStats {
        self.links
    }

    /// Size of every slot: the largest chunk the tier holds.
    pub fn slot_bytes(&self) -> usize {
        self.lock().file.slot_bytes()
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.lock().file.slot_count()
    }

    /// Whether `chunk` is stored.
    pub fn contains(&self, chunk: u64) -> bool {
        self.lock().file.contains(chunk)
    }

    /// Length of stored `chunk`.
    pub fn len_of(&self, chunk: u64) -> Option<usize> {
        self.lock().file.len_of(chunk)
    }

    /// Requests submitted and not yet handed back.
    pub fn outstanding(&self) -> usize {
        self.lock().outstanding()
    }

    /// Requests finished and not yet handed back by [`NvmeTier::poll`] /
    /// [`NvmeTier::wait`] (taken by the pump, or by the owner's last call).
    pub fn finished(&self) -> usize {
        let st = self.lock();
        st.stash.len() + st.file.finished()
    }

    /// Register `pool` (the host tier's) with the swap file's engine as io_uring fixed
    /// buffers; returns whether it took (see `SwapFile::register_pool`). Requests on
    /// other buffers are unaffected.
    pub fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        self.lock()
            .file
            .register_pool(pool)
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Turn an io error into the tier's error: a full file is the NVMe budget exceeded.
    fn error(&self, chunk: u64, e: IoError) -> TierError {
        match e {
            IoError::SwapFull { .. } => TierError::OverBudget {
                tier: TierKind::Nvme,
                needed_bytes: self.slot_bytes() as u64,
                free_bytes: self.capacity_bytes() - self.used_bytes(),
                capacity_bytes: self.capacity_bytes(),
            },
            IoError::UnknownChunk { chunk } => TierError::UnknownChunk {
                tier: TierKind::Nvme,
                chunk,
            },
            other => TierError::io(TierKind::Nvme, Some(chunk), other),
        }
    }

    fn account(&mut self, op: Op, ok: bool, len_bytes: usize) {
        if !ok {
            self.links.failed += 1;
            return;
        }
        match op {
            Op::Write => {
                self.links.host_to_nvme_bytes += len_bytes as u64;
                self.links.writes += 1;
            }
            Op::Read => {
                self.links.nvme_to_host_bytes += len_bytes as u64;
                self.links.reads += 1;
            }
        }
    }

    fn complete(&mut self, c: SwapCompletion) -> NvmeCompletion {
        self.account(c.op, c.result.is_ok(), c.len_bytes);
        let result = c.result.map_err(|e| self.error(c.chunk, e));
        NvmeCompletion {
            chunk: c.chunk,
            op: c.op,
            result,
            buf: c.buf,
            len_bytes: c.len_bytes,
        }
    }

    /// Runs a request the owner blocks on, counting the time as waiting.
    fn blocking<R>(&self, f: impl FnOnce(&mut SwapFile) -> R) -> R {
        let started = Instant::now();
        let mut st = self.lock();
        let r = f(&mut st.file);
        st.waited_since(started);
        r
    }

    /// Write the first `len_bytes` of `buf` as `chunk` and wait for it.
    pub fn write_chunk(
        &mut self,
        chunk: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        let (result, buf) = self.blocking(|f| f.write_chunk(chunk, buf, len_bytes));
        self.sample_peak();
        self.account(Op::Write, result.is_ok(), len_bytes);
        (result.map_err(|e| self.error(chunk, e)), buf)
    }

    /// Read `chunk` into `buf`, verify it, and return its length.
    pub fn read_chunk(&mut self, chunk: u64, buf: AlignedBuf) -> (Result<usize>, AlignedBuf) {
        let (result, buf) = self.blocking(|f| f.read_chunk(chunk, buf));
        match result {
            Ok(len) => {
                self.account(Op::Read, true, len);
                (Ok(len), buf)
            }
            Err(e) => {
                self.account(Op::Read, false, 0);
                (Err(self.error(chunk, e)), buf)
            }
        }
    }

    /// Starts a request: the pump moves it from here (see the module doc).
    fn submit(&self, f: impl FnOnce(&mut SwapFile)) {
        {
            let mut st = self.lock();
            f(&mut st.file);
            if self.pump.is_none() {
                // Without a pump the request starts at the owner's next poll.
                return;
            }
            // Hand the first pieces to the device now rather than at the pump's next
            // tick; keep what completes for the owner.
            while let Some(c) = st.file.poll() {
                st.stash.push_back(c);
            }
            st.sample();
        }
        self.shared.wake.notify_one();
    }

    /// Start writing `chunk`; the completion comes from [`NvmeTier::poll`] or
    /// [`NvmeTier::wait`].
    pub fn submit_write(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) {
        self.submit(|f| f.submit_write(chunk, buf, len_bytes));
        self.sample_peak();
    }

    /// Start reading `chunk` into `buf`.
    pub fn submit_read(&mut self, chunk: u64, buf: AlignedBuf) {
        self.submit(|f| f.submit_read(chunk, buf));
    }

    /// As [`NvmeTier::submit_read`], ordered by `order` among the waiting requests
    /// (see [`SwapFile::submit_read_ordered`]): the moment the chunk is needed.
    pub fn submit_read_ordered(&mut self, chunk: u64, buf: AlignedBuf, order: u64) {
        self.submit(|f| f.submit_read_ordered(chunk, buf, order));
    }

    /// A finished request if there is one, without waiting.
    pub fn poll(&mut self) -> Option<NvmeCompletion> {
        self.next_completion(|st| {
            let c = st.file.poll();
            st.sample();
            c
        })
    }

    /// The next finished request, waiting for it; `None` when nothing is outstanding.
    pub fn wait(&mut self) -> Option<NvmeCompletion> {
        let started = Instant::now();
        self.next_completion(|st| {
            let c = st.file.wait();
            st.waited_since(started);
            c
        })
    }

    /// The completion the pump stashed first, else `from_file`'s, accounted. One lock for
    /// both: a completion the pump takes between a look at the stash and a wait would
    /// otherwise leave the wait with nothing to wait for.
    fn next_completion(
        &mut self,
        from_file: impl FnOnce(&mut State) -> Option<SwapCompletion>,
    ) -> Option<NvmeCompletion> {
        let c = {
            let mut st = self.lock();
            match st.stash.pop_front() {
                Some(c) => Some(c),
                None => from_file(&mut st),
            }
        }?;
        Some(self.complete(c))
    }

    /// Forget `chunk` and free its slot.
    pub fn remove(&mut self, chunk: u64) -> Result<()> {
        let r = self.lock().file.remove(chunk);
        r.map_err(|e| self.error(chunk, e))
    }

    /// Make everything written so far durable (see `SwapFile::flush`).
    pub fn flush(&mut self) -> Result<()> {
        self.blocking(|f| f.flush())
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// The owner's layout fingerprint recorded in the swap file, if any.
    pub fn layout_fingerprint(&self) -> Option<u64> {
        self.lock().file.layout_fingerprint()
    }

    /// Whether the swap file was closed cleanly and nothing changed since (see
    /// `SwapFile::mark_clean`).
    pub fn is_clean(&self) -> bool {
        self.lock().file.is_clean()
    }

    /// Records the owner's layout fingerprint (see `SwapFile::set_layout_fingerprint`).
    pub fn set_layout_fingerprint(&mut self, fingerprint: Option<u64>) -> Result<()> {
        self.blocking(|f| f.set_layout_fingerprint(fingerprint))
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Flushes and persists the clean-close marker (see `SwapFile::mark_clean`).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.blocking(|f| f.mark_clean())
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Clears the clean-close marker on disk if it is set (see `SwapFile::clear_clean`).
    pub fn clear_clean(&mut self) -> Result<()> {
        self.blocking(|f| f.clear_clean())
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }
}
