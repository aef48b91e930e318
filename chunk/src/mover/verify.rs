//! [`Mover::verify`]: every invariant of the slots, the lists, the counters and the
//! tiers that the moves rely on (see the module doc of `mover`), checked rather than
//! repaired; the first broken one is [`ChunkError::Invariant`] naming the chunk and what
//! disagrees. Changes nothing.

use std::collections::BTreeMap;

use super::{Mover, Pending, Slot};
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

/// What [`Mover::verify`] counts over the slots.
#[derive(Debug, Default)]
struct Tally {
    dev_bytes: u64,
    host_bytes: u64,
    /// Write-backs in flight by the host bytes their buffers hold.
    writing_held: BTreeMap<u64, usize>,
    copies: usize,
    nvme: usize,
    queued: usize,
}

/// A broken invariant of chunk `c`.
fn broken<T>(c: ChunkId, what: String) -> Result<T> {
    Err(ChunkError::Invariant {
        chunk: Some(c),
        what,
    })
}

impl Mover {
    /// Checks every invariant of the slots, the lists, the counters and the tiers that
    /// the moves rely on (see the module doc); the first broken one is
    /// [`ChunkError::Invariant`] naming the chunk and what disagrees.
    pub(crate) fn verify(&self) -> Result<()> {
        let mut t = Tally::default();
        for d in 0..self.slots.len() {
            self.verify_slot(d, &mut t)?;
        }
        self.verify_pinned_bytes()?;
        self.verify_in_flight(&t)?;
        self.verify_budgets(&t)?;
        self.verify_swap_claims()
    }

    /// The device bytes counted pinned are those of the chunks pinned on the device.
    fn verify_pinned_bytes(&self) -> Result<()> {
        let pinned: u64 = (0..self.slots.len())
            .filter(|&d| self.slots[d].dev_pins > 0)
            .map(|d| self.dev_bytes[d])
            .sum();
        if pinned != self.pinned_device_bytes {
            return Err(ChunkError::Invariant {
                chunk: None,
                what: format!(
                    "{} device bytes counted pinned, the pinned chunks take {pinned}",
                    self.pinned_device_bytes
                ),
            });
        }
        Ok(())
    }

    /// The counts of transfers in flight and of queued reads agree with the slots.
    fn verify_in_flight(&self, t: &Tally) -> Result<()> {
        let bad = |what: String| Err(ChunkError::Invariant { chunk: None, what });
        if self.hold_queue {
            return bad("the read queue is held outside a demand load".into());
        }
        if (self.pending_copies, self.pending_nvme) != (t.copies, t.nvme) {
            return bad(format!(
                "in flight counted (device copies {}, nvme {}) but slots say (device copies {}, nvme {})",
                self.pending_copies, self.pending_nvme, t.copies, t.nvme
            ));
        }
        if self.writing_held != t.writing_held {
            return bad(format!(
                "write-backs in flight by buffer size counted {:?}, slots say {:?}",
                self.writing_held, t.writing_held
            ));
        }
        let queued = self.queued_held();
        let owed_too_much = queued
            .iter()
            .find(|&(held, &n)| n > t.writing_held.get(held).copied().unwrap_or(0));
        if self.read_queue.len() != t.queued || owed_too_much.is_some() {
            return bad(format!(
                "{} reads queued ({queued:?} by buffer size), {} slots queued, write-backs \
                 to give them buffers {:?}",
                self.read_queue.len(),
                t.queued,
                t.writing_held
            ));
        }
        Ok(())
    }

