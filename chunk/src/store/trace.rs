//! Tracing and following: the first iteration records every access and release as a
//! moment (with the non-model device memory then); at its end its [`Schedule`] — and
//! the device's and the host's, over the same moments — takes over. Each later moment
//! is followed against it; one that departs from it is logged, eviction falls back to
//! LRU and prefetch pauses until the iteration ends, and the next one is traced again.
//!
//! Invariants: the moment numbers are absolute (cycles of the schedule plus the
//! position in it); the `lifetime` policies read a schedule only while it is followed
//! without divergence.

use std::sync::Arc;

use crate::error::ChunkError;
use crate::id::{ChunkId, TensorId};
use crate::policy::{Lifetime, PolicyKind};
use crate::tracer::{Follow, Follower, Horizon, MomentKind, Schedule, Tracer};
use crate::Result;

use super::mode::{Mode, Schedules};
use super::ChunkStore;

impl ChunkStore {
    /// Whether the current iteration is being traced.
    pub fn is_tracing(&self) -> bool {
        matches!(self.mode, Mode::Tracing(_))
    }

    /// The schedule being followed, if any.
    pub fn schedule(&self) -> Option<&Arc<Schedule>> {
        match &self.mode {
            Mode::Following(s) => Some(&s.all),
            Mode::Tracing(_) => None,
        }
    }

    /// The schedule of device accesses (what `lifetime` and the prefetcher read on the
    /// device tier), if one is followed.
    pub fn device_schedule(&self) -> Option<&Arc<Schedule>> {
        match &self.mode {
            Mode::Following(s) => Some(&s.device),
            Mode::Tracing(_) => None,
        }
    }

    /// Records or follows one moment and returns its absolute moment.
    pub(super) fn observe(&mut self, tensor: TensorId, chunk: ChunkId, kind: MomentKind) -> u64 {
        let non_model = self.non_model_now();
        let diverged_now = match &mut self.mode {
            Mode::Tracing(t) => {
                let i = t.record(tensor, chunk, kind, non_model);
                self.position = i.saturating_add(1);
                return u64::from(i);
            }
            Mode::Following(Schedules { all: s, .. }) => {
                let moment = self.cycles * u64::from(s.len()) + u64::from(self.position);
                self.position = self.position.saturating_add(1);
                if self.diverged {
                    return moment;
                }
                // Non-model memory above the trace is a divergence only where it can
                // cut the chunks' budget: beside a slab that still fits whole (a GPU
                // much larger than `device.budget`), its growth changes nothing.
                let squeezes = self
                    .device_bytes
                    .beside(non_model, self.settings.margin_bytes)
                    < self
                        .device_bytes
                        .slab
                        .min(self.settings.device_budget_bytes);
                let observed = if squeezes { non_model } else { 0 };
                let why = match self.follower.observe(s, tensor, kind, observed) {
                    Follow::OnSchedule { moment: m } => {
                        (s.events()[m as usize].chunk != chunk).then_some("another list")
                    }
                    Follow::Diverged(_) => Some("another access sequence"),
                    Follow::Untraced => None,
                };
                match why {
                    None => return moment,
                    Some(why) => (moment, why),
                }
            }
        };
        self.diverge(diverged_now.1);
        diverged_now.0
    }

    fn diverge(&mut self, why: &'static str) {
        self.diverged = true;
        self.counts.divergences += 1;
        self.sync_policies();
        tracing::info!(
            moment = self.position.saturating_sub(1),
            why,
            "chunk store: iteration left the traced schedule; LRU until the next iteration, \
             which is re-traced"
        );
    }

    fn sync_policies(&mut self) {
        let following = matches!(self.mode, Mode::Following(_)) && !self.diverged;
        let use_main = self.settings.policy != PolicyKind::Lifetime || following;
        self.mover.use_main_policies(use_main);
    }

    /// The absolute moment the next observation will get.
    pub(super) fn current_moment(&self) -> u64 {
        match &self.mode {
            Mode::Tracing(t) => t.moments().len() as u64,
            Mode::Following(s) => self.cycles * u64::from(s.all.len()) + u64::from(self.position),
        }
    }

