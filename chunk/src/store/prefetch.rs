//! Prefetch planning on both tiers: after an access, the loads the next moments need
//! (device: host->device copies and NVMe reads; host: NVMe reads into the pool, for
//! accesses on either tier), planned
//! by the [`PrefetchPlanner`] rule — a victim is never needed before the chunk it makes
//! room for — and started while the caller computes.
//!
//! Invariants: nothing is prefetched while tracing or after a divergence; a prefetch that
//! finds no room stops quietly (demand loads will retry); every move it makes carries a
//! [`MoveReason::Prefetch`] naming the chunk it is for.

use crate::accounting::MoveReason;
use crate::id::ChunkId;
use crate::mover::{is_no_room, Ahead};
use crate::planner::{PrefetchStep, Residency};
use crate::tracer::{Horizon, Schedule};
use crate::Result;

use super::mode::{Mode, Schedules};
use super::ChunkStore;

impl ChunkStore {
    pub(super) fn prefetch(&mut self, now: u64) {
        if self.settings.lookahead == 0 || self.diverged || self.is_tracing() {
            return;
        }
        let Mode::Following(s) = &self.mode else {
            return;
        };
        let dev_mark = self.mover.device_marks();
        // The device's window counts its own accesses only (see `PrefetchPlanner`).
        if !needs_any(&s.device, now, self.settings.lookahead, true, |c| {
            !dev_mark[c.dense()]
        }) {
            return;
        }
        let s = s.clone();
        if let Err(e) = self.prefetch_planned(&s, now) {
            tracing::warn!(error = %e, "chunk store: prefetch stopped; demand loads will retry");
        }
    }

