//! The demand load path: a chunk's way to the tier an access needs it on, top to
//! bottom — wait for what is in flight for it, done if it is already there, make room
//! (see `evict`), take a host copy (its own, a read from NVMe, or zeros), copy it to the
//! device and wait.
//!
//! Invariants: a load never evicts the chunk it loads (it is protected in every
//! [`HostRoom`]); a chunk never written reads as zeros; on the device the host copy
//! that fed the copy stays current beside it; a load that fails gives back the device
//! memory it took and leaves the chunk's other copies as they were.

use std::time::Instant;

use tidestore_io::AlignedBuf;
use tidestore_tiers::{TierError, TierKind};

use super::evict::HostRoom;
use super::{remove_from, stopped, tier_err, Cause, Mover, Pending};
use crate::accounting::MoveKind;
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::place::Place;
use crate::Result;

impl Mover {
    /// Makes `c` current at `place` for an access (a hit when it already is), counting
    /// the time a load stalls the caller. After it, `c` is current there with nothing
    /// in flight for it ([`Mover::is_current`]): the store may pin it.
    pub(crate) fn make_current(&mut self, c: ChunkId, place: Place, cause: Cause) -> Result<()> {
        if self.is_current(c, place) {
            self.stats.hits += 1;
            match place {
                Place::Device => self.dev_policy.on_access(c, cause.moment),
                Place::Host => self.ensure_host(c, cause).map(|_| ())?,
            }
        } else {
            let started = Instant::now();
            let r = match place {
                Place::Device => self.ensure_device(c, cause),
                Place::Host => self.ensure_host(c, cause),
            };
            let stalled = started.elapsed();
            self.stats.stall_ns += stalled.as_nanos() as u64;
            if stalled.as_micros() >= 1000 {
                tracing::debug!(
                    chunk = %c,
                    ?place,
                    moment = cause.moment,
                    stalled_ms = stalled.as_secs_f64() * 1e3,
                    "chunk store: an access waited for its chunk"
                );
            }
            if r? {
                self.stats.hits += 1;
            }
        }
        debug_assert!(
            self.is_current(c, place),
            "{c} not current on the {place:?} tier after loading it there"
        );
        Ok(())
    }

    /// Makes `c` current on the device (demand). Returns whether it already was.
    pub(crate) fn ensure_device(&mut self, c: ChunkId, cause: Cause) -> Result<bool> {
        let d = c.dense();
        // Where it is: a transfer in flight lands first; a device copy is a hit.
        if self.slots[d].pending != Pending::None {
            self.wait_pending(c, cause)?;
        }
        if self.slots[d].dev.is_some() {
            self.dev_policy.on_access(c, cause.moment);
            return Ok(true);
        }
        // Make room under the tide, then take the device memory.
        self.make_room_device(self.dev_bytes[d], self.dev_cap, Some(c), cause)?;
        let mem = self
            .device
            .alloc(d as u64, self.len(c))
            .map_err(tier_err("allocating device memory", c))?;
        if self.dead_everywhere(c) {
            self.materialize_on_device(c, mem, cause);
            return Ok(false);
        }
        // Load: the host copy the device copy is made from (from NVMe, or zeros).
        let room = HostRoom {
            protect: &[c],
            ahead: None,
        };
        let buf = match self.host_copy_for_load(c, room, cause) {
            Ok(b) => b,
            Err(e) => {
                drop(mem);
                return Err(e);
            }
        };
        // Copy it to the device and wait for the copy.
        self.slots[d].host = Some(buf);
        self.host_list.push(c);
        self.start_h2d(c, mem)?;
        self.stats.demand_loads += 1;
        self.wait_pending(c, cause)?;
        self.dev_policy.on_insert(c, cause.moment);
        Ok(false)
    }

    /// Makes `c` current in the host pool (from the device, NVMe or zeros). Returns
    /// whether it already was.
    pub(crate) fn ensure_host(&mut self, c: ChunkId, cause: Cause) -> Result<bool> {
        self.wait_pending(c, cause)?;
        let d = c.dense();
        if self.slots[d].host.is_some() {
            self.host_policy.on_access(c, cause.moment);
            return Ok(true);
        }
        let room = HostRoom {
            protect: &[c],
            ahead: None,
        };
        if self.slots[d].dev.is_some() {
            let buf = self.take_host_buffer(c, room, cause)?;
            let done = self.copy_d2h_now(c, buf, "loading", cause)?;
            // The device copy stays: both are current now.
            self.slots[d].dev = Some(done.mem);
            if let Err(e) = done.result {
                drop(done.host);
                return Err(ChunkError::tier("copy device->host", Some(c), e));
            }
            self.copied_to_host(c, done.host, cause);
        } else {
            self.fill_host(c, room, cause)?;
        }
        Ok(false)
    }

