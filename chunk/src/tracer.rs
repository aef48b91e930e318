//! The warm-up trace and the [`Schedule`] it yields.
//!
//! During the warm-up iteration every `access` and `release` becomes a [`Moment`]:
//! its index (0, 1, 2, ... in call order), the tensor and its chunk, the kind, and the
//! non-model device memory at that moment (activations, workspace), as reported by the
//! caller. [`Tracer::finish`] turns the moments into a [`Schedule`] that answers:
//! - for every chunk, the moments it is used (accessed): its lifetime, and
//!   `next_use` in O(log uses) by binary search;
//! - the non-model peak over any window of moments in O(1) (a sparse table), from
//!   which the tidal device budget follows: capacity minus that peak minus a margin.
//!
//! Training repeats the iteration, so the schedule is read with a [`Horizon`]: `Cyclic`
//! unrolls it (a chunk not used again in this iteration is next used at its first use
//! of the next one), `Once` ends it (no further use).
//!
//! Later iterations are compared with the schedule by a [`Follower`]: the first moment
//! whose tensor or kind differs, whose non-model memory exceeds the traced value by
//! more than a slack, or an iteration that ends early or runs past the trace, is a
//! [`Divergence`] (logged with `tracing`), after which the store re-traces.
//!
//! Invariants: moments are dense from 0; each chunk's use list is strictly increasing;
//! a schedule is immutable.

use crate::id::{ChunkId, TensorId};
use crate::state::TensorState;

/// What happened at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MomentKind {
    /// The tensor was accessed (its chunk must be resident).
    Access,
    /// The tensor was released into the given state.
    Release(TensorState),
}

/// One recorded access or release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    /// The moment's index in the iteration.
    pub index: u32,
    /// The tensor.
    pub tensor: TensorId,
    /// Its chunk.
    pub chunk: ChunkId,
    /// Access or release.
    pub kind: MomentKind,
    /// Non-model device memory at this moment, in bytes.
    pub non_model_bytes: u64,
}

/// Records the warm-up iteration.
#[derive(Debug, Clone, Default)]
pub struct Tracer {
    moments: Vec<Moment>,
}

impl Tracer {
    /// An empty trace.
    pub fn new() -> Self {
        Tracer::default()
    }

    /// Records a moment and returns its index.
    ///
    /// # Panics
    /// After `u32::MAX` moments (an iteration with four billion accesses).
    pub fn record(
        &mut self,
        tensor: TensorId,
        chunk: ChunkId,
        kind: MomentKind,
        non_model_bytes: u64,
    ) -> u32 {
        let index = u32::try_from(self.moments.len()).expect("more than u32::MAX moments");
        self.moments.push(Moment {
            index,
            tensor,
            chunk,
            kind,
            non_model_bytes,
        });
        index
    }

    /// Records an access.
    pub fn access(&mut self, tensor: TensorId, chunk: ChunkId, non_model_bytes: u64) -> u32 {
        self.record(tensor, chunk, MomentKind::Access, non_model_bytes)
    }

    /// Records a release into `to`.
    pub fn release(
        &mut self,
        tensor: TensorId,
        chunk: ChunkId,
        to: TensorState,
        non_model_bytes: u64,
    ) -> u32 {
        self.record(tensor, chunk, MomentKind::Release(to), non_model_bytes)
    }

    /// The moments so far.
    pub fn moments(&self) -> &[Moment] {
        &self.moments
    }

    /// The schedule of the recorded iteration.
    pub fn finish(self) -> Schedule {
        let groups: Vec<Option<ChunkId>> = self
            .moments
            .iter()
            .map(|m| (m.kind == MomentKind::Access).then_some(m.chunk))
            .collect();
        let non_model: Vec<u64> = self.moments.iter().map(|m| m.non_model_bytes).collect();
        Schedule::build(groups.iter().map(|g| g.as_slice()), non_model, self.moments)
    }
}

/// How a schedule is read past its last moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Horizon {
    /// The iteration repeats: moment `m` of iteration `k` is `k * len + m`.
    Cyclic,
    /// The trace ends after its last moment.
    Once,
}

