//! The prefetch planner: which chunks to load ahead of need, and which to evict first.
//!
//! [`PrefetchPlanner`] looks `lookahead` moments ahead on the schedule (or, as the
//! device's does, the next `lookahead` moments that use a chunk; optionally also
//! bounded by the bytes those moments need) and returns the
//! chunks to load, in order of need, each with the victims to evict first (farthest
//! next use first). It only evicts chunks not needed within the look-ahead window, so
//! in particular never one needed sooner than (or as soon as) the chunk it brings:
//! evicting a chunk the window needs would only reload it a few moments later. It
//! stops at the first chunk that cannot be made to fit that way (loading a later one
//! first would serve the future out of order). Prefetching is not free under a tight
//! budget: it evicts at planning time, when chunks about to finish their use are not
//! yet candidates, so it can move more bytes than demand loading with Belady's rule;
//! it trades bytes for fewer stalls. [`PrefetchPlanner::plan_split`] (the host tier's)
//! also takes the chunks in use and waits rather than evict a chunk that Belady's rule,
//! at the moment the load is needed, would keep over one of them; there a copy current
//! on a faster tier too (a shadow) counts as [`SHADOW_REFILL_COST`] times as far away as
//! its next use, and is never waited for. A tier whose room is
//! a pool of equal buffers split into parts by size (the host pool) is planned by
//! [`PoolRoom`]: a chunk fits a whole free buffer or a free part of its own size, and a
//! victim makes room only for a chunk its buffer (or part) can hold.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::tracer::{Horizon, Schedule};
use crate::Result;

/// One planned load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefetchStep {
    /// The chunk to load.
    pub chunk: ChunkId,
    /// The absolute moment it is first needed.
    pub needed_at: u64,
    /// Chunks to evict before loading it, each next used after the look-ahead window
    /// (so strictly after `needed_at`).
    pub evict: Vec<ChunkId>,
}

/// What the tier looks like to the planner.
#[derive(Debug, Clone, Copy)]
pub struct Residency<'a> {
    /// Per dense chunk: whether it is resident (missing entries: not resident).
    pub resident: &'a [bool],
    /// Resident chunks that may be evicted now.
    pub evictable: &'a [ChunkId],
    /// Per dense chunk: its byte size.
    pub chunk_bytes: &'a [u64],
    /// Bytes free in the tier now.
    pub free_bytes: u64,
    /// The tier's room as buffers and parts by size (a pool that serves sizes, not
    /// bytes: see [`PoolRoom`]); when given, it decides what fits instead of
    /// `free_bytes`, and `chunk_bytes` are the bytes each chunk holds in it.
    pub pool: Option<&'a PoolRoom>,
}

/// The room in a pool of equal buffers where a chunk of less than half a buffer takes a
/// part of a buffer split for its size (`tidestore_io::BufferPool`): what is free now,
/// by size, and which buffer each resident chunk sits in. A chunk fits when a whole
/// buffer is free, or a free part of its own size — free parts of other sizes do not
/// count, however many bytes they add up to (a byte count would plan a load the pool
/// then refuses, and stop the prefetch there). Evicting a chunk frees its part; the
/// last taken part of a split buffer frees the whole buffer.
///
/// The parts of buffers split by the plan itself, and of write-backs in flight (counted
/// free: they return soon), are not tracked by buffer: they never merge into a whole
/// buffer in the plan, which can only make it evict more than the pool needs, never
/// plan a load the pool refuses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolRoom {
    /// Bytes of a whole buffer (a chunk of at least this many takes a whole buffer).
    pub buf_bytes: u64,
    /// Whole buffers free.
    pub whole: u64,
    /// By the bytes of a part (a chunk's held bytes): `(parts per buffer, free parts
    /// not in `splits`)` — the parts of write-backs in flight. A part size without an
    /// entry is served by whole buffers only, and its victims free nothing.
    pub parts: BTreeMap<u64, (u64, u64)>,
    /// Split buffers by index: `(part bytes, parts per buffer, parts taken)`. The pool
    /// hands out the free part of the lowest index first, and so does the plan.
    pub splits: BTreeMap<u32, (u64, u64, u64)>,
    /// The buffer each resident chunk's part sits in (chunks of whole buffers need
    /// none).
    pub buffer_of: HashMap<ChunkId, u32>,
}