    /// Ends an iteration. After a traced one, the schedule takes over (and its moments
    /// are checked: a moment whose chunks in use exceed its tidal budget is
    /// [`ChunkError::WorkingSetTooLarge`], returned after the schedule is installed).
    /// After a followed one that diverged (or ended early), the next one is traced.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.counts.iterations += 1;
        self.position = 0;
        let mode = std::mem::replace(&mut self.mode, Mode::Tracing(Tracer::new()));
        let result = match mode {
            Mode::Tracing(t) => {
                self.counts.traced_iterations += 1;
                if t.moments().is_empty() {
                    self.warmup.clear();
                    self.device_moments.clear();
                    self.host_moments.clear();
                    return Ok(());
                }
                self.follow_traced(t)
            }
            Mode::Following(s) => {
                self.end_followed(s);
                Ok(())
            }
        };
        self.diverged = false;
        self.sync_policies();
        result
    }

    /// Ends an iteration that the next ones will not repeat — its front end changes
    /// what an iteration does from now on (a step deferred into the next forward, which
    /// the first iteration has none of): its trace, or the schedule it followed, is
    /// dropped and the next iteration is traced afresh, instead of being followed until
    /// it diverges and then traced.
    pub fn end_iteration_retrace(&mut self) -> Result<()> {
        self.counts.iterations += 1;
        if self.is_tracing() {
            self.counts.traced_iterations += 1;
        }
        self.position = 0;
        self.mode = Mode::Tracing(Tracer::new());
        self.warmup.clear();
        self.device_moments.clear();
        self.host_moments.clear();
        self.diverged = false;
        self.sync_policies();
        tracing::debug!("chunk store: iteration ended untraced; the next one is traced");
        Ok(())
    }

    /// After a traced iteration: its schedule (and the device's and the host's, and the
    /// `lifetime` policies over them) takes over. A moment whose chunks in use exceed
    /// its tidal budget is [`ChunkError::WorkingSetTooLarge`], returned after the
    /// schedule is installed.
    fn follow_traced(&mut self, t: Tracer) -> Result<()> {
        let moments = t.moments().len();
        let s = Arc::new(t.finish());
        tracing::info!(
            moments,
            "chunk store: iteration traced; following its schedule"
        );
        let result = self.check_traced(&s);
        self.warmup.clear();
        let non_model: Vec<u64> = (0..moments as u32).map(|m| s.non_model_bytes(m)).collect();
        let schedules = Schedules {
            device: tier_schedule(std::mem::take(&mut self.device_moments), &non_model),
            host: tier_schedule(std::mem::take(&mut self.host_moments), &non_model),
            all: s,
        };
        if self.settings.policy == PolicyKind::Lifetime {
            self.mover.set_main_policies(
                Box::new(Lifetime::new(schedules.device.clone(), Horizon::Cyclic)),
                Box::new(Lifetime::new(schedules.all.clone(), Horizon::Cyclic)),
            );
        }
        self.follower = Follower::new(self.settings.slack_bytes);
        self.cycles = 0;
        self.mode = Mode::Following(schedules);
        result
    }

    /// After a followed iteration: the next one is followed too, or traced again when
    /// this one diverged or ended early.
    fn end_followed(&mut self, s: Schedules) {
        let early = self.follower.end_iteration(&s.all);
        if early.is_some() {
            self.counts.divergences += 1;
        }
        if self.diverged || early.is_some() {
            tracing::info!("chunk store: access sequence changed; re-tracing this iteration");
            self.warmup.clear();
            self.device_moments.clear();
            self.host_moments.clear();
        } else {
            self.cycles += 1;
            self.mode = Mode::Following(s);
        }
    }

    fn check_traced(&self, s: &Schedule) -> Result<()> {
        for &(m, pinned, phase) in &self.warmup {
            let cap = self.cap_for(Some(s), u64::from(m), phase, s.non_model_bytes(m));
            if pinned > cap {
                return Err(ChunkError::WorkingSetTooLarge {
                    moment: u64::from(m),
                    needed_bytes: pinned,
                    capacity_bytes: cap,
                    short_bytes: pinned - cap,
                });
            }
        }
        Ok(())
    }
}

/// The schedule of one tier's accesses (per moment, the chunk accessed there, if any),
/// over the same moments and non-model bytes as the traced one.
fn tier_schedule(moments: Vec<Option<ChunkId>>, non_model: &[u64]) -> Arc<Schedule> {
    let mut groups: Vec<Vec<ChunkId>> = moments
        .into_iter()
        .map(|c| c.into_iter().collect())
        .collect();
    groups.resize(non_model.len(), Vec::new());
    Arc::new(Schedule::from_groups(&groups, non_model))
}
