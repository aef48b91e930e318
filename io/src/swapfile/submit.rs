//! Requests going in: the synchronous `write_chunk` / `read_chunk`, the asynchronous
//! `submit_*` with `wait` / `poll`, and what happens at submit — the checks that refuse
//! a request at once (it then completes with its error), the slot claim, compression
//! into an image buffer, and the token that finds the completion again.
//!
//! Invariants: at most one request per chunk is in flight; a caller's buffer is never
//! changed by a write (compression works in the scratch and image buffers made at
//! open); a token is never reused while an older completion with it may be queued, and
//! refused requests' tokens (bit 62) never collide with in-flight ones.

use super::{InFlight, SwapCompletion, SwapFile};
use crate::buffer::{align_up, AlignedBuf};
use crate::engine::IoRequest;
use crate::error::{IoError, Op, Result};

/// Tokens of requests refused at submit, kept apart from in-flight slab indices.
const REFUSED_TOKEN_BIT: u64 = 1 << 62;

impl SwapFile {
    // ---------------------------------------------------------------- requests

    /// Write the first `len_bytes` of `buf` as `chunk` and wait for it. The chunk keeps
    /// its slot if it is stored already, else takes a free one. `buf` comes back
    /// unchanged. Durable after the next [`SwapFile::flush`].
    pub fn write_chunk(
        &mut self,
        chunk: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        let token = self.submit_write_token(chunk, buf, len_bytes);
        let c = self.wait_for(token);
        (c.result, c.buf)
    }

    /// Read `chunk` into `buf` (at least its length rounded up to 4096), verify its
    /// checksum, and return its length.
    pub fn read_chunk(&mut self, chunk: u64, buf: AlignedBuf) -> (Result<usize>, AlignedBuf) {
        let token = self.submit_read_token(chunk, buf, 0);
        let c = self.wait_for(token);
        (c.result.map(|()| c.len_bytes), c.buf)
    }

    /// Start writing `chunk` from the first `len_bytes` of `buf`; the compressed image is
    /// made now, the checksum by the engine as the write's pieces complete (so the write
    /// starts at once). The completion comes from [`SwapFile::wait`] or
    /// [`SwapFile::poll`]; a request refused at once (poisoned file, chunk busy, no free
    /// slot, too large) completes with its error. With compression on, this may wait for
    /// an earlier compressed write to finish when all image buffers are in flight.
    pub fn submit_write(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) {
        self.submit_write_token(chunk, buf, len_bytes);
    }

    /// Start reading `chunk` into `buf`; it is verified (and decompressed) when its
    /// completion is taken by [`SwapFile::wait`] or [`SwapFile::poll`].
    pub fn submit_read(&mut self, chunk: u64, buf: AlignedBuf) {
        self.submit_read_token(chunk, buf, 0);
    }

    /// As [`SwapFile::submit_read`], with an order key: its pieces start before the
    /// waiting pieces of requests with larger keys (writes and plain reads have key 0;
    /// see [`crate::Engine::submit_checksummed_ordered`]). A prefetch keys its reads by
    /// the moment they are needed, so a read needed sooner is not queued behind them.
    pub fn submit_read_ordered(&mut self, chunk: u64, buf: AlignedBuf, order: u64) {
        self.submit_read_token(chunk, buf, order);
    }

    /// The next finished request, waiting for one; `None` when nothing is outstanding.
    pub fn wait(&mut self) -> Option<SwapCompletion> {
        while self.ready.is_empty() {
            let c = self.engine.wait()?;
            self.on_completion(c);
        }
        self.ready.pop_front()
    }

    /// A finished request if there is one, without waiting (also starts queued I/O).
    pub fn poll(&mut self) -> Option<SwapCompletion> {
        if self.ready.is_empty() {
            if let Some(c) = self.engine.poll() {
                self.on_completion(c);
            }
        }
        self.ready.pop_front()
    }

    pub(super) fn refuse(
        &mut self,
        chunk: u64,
        op: Op,
        buf: AlignedBuf,
        len_bytes: usize,
        e: IoError,
    ) -> u64 {
        let token = REFUSED_TOKEN_BIT | self.next_refused;
        self.next_refused = (self.next_refused + 1) % REFUSED_TOKEN_BIT;
        self.ready.push_back(SwapCompletion {
            chunk,
            op,
            result: Err(e),
            buf,
            len_bytes,
            token,
        });
        token
    }

