//! The tide: the device budget for chunks at each moment — during forward and backward
//! the device less the non-model memory peak over the next moments (from the schedule)
//! less a margin, within the configured budget; during the optimizer step nearly the
//! whole device. A falling tide evicts what no longer fits.
//!
//! Invariant: the budget never falls below the chunks in use or in flight on the
//! device (it is held above its target instead, and logged).

use tidestore_tiers::DeviceKind;

use crate::accounting::MoveReason;
use crate::tracer::Schedule;
use crate::Result;

use super::{ChunkStore, DeviceBytes, Mode};

/// Which device budget applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Forward and backward: the tidal budget.
    ForwardBackward,
    /// The optimizer step: nearly the whole device.
    OptimizerStep,
}

impl ChunkStore {
    /// The phase (which device budget applies).
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The device budget for chunks now (the tide).
    pub fn device_budget_bytes(&self) -> u64 {
        self.mover.device_cap()
    }

    /// Reports the device memory used by everything but chunks now (activations,
    /// workspace). On a GPU it is measured instead; this value is the fallback.
    pub fn report_non_model_bytes(&mut self, bytes: u64) {
        self.non_model_reported_bytes = bytes;
        self.mover.report_non_model_bytes(bytes);
    }

    /// Lets chunks use nearly the whole device (less the margin and the non-model
    /// memory now) until [`ChunkStore::end_optimizer_step`].
    pub fn begin_optimizer_step(&mut self) -> Result<()> {
        self.phase = Phase::OptimizerStep;
        self.update_tide(self.current_moment())
    }

    /// Back to the tidal forward/backward budget (evicting what no longer fits), and
    /// the device prefetcher starts on the moments that follow.
    pub fn end_optimizer_step(&mut self) -> Result<()> {
        self.phase = Phase::ForwardBackward;
        let next = self.current_moment();
        self.update_tide(next)?;
        // The step's last moments were host accesses, which do not run the device
        // prefetcher: start the loads the next device moments need now, so their NVMe
        // reads (and the write-backs that make room for them) overlap what the caller
        // does before its next access.
        self.prefetch(next.saturating_sub(1));
        Ok(())
    }

    pub(super) fn non_model_now(&self) -> u64 {
        match self.mover.device().kind() {
            DeviceKind::Sim => self.non_model_reported_bytes,
            DeviceKind::Cuda => self
                .mover
                .device()
                .non_model_bytes()
                .unwrap_or(self.non_model_reported_bytes),
        }
    }

    /// The device budget for chunks at `moment`.
    pub(super) fn cap_for(
        &self,
        s: Option<&Schedule>,
        moment: u64,
        phase: Phase,
        non_model: u64,
    ) -> u64 {
        let st = &self.settings;
        let DeviceBytes { total, slab } = self.device_bytes;
        let now = self.device_bytes.beside(non_model, st.margin_bytes);
        let cap = match phase {
            // The schedule's tide, never above what the device has beside the non-model
            // memory now (more than the trace saw: longer micro-batches, say).
            Phase::ForwardBackward => st.device_budget_bytes.min(now).min(match s {
                Some(s) => s.tidal_budget_bytes(total, moment, st.window, st.margin_bytes),
                None => now,
            }),
            Phase::OptimizerStep => st.step_device_budget_bytes.unwrap_or(total).min(now),
        };
        cap.min(slab)
    }

    pub(super) fn update_tide(&mut self, moment: u64) -> Result<()> {
        let s = match &self.mode {
            Mode::Following(s) if !self.diverged => Some(&*s.all),
            _ => None,
        };
        let cap = self.cap_for(s, moment, self.phase, self.non_model_now());
        if cap != self.mover.device_cap() {
            self.mover
                .set_device_cap(cap, self.cause(MoveReason::Tide))?;
        }
        Ok(())
    }
}
