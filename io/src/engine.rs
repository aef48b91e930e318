//! The chunk I/O engine: whole-buffer reads and writes over any [`Backend`].
//!
//! A request moves `len_bytes` between one owned [`AlignedBuf`] and a file offset. The
//! engine splits it into block-size pieces, keeps at most `queue_depth` pieces in flight,
//! puts every piece ready to go into the same submission (so adjacent blocks reach the
//! block layer together and merge), checks every completion, resubmits the remainder of a
//! short transfer, and turns errors into [`IoError`]s that carry the op, offset and length.
//! The buffer comes back inside the [`IoCompletion`], whatever happened.
//!
//! A request submitted with [`Engine::submit_checksummed`] also gets the crc32c of its
//! first bytes, computed *while the rest of it is still in flight*: each piece that
//! completes is folded into a running checksum as soon as every byte before it has been
//! (pieces complete nearly in order; one that arrives early waits for its predecessors).
//! So the checksum of a read costs no time after its last byte arrives beyond that of its
//! last piece, and a write starts without waiting for its checksum.
//!
//! Pieces waiting for the queue start in the order of their request's *order key*
//! ([`Engine::submit_checksummed_ordered`]; plain submits have key 0), equal keys in
//! submission order: a caller that keys reads by the moment they are needed lets a read
//! needed sooner overtake the waiting pieces of reads needed later (pieces in flight
//! are not recalled). A request's own pieces always start in order.
//!
//! Invariants:
//! - a buffer handed to the backend is owned by the engine until every piece of its
//!   request has completed; dropping the engine waits for in-flight pieces first;
//! - a request completes exactly once; its result is the first error of any piece, or Ok
//!   when every byte was moved;
//! - a checksummed request's checksum covers exactly the bytes that completed, in order,
//!   as they lay in the buffer once their piece completed (for a read: the bytes the
//!   device delivered; for a write: the bytes the device was given, which nobody can
//!   change while the engine owns the buffer); only byte ranges whose pieces have
//!   completed are ever read by the engine, never memory the kernel may still write;
//! - nothing on the submit/complete path allocates once the slabs have grown to the
//!   number of requests the caller keeps in flight (bounded by the caller's buffers).

use std::collections::VecDeque;
use std::path::Path;

use crate::backend::{Backend, BackendKind, RawCompletion, RawOp};
use crate::buffer::{AlignedBuf, BufferPool, ALIGN_BYTES};
use crate::config::{EngineChoice, IoConfig};
use crate::error::{IoError, Op, Result};

/// One chunk-sized transfer.
#[derive(Debug)]
pub struct IoRequest {
    pub op: Op,
    pub offset_bytes: u64,
    /// Bytes to move from the start of `buf`; at most its capacity.
    pub len_bytes: usize,
    pub buf: AlignedBuf,
    /// Echoed in the completion.
    pub user_data: u64,
}

/// A finished request: its buffer back, and whether every byte moved.
#[derive(Debug)]
pub struct IoCompletion {
    pub op: Op,
    pub offset_bytes: u64,
    pub len_bytes: usize,
    pub buf: AlignedBuf,
    pub user_data: u64,
    pub result: Result<()>,
    /// The crc32c of the request's first `crc_len_bytes` (see
    /// [`Engine::submit_checksummed`]); `None` for a request submitted without one or
    /// one that failed.
    pub crc32c: Option<u32>,
}

/// How many times a piece that moved zero bytes or was interrupted is tried again before
/// the request fails.
const RETRIES_MAX: u8 = 8;

struct ReqState {
    req: IoRequest,
    pieces_left: u32,
    error: Option<IoError>,
    crc: Option<RunningCrc>,
}

/// The checksum of a request's prefix, advanced as its pieces complete.
#[derive(Debug, Clone, Copy)]
struct RunningCrc {
    /// Bytes the checksum covers when complete.
    len_bytes: usize,
    /// Bytes folded in so far (always a prefix).
    done_bytes: usize,
    value: u32,
}