/// Per-chunk use lists and non-model memory of one traced iteration.
#[derive(Debug, Clone)]
pub struct Schedule {
    len: u32,
    events: Vec<Moment>,
    /// CSR: uses of dense chunk `d` are `uses[use_start[d]..use_start[d + 1]]`.
    use_start: Vec<u32>,
    uses: Vec<u32>,
    /// CSR: chunks used at moment `m` are `moment_chunks[moment_start[m]..moment_start[m + 1]]`.
    moment_start: Vec<u32>,
    moment_chunks: Vec<ChunkId>,
    /// `peak[k][i]` = max of `non_model[i..i + 2^k]`; level 0 is the raw series.
    peak: Vec<Vec<u64>>,
}

impl Schedule {
    /// A schedule whose moment `m` uses the chunks `groups[m]` (duplicates ignored),
    /// with `non_model_bytes[m]` (missing entries count as 0). It carries no events,
    /// so a [`Follower`] reports divergence at its first observation.
    ///
    /// # Panics
    /// With more than `u32::MAX` moments or uses.
    pub fn from_groups(groups: &[Vec<ChunkId>], non_model_bytes: &[u64]) -> Schedule {
        let mut non_model = non_model_bytes.to_vec();
        non_model.resize(groups.len(), 0);
        Schedule::build(groups.iter().map(|g| g.as_slice()), non_model, Vec::new())
    }