impl PoolRoom {
    fn is_whole(&self, bytes: u64) -> bool {
        bytes >= self.buf_bytes
    }

    /// The split buffer of part size `bytes` with a free part and the lowest index.
    fn split_with_room(&self, bytes: u64) -> Option<u32> {
        self.splits
            .iter()
            .find(|(_, &(held, per, taken))| held == bytes && taken < per)
            .map(|(&index, _)| index)
    }

    fn fits(&self, bytes: u64) -> bool {
        self.whole > 0
            || (!self.is_whole(bytes)
                && (self.parts.get(&bytes).is_some_and(|&(_, free)| free > 0)
                    || self.split_with_room(bytes).is_some()))
    }

    /// Takes room for a chunk that [`PoolRoom::fits`].
    fn take(&mut self, bytes: u64) {
        if !self.is_whole(bytes) {
            if let Some(index) = self.split_with_room(bytes) {
                self.splits.get_mut(&index).expect("a split").2 += 1;
                return;
            }
            if let Some((per, free)) = self.parts.get_mut(&bytes) {
                if *free > 0 {
                    *free -= 1;
                    return;
                }
                // A buffer split by the plan: its other parts are free, untracked.
                *free += *per - 1;
            }
        }
        self.whole -= 1;
    }

    /// Whether `chunk`'s split buffer (tracked here) is whole again in `after`, a copy
    /// of this room that victims were given back to.
    fn freed_in(&self, after: &PoolRoom, chunk: ChunkId) -> bool {
        self.buffer_of
            .get(&chunk)
            .is_some_and(|b| self.splits.contains_key(b) && !after.splits.contains_key(b))
    }

    /// Gives back the room of `chunk`, holding `bytes`. Returns whether a whole buffer
    /// came free.
    fn give(&mut self, chunk: ChunkId, bytes: u64) -> bool {
        if self.is_whole(bytes) {
            self.whole += 1;
            return true;
        }
        let split = self.buffer_of.get(&chunk).copied();
        match split.and_then(|b| self.splits.get_mut(&b).map(|s| (b, s))) {
            Some((b, (_, _, taken))) if *taken <= 1 => {
                // The last part taken: the buffer is whole again.
                self.splits.remove(&b);
                self.whole += 1;
                true
            }
            Some((_, (_, _, taken))) => {
                *taken -= 1;
                false
            }
            None => {
                if let Some((_, free)) = self.parts.get_mut(&bytes) {
                    *free += 1;
                }
                false
            }
        }
    }
}

/// The room the planner counts down: bytes, or a pool's buffers and parts.
#[derive(Debug, Clone)]
enum Room {
    Bytes(u64),
    Pool(PoolRoom),
}

impl Room {
    fn fits(&self, bytes: u64) -> bool {
        match self {
            Room::Bytes(free) => *free >= bytes,
            Room::Pool(p) => p.fits(bytes),
        }
    }

    fn take(&mut self, bytes: u64) {
        match self {
            Room::Bytes(free) => *free -= bytes,
            Room::Pool(p) => p.take(bytes),
        }
    }

    /// Gives back `victim`'s room; returns whether that alone can make room for a chunk
    /// of `bytes` (a byte count always; in a pool, a whole buffer freed or a part of
    /// that size).
    fn give(&mut self, victim: ChunkId, victim_bytes: u64, bytes: u64) -> bool {
        match self {
            Room::Bytes(free) => {
                *free = free.saturating_add(victim_bytes);
                true
            }
            Room::Pool(p) => p.give(victim, victim_bytes) || victim_bytes == bytes,
        }
    }
}

/// The bytes `c` takes on `tier`; a chunk the tier does not know is an error.
fn chunk_size(tier: &Residency<'_>, c: ChunkId) -> Result<u64> {
    tier.chunk_bytes
        .get(c.dense())
        .copied()
        .ok_or(ChunkError::UnknownChunk { chunk: c })
}

/// How many times a disk chunk's refill costs a shadow's: a chunk read back from the
/// disk (about 2.5 GB/s on the NVMe disks this is measured on, after a write when it
/// changed) against a copy over the device link (PCIe, or `memcpy` for the simulated
/// device: 10 GB/s and more). The planner counts a shadow's next use this many times
/// as far away.
pub const SHADOW_REFILL_COST: u64 = 4;

