//! Eviction policies (the prefetch planner that evicts by them ahead of need is
//! [`crate::planner`]).
//!
//! An [`EvictionPolicy`] picks a victim among the candidates the caller offers: chunks
//! that are resident in the tier and evictable (no tensor in `Compute`, not needed at
//! the current moment). The caller tells it about inserts, accesses and evictions.
//! Three policies:
//! - [`Lifetime`] (the default): Belady's rule on the traced [`Schedule`]: evict the
//!   chunk whose next use is farthest away; a chunk never used again goes first.
//! - [`Lru`]: evict the chunk whose last access is oldest.
//! - [`Fifo`]: evict the chunk that became resident first.
//!
//! Ties are broken by the smaller [`ChunkId::dense`], so every policy is deterministic
//! and `Lifetime` matches the offline reference in [`crate::sim`] decision for decision.
//!
//! Costs: `choose_victim` is O(candidates) for `Lru`/`Fifo` and O(candidates x log
//! uses) for `Lifetime`; notifications are O(1) (amortised: per-chunk arrays grow on
//! demand).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::tracer::{Horizon, Schedule};
use crate::Result;

/// Chooses which resident chunk leaves a tier.
pub trait EvictionPolicy {
    /// The policy's name (`lifetime`, `lru`, `fifo`).
    fn name(&self) -> &'static str;

    /// `chunk` became resident at `moment`; this counts as an access.
    fn on_insert(&mut self, chunk: ChunkId, moment: u64);

    /// `chunk`, already resident, was accessed at `moment`.
    fn on_access(&mut self, chunk: ChunkId, moment: u64);

    /// `chunk` left the tier at `moment`.
    fn on_evict(&mut self, chunk: ChunkId, moment: u64);

    /// The victim among `candidates` (resident and evictable) at `moment`; `None` only
    /// when `candidates` is empty.
    fn choose_victim(&mut self, candidates: &[ChunkId], moment: u64) -> Option<ChunkId>;
}

/// The policies by name, as configuration files spell them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// [`Lifetime`].
    Lifetime,
    /// [`Lru`].
    Lru,
    /// [`Fifo`].
    Fifo,
}

impl PolicyKind {
    /// All policies.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Lifetime, PolicyKind::Lru, PolicyKind::Fifo];

    /// The policy's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lifetime => "lifetime",
            PolicyKind::Lru => "lru",
            PolicyKind::Fifo => "fifo",
        }
    }

    /// A fresh policy of this kind; `Lifetime` reads `schedule` with `horizon`.
    pub fn build(
        self,
        schedule: Arc<Schedule>,
        horizon: Horizon,
    ) -> Box<dyn EvictionPolicy + Send> {
        match self {
            PolicyKind::Lifetime => Box::new(Lifetime::new(schedule, horizon)),
            PolicyKind::Lru => Box::new(Lru::new()),
            PolicyKind::Fifo => Box::new(Fifo::new()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = ChunkError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lifetime" | "belady" => Ok(PolicyKind::Lifetime),
            "lru" => Ok(PolicyKind::Lru),
            "fifo" => Ok(PolicyKind::Fifo),
            _ => Err(ChunkError::UnknownPolicy {
                name: s.to_string(),
            }),
        }
    }
}

/// Belady's rule on a traced schedule.
#[derive(Debug, Clone)]
pub struct Lifetime {
    schedule: Arc<Schedule>,
    horizon: Horizon,
}

impl Lifetime {
    /// Evicts by next use on `schedule`, read with `horizon`.
    pub fn new(schedule: Arc<Schedule>, horizon: Horizon) -> Self {
        Lifetime { schedule, horizon }
    }

    /// Replaces the schedule (after a re-trace).
    pub fn set_schedule(&mut self, schedule: Arc<Schedule>) {
        self.schedule = schedule;
    }

    /// The schedule in use.
    pub fn schedule(&self) -> &Arc<Schedule> {
        &self.schedule
    }

    /// The key victims are chosen by: next use at or after `moment`, `u64::MAX` if never.
    fn next_use(&self, chunk: ChunkId, moment: u64) -> u64 {
        self.schedule
            .next_use_from(chunk, moment, self.horizon)
            .unwrap_or(u64::MAX)
    }
}