    fn build<'a>(
        groups: impl ExactSizeIterator<Item = &'a [ChunkId]> + Clone,
        non_model: Vec<u64>,
        events: Vec<Moment>,
    ) -> Schedule {
        let len = u32::try_from(groups.len()).expect("more than u32::MAX moments");
        let dense_len = groups
            .clone()
            .flat_map(|g| g.iter().map(|c| c.dense() + 1))
            .max()
            .unwrap_or(0);
        // Moment -> chunks, deduplicated within a moment (order of first mention).
        let mut moment_start = Vec::with_capacity(groups.len() + 1);
        let mut moment_chunks = Vec::new();
        let mut seen_at = vec![u32::MAX; dense_len];
        let mut counts = vec![0u32; dense_len + 1];
        for (m, g) in groups.enumerate() {
            moment_start.push(moment_chunks.len() as u32);
            for &c in g {
                if seen_at[c.dense()] != m as u32 {
                    seen_at[c.dense()] = m as u32;
                    moment_chunks.push(c);
                    counts[c.dense() + 1] += 1;
                }
            }
        }
        moment_start.push(u32::try_from(moment_chunks.len()).expect("more than u32::MAX uses"));
        // Chunk -> moments (counting sort keeps them increasing).
        for d in 0..dense_len {
            counts[d + 1] += counts[d];
        }
        let use_start = counts.clone();
        let mut fill = counts;
        let mut uses = vec![0u32; moment_chunks.len()];
        for m in 0..len as usize {
            for c in &moment_chunks[moment_start[m] as usize..moment_start[m + 1] as usize] {
                uses[fill[c.dense()] as usize] = m as u32;
                fill[c.dense()] += 1;
            }
        }
        let mut peak = vec![non_model];
        let mut width = 1usize;
        while width * 2 <= len as usize {
            let prev = &peak[peak.len() - 1];
            let next: Vec<u64> = (0..len as usize + 1 - width * 2)
                .map(|i| prev[i].max(prev[i + width]))
                .collect();
            peak.push(next);
            width *= 2;
        }
        Schedule {
            len,
            events,
            use_start,
            uses,
            moment_start,
            moment_chunks,
            peak,
        }
    }

    /// Moments in one iteration.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the iteration has no moments.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The recorded moments (empty for a schedule built from groups).
    pub fn events(&self) -> &[Moment] {
        &self.events
    }

    /// The length of a dense per-chunk array covering every chunk used.
    pub fn dense_len(&self) -> usize {
        self.use_start.len() - 1
    }

    /// The moments `chunk` is used, increasing (empty for a chunk never used).
    pub fn uses(&self, chunk: ChunkId) -> &[u32] {
        let d = chunk.dense();
        if d + 1 >= self.use_start.len() {
            return &[];
        }
        &self.uses[self.use_start[d] as usize..self.use_start[d + 1] as usize]
    }

    /// The first and last moment `chunk` is used.
    pub fn lifetime(&self, chunk: ChunkId) -> Option<(u32, u32)> {
        let u = self.uses(chunk);
        Some((*u.first()?, *u.last()?))
    }

    /// The chunks used at `moment` (empty past the end).
    pub fn chunks_at(&self, moment: u32) -> &[ChunkId] {
        let m = moment as usize;
        if m >= self.len as usize {
            return &[];
        }
        &self.moment_chunks[self.moment_start[m] as usize..self.moment_start[m + 1] as usize]
    }

    /// The moments of a prefetch window after the absolute moment `now`, each with
    /// its chunks, read with `horizon`: the next `count` moments, or with `busy_only`
    /// the next `count` moments that use a chunk (a tier's schedule has empty moments
    /// where the other tier's accesses are, and these do not bring a need closer; they
    /// are looked for at most one iteration on).
    pub fn window(
        &self,
        now: u64,
        count: u32,
        horizon: Horizon,
        busy_only: bool,
    ) -> impl Iterator<Item = (u64, &[ChunkId])> + '_ {
        let len = u64::from(self.len);
        let ahead = now.saturating_add(u64::from(count));
        // The last moment read: busy moments are looked for up to one iteration on.
        let reach = match horizon {
            _ if len == 0 => now,
            Horizon::Once if busy_only => len - 1,
            Horizon::Once => ahead.min(len - 1),
            Horizon::Cyclic if busy_only => now.saturating_add(len),
            Horizon::Cyclic => ahead,
        };
        (now + 1..=reach)
            .map(move |at| {
                let m = match horizon {
                    Horizon::Once => at,
                    Horizon::Cyclic => at % len.max(1),
                };
                (at, self.chunks_at(m as u32))
            })
            .filter(move |(_, chunks)| !busy_only || !chunks.is_empty())
            .take(count as usize)
    }

    /// The first use of `chunk` strictly after `after` in this iteration, O(log uses).
    pub fn next_use(&self, chunk: ChunkId, after: u32) -> Option<u32> {
        let u = self.uses(chunk);
        u.get(u.partition_point(|&m| m <= after)).copied()
    }

    /// The first use of `chunk` at or after the absolute moment `from`, read with
    /// `horizon`; `None` when it is never used (again). O(log uses).
    pub fn next_use_from(&self, chunk: ChunkId, from: u64, horizon: Horizon) -> Option<u64> {
        let u = self.uses(chunk);
        let len = u64::from(self.len);
        match horizon {
            Horizon::Once => {
                if from >= len {
                    return None;
                }
                u.get(u.partition_point(|&m| u64::from(m) < from))
                    .map(|&m| u64::from(m))
            }
            Horizon::Cyclic => {
                let first = u64::from(*u.first()?);
                let base = from / len * len;
                let m = from - base;
                match u.get(u.partition_point(|&x| u64::from(x) < m)) {
                    Some(&x) => Some(base + u64::from(x)),
                    None => Some(base + len + first),
                }
            }
        }
    }

    /// Non-model bytes recorded at `moment` (0 past the end).
    pub fn non_model_bytes(&self, moment: u32) -> u64 {
        self.peak[0].get(moment as usize).copied().unwrap_or(0)
    }

    /// The non-model peak over moments `from..=to` (clamped to the iteration; 0 when
    /// empty), O(1).
    pub fn non_model_peak(&self, from: u32, to: u32) -> u64 {
        if self.len == 0 || from >= self.len || from > to {
            return 0;
        }
        let to = to.min(self.len - 1) as usize;
        let from = from as usize;
        let span = to - from + 1;
        let k = (usize::BITS - 1 - span.leading_zeros()) as usize;
        self.peak[k][from].max(self.peak[k][to + 1 - (1 << k)])
    }

    /// The non-model peak over the `window + 1` moments starting at `moment`, wrapping
    /// into the next iteration (the whole iteration when the window covers it).
    pub fn non_model_peak_window(&self, moment: u64, window: u32) -> u64 {
        if self.len == 0 {
            return 0;
        }
        let len = u64::from(self.len);
        if u64::from(window) + 1 >= len {
            return self.non_model_peak(0, self.len - 1);
        }
        let start = (moment % len) as u32;
        let end = u64::from(start) + u64::from(window);
        if end < len {
            self.non_model_peak(start, end as u32)
        } else {
            self.non_model_peak(start, self.len - 1)
                .max(self.non_model_peak(0, (end - len) as u32))
        }
    }

    /// The tidal device budget for chunks around `moment`: `capacity_bytes` minus the
    /// non-model peak over the next `window` moments minus `margin_bytes` (0 if none).
    pub fn tidal_budget_bytes(
        &self,
        capacity_bytes: u64,
        moment: u64,
        window: u32,
        margin_bytes: u64,
    ) -> u64 {
        capacity_bytes
            .saturating_sub(self.non_model_peak_window(moment, window))
            .saturating_sub(margin_bytes)
    }
}