/// Plans loads for the next moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchPlanner {
    /// How many moments after the current one to look at.
    pub lookahead: u32,
    /// The most bytes of (distinct) chunks the window may need, resident or not; the
    /// window ends before the chunk that would pass it. Bounds how far ahead chunks
    /// are loaded when moments use many or large chunks (`u64::MAX`: no bound).
    pub lookahead_bytes_max: u64,
    /// How the schedule is read past its end.
    pub horizon: Horizon,
    /// Whether `lookahead` counts only the moments that use a chunk of the schedule
    /// planned on (a tier's own schedule is empty where the other tier's accesses
    /// are); else every moment.
    pub busy_only: bool,
}

impl PrefetchPlanner {
    /// A planner looking `lookahead` moments ahead, with no byte bound.
    pub fn new(lookahead: u32, horizon: Horizon) -> Self {
        PrefetchPlanner {
            lookahead,
            lookahead_bytes_max: u64::MAX,
            horizon,
            busy_only: false,
        }
    }

    /// With `lookahead` counting only the moments that use a chunk
    /// ([`PrefetchPlanner::busy_only`]).
    pub fn counting_busy_moments(mut self) -> Self {
        self.busy_only = true;
        self
    }

    /// With the window also bounded by the bytes its chunks take.
    pub fn with_lookahead_bytes_max(mut self, bytes: u64) -> Self {
        self.lookahead_bytes_max = bytes;
        self
    }

    /// The loads to start at absolute moment `now` (whose own chunks are already
    /// resident), in order of need. A chunk whose size is unknown is an error.
    pub fn plan(
        &self,
        schedule: &Schedule,
        now: u64,
        tier: Residency<'_>,
    ) -> Result<Vec<PrefetchStep>> {
        self.plan_inner(schedule, schedule, now, tier, None, None)
    }

    /// As [`PrefetchPlanner::plan`], with the chunks to load read from `needs` and the
    /// victims' next uses from `uses` (same moments): a tier whose loads serve only some
    /// accesses (the host tier's prefetch serves host accesses) still never evicts a
    /// chunk that any access needs sooner than the one it brings.
    ///
    /// `held` are the tier's other resident chunks, those that cannot be evicted now (in
    /// use). Victims also follow Belady's order *at the moment each load is needed*:
    /// ranking every resident chunk (held ones, and evictable ones used before then,
    /// included) by its next use at or after that moment, a victim is taken only when
    /// it is the farthest one left; when the farthest is held or still needed before the
    /// load, planning stops, and the load waits until that chunk can go (a later plan,
    /// or the demand load). Without this, a chunk about to finish its use (pinned at
    /// planning time, next used much later) is passed over for one needed sooner, which
    /// then has to be written back and read again: the host prefetcher evicting the
    /// 16-bit parameters the next forward needs first, while the optimizer state it just
    /// stepped (next used one iteration later) is still pinned.
    ///
    /// `shadows` marks (per dense chunk; missing entries: false) copies on this tier of
    /// chunks current on a faster tier too: their next use is read from the schedule
    /// given with them (this tier's own accesses), as the faster copy serves the
    /// others. Dropping one writes nothing and costs a copy from the faster tier when it
    /// is next needed (which the host prefetcher starts ahead), where any other victim
    /// costs a read from the disk, and a write first when it changed: a shadow goes
    /// before a chunk used up to [`SHADOW_REFILL_COST`] times as far away, and the rule
    /// above neither holds it back nor waits for a held one. Ranked by next use alone, shadows crowd out the
    /// optimizer state the step reads next (fp32 masters that compute reads on the
    /// device, each with a copy left in the host pool by its step, took five of eleven
    /// buffers through forward, and their optimizer state went through the disk).
    pub fn plan_split(
        &self,
        needs: &Schedule,
        uses: &Schedule,
        now: u64,
        tier: Residency<'_>,
        held: &[ChunkId],
        shadows: Option<(&[bool], &Schedule)>,
    ) -> Result<Vec<PrefetchStep>> {
        self.plan_inner(needs, uses, now, tier, Some(held), shadows)
    }

