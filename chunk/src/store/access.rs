//! The access path: a tensor's way into COMPUTE and out of it, top to bottom — may it
//! be used there, the moment it is, the tide at that moment, where its chunk is (made
//! current by the mover's load path, which makes room and loads), the pin, the state,
//! the warm-up record, and the prefetch of what the next moments need; then release.
//!
//! Invariants: an access that fails leaves the tensor's state unchanged; a chunk with a
//! tensor in COMPUTE is pinned where it is (never evicted) and in use on one tier at a
//! time; the device bytes pinned are counted once per pinned chunk.

use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::state::{ChunkState, TensorState};
use crate::tracer::MomentKind;
use crate::Result;

use super::{ChunkStore, Guard, Mode, Place};

impl ChunkStore {
    /// Makes `tensor` (its place in `list`) current at `place` and puts it in COMPUTE.
    ///
    /// Errors (the tensor's state is then unchanged): a tensor without a place in
    /// `list`, an illegal transition (already in COMPUTE), its chunk in use on the
    /// other tier, a working set that does not fit the tier, tier and I/O errors.
    pub fn access(&mut self, tensor: TensorId, list: ListKind, place: Place) -> Result<Guard> {
        let loc = self.location(tensor, list)?;
        let local = self.local(tensor, list)?;
        let chunk = loc.chunk;
        self.check_access(tensor, list, local, chunk, place)?;
        // A moment of the trace, and the device budget at it.
        let moment = self.observe(tensor, chunk, MomentKind::Access);
        self.moment = moment;
        self.counts.accesses += 1;
        self.update_tide(moment)?;
        // Where the chunk is; where it is not, room is made and it is loaded.
        self.mover.make_current(chunk, place, self.demand())?;
        self.mover.count_read_ahead(chunk, moment);
        self.mover.pin(chunk, place);
        let generation = self.enter_compute(list, local, place)?;
        self.record_warmup(moment, chunk, place);
        if place == Place::Device {
            self.prefetch(moment);
        }
        self.prefetch_host(moment);
        Ok(Guard {
            store: self.id,
            generation,
            tensor,
            list,
            chunk,
            place,
            offset_bytes: loc.offset_bytes() as usize,
            len_bytes: loc.bytes() as usize,
            dtype: loc.dtype,
        })
    }

    /// Whether `tensor` may enter COMPUTE at `place`: its state allows it, and its chunk
    /// is not in use on the other tier. Changes nothing.
    fn check_access(
        &mut self,
        tensor: TensorId,
        list: ListKind,
        local: u32,
        chunk: ChunkId,
        place: Place,
    ) -> Result<()> {
        {
            let ls = self.list_states(list);
            let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
            if !from.can_become(TensorState::Compute) {
                return Err(ChunkError::IllegalTransition {
                    tensor: self.name(tensor),
                    chunk,
                    from,
                    to: TensorState::Compute,
                });
            }
        }
        match self.mover.pinned_on(chunk) {
            Some(elsewhere) if elsewhere != place => Err(ChunkError::PinnedElsewhere {
                tensor: self.name(tensor),
                chunk,
                pinned_on: elsewhere.tier(),
            }),
            _ => Ok(()),
        }
    }

    /// Puts the tensor in COMPUTE at `place` under a new access generation (returned).
    fn enter_compute(&mut self, list: ListKind, local: u32, place: Place) -> Result<u64> {
        let generation = self.next_generation;
        self.next_generation += 1;
        let ls = self.list_states(list);
        ls.table.transition(TensorId(local), TensorState::Compute)?;
        ls.place[local as usize] = Some(place);
        ls.generation[local as usize] = generation;
        Ok(generation)
    }

    /// While tracing, notes the access at `moment`: the device bytes pinned, the phase,
    /// and which tier's schedule the chunk goes into.
    fn record_warmup(&mut self, moment: u64, chunk: ChunkId, place: Place) {
        if let Mode::Tracing(_) = self.mode {
            if let Ok(m) = u32::try_from(moment) {
                let pinned = self.mover.pinned_device_bytes();
                self.warmup.push((m, pinned, self.phase));
                self.device_moments.resize(m as usize, None);
                self.device_moments
                    .push((place == Place::Device).then_some(chunk));
                self.host_moments.resize(m as usize, None);
                self.host_moments
                    .push((place == Place::Host).then_some(chunk));
            }
        }
    }

    /// Ends `guard`'s use: its tensor goes from COMPUTE to `to` (`Hold`,
    /// `HoldAfterFwd` or `HoldAfterBwd`; COMPUTE -> FREE is illegal, see
    /// [`crate::state`]). On an error the tensor stays in COMPUTE;
    /// [`ChunkStore::release_tensor`] can release it then. A stale guard (see
    /// [`Guard`]) is [`ChunkError::StaleGuard`], and nothing changes.
    pub fn release(&mut self, guard: Guard, to: TensorState) -> Result<()> {
        self.check_guard(&guard)?;
        self.release_tensor(guard.tensor, guard.list, to)
    }

    /// Releases `tensor` in `list` by id (see [`ChunkStore::release`]).
    pub fn release_tensor(
        &mut self,
        tensor: TensorId,
        list: ListKind,
        to: TensorState,
    ) -> Result<()> {
        let local = self.local(tensor, list)?;
        let chunk = self.location(tensor, list)?.chunk;
        let ls = self.list_states(list);
        let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
        if from != TensorState::Compute || !from.can_become(to) {
            return Err(ChunkError::IllegalTransition {
                tensor: self.name(tensor),
                chunk,
                from,
                to,
            });
        }
        // A tensor in COMPUTE has a place, and its chunk a pin there: checked before
        // anything changes.
        let place = ls.place[local as usize];
        let Some(place) = place.filter(|&p| self.mover.can_unpin(chunk, p)) else {
            return Err(ChunkError::Invariant {
                chunk: Some(chunk),
                what: format!(
                    "releasing `{}` in COMPUTE at {place:?}, but its chunk has no pin there",
                    self.name(tensor)
                ),
            });
        };
        let ls = self.list_states(list);
        ls.table.transition(TensorId(local), to)?;
        ls.place[local as usize] = None;
        let moment = self.observe(tensor, chunk, MomentKind::Release(to));
        self.moment = moment;
        self.mover.unpin(chunk, place)
    }

    /// Moves a tensor that is not in COMPUTE to another state that is not COMPUTE
    /// (e.g. HOLD_AFTER_BWD -> FREE once its gradient is consumed). Not a moment. Bytes
    /// are kept, except when it leaves every tensor of its chunk FREE: then no payload
    /// of the chunk is needed and the chunk is discarded — every copy dropped, NVMe slot
    /// included, none written — and its bytes are unspecified until written again (its
    /// next copy is neither read nor zero-filled). So a dead gradient chunk costs no
    /// write-back after the step, and no read or fill before backward overwrites it.
    pub fn set_state(&mut self, tensor: TensorId, list: ListKind, to: TensorState) -> Result<()> {
        let local = self.local(tensor, list)?;
        let chunk = self.location(tensor, list)?.chunk;
        let ls = self.list_states(list);
        let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
        if from == TensorState::Compute || to == TensorState::Compute {
            return Err(ChunkError::IllegalTransition {
                tensor: self.name(tensor),
                chunk,
                from,
                to,
            });
        }
        let t = ls.table.transition(TensorId(local), to)?;
        if t.after == ChunkState::Free && t.before != ChunkState::Free {
            let cause = self.demand();
            self.mover.discard(chunk, cause)?;
        }
        Ok(())
    }
}