#[derive(Clone, Copy)]
struct Piece {
    slot: u32,
    /// Offset of the piece inside the request.
    start_bytes: usize,
    len_bytes: usize,
    retries: u8,
    /// The request's order key: waiting pieces start smallest key first.
    order: u64,
}

/// Chunk-level I/O over one file (or its in-memory stand-in).
pub struct Engine {
    backend: Box<dyn Backend>,
    block_bytes: usize,
    /// Whether offsets and lengths must be 4096-aligned (O_DIRECT).
    aligned_only: bool,
    requests: Vec<Option<ReqState>>,
    free_requests: Vec<u32>,
    pending: VecDeque<Piece>,
    /// Pieces handed to the backend, indexed by raw op id.
    in_flight: Vec<Option<Piece>>,
    free_ids: Vec<u32>,
    reaped: Vec<RawCompletion>,
    done: VecDeque<IoCompletion>,
    /// Per request slot: byte ranges `(start, end)` of a checksummed request that have
    /// completed beyond its checksum's prefix (kept across requests so they do not
    /// allocate once grown).
    crc_ranges: Vec<Vec<(usize, usize)>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend.kind())
            .field("block_bytes", &self.block_bytes)
            .field("queue_depth", &self.backend.queue_depth())
            .finish()
    }
}

impl Engine {
    /// Wrap a backend. `aligned_only` makes the engine refuse requests whose offset or
    /// length is not a multiple of 4096 (needed for O_DIRECT files).
    pub fn new(backend: Box<dyn Backend>, block_bytes: usize, aligned_only: bool) -> Result<Self> {
        if block_bytes == 0
            || !block_bytes.is_multiple_of(ALIGN_BYTES)
            || block_bytes > u32::MAX as usize
        {
            return Err(IoError::config(
                "io.block_size",
                format!("{block_bytes} bytes is not a positive multiple of 4096"),
            ));
        }
        let depth = backend.queue_depth();
        Ok(Engine {
            backend,
            block_bytes,
            aligned_only,
            requests: Vec::with_capacity(64),
            free_requests: Vec::with_capacity(64),
            pending: VecDeque::with_capacity(depth * 4),
            in_flight: (0..depth).map(|_| None).collect(),
            free_ids: (0..depth as u32).rev().collect(),
            reaped: Vec::with_capacity(depth),
            done: VecDeque::with_capacity(64),
            crc_ranges: Vec::with_capacity(64),
        })
    }

