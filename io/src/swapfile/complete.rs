//! Completions coming back from the engine: each is matched to its request by token,
//! a write's slot entry is set (or, after a failure, the chunk dropped and the file
//! poisoned), and a read is checked against the checksum taken when the chunk was
//! written, then decompressed.
//!
//! Invariants: every read is verified before its bytes are handed back (a mismatch is
//! [`IoError::Corrupt`], never wrong bytes); checksums come from the engine as each
//! request's pieces complete, so nothing waits for a whole-chunk checksum pass; a slot
//! whose write failed is never handed out again in this session.

use super::format::SlotEntry;
use super::{InFlight, SwapCompletion, SwapFile};
use crate::buffer::AlignedBuf;
use crate::compress;
use crate::engine::IoCompletion;
use crate::error::{IoError, Op, Result};

impl SwapFile {
    /// Turn an engine completion into a swap completion: update the map after a write,
    /// verify (and decompress) after a read.
    pub(super) fn on_completion(&mut self, c: IoCompletion) {
        let token = c.user_data;
        let index = (token & u64::from(u32::MAX)) as usize;
        let Some(state) = self
            .in_flight
            .get_mut(index)
            .and_then(|s| s.take_if(|s| s.token == token))
        else {
            tracing::error!(token, "completion for an unknown swap request ignored");
            return;
        };
        self.free_tokens.push(index as u32);
        let slot = state.slot as usize;
        self.slots[slot].busy = false;
        let completion = match state.op {
            Op::Write => self.complete_write(state, c),
            Op::Read => self.complete_read(state, c),
        };
        self.ready.push_back(completion);
    }

    /// A write finished: on success its slot entry is the chunk (with the checksum the
    /// engine took of the bytes written); on failure the file is poisoned and the chunk
    /// dropped. The caller's buffer goes back, the image buffer to the pool.
    fn complete_write(&mut self, state: InFlight, c: IoCompletion) -> SwapCompletion {
        let token = state.token;
        let slot = state.slot as usize;
        // The checksum of the bytes written, taken by the engine as they went out
        // (computed here only if the engine did not, which it always does).
        let crc = c.crc32c.unwrap_or_else(|| {
            if c.result.is_ok() {
                crc32c::crc32c(&c.buf[..state.stored_bytes])
            } else {
                0
            }
        });
        let buf = match state.held {
            Some(caller) => {
                self.write_bufs.push(c.buf);
                caller
            }
            None => c.buf,
        };
        match c.result {
            Ok(()) => {
                self.slots[slot] = SlotEntry {
                    chunk: state.chunk,
                    len_bytes: state.len_bytes as u64,
                    stored_bytes: state.stored_bytes as u64,
                    crc,
                    used: true,
                    compressed: state.compressed,
                    busy: false,
                };
                self.dirty = true;
                SwapCompletion {
                    chunk: state.chunk,
                    op: Op::Write,
                    result: Ok(()),
                    buf,
                    len_bytes: state.len_bytes,
                    token,
                }
            }
            Err(e) => {
                self.poison(&e);
                // The slot's bytes are undefined now: drop the chunk and never
                // hand the slot out again in this session (flush is refused).
                self.slots[slot] = SlotEntry::default();
                self.map.remove(&state.chunk);
                self.quarantine.push(state.slot);
                self.dirty = true;
                SwapCompletion {
                    chunk: state.chunk,
                    op: Op::Write,
                    result: Err(e),
                    buf,
                    len_bytes: state.len_bytes,
                    token,
                }
            }
        }
    }

    /// A read finished: verified against its checksum, and decompressed.
    fn complete_read(&mut self, state: InFlight, c: IoCompletion) -> SwapCompletion {
        let token = state.token;
        let mut buf = c.buf;
        let found = c.crc32c;
        let result = c
            .result
            .and_then(|()| self.verify_read(&state, found, &mut buf));
        SwapCompletion {
            chunk: state.chunk,
            op: Op::Read,
            result,
            buf,
            len_bytes: state.len_bytes,
            token,
        }
    }

    /// Check a read chunk against its checksum (`found`: the engine's checksum of the
    /// bytes read, taken as they arrived), then decompress it if it is compressed.
    fn verify_read(
        &mut self,
        state: &InFlight,
        found: Option<u32>,
        buf: &mut AlignedBuf,
    ) -> Result<()> {
        let found = found.unwrap_or_else(|| crc32c::crc32c(&buf[..state.stored_bytes]));
        if found != state.crc {
            tracing::warn!(
                chunk = state.chunk,
                slot = state.slot,
                "swap file chunk failed its checksum"
            );
            return Err(IoError::Corrupt {
                chunk: state.chunk,
                slot: state.slot,
                expected: state.crc,
                found,
            });
        }
        if !state.compressed {
            return Ok(());
        }
        let (Some(codec), Some(scratch)) = (self.codec.as_mut(), self.scratch.as_mut()) else {
            return Err(IoError::Compression {
                chunk: state.chunk,
                reason: "chunk is compressed but the file has no codec".into(),
            });
        };
        codec.decompress_shuffled(
            state.chunk,
            &buf[..state.stored_bytes],
            scratch,
            state.len_bytes,
        )?;
        compress::unshuffle(
            &scratch[..state.len_bytes],
            &mut buf[..state.len_bytes],
            codec.word_bytes(),
        );
        Ok(())
    }
}