    /// Each tier's bytes in use equal the copies it holds, within its budget.
    fn verify_budgets(&self, t: &Tally) -> Result<()> {
        let bad = |what: String| Err(ChunkError::Invariant { chunk: None, what });
        let dev = self.device.budget();
        if dev.used_bytes() != t.dev_bytes
            || dev.capacity_bytes() != self.dev_cap
            || dev.used_bytes() > dev.capacity_bytes()
        {
            return bad(format!(
                "device budget uses {} of {} bytes (tide {}), the chunks' device copies take {}",
                dev.used_bytes(),
                dev.capacity_bytes(),
                self.dev_cap,
                t.dev_bytes
            ));
        }
        let host = self.host.budget();
        if self.host.taken_bytes() != t.host_bytes || host.used_bytes() > host.capacity_bytes() {
            return bad(format!(
                "host pool hands out {} bytes (uses {} of {}), the chunks hold {} bytes",
                self.host.taken_bytes(),
                host.used_bytes(),
                host.capacity_bytes(),
                t.host_bytes
            ));
        }
        let nvme = self.nvme.budget();
        if nvme.used_bytes() > nvme.capacity_bytes() {
            return bad(format!(
                "swap file uses {} of {} bytes",
                nvme.used_bytes(),
                nvme.capacity_bytes()
            ));
        }
        Ok(())
    }

    /// Every chunk the swap file stores is claimed by its slot.
    fn verify_swap_claims(&self) -> Result<()> {
        let bad = |what: String| Err(ChunkError::Invariant { chunk: None, what });
        let stored: Vec<u64> = self
            .nvme
            .with_swap_file(|f| f.chunks().map(|(id, _)| id).collect());
        for id in stored {
            let ours = usize::try_from(id)
                .ok()
                .and_then(|d| self.slots.get(d))
                .is_some_and(|s| s.nvme_stored || s.pending == Pending::NvmeWrite);
            if !ours {
                return bad(format!(
                    "the swap file stores chunk {id}, which no slot claims"
                ));
            }
        }
        Ok(())
    }

    fn verify_slot(&self, d: usize, t: &mut Tally) -> Result<()> {
        let s = &self.slots[d];
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        if self.len_bytes[d] == 0 {
            let empty = s.dev.is_none()
                && s.host.is_none()
                && !s.nvme_stored
                && s.pending == Pending::None
                && s.reserved_dev.is_none()
                && s.dev_pins == 0
                && s.host_pins == 0;
            return if empty {
                Ok(())
            } else {
                bad("a chunk the layout does not have holds state".into())
            };
        }
        self.verify_pins(d, s)?;
        self.verify_nvme_copy(d, s)?;
        let moving = self.tally_pending(d, s, t)?;
        self.verify_copies(d, s, moving, t)?;
        self.verify_lists(d, s)
    }

    /// A chunk is pinned on one tier at most, where its copy is ready.
    fn verify_pins(&self, d: usize, s: &Slot) -> Result<()> {
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        if s.dev_pins > 0 && s.host_pins > 0 {
            return bad(format!(
                "pinned on both tiers ({} device, {} host pins)",
                s.dev_pins, s.host_pins
            ));
        }
        if s.dev_pins > 0 && (s.dev.is_none() || s.pending != Pending::None) {
            return bad(format!(
                "{} device pins without a device copy ready",
                s.dev_pins
            ));
        }
        if s.host_pins > 0 && (s.host.is_none() || s.pending != Pending::None) {
            return bad(format!(
                "{} host pins without a host copy ready",
                s.host_pins
            ));
        }
        Ok(())
    }

    /// The slot's NVMe flags agree with the swap file.
    fn verify_nvme_copy(&self, d: usize, s: &Slot) -> Result<()> {
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        if s.nvme_valid && !s.nvme_stored {
            return bad("NVMe copy current but no slot stored".into());
        }
        // A write-back in flight may have completed in the swap file (stored there, or
        // dropped after a failure) before its completion is routed here.
        let writing = s.pending == Pending::NvmeWrite;
        if !writing && s.nvme_stored != self.nvme.contains(d as u64) {
            return bad(format!(
                "slot says stored on NVMe {}, the swap file {}",
                s.nvme_stored,
                self.nvme.contains(d as u64)
            ));
        }
        if !writing && s.nvme_stored && self.nvme.len_of(d as u64) != Some(self.len(c)) {
            return bad(format!(
                "stored on NVMe as {:?} bytes, the chunk is {}",
                self.nvme.len_of(d as u64),
                self.len(c)
            ));
        }
        Ok(())
    }

