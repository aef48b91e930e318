//! Copies between the host pool and the device: starting a host->device copy (and the
//! host prefetcher's device->host copy) and routing each copy completion's buffers back
//! into its chunk's slot, whoever waits.
//!
//! Invariants: device completions come in submission order; every completion goes back
//! into its slot exactly once (the host buffer still current, the device memory current
//! after a good copy); a completion nobody counted in flight is a broken invariant.

use tidestore_io::AlignedBuf;
use tidestore_tiers::{CopyCompletion, CopyDir, CopyId, DeviceMem, TierError};

use super::{count_down, remove_from, stopped, Cause, Mover, Pending};
use crate::accounting::MoveKind;
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

impl Mover {
    /// Starts copying `c`'s host copy (its callers put one in the slot) into `mem`.
    pub(super) fn start_h2d(&mut self, c: ChunkId, mem: DeviceMem) -> Result<()> {
        let d = c.dense();
        let Some(buf) = self.slots[d].host.take() else {
            drop(mem);
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "a host->device copy started without a host copy".into(),
            });
        };
        remove_from(&mut self.host_list, c);
        self.slots[d].host_prefetched = false;
        let len = self.len(c);
        let id = self.device.copy_to_device(d as u64, buf, mem, len);
        self.slots[d].pending = Pending::HostToDevice(id);
        self.dev_mark[d] = true;
        self.pending_copies += 1;
        Ok(())
    }

    /// Starts copying `c`'s device copy into the host buffer `buf` (the host
    /// prefetcher's load of a chunk that a host access needs and only the device holds).
    pub(super) fn start_d2h(&mut self, c: ChunkId, buf: AlignedBuf) -> Result<()> {
        let d = c.dense();
        let Some(mem) = self.slots[d].dev.take() else {
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "a device->host copy started without a device copy".into(),
            });
        };
        remove_from(&mut self.dev_list, c);
        let len = self.len(c);
        let id = self.device.copy_to_host(d as u64, mem, buf, len);
        let slot = &mut self.slots[d];
        slot.pending = Pending::DeviceToHost(id);
        slot.host_prefetched = true;
        self.pending_copies += 1;
        Ok(())
    }

    /// Copies `c`'s device copy into `buf` and waits for it: the blocking
    /// device->host copy of an eviction (`doing`: "evicting") or of a host access
    /// ("loading"). The completion carries the device memory and the host buffer back
    /// whatever its result; the caller puts them where they belong.
    pub(super) fn copy_d2h_now(
        &mut self,
        c: ChunkId,
        buf: AlignedBuf,
        doing: &'static str,
        cause: Cause,
    ) -> Result<CopyCompletion> {
        let d = c.dense();
        let Some(mem) = self.slots[d].dev.take() else {
            return Err(ChunkError::tier(
                doing,
                Some(c),
                stopped("device copy vanished"),
            ));
        };
        let len = self.len(c);
        let id = self.device.copy_to_host(d as u64, mem, buf, len);
        self.wait_copy_id(id, c, cause)
    }

    /// Puts the host buffer a good device->host copy of `c` filled into its slot (the
    /// device copy stays: both are current), counted and reported; on demand or ahead.
    pub(super) fn copied_to_host(&mut self, c: ChunkId, buf: AlignedBuf, cause: Cause) {
        let len = self.len(c) as u64;
        self.slots[c.dense()].host = Some(buf);
        self.host_list.push(c);
        self.host_policy.on_insert(c, cause.moment);
        self.stats.device_to_host_bytes += len;
        self.stats.device_to_host_copies += 1;
        self.emit(cause, MoveKind::DeviceToHost, c, len);
    }

    /// Puts a finished copy's buffers back into its chunk's slot.
    pub(super) fn route_copy(&mut self, c: CopyCompletion, cause: Cause) -> Result<()> {
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        match c.dir {
            CopyDir::HostToDevice => {
                let counted = count_down(&mut self.pending_copies, "host->device copy", chunk);
                let slot = &mut self.slots[d];
                slot.pending = Pending::None;
                // The host buffer still holds the chunk's current bytes, copy or not.
                slot.host = Some(c.host);
                self.host_list.push(chunk);
                match c.result {
                    Ok(()) => {
                        slot.dev = Some(c.mem);
                        self.dev_list.push(chunk);
                        self.stats.host_to_device_bytes += c.len_bytes as u64;
                        self.stats.host_to_device_copies += 1;
                        self.emit(cause, MoveKind::HostToDevice, chunk, c.len_bytes as u64);
                        counted
                    }
                    Err(e) => {
                        self.dev_mark[d] = false;
                        slot.prefetched = false;
                        drop(c.mem);
                        counted?;
                        Err(ChunkError::tier("copy host->device", Some(chunk), e))
                    }
                }
            }
            CopyDir::DeviceToHost if self.slots[d].pending == Pending::DeviceToHost(c.id) => {
                let counted = count_down(&mut self.pending_copies, "device->host copy", chunk);
                let slot = &mut self.slots[d];
                slot.pending = Pending::None;
                // The device memory is still current, copy or not.
                slot.dev = Some(c.mem);
                self.dev_list.push(chunk);
                if let Err(e) = c.result {
                    slot.host_prefetched = false;
                    drop(c.host);
                    counted?;
                    return Err(ChunkError::tier("copy device->host", Some(chunk), e));
                }
                self.copied_to_host(chunk, c.host, cause);
                counted
            }
            CopyDir::DeviceToHost => {
                // Write-backs are waited for by their issuer; one arriving here was
                // orphaned by an earlier error. The device memory is still current.
                let slot = &mut self.slots[d];
                if slot.dev.is_none() {
                    slot.dev = Some(c.mem);
                    self.dev_list.push(chunk);
                    self.dev_mark[d] = true;
                }
                Ok(())
            }
        }
    }

    /// Waits for copy `id`, routing every other completion that comes first.
    pub(super) fn wait_copy_id(
        &mut self,
        id: CopyId,
        chunk: ChunkId,
        cause: Cause,
    ) -> Result<CopyCompletion> {
        let mut first_err = None;
        loop {
            let Some(c) = self.device.wait_copy() else {
                return Err(ChunkError::tier(
                    "waiting for a device copy",
                    Some(chunk),
                    TierError::CopyEngineStopped {
                        reason: format!("copy {id} never completed"),
                    },
                ));
            };
            if c.id == id {
                return match first_err {
                    Some(e) => {
                        // Our own completion still goes back where it belongs.
                        self.route_copy(c, cause)?;
                        Err(e)
                    }
                    None => Ok(c),
                };
            }
            if let Err(e) = self.route_copy(c, cause) {
                first_err.get_or_insert(e);
            }
        }
    }
}