    /// The chunks the window after `now` needs that `tier` does not hold, each with
    /// the first moment it is needed at, in order, and the window's last moment: the
    /// next `lookahead` moments (busy ones only, with [`PrefetchPlanner::busy_only`]),
    /// ending sooner where the distinct chunks it uses pass `lookahead_bytes_max`.
    fn window(
        &self,
        schedule: &Schedule,
        now: u64,
        tier: &Residency<'_>,
    ) -> Result<(Vec<(ChunkId, u64)>, u64)> {
        let resident = |c: ChunkId| tier.resident.get(c.dense()).copied().unwrap_or(false);
        let mut needed = Vec::new();
        if schedule.is_empty() {
            return Ok((needed, now.saturating_add(u64::from(self.lookahead))));
        }
        // Without `busy_only` the window ends `lookahead` moments on, used or not.
        let mut window_end = if self.busy_only {
            now
        } else {
            now.saturating_add(u64::from(self.lookahead))
        };
        let mut seen: HashSet<ChunkId> = HashSet::new();
        let mut window_bytes = 0u64;
        for (at, chunks) in schedule.window(now, self.lookahead, self.horizon, self.busy_only) {
            if self.busy_only {
                window_end = at;
            }
            for &c in chunks {
                if !seen.insert(c) {
                    continue;
                }
                window_bytes = window_bytes.saturating_add(chunk_size(tier, c)?);
                if window_bytes > self.lookahead_bytes_max {
                    return Ok((needed, at));
                }
                if !resident(c) {
                    needed.push((c, at));
                }
            }
        }
        Ok((needed, window_end))
    }

    fn plan_inner(
        &self,
        needs: &Schedule,
        uses: &Schedule,
        now: u64,
        tier: Residency<'_>,
        held: Option<&[ChunkId]>,
        shadows: Option<(&[bool], &Schedule)>,
    ) -> Result<Vec<PrefetchStep>> {
        let size = |c: ChunkId| chunk_size(&tier, c);
        let (needed, window_end) = self.window(needs, now, &tier)?;
        let shadow =
            |c: ChunkId| shadows.is_some_and(|(marks, _)| marks.get(c.dense()) == Some(&true));
        let next_use = |c: ChunkId, from: u64| {
            let uses = match shadows {
                Some((_, own)) if shadow(c) => own,
                _ => uses,
            };
            uses.next_use_from(c, from, self.horizon)
                .unwrap_or(u64::MAX)
        };
        let (victims, blockers) =
            victims_and_blockers(&tier, held, (now, window_end), &next_use, &shadow);
        let mut room = match tier.pool {
            Some(p) => Room::Pool(p.clone()),
            None => Room::Bytes(tier.free_bytes),
        };
        let mut taken = vec![false; victims.len()];
        let mut plan = Vec::new();
        for (chunk, needed_at) in needed {
            let bytes = size(chunk)?;
            // The farthest next use at `needed_at` among chunks that cannot go now: a
            // victim must be at least as far (ties go to the victim).
            let wall = blockers
                .iter()
                .map(|&b| next_use(b, needed_at))
                .max()
                .unwrap_or(0);
            // Victims in Belady's order until the chunk fits. In a pool, a victim that
            // frees neither a whole buffer (alone, or as the last part of its buffer)
            // nor a part of this size makes no room for it; unless a later victim
            // completes its buffer it stays, for a later load it does make room for.
            let mut trial = room.clone();
            let mut given: Vec<(usize, bool)> = Vec::new();
            for (i, &(next, v)) in victims.iter().enumerate() {
                if trial.fits(bytes) {
                    break;
                }
                if taken[i] {
                    continue;
                }
                if shadow(v) {
                    // Never one needed before the load; no wall: keeping it over a
                    // chunk in use saves a copy, not a write and a read.
                    if next <= needed_at {
                        continue;
                    }
                } else if next <= needed_at || (held.is_some() && next_use(v, needed_at) < wall) {
                    break;
                }
                let helps = trial.give(v, size(v)?, bytes);
                given.push((i, helps));
            }
            if !trial.fits(bytes) {
                break;
            }
            let (mut trial, evict) = kept(&room, trial, &given, &victims, bytes, &tier)?;
            debug_assert!(trial.fits(bytes), "pruning left no room for {chunk}");
            trial.take(bytes);
            room = trial;
            for &i in &evict {
                taken[i] = true;
            }
            plan.push(PrefetchStep {
                chunk,
                needed_at,
                evict: evict.iter().map(|&i| victims[i].1).collect(),
            });
        }
        Ok(plan)
    }
}