/// How an observed iteration departs from the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DivergenceKind {
    /// Another tensor or kind than traced (`expected` is `None` past the trace's end).
    Event {
        /// The traced tensor and kind.
        expected: Option<(TensorId, MomentKind)>,
        /// The observed tensor and kind.
        observed: (TensorId, MomentKind),
    },
    /// More non-model memory than traced plus the slack.
    NonModelMemory {
        /// Bytes traced at this moment.
        traced_bytes: u64,
        /// Bytes observed.
        observed_bytes: u64,
    },
    /// The iteration ended before the trace did.
    EndedEarly {
        /// Moments in the trace.
        traced_moments: u32,
    },
}

/// The first moment at which an iteration left the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Divergence {
    /// The moment index (in the iteration).
    pub moment: u32,
    /// How it diverged.
    pub kind: DivergenceKind,
}

/// The answer to one observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Follow {
    /// The observation matches the traced moment.
    OnSchedule {
        /// Its moment.
        moment: u32,
    },
    /// This observation is the first divergence of the iteration.
    Diverged(Divergence),
    /// The iteration already diverged; observations are no longer compared.
    Untraced,
}

/// Follows later iterations against a schedule.
#[derive(Debug, Clone)]
pub struct Follower {
    position: u32,
    diverged: bool,
    non_model_slack_bytes: u64,
}

impl Follower {
    /// A follower tolerating `non_model_slack_bytes` more non-model memory than traced
    /// before calling it a divergence (less is always fine).
    pub fn new(non_model_slack_bytes: u64) -> Self {
        Follower {
            position: 0,
            diverged: false,
            non_model_slack_bytes,
        }
    }

    /// The moment the next observation is compared with.
    pub fn position(&self) -> u32 {
        self.position
    }

    /// Whether this iteration diverged.
    pub fn is_diverged(&self) -> bool {
        self.diverged
    }

    /// Compares one access or release with the schedule, O(1).
    pub fn observe(
        &mut self,
        schedule: &Schedule,
        tensor: TensorId,
        kind: MomentKind,
        non_model_bytes: u64,
    ) -> Follow {
        if self.diverged {
            return Follow::Untraced;
        }
        let moment = self.position;
        self.position = self.position.saturating_add(1);
        let expected = schedule.events.get(moment as usize);
        let divergence = match expected {
            Some(e) if e.tensor == tensor && e.kind == kind => {
                if non_model_bytes > e.non_model_bytes.saturating_add(self.non_model_slack_bytes) {
                    Some(DivergenceKind::NonModelMemory {
                        traced_bytes: e.non_model_bytes,
                        observed_bytes: non_model_bytes,
                    })
                } else {
                    None
                }
            }
            _ => Some(DivergenceKind::Event {
                expected: expected.map(|e| (e.tensor, e.kind)),
                observed: (tensor, kind),
            }),
        };
        match divergence {
            None => Follow::OnSchedule { moment },
            Some(kind) => Follow::Diverged(self.diverge(Divergence { moment, kind })),
        }
    }

    /// Ends the iteration and rewinds to moment 0. Returns the divergence if the
    /// iteration stopped before the trace did (and had not diverged already).
    pub fn end_iteration(&mut self, schedule: &Schedule) -> Option<Divergence> {
        let early =
            (!self.diverged && (self.position as usize) < schedule.events.len()).then(|| {
                self.diverge(Divergence {
                    moment: self.position,
                    kind: DivergenceKind::EndedEarly {
                        traced_moments: schedule.events.len() as u32,
                    },
                })
            });
        self.position = 0;
        self.diverged = false;
        early
    }