    /// Plans the device's loads of the next moments on the device schedule and starts
    /// them, each after its victims' evictions.
    fn prefetch_planned(&mut self, schedules: &Schedules, now: u64) -> Result<()> {
        let s = &*schedules.device;
        self.mover.harvest(self.demand())?;
        let evictable = self.mover.device_evictable();
        let plan = self.planner.plan(
            s,
            now,
            Residency {
                resident: self.mover.device_marks(),
                evictable: &evictable,
                chunk_bytes: self.mover.device_chunk_bytes(),
                free_bytes: self.mover.device_free(),
                pool: None,
            },
        )?;
        for step in plan {
            for &v in &step.evict {
                let cause = self.cause(prefetch_reason(&step, Some((s, v, now))));
                let ahead = Ahead {
                    needed_at: step.needed_at,
                    schedule: &schedules.all,
                };
                match self.mover.evict_device(v, Some(ahead), step.chunk, cause) {
                    Ok(()) => {}
                    Err(e) if is_no_room(&e) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            let cause = self.cause(prefetch_reason(&step, None));
            let ahead = Ahead {
                needed_at: step.needed_at,
                schedule: &schedules.all,
            };
            if !self.mover.prefetch_device(step.chunk, ahead, cause)? {
                break;
            }
        }
        Ok(())
    }

    /// The host tier's prefetch, after every access on either tier, in two passes:
    /// 1. NVMe -> host reads of the chunks the host accesses of the next moments need,
    ///    planned by the same [`PrefetchPlanner`] rule as the device's (a victim is
    ///    never needed, by any access, before the chunk it makes room for);
    /// 2. read-ahead for the device: NVMe -> host reads of the chunks the device
    ///    accesses of the next moments need, so that the device's own prefetch only
    ///    copies them — into free buffers, or in place of host copies of chunks current
    ///    on the device (shadows: the device's accesses use its copy, so a shadow is
    ///    next needed at its chunk's next host access), never of anything else.
    ///
    /// Reads run while the caller computes; the NVMe tier's pump keeps them moving.
    pub(super) fn prefetch_host(&mut self, now: u64) {
        if self.settings.host_lookahead == 0 || self.diverged || self.is_tracing() {
            return;
        }
        let Mode::Following(Schedules {
            all: s,
            device: ds,
            host: hs,
        }) = &self.mode
        else {
            return;
        };
        let lookahead = self.settings.host_lookahead;
        let mover = &self.mover;
        let for_host = needs_any(hs, now, lookahead, false, |c| !mover.host_ready(c, true));
        let for_device = needs_any(ds, now, lookahead, false, |c| !mover.host_ready(c, false));
        if !for_host && !for_device {
            return;
        }
        let (hs, ds, s) = (hs.clone(), ds.clone(), s.clone());
        let mut result = Ok(());
        if for_host {
            result = self.prefetch_host_planned(&hs, &s, &hs, now, false);
        }
        if for_device && result.is_ok() {
            result = self.prefetch_host_planned(&ds, &s, &hs, now, true);
        }
        if let Err(e) = result {
            tracing::warn!(error = %e, "chunk store: host prefetch stopped; demand loads will retry");
        }
    }

    /// Plans and starts the host pool's reads of the chunks `needs` asks for; `s` is
    /// every access's schedule, `hs` the host accesses'. Host copies of chunks current
    /// on the device (shadows) are next needed at their next host access, and cheap to
    /// drop (see `plan_split`). With `read_ahead` (the device read-ahead) only shadows may go.
    fn prefetch_host_planned(
        &mut self,
        needs: &Schedule,
        s: &Schedule,
        hs: &Schedule,
        now: u64,
        read_ahead: bool,
    ) -> Result<()> {
        self.mover.harvest(self.demand())?;
        let resident: Vec<bool> = (0..self.mover.chunk_count())
            .map(|d| {
                let c = ChunkId::from_dense(d);
                self.mover.host_ready(c, !read_ahead)
            })
            .collect();
        // Chunks in use cannot go now, but may be what Belady's rule would evict when a
        // load is needed (see `plan_split`).
        let (mut held, mut evictable) = self.mover.host_copies_by_pin();
        let shadow = self.mover.device_copies();
        if read_ahead {
            evictable.retain(|c| shadow[c.dense()]);
            held.clear();
        }
        let room = self.mover.host_room();
        let plan = self.host_planner.plan_split(
            needs,
            s,
            now,
            Residency {
                resident: &resident,
                evictable: &evictable,
                chunk_bytes: self.mover.host_chunk_bytes(),
                // The pool serves sizes: whole buffers, or parts split for one size
                // (`PoolRoom`). Buffers of write-backs in flight count as free: they
                // return soon, and evicting more instead would write (and later read)
                // chunks for nothing.
                free_bytes: 0,
                pool: Some(&room),
            },
            &held,
            Some((&shadow[..], hs)),
        )?;
        let uses = (s, hs, &shadow[..]);
        if self.start_host_plan(plan, uses, now, !read_ahead)? {
            // Submitted requests start at the engine's next poll.
            self.mover.harvest(self.demand())?;
        }
        Ok(())
    }

    /// Starts the host pool's planned reads, each after its victims' evictions (`uses`:
    /// every access's schedule, the host accesses', and the shadow marks, which say
    /// from which of the two a victim's next use is read, as the planner read it;
    /// `materialize`: the host accesses' pass, where a dead chunk gets its buffer
    /// ahead). Whether any read started and the plan ran to its end (a victim that
    /// finds no room stops it quietly).
    fn start_host_plan(
        &mut self,
        plan: Vec<PrefetchStep>,
        (s, hs, shadow): (&Schedule, &Schedule, &[bool]),
        now: u64,
        materialize: bool,
    ) -> Result<bool> {
        let mut started = false;
        for step in plan {
            for &v in &step.evict {
                let uses = if shadow[v.dense()] { hs } else { s };
                let cause = self.cause(prefetch_reason(&step, Some((uses, v, now))));
                match self.mover.evict_host(v, false, cause) {
                    Ok(()) => {}
                    Err(e) if is_no_room(&e) => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            let cause = self.cause(prefetch_reason(&step, None));
            if !self
                .mover
                .prefetch_host(step.chunk, step.needed_at, cause, materialize)?
            {
                break;
            }
            started = true;
        }
        Ok(started)
    }
}

/// Whether any chunk used in the `lookahead` moments after `now` (wrapping around the
/// traced iteration; with `busy_only`, moments that use a chunk) satisfies `missing`:
/// the cheap test that decides whether a prefetch planner needs to run at all.
fn needs_any(
    schedule: &Schedule,
    now: u64,
    lookahead: u32,
    busy_only: bool,
    mut missing: impl FnMut(ChunkId) -> bool,
) -> bool {
    schedule
        .window(now, lookahead, Horizon::Cyclic, busy_only)
        .flat_map(|(_, chunks)| chunks)
        .any(|&c| missing(c))
}

/// The reason recorded for a prefetch's moves: the load of `step.chunk` itself (`victim`
/// `None`), or the eviction of a victim, with the victim's next use on `schedule` after
/// `now` (`u64::MAX` when it is not used again).
fn prefetch_reason(step: &PrefetchStep, victim: Option<(&Schedule, ChunkId, u64)>) -> MoveReason {
    let victim_next_use = victim
        .and_then(|(schedule, v, now)| schedule.next_use_from(v, now + 1, Horizon::Cyclic))
        .unwrap_or(u64::MAX);
    MoveReason::Prefetch {
        for_chunk: step.chunk,
        needed_at: step.needed_at,
        victim_next_use,
    }
}