    /// Open (creating if asked) the file at `path` with the engine `cfg` asks for:
    /// io_uring, or the thread pool when io_uring cannot be set up or is not wanted.
    pub fn open(path: &Path, cfg: &IoConfig, create: bool) -> Result<Self> {
        cfg.validate()?;
        let (file, direct) = crate::file::open(path, cfg.direct, create)?;
        let backend: Box<dyn Backend> = match cfg.engine {
            EngineChoice::ThreadPool => {
                tracing::info!(path = %path.display(), "io engine: thread pool (asked for by config)");
                Box::new(crate::fallback::ThreadPoolBackend::new(
                    file,
                    cfg.queue_depth as usize,
                    cfg.threads,
                )?)
            }
            EngineChoice::IoUring => {
                Box::new(crate::uring::UringBackend::new(file, cfg.queue_depth)?)
            }
            EngineChoice::Auto => match crate::uring::UringBackend::new(
                file.try_clone().map_err(|e| IoError::Setup {
                    what: "duplicating descriptor of",
                    path: path.to_path_buf(),
                    source: e,
                })?,
                cfg.queue_depth,
            ) {
                Ok(b) => Box::new(b),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable; falling back to the thread-pool engine");
                    Box::new(crate::fallback::ThreadPoolBackend::new(
                        file,
                        cfg.queue_depth as usize,
                        cfg.threads,
                    )?)
                }
            },
        };
        tracing::debug!(path = %path.display(), backend = %backend.kind(), direct, "engine opened");
        Engine::new(backend, cfg.block_bytes, direct)
    }

    /// The backend in use.
    pub fn kind(&self) -> BackendKind {
        self.backend.kind()
    }

    /// Size of the pieces a request is split into.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Whether requests must be 4096-aligned (the file is open with O_DIRECT).
    pub fn aligned_only(&self) -> bool {
        self.aligned_only
    }

    /// Register `pool` with the backend (io_uring fixed buffers); returns whether it took.
    pub fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        self.backend.register_pool(pool)
    }

    /// Block operations issued on registered (fixed) buffers so far (io_uring
    /// `READ_FIXED` / `WRITE_FIXED`); 0 on backends without them.
    pub fn ops_fixed(&self) -> u64 {
        self.backend.ops_fixed()
    }

    /// Pieces handed to the backend and not yet reaped: the requests the device has in
    /// flight, as far as the engine knows (at most [`Engine::queue_depth`]).
    pub fn pieces_in_flight(&self) -> usize {
        self.in_flight.len() - self.free_ids.len()
    }

    /// The most pieces in flight at once (the backend's queue depth).
    pub fn queue_depth(&self) -> usize {
        self.in_flight.len()
    }

    /// Requests submitted and not yet returned by [`Engine::wait`] / [`Engine::poll`].
    pub fn outstanding(&self) -> usize {
        self.requests.len() - self.free_requests.len() + self.done.len()
    }

    /// Queue a request. It starts at the next [`Engine::flush`], [`Engine::wait`] or
    /// [`Engine::poll`]; a malformed request completes at once with the error.
    pub fn submit(&mut self, req: IoRequest) {
        self.submit_inner(req, None, 0);
    }

    /// As [`Engine::submit`], and the completion carries the crc32c of the request's
    /// first `crc_len_bytes` (at most its `len_bytes`), computed as its pieces complete
    /// (see the module doc). A `crc_len_bytes` beyond the request is an
    /// [`IoError::InvalidRequest`].
    pub fn submit_checksummed(&mut self, req: IoRequest, crc_len_bytes: usize) {
        self.submit_inner(req, Some(crc_len_bytes), 0);
    }

    /// As [`Engine::submit_checksummed`], with the order key `order`: its pieces start
    /// after every waiting piece of a key at most `order` and before those of larger
    /// keys (see the module doc).
    pub fn submit_checksummed_ordered(&mut self, req: IoRequest, crc_len_bytes: usize, order: u64) {
        self.submit_inner(req, Some(crc_len_bytes), order);
    }

    fn submit_inner(&mut self, req: IoRequest, crc_len_bytes: Option<usize>, order: u64) {
        if let Err(e) = self.check(&req) {
            self.done.push_back(finish(req, Err(e), None));
            return;
        }
        if let Some(n) = crc_len_bytes.filter(|&n| n > req.len_bytes) {
            let e = IoError::InvalidRequest {
                reason: format!(
                    "checksum of {n} bytes over a {} of {} bytes",
                    req.op, req.len_bytes
                ),
            };
            self.done.push_back(finish(req, Err(e), None));
            return;
        }
        let pieces = req.len_bytes.div_ceil(self.block_bytes) as u32;
        let slot = match self.free_requests.pop() {
            Some(s) => s,
            None => {
                self.requests.push(None);
                self.crc_ranges.push(Vec::new());
                (self.requests.len() - 1) as u32
            }
        };
        let len_bytes = req.len_bytes;
        self.crc_ranges[slot as usize].clear();
        self.requests[slot as usize] = Some(ReqState {
            req,
            pieces_left: pieces,
            error: None,
            crc: crc_len_bytes.map(|n| RunningCrc {
                len_bytes: n,
                done_bytes: 0,
                value: 0,
            }),
        });
        // After the last waiting piece of a key at most `order` (retried pieces, put
        // back at the front, may break the order there; they go first anyway).
        let mut at = self
            .pending
            .iter()
            .rposition(|p| p.order <= order)
            .map_or(0, |i| i + 1);
        let mut start_bytes = 0;
        while start_bytes < len_bytes {
            let piece_bytes = self.block_bytes.min(len_bytes - start_bytes);
            self.pending.insert(
                at,
                Piece {
                    slot,
                    start_bytes,
                    len_bytes: piece_bytes,
                    retries: 0,
                    order,
                },
            );
            at += 1;
            start_bytes += piece_bytes;
        }
    }

    fn check(&self, req: &IoRequest) -> Result<()> {
        let bad = |reason: String| Err(IoError::InvalidRequest { reason });
        if req.len_bytes == 0 {
            return bad(format!(
                "{} of zero bytes at offset {}",
                req.op, req.offset_bytes
            ));
        }
        if req.len_bytes > req.buf.capacity() {
            return bad(format!(
                "{} of {} bytes into a buffer of {}",
                req.op,
                req.len_bytes,
                req.buf.capacity()
            ));
        }
        if self.aligned_only
            && (!req.offset_bytes.is_multiple_of(ALIGN_BYTES as u64)
                || !req.len_bytes.is_multiple_of(ALIGN_BYTES))
        {
            return bad(format!(
                "{} at offset {} of {} bytes is not 4096-aligned (file is open with O_DIRECT)",
                req.op, req.offset_bytes, req.len_bytes
            ));
        }
        Ok(())
    }

    /// Hand every queued piece that fits in the queue to the backend and start them,
    /// without waiting.
    pub fn flush(&mut self) {
        self.pump(0);
    }

    /// Return a finished request if there is one, without waiting.
    pub fn poll(&mut self) -> Option<IoCompletion> {
        if self.done.is_empty() {
            self.pump(0);
        }
        self.done.pop_front()
    }

    /// Return the next finished request, waiting for one; `None` when nothing is
    /// outstanding.
    pub fn wait(&mut self) -> Option<IoCompletion> {
        while self.done.is_empty() {
            if self.requests.len() == self.free_requests.len() {
                return None;
            }
            self.pump(1);
        }
        self.done.pop_front()
    }

    /// Read `len_bytes` at `offset_bytes` into `buf` and wait for it. Other requests'
    /// completions that arrive meanwhile stay queued for [`Engine::wait`].
    pub fn read_at(
        &mut self,
        offset_bytes: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        self.transfer(Op::Read, offset_bytes, buf, len_bytes)
    }

    /// Write the first `len_bytes` of `buf` at `offset_bytes` and wait for it.
    pub fn write_at(
        &mut self,
        offset_bytes: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        self.transfer(Op::Write, offset_bytes, buf, len_bytes)
    }

    fn transfer(
        &mut self,
        op: Op,
        offset_bytes: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        const SYNC_TAG: u64 = u64::MAX;
        self.submit(IoRequest {
            op,
            offset_bytes,
            len_bytes,
            buf,
            user_data: SYNC_TAG,
        });
        loop {
            if let Some(pos) = self.done.iter().position(|c| c.user_data == SYNC_TAG) {
                let c = self.done.remove(pos).expect("position is in range");
                return (c.result, c.buf);
            }
            self.pump(1);
        }
    }

    /// Make written data durable.
    pub fn sync_data(&mut self) -> Result<()> {
        self.backend.sync_data()
    }

    /// Length of the underlying file.
    pub fn len_bytes(&self) -> Result<u64> {
        self.backend.len_bytes()
    }

    /// Reserve real space for `len_bytes` (so writes inside it cannot hit ENOSPC later).
    pub fn allocate(&mut self, len_bytes: u64) -> Result<()> {
        self.backend.allocate(len_bytes)
    }

    /// Push what fits, submit, wait for `min_complete` raw completions, process them.
    fn pump(&mut self, min_complete: usize) {
        self.push_pending();
        let in_flight = self.in_flight.len() - self.free_ids.len();
        let min_complete = min_complete.min(in_flight);
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.clear();
        if let Err(e) = self.backend.submit_and_reap(min_complete, &mut reaped) {
            // The backend itself broke (the ring cannot be entered): fail everything that
            // has not been handed to it; what is in flight still completes through it.
            tracing::error!(error = %e, "io backend failed to submit");
            self.fail_pending(&e);
        }
        for c in reaped.drain(..) {
            self.on_raw_completion(c);
        }
        self.reaped = reaped;
    }

    fn push_pending(&mut self) {
        while let Some(&piece) = self.pending.front() {
            let Some(id) = self.free_ids.pop() else { break };
            self.pending.pop_front();
            let state = self.requests[piece.slot as usize]
                .as_mut()
                .expect("pending pieces belong to live requests");
            if state.error.is_some() {
                // The request already failed: do not start the rest of it.
                self.free_ids.push(id);
                self.piece_done(piece.slot);
                continue;
            }
            let req = &mut state.req;
            let fixed = req.buf.fixed_index();
            // SAFETY: `start_bytes + len_bytes <= req.len_bytes <= capacity` (checked in
            // `submit`, kept by splitting), so the pointer stays inside the buffer.
            let ptr = unsafe { req.buf.as_mut_ptr().add(piece.start_bytes) };
            let op = RawOp {
                id: id as u64,
                op: req.op,
                offset_bytes: req.offset_bytes + piece.start_bytes as u64,
                ptr,
                len_bytes: piece.len_bytes as u32,
                fixed,
            };
            // SAFETY: the buffer is owned by `self.requests[slot]` and is neither moved nor
            // touched until this piece's completion is processed (`piece_done` is the only
            // place that releases it, after the last piece); `Drop` drains in-flight pieces
            // before the buffers are freed.
            match unsafe { self.backend.push(op) } {
                Ok(()) => self.in_flight[id as usize] = Some(piece),
                Err(e) => {
                    self.free_ids.push(id);
                    self.record_error(piece.slot, e);
                    self.piece_done(piece.slot);
                }
            }
        }
    }

    fn fail_pending(&mut self, e: &IoError) {
        while let Some(piece) = self.pending.pop_front() {
            self.record_error(
                piece.slot,
                IoError::InvalidRequest {
                    reason: format!("not submitted: io backend failed: {e}"),
                },
            );
            self.piece_done(piece.slot);
        }
    }

    fn on_raw_completion(&mut self, c: RawCompletion) {
        let id = c.id as usize;
        let Some(mut piece) = self.in_flight.get_mut(id).and_then(Option::take) else {
            tracing::error!(id, "completion for an unknown io id ignored");
            return;
        };
        self.free_ids.push(id as u32);
        let state = self.requests[piece.slot as usize]
            .as_ref()
            .expect("in-flight pieces belong to live requests");
        let op = state.req.op;
        let offset_bytes = state.req.offset_bytes + piece.start_bytes as u64;
        let res = c.result;
        if res < 0 {
            let errno = -res;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && piece.retries < RETRIES_MAX {
                piece.retries += 1;
                self.pending.push_front(piece);
            } else {
                self.record_error(
                    piece.slot,
                    IoError::from_errno(op, offset_bytes, piece.len_bytes, errno),
                );
                self.piece_done(piece.slot);
            }
            return;
        }
        let moved = (res as usize).min(piece.len_bytes);
        if moved > 0 {
            self.crc_completed(piece.slot, piece.start_bytes, piece.start_bytes + moved);
        }
        if moved >= piece.len_bytes {
            self.piece_done(piece.slot);
        } else if moved == 0 {
            if op == Op::Write && piece.retries < RETRIES_MAX {
                piece.retries += 1;
                self.pending.push_front(piece);
            } else {
                self.record_error(
                    piece.slot,
                    IoError::UnexpectedEof {
                        op,
                        offset_bytes,
                        remaining_bytes: piece.len_bytes,
                    },
                );
                self.piece_done(piece.slot);
            }
        } else {
            // Short transfer: the rest goes out again, first in line.
            tracing::trace!(op = %op, offset_bytes, moved, asked = piece.len_bytes, "short transfer resubmitted");
            piece.start_bytes += moved;
            piece.len_bytes -= moved;
            piece.retries = 0;
            self.pending.push_front(piece);
        }
    }

    /// Bytes `start..end` of request `slot` have completed: fold into its checksum every
    /// completed byte that now continues its prefix.
    fn crc_completed(&mut self, slot: u32, start: usize, end: usize) {
        let Some(state) = self.requests[slot as usize].as_mut() else {
            return;
        };
        let Some(crc) = state.crc.as_mut() else {
            return;
        };
        let ranges = &mut self.crc_ranges[slot as usize];
        ranges.push((start, end));
        // Pieces complete nearly in order, so this finds the next range at once.
        while crc.done_bytes < crc.len_bytes {
            let Some(i) = ranges.iter().position(|&(s, _)| s == crc.done_bytes) else {
                break;
            };
            let (from, to) = ranges.swap_remove(i);
            let to = to.min(crc.len_bytes);
            if to > from {
                // SAFETY: `from..to` lies inside the buffer (`to <= len_bytes <= capacity`,
                // checked at submit) and every byte of it belongs to a piece (or the moved
                // part of a short piece) whose completion has been reaped: pieces cover
                // disjoint ranges and a short piece's resubmission covers only its unmoved
                // rest, so no operation in flight reads or writes these bytes now.
                let bytes = unsafe { completed_bytes(&state.req.buf, from, to) };
                crc.value = crc32c::crc32c_append(crc.value, bytes);
            }
            crc.done_bytes = crc.done_bytes.max(to);
        }
    }

    fn record_error(&mut self, slot: u32, e: IoError) {
        let state = self.requests[slot as usize].as_mut().expect("live request");
        if state.error.is_none() {
            state.error = Some(e);
        }
    }

    fn piece_done(&mut self, slot: u32) {
        let state = self.requests[slot as usize].as_mut().expect("live request");
        state.pieces_left -= 1;
        if state.pieces_left == 0 {
            let state = self.requests[slot as usize].take().expect("live request");
            self.free_requests.push(slot);
            let (result, crc) = match (state.error, state.crc) {
                (Some(e), _) => (Err(e), None),
                (None, None) => (Ok(()), None),
                (None, Some(c)) if c.done_bytes >= c.len_bytes => (Ok(()), Some(c.value)),
                (None, Some(c)) => (
                    // Every piece completed in full, so the prefix must be complete.
                    Err(IoError::InvalidRequest {
                        reason: format!(
                            "checksum covered {} of {} bytes of a completed {} (engine bug)",
                            c.done_bytes, c.len_bytes, state.req.op
                        ),
                    }),
                    None,
                ),
            };
            self.done.push_back(finish(state.req, result, crc));
        }
    }
}

