//! Making room: choosing victims on the device and host tiers by their policies, taking
//! copies off a tier — dropped where they are current elsewhere (clean), written one tier
//! down otherwise (device -> host, host -> NVMe, synchronously or as an asynchronous
//! write-back) — and freeing NVMe slots for those writes.
//!
//! Invariants: a chunk in COMPUTE on a tier (pinned) is never its victim; evicting the
//! only current copy writes it down first, and a failed write leaves it where it was;
//! the prefetcher's room ([`HostRoom::not_before`]) only takes host copies next used
//! after the chunk it loads, and never waits.

use tidestore_io::AlignedBuf;
use tidestore_tiers::TierKind;

use super::{remove_from, tier_err, Cause, Mover, Pending, Slot};
use crate::accounting::MoveKind;
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::tracer::{Horizon, Schedule};
use crate::Result;

/// The prefetcher's rule for the room it makes: only host copies next used (on
/// `schedule`, every access's) after `needed_at` may go, and nothing is waited for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ahead<'a> {
    /// The absolute moment the chunk being prefetched is needed at.
    pub(crate) needed_at: u64,
    /// The schedule followed now.
    pub(crate) schedule: &'a Schedule,
}

/// Where a host buffer may come from when none is free.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostRoom<'a> {
    /// Chunks whose host copies must stay.
    pub(super) protect: &'a [ChunkId],
    /// The prefetcher's rule ([`Ahead`]); `None`: any victim, and transfers in flight
    /// may be waited for.
    pub(super) ahead: Option<Ahead<'a>>,
}

impl Mover {
    /// The error for `chunk` finding no host buffer: the host tier is full.
    fn host_full(&self, chunk: ChunkId) -> ChunkError {
        ChunkError::TierFull {
            tier: TierKind::Host,
            chunk,
            needed_bytes: self.host_bytes[chunk.dense()],
            capacity_bytes: self.host.budget().capacity_bytes(),
        }
    }

    /// A free host buffer for `chunk`, evicting host copies (to NVMe where they are the
    /// only current copy) as needed.
    pub(super) fn take_host_buffer(
        &mut self,
        chunk: ChunkId,
        room: HostRoom<'_>,
        cause: Cause,
    ) -> Result<AlignedBuf> {
        let d = chunk.dense();
        loop {
            if let Ok(buf) = self.host.try_take(d as u64, self.len_bytes[d]) {
                return Ok(buf);
            }
            if self.pending_writes() > 0 {
                // A write-back in flight gives a buffer back: wait for it rather than
                // evicting more (the prefetcher never waits). Queued prefetch reads do
                // not take it first: this chunk is needed sooner.
                if room.ahead.is_none() && self.wait_for_demand(cause)? {
                    continue;
                }
                return Err(self.host_full(chunk));
            }
            let candidates: Vec<ChunkId> = self
                .host_list
                .iter()
                .copied()
                .filter(|w| {
                    self.slots[w.dense()].host_pins == 0
                        && !room.protect.contains(w)
                        && room.ahead.is_none_or(|a| {
                            a.schedule
                                .next_use_from(*w, cause.moment + 1, Horizon::Cyclic)
                                .is_none_or(|u| u > a.needed_at)
                        })
                })
                .collect();
            if candidates.is_empty() {
                if room.ahead.is_none() && self.wait_any(cause)? {
                    continue;
                }
                return Err(self.host_full(chunk));
            }
            let Some(victim) = self.host_policy.choose(&candidates, cause.moment) else {
                return Err(ChunkError::NoVictim {
                    moment: cause.moment,
                    chunk,
                    policy: "host",
                });
            };
            self.evict_host(victim, room.ahead.is_none(), cause)?;
        }
    }