impl EvictionPolicy for Lifetime {
    fn name(&self) -> &'static str {
        "lifetime"
    }

    fn on_insert(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn on_access(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn on_evict(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn choose_victim(&mut self, candidates: &[ChunkId], moment: u64) -> Option<ChunkId> {
        candidates
            .iter()
            .copied()
            .max_by_key(|&c| (self.next_use(c, moment), std::cmp::Reverse(c.dense())))
    }
}

/// Stamps per dense chunk from a private clock, for `Lru` and `Fifo`.
#[derive(Debug, Clone, Default)]
struct Stamps {
    clock: u64,
    stamp: Vec<u64>,
}

impl Stamps {
    fn touch(&mut self, chunk: ChunkId) {
        let d = chunk.dense();
        if d >= self.stamp.len() {
            self.stamp.resize(d + 1, 0);
        }
        self.clock += 1;
        self.stamp[d] = self.clock;
    }

    fn oldest(&self, candidates: &[ChunkId]) -> Option<ChunkId> {
        candidates
            .iter()
            .copied()
            .min_by_key(|c| (self.stamp.get(c.dense()).copied().unwrap_or(0), c.dense()))
    }
}

/// Least recently used.
#[derive(Debug, Clone, Default)]
pub struct Lru {
    stamps: Stamps,
}

impl Lru {
    /// An empty LRU.
    pub fn new() -> Self {
        Lru::default()
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_insert(&mut self, chunk: ChunkId, _moment: u64) {
        self.stamps.touch(chunk);
    }

    fn on_access(&mut self, chunk: ChunkId, _moment: u64) {
        self.stamps.touch(chunk);
    }

    fn on_evict(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn choose_victim(&mut self, candidates: &[ChunkId], _moment: u64) -> Option<ChunkId> {
        self.stamps.oldest(candidates)
    }
}

/// First in, first out.
#[derive(Debug, Clone, Default)]
pub struct Fifo {
    stamps: Stamps,
}

impl Fifo {
    /// An empty FIFO.
    pub fn new() -> Self {
        Fifo::default()
    }
}

impl EvictionPolicy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn on_insert(&mut self, chunk: ChunkId, _moment: u64) {
        self.stamps.touch(chunk);
    }

    fn on_access(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn on_evict(&mut self, _chunk: ChunkId, _moment: u64) {}

    fn choose_victim(&mut self, candidates: &[ChunkId], _moment: u64) -> Option<ChunkId> {
        self.stamps.oldest(candidates)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::id::ListKind;

    /// Chunk `i` of the parameters (also the planner's tests').
    pub(crate) fn c(i: u32) -> ChunkId {
        ChunkId::new(ListKind::Params, i)
    }

    /// The schedule 0 1 2 0 3 1 0 (also the planner's tests').
    pub(crate) fn schedule() -> Arc<Schedule> {
        // 0 1 2 0 3 1 0
        let g: Vec<Vec<ChunkId>> = [0u32, 1, 2, 0, 3, 1, 0]
            .iter()
            .map(|&i| vec![c(i)])
            .collect();
        Arc::new(Schedule::from_groups(&g, &[]))
    }

    #[test]
    fn lifetime_evicts_farthest_and_unused_first() {
        let s = schedule();
        let mut p = Lifetime::new(s.clone(), Horizon::Once);
        // At moment 4 (chunk 3 in use): next uses 0 -> 6, 1 -> 5, 2 -> never.
        assert_eq!(p.choose_victim(&[c(0), c(1), c(2)], 4), Some(c(2)));
        assert_eq!(p.choose_victim(&[c(0), c(1)], 4), Some(c(0)));
        // Cyclic: 2 is used again next iteration at 7 + 2 = 9.
        let mut p = Lifetime::new(s, Horizon::Cyclic);
        assert_eq!(p.choose_victim(&[c(0), c(1), c(2)], 4), Some(c(2)));
        assert_eq!(p.choose_victim(&[c(0), c(1), c(9)], 4), Some(c(9)));
        assert_eq!(p.choose_victim(&[], 4), None);
    }

    #[test]
    fn lru_and_fifo() {
        let mut lru = Lru::new();
        let mut fifo = Fifo::new();
        for p in [&mut lru as &mut dyn EvictionPolicy, &mut fifo] {
            p.on_insert(c(0), 0);
            p.on_insert(c(1), 1);
            p.on_access(c(0), 2);
        }
        assert_eq!(lru.choose_victim(&[c(0), c(1)], 3), Some(c(1)));
        assert_eq!(fifo.choose_victim(&[c(0), c(1)], 3), Some(c(0)));
    }

    #[test]
    fn policy_kind_names() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>().unwrap(), k);
            assert_eq!(k.build(schedule(), Horizon::Cyclic).name(), k.as_str());
        }
        assert!(matches!(
            "mru".parse::<PolicyKind>(),
            Err(ChunkError::UnknownPolicy { .. })
        ));
    }
}