/// The bytes `from..to` of `buf`, without forming a reference to the rest of it (which
/// the kernel may be writing).
///
/// # Safety
/// `from <= to <= buf.capacity()`, and nothing may write `from..to` while the returned
/// slice lives.
unsafe fn completed_bytes(buf: &AlignedBuf, from: usize, to: usize) -> &[u8] {
    debug_assert!(from <= to && to <= buf.capacity());
    // SAFETY: the range is inside the buffer's allocation (caller's first condition), the
    // pointer is valid for reads of it as long as `buf` lives (the returned lifetime), and
    // it is not written meanwhile (caller's second condition).
    unsafe { std::slice::from_raw_parts(buf.as_ptr().add(from), to - from) }
}

fn finish(req: IoRequest, result: Result<()>, crc32c: Option<u32>) -> IoCompletion {
    IoCompletion {
        op: req.op,
        offset_bytes: req.offset_bytes,
        len_bytes: req.len_bytes,
        buf: req.buf,
        user_data: req.user_data,
        result,
        crc32c,
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Pieces in flight point into buffers we own: let the backend finish them before
        // those buffers are freed. Pending pieces are simply dropped.
        self.pending.clear();
        let mut reaped = Vec::new();
        while self.in_flight.len() > self.free_ids.len() {
            reaped.clear();
            if let Err(e) = self.backend.submit_and_reap(1, &mut reaped) {
                tracing::error!(error = %e, "io backend failed while draining; leaking buffers in flight");
                for state in self.requests.drain(..).flatten() {
                    std::mem::forget(state.req.buf);
                }
                return;
            }
            for c in &reaped {
                if let Some(slot) = self.in_flight.get_mut(c.id as usize).and_then(Option::take) {
                    let _ = slot;
                    self.free_ids.push(c.id as u32);
                }
            }
        }
    }
}