    /// Takes `w`'s host copy out of the pool, writing it to NVMe first when it is the
    /// chunk's only current copy. On a failed write the copy stays where it was. With
    /// `may_wait` (a demand load makes room), a swap file whose slots are all held by
    /// transfers in flight is waited on rather than reported full.
    pub(crate) fn evict_host(&mut self, w: ChunkId, may_wait: bool, cause: Cause) -> Result<()> {
        let d = w.dense();
        let slot = &self.slots[d];
        debug_assert_eq!(
            slot.host_pins, 0,
            "evicting {w} from the host pool, where it is pinned"
        );
        if slot.host.is_none() {
            return Ok(());
        }
        if slot.dev.is_none() && !slot.nvme_valid {
            // Found before the copy leaves its slot: waiting routes other transfers.
            self.ensure_nvme_slot(w, may_wait, cause)?;
        }
        let Some(buf) = self.slots[d].host.take() else {
            return Ok(());
        };
        remove_from(&mut self.host_list, w);
        if std::mem::take(&mut self.slots[d].host_prefetched) {
            self.stats.prefetch_wasted += 1;
        }
        let slot = &self.slots[d];
        if slot.dev.is_some() || slot.nvme_valid {
            drop(buf);
            self.stats.host_evictions += 1;
            self.stats.host_clean_evictions += 1;
            self.host_policy.on_evict(w, cause.moment);
            self.emit(cause, MoveKind::DropHost, w, 0);
            return Ok(());
        }
        let len = self.len(w);
        if self.async_writes {
            // The buffer stays with the write until it completes (route_nvme_write);
            // the chunk waits for it before any other use.
            self.nvme.submit_write(d as u64, buf, len);
            self.slots[d].pending = Pending::NvmeWrite;
            self.pending_nvme += 1;
            self.writing_back(d);
            self.note_nvme_in_flight(false);
            self.stats.async_writes += 1;
            self.stats.host_evictions += 1;
            self.host_policy.on_evict(w, cause.moment);
            // Start it now (submitted requests start at the next poll).
            let first = self.nvme.poll();
            if let Some(c) = first {
                self.nvme_stash.push_back(c);
            }
            return Ok(());
        }
        self.note_nvme_in_flight(true);
        let (result, buf) = self.nvme.write_chunk(d as u64, buf, len);
        if let Err(e) = result {
            // A failed write drops the chunk from the file (which refuses writes now).
            self.slots[d].nvme_stored = self.nvme.contains(d as u64);
            self.slots[d].host = Some(buf);
            self.host_list.push(w);
            return Err(ChunkError::tier("writing to NVMe", Some(w), e));
        }
        drop(buf);
        let slot = &mut self.slots[d];
        slot.nvme_stored = true;
        slot.nvme_valid = true;
        self.stats.host_to_nvme_bytes += len as u64;
        self.stats.nvme_writes += 1;
        self.stats.host_evictions += 1;
        self.host_policy.on_evict(w, cause.moment);
        self.emit(cause, MoveKind::HostToNvme, w, len as u64);
        Ok(())
    }

    /// Makes sure writing `w` to NVMe finds a slot: its own, a free one, or one freed
    /// from a chunk whose NVMe copy is stale or also current elsewhere. A chunk being
    /// read holds its slot until the read lands (then its copy is current elsewhere
    /// too): with `may_wait`, transfers in flight are waited for rather than the file
    /// reported full.
    pub(super) fn ensure_nvme_slot(
        &mut self,
        w: ChunkId,
        may_wait: bool,
        cause: Cause,
    ) -> Result<()> {
        let d = w.dense();
        if self.slots[d].nvme_stored {
            return Ok(());
        }
        let reclaim = |s: &Slot| {
            s.nvme_stored
                && !matches!(
                    s.pending,
                    Pending::NvmeRead | Pending::NvmeReadQueued | Pending::NvmeWrite
                )
                && (!s.nvme_valid || s.host.is_some() || s.dev.is_some())
        };
        let r = loop {
            let budget = self.nvme.budget();
            if budget.free_bytes() >= self.nvme.slot_bytes() as u64 {
                return Ok(());
            }
            // Stale copies first, then copies current elsewhere.
            let pick = (0..self.slots.len())
                .filter(|&i| i != d && reclaim(&self.slots[i]))
                .min_by_key(|&i| self.slots[i].nvme_valid);
            match pick {
                Some(r) => break r,
                None if may_wait && self.wait_for_demand(cause)? => {}
                None => {
                    return Err(ChunkError::TierFull {
                        tier: TierKind::Nvme,
                        chunk: w,
                        needed_bytes: self.nvme.slot_bytes() as u64,
                        capacity_bytes: budget.capacity_bytes(),
                    })
                }
            }
        };
        let rc = ChunkId::from_dense(r);
        self.nvme
            .remove(r as u64)
            .map_err(tier_err("freeing an NVMe slot", rc))?;
        let s = &mut self.slots[r];
        s.nvme_stored = false;
        s.nvme_valid = false;
        self.emit(cause, MoveKind::ReclaimNvme, rc, 0);
        Ok(())
    }