    fn diverge(&mut self, d: Divergence) -> Divergence {
        self.diverged = true;
        tracing::warn!(
            moment = d.moment,
            divergence = ?d.kind,
            "access sequence diverged from the traced schedule; re-trace needed"
        );
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ListKind;
    use proptest::prelude::*;

    fn c(i: u32) -> ChunkId {
        ChunkId::new(ListKind::Params, i)
    }

    #[test]
    fn a_window_of_busy_moments_skips_the_empty_ones_and_wraps() {
        let mut t = Tracer::new();
        // a(c0) r a(c1) r a(c2) r: busy moments 0, 2, 4.
        for i in 0..3u32 {
            t.access(TensorId(i), c(i), 0);
            t.release(TensorId(i), c(i), TensorState::Hold, 0);
        }
        let s = t.finish();
        let at = |now, count, horizon, busy| -> Vec<u64> {
            s.window(now, count, horizon, busy)
                .map(|(m, _)| m)
                .collect()
        };
        assert_eq!(at(0, 2, Horizon::Cyclic, false), vec![1, 2]);
        assert_eq!(at(0, 2, Horizon::Cyclic, true), vec![2, 4]);
        // Past the end: the next iteration's moments, at most one iteration read.
        assert_eq!(at(4, 2, Horizon::Cyclic, true), vec![6, 8]);
        assert_eq!(at(4, 9, Horizon::Cyclic, true), vec![6, 8, 10]);
        assert_eq!(at(2, 9, Horizon::Once, true), vec![4]);
        assert_eq!(at(3, 9, Horizon::Once, false), vec![4, 5]);
        let chunks: Vec<&[ChunkId]> = s
            .window(4, 1, Horizon::Cyclic, true)
            .map(|(_, c)| c)
            .collect();
        assert_eq!(chunks, vec![&[c(0)][..]]);
    }

    #[test]
    fn tracer_builds_uses_and_next_use() {
        let mut t = Tracer::new();
        // a(c0) r a(c1) r a(c0) r
        for (i, chunk) in [0u32, 1, 0].into_iter().enumerate() {
            t.access(TensorId(i as u32), c(chunk), 10 * i as u64);
            t.release(TensorId(i as u32), c(chunk), TensorState::Hold, 5);
        }
        let s = t.finish();
        assert_eq!(s.len(), 6);
        assert_eq!(s.uses(c(0)), &[0, 4]);
        assert_eq!(s.uses(c(1)), &[2]);
        assert_eq!(s.uses(c(7)), &[] as &[u32]);
        assert_eq!(s.lifetime(c(0)), Some((0, 4)));
        assert_eq!(s.next_use(c(0), 0), Some(4));
        assert_eq!(s.next_use(c(0), 4), None);
        assert_eq!(s.next_use_from(c(0), 4, Horizon::Once), Some(4));
        assert_eq!(s.next_use_from(c(0), 5, Horizon::Once), None);
        assert_eq!(s.next_use_from(c(0), 5, Horizon::Cyclic), Some(6));
        assert_eq!(s.next_use_from(c(1), 15, Horizon::Cyclic), Some(20));
        assert_eq!(s.next_use_from(c(7), 0, Horizon::Cyclic), None);
        assert_eq!(s.chunks_at(2), &[c(1)]);
        assert_eq!(s.chunks_at(3), &[] as &[ChunkId]);
        assert_eq!(s.non_model_peak(0, 5), 20);
        assert_eq!(s.non_model_peak(1, 3), 10);
        assert_eq!(s.non_model_peak_window(5, 1), 5);
        assert_eq!(s.non_model_peak_window(3, 1), 20);
        assert_eq!(s.tidal_budget_bytes(100, 3, 1, 7), 73);
        assert_eq!(s.tidal_budget_bytes(10, 3, 1, 7), 0);
    }

    #[test]
    fn follower_detects_first_divergence() {
        let mut t = Tracer::new();
        for i in 0..4 {
            t.access(TensorId(i), c(i), 100);
        }
        let s = t.finish();
        let mut f = Follower::new(10);
        for i in 0..4 {
            assert_eq!(
                f.observe(&s, TensorId(i), MomentKind::Access, 105),
                Follow::OnSchedule { moment: i }
            );
        }
        assert_eq!(f.end_iteration(&s), None);
        f.observe(&s, TensorId(0), MomentKind::Access, 100);
        let d = f.observe(&s, TensorId(2), MomentKind::Access, 100);
        assert_eq!(
            d,
            Follow::Diverged(Divergence {
                moment: 1,
                kind: DivergenceKind::Event {
                    expected: Some((TensorId(1), MomentKind::Access)),
                    observed: (TensorId(2), MomentKind::Access)
                }
            })
        );
        assert_eq!(
            f.observe(&s, TensorId(3), MomentKind::Access, 0),
            Follow::Untraced
        );
        assert_eq!(f.end_iteration(&s), None);
        // Memory grows (a longer sequence): divergence at that moment.
        let d = f.observe(&s, TensorId(0), MomentKind::Access, 111);
        assert!(matches!(
            d,
            Follow::Diverged(Divergence {
                moment: 0,
                kind: DivergenceKind::NonModelMemory { .. }
            })
        ));
        f.end_iteration(&s);
        // Ending early and overrunning.
        f.observe(&s, TensorId(0), MomentKind::Access, 0);
        let d = f.end_iteration(&s).unwrap();
        assert_eq!(d.kind, DivergenceKind::EndedEarly { traced_moments: 4 });
        for i in 0..4 {
            f.observe(&s, TensorId(i), MomentKind::Access, 0);
        }
        let d = f.observe(&s, TensorId(0), MomentKind::Access, 0);
        assert!(matches!(
            d,
            Follow::Diverged(Divergence {
                moment: 4,
                kind: DivergenceKind::Event { expected: None, .. }
            })
        ));
    }

    proptest! {
        /// The schedule's answers equal naive scans of the groups.
        #[test]
        fn schedule_matches_naive(
            groups in prop::collection::vec(prop::collection::vec(0u32..8, 0..4), 0..60),
            mem in prop::collection::vec(0u64..1000, 60),
            probes in prop::collection::vec((0u32..8, 0u64..200, 0u32..70, 0u32..70), 20),
        ) {
            let groups: Vec<Vec<ChunkId>> = groups.iter().map(|g| g.iter().map(|&i| c(i)).collect()).collect();
            let n = groups.len();
            let s = Schedule::from_groups(&groups, &mem[..n]);
            for (chunk, from, a, b) in probes {
                let ch = c(chunk);
                let used = |m: usize| groups[m].contains(&ch);
                let naive_uses: Vec<u32> = (0..n).filter(|&m| used(m)).map(|m| m as u32).collect();
                prop_assert_eq!(s.uses(ch), &naive_uses[..]);
                let once = (from as usize..n).find(|&m| used(m)).map(|m| m as u64);
                prop_assert_eq!(s.next_use_from(ch, from, Horizon::Once), once);
                let cyc = if n == 0 || naive_uses.is_empty() { None } else {
                    (from..from + 2 * n as u64).find(|&m| used((m % n as u64) as usize))
                };
                prop_assert_eq!(s.next_use_from(ch, from, Horizon::Cyclic), cyc);
                let after = a;
                let next = ((after as usize + 1)..n).find(|&m| used(m)).map(|m| m as u32);
                prop_assert_eq!(s.next_use(ch, after), next);
                let (lo, hi) = (a.min(b), a.max(b));
                let peak = (lo as usize..=(hi as usize).min(n.saturating_sub(1)))
                    .filter(|&m| m < n).map(|m| mem[m]).max().unwrap_or(0);
                prop_assert_eq!(s.non_model_peak(lo, hi), peak);
                if n > 0 {
                    let w = b % (n as u32 + 2);
                    let naive_w = (0..=w as u64).map(|k| mem[((from + k) % n as u64) as usize]).max().unwrap_or(0);
                    prop_assert_eq!(s.non_model_peak_window(from, w), naive_w);
                }
            }
        }
    }
}