/// The victims to evict for a load of `bytes` that `trial` (`room` after every victim
/// `given`) fits, and the room they leave. `given`: indices into `victims` in the order
/// tried, each with whether it made room alone. In a pool, those that helped alone and
/// the parts of buffers a later victim freed whole (what made the trial fit is among
/// them, so the room they leave fits too); counted in bytes, all of them.
fn kept(
    room: &Room,
    trial: Room,
    given: &[(usize, bool)],
    victims: &[(u64, ChunkId)],
    bytes: u64,
    tier: &Residency<'_>,
) -> Result<(Room, Vec<usize>)> {
    let (Room::Pool(before), Room::Pool(after)) = (room, &trial) else {
        return Ok((trial, given.iter().map(|&(i, _)| i).collect()));
    };
    let keep: Vec<usize> = given
        .iter()
        .filter(|&&(i, helps)| helps || before.freed_in(after, victims[i].1))
        .map(|&(i, _)| i)
        .collect();
    let mut pruned = room.clone();
    for &i in &keep {
        let v = victims[i].1;
        pruned.give(v, chunk_size(tier, v)?, bytes);
    }
    Ok((pruned, keep))
}

/// The chunks a plan may evict, in the order it takes them, each with its next use after
/// `now` — those not needed within the window ending at `window_end`, in Belady's order
/// with a shadow's next use counted [`SHADOW_REFILL_COST`] times as far (see
/// `plan_split`), ties to the smaller dense id (as `Lifetime`) — and, with `held`, the
/// chunks a load's victim must go at least as far as: the held ones and the evictable
/// ones the window needs (they cannot go now, but may be the farthest at a load's
/// moment), shadows left out.
fn victims_and_blockers(
    tier: &Residency<'_>,
    held: Option<&[ChunkId]>,
    (now, window_end): (u64, u64),
    next_use: &dyn Fn(ChunkId, u64) -> u64,
    shadow: &dyn Fn(ChunkId) -> bool,
) -> (Vec<(u64, ChunkId)>, Vec<ChunkId>) {
    let mut victims: Vec<(u64, ChunkId)> = tier
        .evictable
        .iter()
        .map(|&c| (next_use(c, now + 1), c))
        .collect();
    let mut blockers: Vec<ChunkId> = Vec::new();
    if let Some(held) = held {
        blockers.extend(
            victims
                .iter()
                .filter(|&&(next, _)| next <= window_end)
                .map(|&(_, c)| c),
        );
        blockers.extend(held.iter().copied());
    }
    blockers.retain(|&b| !shadow(b));
    victims.retain(|&(next, _)| next > window_end);
    let weighed = |next: u64, c: ChunkId| {
        let far = next.saturating_sub(now);
        if shadow(c) {
            far.saturating_mul(SHADOW_REFILL_COST)
        } else {
            far
        }
    };
    victims.sort_by_key(|&(next, c)| (std::cmp::Reverse(weighed(next, c)), c.dense()));
    (victims, blockers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::{c, schedule};

    #[test]
    fn prefetch_in_order_of_need_and_never_evicts_sooner() {
        let s = schedule();
        let planner = PrefetchPlanner::new(3, Horizon::Once);
        let sizes = vec![10u64; 20];
        let mut resident = vec![false; 20];
        resident[c(0).dense()] = true;
        resident[c(3).dense()] = true;
        // now = 0, window 1..=3 needs 1, 2 (0 resident). One free slot.
        let plan = planner
            .plan(
                &s,
                0,
                Residency {
                    resident: &resident,
                    evictable: &[c(3)],
                    chunk_bytes: &sizes,
                    free_bytes: 10,
                    pool: None,
                },
            )
            .unwrap();
        // 1 needed at 1 fits; 2 needed at 2 evicts 3 (next use 4 > 2).
        assert_eq!(plan.len(), 2);
        assert_eq!(
            (plan[0].chunk, plan[0].needed_at, plan[0].evict.clone()),
            (c(1), 1, vec![])
        );
        assert_eq!((plan[1].chunk, plan[1].evict.clone()), (c(2), vec![c(3)]));
        // Only chunk 0 may go (next use 3, past a 2-moment window): it makes room for
        // 1 (needed at 1), then nothing is left for 2. With a 3-moment window it stays.
        let short = PrefetchPlanner::new(2, Horizon::Once);
        let tier = |resident: &'static [u32], evictable: &'static [u32]| {
            let mut r = vec![false; 20];
            for &i in resident {
                r[c(i).dense()] = true;
            }
            (r, evictable.iter().map(|&i| c(i)).collect::<Vec<_>>())
        };
        let (r, e) = tier(&[0, 3], &[0]);
        let at0 = Residency {
            resident: &r,
            evictable: &e,
            chunk_bytes: &sizes,
            free_bytes: 0,
            pool: None,
        };
        let plan = short.plan(&s, 0, at0).unwrap();
        assert_eq!(
            plan,
            vec![PrefetchStep {
                chunk: c(1),
                needed_at: 1,
                evict: vec![c(0)]
            }]
        );
        assert!(planner.plan(&s, 0, at0).unwrap().is_empty());
        // At moment 2, chunk 3 is needed at 4 but the only victim, 0, is needed at 3.
        let (r, e) = tier(&[0, 2], &[0]);
        let plan = planner
            .plan(
                &s,
                2,
                Residency {
                    resident: &r,
                    evictable: &e,
                    chunk_bytes: &sizes,
                    free_bytes: 0,
                    pool: None,
                },
            )
            .unwrap();
        assert!(plan.is_empty());
    }

    #[test]
    fn split_plan_waits_for_a_held_chunk_that_goes_farther() {
        // Moments: 0 uses 1 and 2, then 3, 4, 0, 1, 2 (needed by the host: 3 at 1).
        let g: Vec<Vec<ChunkId>> = vec![
            vec![c(1), c(2)],
            vec![c(3)],
            vec![c(4)],
            vec![c(0)],
            vec![c(1)],
            vec![c(2)],
        ];
        let s = Schedule::from_groups(&g, &[]);
        let planner = PrefetchPlanner::new(1, Horizon::Once);
        let sizes = vec![10u64; 20];
        let mut resident = vec![false; 20];
        for i in [0, 1, 2] {
            resident[c(i).dense()] = true;
        }
        let tier = Residency {
            resident: &resident,
            evictable: &[c(0)],
            chunk_bytes: &sizes,
            free_bytes: 0,
            pool: None,
        };
        // Without held chunks: 0 (next use 3) makes room for 3 (needed at 1).
        let plan = planner.plan_split(&s, &s, 0, tier, &[], None).unwrap();
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].evict, vec![c(0)]);
        // 1 and 2, in use now, go farther (4, 5) than 0: the load waits for them.
        assert!(planner
            .plan_split(&s, &s, 0, tier, &[c(1), c(2)], None)
            .unwrap()
            .is_empty());
        // The plain planner is unchanged.
        assert_eq!(planner.plan(&s, 0, tier).unwrap(), plan);
    }

    #[test]
    fn a_shadow_goes_before_a_disk_chunk_used_up_to_its_refill_cost_as_far() {
        // Moment 0 uses 1; 9 is needed at 1; then 2 at 3, 3 at 12, 1 at 40.
        let mut g: Vec<Vec<ChunkId>> = vec![Vec::new(); 41];
        g[0] = vec![c(1)];
        g[1] = vec![c(9)];
        g[3] = vec![c(2)];
        g[12] = vec![c(3)];
        g[40] = vec![c(1)];
        let s = Schedule::from_groups(&g, &[]);
        let planner = PrefetchPlanner::new(1, Horizon::Once);
        let sizes = vec![10u64; 64];
        let mut resident = vec![false; 64];
        for i in [1, 2, 3] {
            resident[c(i).dense()] = true;
        }
        let tier = Residency {
            resident: &resident,
            evictable: &[c(2), c(3)],
            chunk_bytes: &sizes,
            free_bytes: 0,
            pool: None,
        };
        let victim = |marks: &[bool], held: &[ChunkId]| {
            let plan = planner
                .plan_split(&s, &s, 0, tier, held, Some((marks, &s)))
                .unwrap();
            plan.first().map(|p| p.evict.clone())
        };
        let mut marks = vec![false; 64];
        // Belady's rule alone: 3 (next use 12) before 2 (3).
        assert_eq!(victim(&marks, &[]), Some(vec![c(3)]));
        // 2 as a shadow: 3 moments away counts as 12, a tie with 3 (smaller id wins).
        marks[c(2).dense()] = true;
        assert_eq!(victim(&marks, &[]), Some(vec![c(2)]));
        // 1, held and used at 40, would stop the load for a disk chunk; as a shadow
        // it does not hold it back: dropped when it is released, it costs a copy.
        marks[c(2).dense()] = false;
        assert_eq!(victim(&marks, &[c(1)]), None);
        marks[c(1).dense()] = true;
        assert_eq!(victim(&marks, &[c(1)]), Some(vec![c(3)]));
    }

    #[test]
    fn a_pool_plans_by_buffers_and_parts_not_bytes() {
        // Buffers of 100 bytes; chunks of 50 take half a buffer. Moment 0 uses 0, then
        // 1 (whole), 2 and 3 (halves) are needed; 4 (whole) and 5 (half) are the
        // victims, 5 the farthest. Buffer 8 holds 0 and a free half; buffer 7 holds 5
        // and 6 (resident, not evictable).
        let g: Vec<Vec<ChunkId>> = (0..6).map(|i| vec![c(i)]).collect();
        let s = Schedule::from_groups(&g, &[]);
        let planner = PrefetchPlanner::new(3, Horizon::Once);
        let mut sizes = vec![100u64; 64];
        for i in [0, 2, 3, 5, 6] {
            sizes[c(i).dense()] = 50;
        }
        let mut resident = vec![false; 64];
        for i in [0, 4, 5, 6] {
            resident[c(i).dense()] = true;
        }
        let evictable = [c(4), c(5)];
        // The plan from moment 0 as (chunk, victims) pairs.
        let steps = |s: &Schedule,
                     evictable: &[ChunkId],
                     free_bytes: u64,
                     pool: Option<&PoolRoom>|
         -> Vec<(ChunkId, Vec<ChunkId>)> {
            let tier = Residency {
                resident: &resident,
                evictable,
                chunk_bytes: &sizes,
                free_bytes,
                pool,
            };
            let plan = planner.plan(s, 0, tier).unwrap();
            plan.into_iter().map(|p| (p.chunk, p.evict)).collect()
        };
        // One half of a buffer free: 50 bytes.
        let by_bytes = steps(&s, &evictable, 50, None);
        // By bytes, evicting the half-size 5 "frees" 100 bytes for the whole chunk 1:
        // a plan the pool cannot serve (buffer 7 still holds 6, buffer 8 holds 0).
        assert_eq!(by_bytes[0], (c(1), vec![c(5)]));
        let room = PoolRoom {
            buf_bytes: 100,
            whole: 0,
            parts: [(50, (2, 0))].into_iter().collect(),
            splits: [(7, (50, 2, 2)), (8, (50, 2, 1))].into_iter().collect(),
            buffer_of: [(c(0), 8), (c(5), 7), (c(6), 7)].into_iter().collect(),
        };
        let by_pool = steps(&s, &evictable, 0, Some(&room));
        // 1 takes the buffer 4 frees (evicting 5 would free half a buffer only); 2
        // the free half of buffer 8; 3 the half 5 frees.
        assert_eq!(
            by_pool,
            vec![(c(1), vec![c(4)]), (c(2), vec![]), (c(3), vec![c(5)])]
        );
        // A half-size chunk splits a whole buffer and leaves its other half free for
        // the next one; the whole chunk after them then finds no room.
        let room = PoolRoom {
            buf_bytes: 100,
            whole: 1,
            parts: [(50, (2, 0))].into_iter().collect(),
            ..PoolRoom::default()
        };
        let g: Vec<Vec<ChunkId>> = [0u32, 2, 3, 1].iter().map(|&i| vec![c(i)]).collect();
        let s = Schedule::from_groups(&g, &[]);
        assert_eq!(
            steps(&s, &[], 0, Some(&room)),
            vec![(c(2), vec![]), (c(3), vec![])]
        );
    }
}