    /// Whether `c` holds nothing to keep anywhere: discarded (its bytes unspecified
    /// until written, see `discard`), with no copy on any tier and nothing in flight.
    pub(super) fn dead_everywhere(&self, c: ChunkId) -> bool {
        let s = &self.slots[c.dense()];
        s.dead && s.host.is_none() && s.dev.is_none() && !s.nvme_valid && s.pending == Pending::None
    }

    /// Makes the dead chunk `c` current on the device in `mem` as it is, as `fill_host`
    /// leaves a dead chunk's host buffer unfilled: no host buffer is taken and nothing
    /// is copied (a gradient chunk the next backward writes on the device).
    pub(super) fn materialize_on_device(
        &mut self,
        c: ChunkId,
        mem: tidestore_tiers::DeviceMem,
        cause: Cause,
    ) {
        let d = c.dense();
        let slot = &mut self.slots[d];
        slot.dead = false;
        slot.dev = Some(mem);
        self.dev_list.push(c);
        self.dev_mark[d] = true;
        self.dev_policy.on_insert(c, cause.moment);
        self.stats.materialized_chunks += 1;
        self.emit(cause, MoveKind::Materialize, c, 0);
    }

    /// A host buffer holding `c`'s current bytes, taken out of its slot (it goes back
    /// with the copy that uses it): its host copy, a read from NVMe, or zeros.
    fn host_copy_for_load(
        &mut self,
        c: ChunkId,
        room: HostRoom<'_>,
        cause: Cause,
    ) -> Result<AlignedBuf> {
        let d = c.dense();
        if let Some(buf) = self.slots[d].host.take() {
            remove_from(&mut self.host_list, c);
            self.slots[d].host_prefetched = false;
            return Ok(buf);
        }
        self.fill_host(c, room, cause)?;
        remove_from(&mut self.host_list, c);
        self.slots[d]
            .host
            .take()
            .ok_or_else(|| ChunkError::tier("loading", Some(c), stopped("host copy vanished")))
    }

    /// Gives `c` a current host copy (from NVMe, or zeros), not from the device.
    pub(super) fn fill_host(&mut self, c: ChunkId, room: HostRoom<'_>, cause: Cause) -> Result<()> {
        let d = c.dense();
        let buf = self.take_host_buffer(c, room, cause)?;
        let len = self.len(c);
        if self.slots[d].nvme_valid {
            self.note_nvme_in_flight(true);
            self.stats.nvme_reads_on_demand += 1;
            self.slots[d].read_started_at = None;
            let (result, buf) = self.nvme.read_chunk(d as u64, buf);
            match result {
                Ok(n) if n == len => {}
                Ok(n) => {
                    return Err(ChunkError::tier(
                        "reading from NVMe",
                        Some(c),
                        TierError::TooLarge {
                            tier: TierKind::Nvme,
                            chunk: d as u64,
                            len_bytes: n as u64,
                            limit_bytes: len as u64,
                        },
                    ))
                }
                Err(e) => return Err(ChunkError::tier("reading from NVMe", Some(c), e)),
            }
            self.slots[d].host = Some(buf);
            self.host_list.push(c);
            self.host_policy.on_insert(c, cause.moment);
            self.stats.nvme_to_host_bytes += len as u64;
            self.stats.nvme_reads += 1;
            self.emit(cause, MoveKind::NvmeToHost, c, len as u64);
        } else {
            let mut buf = buf;
            if !std::mem::take(&mut self.slots[d].dead) {
                buf[..len].fill(0);
            }
            self.slots[d].host = Some(buf);
            self.host_list.push(c);
            self.host_policy.on_insert(c, cause.moment);
            self.stats.materialized_chunks += 1;
            self.emit(cause, MoveKind::Materialize, c, 0);
        }
        Ok(())
    }
}