    /// Counts what is in flight for the chunk; whether anything is.
    fn tally_pending(&self, d: usize, s: &Slot, t: &mut Tally) -> Result<bool> {
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        Ok(match s.pending {
            Pending::None => false,
            Pending::HostToDevice(_) | Pending::DeviceToHost(_) => {
                t.copies += 1;
                t.host_bytes += self.host_bytes[d];
                t.dev_bytes += self.dev_bytes[d];
                true
            }
            Pending::NvmeRead => {
                t.nvme += 1;
                t.host_bytes += self.host_bytes[d];
                true
            }
            Pending::NvmeReadQueued => {
                t.queued += 1;
                if self.read_queue.iter().filter(|&&x| x == c).count() != 1 {
                    return bad("queued for a read but not once in the read queue".into());
                }
                true
            }
            Pending::NvmeWrite => {
                t.nvme += 1;
                *t.writing_held.entry(self.host_bytes[d]).or_default() += 1;
                t.host_bytes += self.host_bytes[d];
                if s.nvme_valid {
                    return bad("a write-back in flight over a current NVMe copy".into());
                }
                true
            }
        })
    }

    /// Nothing in flight beside a copy, no read of a stale copy, no reservation without
    /// a read, never a stale NVMe copy alone; counts the copies' bytes.
    fn verify_copies(&self, d: usize, s: &Slot, moving: bool, t: &mut Tally) -> Result<()> {
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        let copies = s.host.is_some() || s.dev.is_some();
        if moving && copies {
            return bad(format!(
                "{:?} in flight beside a copy in the slot",
                s.pending
            ));
        }
        let reading = matches!(s.pending, Pending::NvmeRead | Pending::NvmeReadQueued);
        if reading && !s.nvme_valid {
            return bad("an NVMe read of a copy that is not current".into());
        }
        if s.reserved_dev.is_some() {
            if !reading {
                return bad("device memory reserved without a read for it".into());
            }
            t.dev_bytes += self.dev_bytes[d];
        }
        if s.nvme_stored
            && !s.nvme_valid
            && !copies
            && !matches!(
                s.pending,
                Pending::HostToDevice(_) | Pending::DeviceToHost(_) | Pending::NvmeWrite
            )
        {
            return bad("its only copy is a stale NVMe copy".into());
        }
        if s.dev.is_some() {
            t.dev_bytes += self.dev_bytes[d];
        }
        if let Some(b) = &s.host {
            if b.capacity() as u64 != self.host_bytes[d] {
                return bad(format!(
                    "a host buffer of {} bytes for a chunk that holds {}",
                    b.capacity(),
                    self.host_bytes[d]
                ));
            }
            t.host_bytes += self.host_bytes[d];
        }
        Ok(())
    }

    /// The lists the policies see and the planner's device marks agree with the slot.
    fn verify_lists(&self, d: usize, s: &Slot) -> Result<()> {
        let c = ChunkId::from_dense(d);
        let bad = |what: String| broken(c, what);
        let in_list = |list: &[ChunkId]| list.iter().filter(|&&x| x == c).count();
        if in_list(&self.dev_list) != usize::from(s.dev.is_some()) {
            return bad(format!(
                "device copy {}, {} times in the device list",
                s.dev.is_some(),
                in_list(&self.dev_list)
            ));
        }
        if in_list(&self.host_list) != usize::from(s.host.is_some()) {
            return bad(format!(
                "host copy {}, {} times in the host list",
                s.host.is_some(),
                in_list(&self.host_list)
            ));
        }
        let marked = s.dev.is_some()
            || s.reserved_dev.is_some()
            || matches!(
                s.pending,
                Pending::HostToDevice(_) | Pending::DeviceToHost(_)
            );
        if self.dev_mark[d] != marked {
            return bad(format!(
                "device mark {} but on or bound for the device {marked}",
                self.dev_mark[d]
            ));
        }
        if s.prefetched && !marked {
            return bad("prefetched to the device but not there".into());
        }
        Ok(())
    }
}