    /// The device's one make-room loop: evicts chunks not pinned, as the device policy
    /// chooses, until `need` more bytes fit under `cap` — for a load (`for_chunk`, never
    /// a victim, whose host copy stays while write-backs make room) and for a falling
    /// tide (`None`). With no victim it waits for a transfer in flight; with none in
    /// flight a load is refused (the working set does not fit) and a tide is held
    /// where it is. Returns the device bytes in use after it.
    pub(super) fn make_room_device(
        &mut self,
        need: u64,
        cap: u64,
        for_chunk: Option<ChunkId>,
        cause: Cause,
    ) -> Result<u64> {
        loop {
            let used = self.device_used();
            if used + need <= cap {
                return Ok(used);
            }
            let mut candidates = self.device_evictable();
            candidates.retain(|&v| Some(v) != for_chunk);
            match (self.dev_policy.choose(&candidates, cause.moment), for_chunk) {
                (Some(victim), _) => {
                    self.evict_device(victim, None, for_chunk.unwrap_or(victim), cause)?;
                }
                (None, Some(chunk)) if !candidates.is_empty() => {
                    return Err(ChunkError::NoVictim {
                        moment: cause.moment,
                        chunk,
                        policy: "device",
                    });
                }
                (None, _) if self.wait_any(cause)? => {}
                (None, None) => return Ok(used),
                (None, Some(_)) => {
                    return Err(ChunkError::WorkingSetTooLarge {
                        moment: cause.moment,
                        needed_bytes: used + need,
                        capacity_bytes: cap,
                        short_bytes: used + need - cap,
                    });
                }
            }
        }
    }

    /// Takes `v` off the device, copying it to the host first when the device copy is
    /// its only current one. On failure the device copy stays.
    /// `keep`'s host copy is not evicted to make room for the write-back.
    pub(crate) fn evict_device(
        &mut self,
        v: ChunkId,
        ahead: Option<Ahead<'_>>,
        keep: ChunkId,
        cause: Cause,
    ) -> Result<()> {
        let d = v.dense();
        debug_assert_eq!(
            self.slots[d].dev_pins, 0,
            "evicting {v} from the device, where it is pinned"
        );
        if self.slots[d].dev.is_none() {
            return Ok(());
        }
        let clean = self.slots[d].host.is_some() || self.slots[d].nvme_valid;
        if !clean {
            let buf = self.take_host_buffer(
                v,
                HostRoom {
                    protect: &[v, keep],
                    ahead,
                },
                cause,
            )?;
            let done = self.copy_d2h_now(v, buf, "evicting", cause)?;
            let len = self.len(v);
            if let Err(e) = done.result {
                self.slots[d].dev = Some(done.mem);
                return Err(ChunkError::tier("copy device->host", Some(v), e));
            }
            drop(done.mem);
            self.slots[d].host = Some(done.host);
            self.host_list.push(v);
            self.host_policy.on_insert(v, cause.moment);
            self.stats.device_to_host_bytes += len as u64;
            self.stats.device_to_host_copies += 1;
        } else {
            drop(self.slots[d].dev.take());
        }
        remove_from(&mut self.dev_list, v);
        self.dev_mark[d] = false;
        let slot = &mut self.slots[d];
        if slot.prefetched {
            slot.prefetched = false;
            self.stats.prefetch_wasted += 1;
        }
        self.stats.device_evictions += 1;
        self.dev_policy.on_evict(v, cause.moment);
        if clean {
            self.stats.device_clean_evictions += 1;
            self.emit(cause, MoveKind::DropDevice, v, 0);
        } else {
            let len = self.len_bytes[d];
            self.emit(cause, MoveKind::DeviceToHost, v, len);
        }
        Ok(())
    }

    /// Moves every chunk not pinned off the device, in the device list's order (written
    /// back where the device copy is the only current one); stops at the first error.
    pub(crate) fn evict_device_unpinned(&mut self, cause: Cause) -> Result<()> {
        for v in self.device_evictable() {
            self.evict_device(v, None, v, cause)?;
        }
        Ok(())
    }

    /// Sets the device budget's capacity (the tide) to `cap`. A falling tide first
    /// evicts what no longer fits; chunks in use or in flight hold it above `cap`
    /// (logged).
    pub(crate) fn set_device_cap(&mut self, cap: u64, cause: Cause) -> Result<()> {
        let cap = if cap < self.dev_cap {
            let held = self.make_room_device(0, cap, None, cause)?;
            if held > cap {
                tracing::debug!(
                    cap,
                    held,
                    "tidal budget held above target by chunks in use or in flight"
                );
            }
            cap.max(held)
        } else {
            cap
        };
        self.device
            .set_budget_capacity(cap)
            .map_err(|e| ChunkError::tier("setting the tidal device budget", None, e))?;
        self.dev_cap = cap;
        Ok(())
    }
}