    fn busy_error(chunk: u64) -> IoError {
        IoError::InvalidRequest {
            reason: format!("chunk {chunk} already has a request in flight"),
        }
    }

    fn submit_write_token(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) -> u64 {
        if let Err(e) = self.check_write(chunk, buf.capacity(), len_bytes) {
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        }
        // A compressed image needs one of the image buffers; waiting for one processes
        // other completions, which cannot make this chunk busy but may poison the file.
        let image = match self.take_image() {
            Ok(image) => image,
            Err(e) => return self.refuse(chunk, Op::Write, buf, len_bytes, e),
        };
        let Some((slot, is_new)) = self.claim_slot(chunk) else {
            if let Some(b) = image {
                self.write_bufs.push(b);
            }
            let e = IoError::SwapFull {
                chunk,
                slots: self.layout.slot_count,
            };
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        };
        let packed = match image.map(|image| self.pack(chunk, &buf[..len_bytes], image)) {
            None => None,
            Some(Ok(packed)) => packed,
            Some(Err(e)) => {
                if is_new {
                    self.free.push(slot);
                }
                return self.refuse(chunk, Op::Write, buf, len_bytes, e);
            }
        };
        if is_new {
            self.map.insert(chunk, slot);
        }
        self.start_write(chunk, slot, buf, len_bytes, packed)
    }

    /// Why a write of `len_bytes` of `chunk` from a buffer of `capacity` bytes cannot
    /// start now: a poisoned file, a bad length, a chunk larger than a slot, a failure
    /// to clear the clean flag (a clean file is marked not clean on disk before its
    /// first change), or a request on the chunk in flight.
    fn check_write(&mut self, chunk: u64, capacity: usize, len_bytes: usize) -> Result<()> {
        self.check_not_poisoned()?;
        if len_bytes == 0 || len_bytes > capacity {
            return Err(IoError::InvalidRequest {
                reason: format!(
                    "write of chunk {chunk}: {len_bytes} bytes from a buffer of {capacity}"
                ),
            });
        }
        if len_bytes as u64 > self.layout.slot_bytes {
            return Err(IoError::ChunkTooLarge {
                chunk,
                len_bytes,
                slot_bytes: self.slot_bytes(),
            });
        }
        self.clear_clean()?;
        if let Some(&slot) = self.map.get(&chunk) {
            if self.slots[slot as usize].busy {
                return Err(Self::busy_error(chunk));
            }
        }
        Ok(())
    }

    /// An image buffer when compression is on (`None` when it is off, or when none can
    /// come back); the file may have been poisoned while waiting for one.
    fn take_image(&mut self) -> Result<Option<AlignedBuf>> {
        if self.codec.is_none() {
            return Ok(None);
        }
        let image = self.take_write_buf();
        if let Err(e) = self.check_not_poisoned() {
            if let Some(b) = image {
                self.write_bufs.push(b);
            }
            return Err(e);
        }
        Ok(image)
    }

    /// Compresses `data` into `image` when that saves at least one 4096-byte page:
    /// the image and its length, or `None` (stored raw; the image buffer goes back).
    fn pack(
        &mut self,
        chunk: u64,
        data: &[u8],
        mut image: AlignedBuf,
    ) -> Result<Option<(AlignedBuf, usize)>> {
        let result = match (self.codec.as_mut(), self.scratch.as_mut()) {
            (Some(codec), Some(scratch)) => codec.compress(chunk, data, scratch, &mut image),
            _ => Err(IoError::Compression {
                chunk,
                reason: "compression state missing".into(),
            }),
        };
        match result {
            Ok(n) if align_up(n) < align_up(data.len()) => {
                image[n..align_up(n)].fill(0);
                Ok(Some((image, n)))
            }
            Ok(_) => {
                self.write_bufs.push(image);
                Ok(None)
            }
            Err(e) => {
                self.write_bufs.push(image);
                Err(e)
            }
        }
    }

    /// Hands the write of `chunk` into `slot` to the engine: its compressed image
    /// (`packed`, the caller's buffer held until it completes) or `buf` itself.
    fn start_write(
        &mut self,
        chunk: u64,
        slot: u32,
        buf: AlignedBuf,
        len_bytes: usize,
        packed: Option<(AlignedBuf, usize)>,
    ) -> u64 {
        self.slots[slot as usize].busy = true;
        let offset_bytes = self.layout.slot_offset(slot);
        let (io_buf, stored_bytes, held) = match packed {
            Some((image, n)) => (image, n, Some(buf)),
            None => (buf, len_bytes, None),
        };
        let token = self.track(InFlight {
            token: 0,
            chunk,
            slot,
            op: Op::Write,
            len_bytes,
            stored_bytes,
            // Taken by the engine as the write's pieces complete.
            crc: 0,
            compressed: held.is_some(),
            held,
        });
        self.engine.submit_checksummed(
            IoRequest {
                op: Op::Write,
                offset_bytes,
                len_bytes: align_up(stored_bytes),
                buf: io_buf,
                user_data: token,
            },
            stored_bytes,
        );
        self.engine.flush();
        token
    }

    fn submit_read_token(&mut self, chunk: u64, buf: AlignedBuf, order: u64) -> u64 {
        let Some((slot, entry)) = self.entry(chunk).map(|(s, e)| (s, *e)) else {
            let busy = self
                .map
                .get(&chunk)
                .is_some_and(|&s| self.slots[s as usize].busy);
            let e = if busy {
                Self::busy_error(chunk)
            } else {
                IoError::UnknownChunk { chunk }
            };
            return self.refuse(chunk, Op::Read, buf, 0, e);
        };
        let len_bytes = entry.len_bytes as usize;
        if entry.busy {
            return self.refuse(chunk, Op::Read, buf, len_bytes, Self::busy_error(chunk));
        }
        if align_up(len_bytes) > buf.capacity() {
            let e = IoError::InvalidRequest {
                reason: format!(
                    "read of chunk {chunk} ({len_bytes} bytes) into a buffer of {}",
                    buf.capacity()
                ),
            };
            return self.refuse(chunk, Op::Read, buf, len_bytes, e);
        }
        self.slots[slot as usize].busy = true;
        let stored_bytes = entry.stored_bytes as usize;
        let token = self.track(InFlight {
            token: 0,
            chunk,
            slot,
            op: Op::Read,
            len_bytes,
            stored_bytes,
            crc: entry.crc,
            compressed: entry.compressed,
            held: None,
        });
        self.engine.submit_checksummed_ordered(
            IoRequest {
                op: Op::Read,
                offset_bytes: self.layout.slot_offset(slot),
                len_bytes: align_up(stored_bytes),
                buf,
                user_data: token,
            },
            stored_bytes,
            order,
        );
        self.engine.flush();
        token
    }

    fn track(&mut self, mut state: InFlight) -> u64 {
        // Sequence numbers stay below 2^30 so tokens never reach REFUSED_TOKEN_BIT.
        self.next_seq = self.next_seq % ((1 << 30) - 1) + 1;
        let index = match self.free_tokens.pop() {
            Some(t) => t as usize,
            None => {
                self.in_flight.push(None);
                self.in_flight.len() - 1
            }
        };
        let token = self.next_seq << 32 | index as u64;
        state.token = token;
        self.in_flight[index] = Some(state);
        token
    }

    /// An image buffer for a compressed write, waiting for in-flight requests to bring
    /// one back when all are out. `None` only if none can come back (then the chunk is
    /// stored raw).
    fn take_write_buf(&mut self) -> Option<AlignedBuf> {
        loop {
            if let Some(b) = self.write_bufs.pop() {
                return Some(b);
            }
            let c = self.engine.wait()?;
            self.on_completion(c);
        }
    }

    /// Wait for the request `token` (a refused one is already in `ready`).
    fn wait_for(&mut self, token: u64) -> SwapCompletion {
        loop {
            if let Some(pos) = self.ready.iter().position(|c| c.token == token) {
                if let Some(c) = self.ready.remove(pos) {
                    return c;
                }
            }
            // Invariant: a request we submitted completes exactly once (the engine's
            // contract), so while ours is not in `ready` the engine has it outstanding.
            let c = self
                .engine
                .wait()
                .expect("engine holds the request being waited for");
            self.on_completion(c);
        }
    }
}
