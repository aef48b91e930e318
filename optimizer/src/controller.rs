//! Everything around the kernel that is decided once per step for all groups: the step
//! count, global gradient-norm clipping and dynamic loss scaling.
//!
//! Protocol, per iteration: sum [`crate::AdamW::grad_sq_norm`] over every gradient slice
//! of every group (the raw, loss-scaled gradients), call [`StepController::decide`] with
//! the sum, then either skip (overflow) or call [`crate::AdamW::step_slice`] on every
//! slice with the returned [`StepState`], whose `grad_scale` folds `1 / loss_scale` and
//! the clipping coefficient into the kernel's single pass. [`crate::AdamW::step_groups`]
//! does all of that for groups held in memory. The state is three plain numbers
//! ([`ControllerState`]) for checkpoints.

use crate::error::{OptimError, Result};
use crate::loss_scale::{DynamicLossScaler, LossScalerConfig, LossScalerState};
use crate::params::StepState;

/// PyTorch's `clip_grad_norm_` coefficient: `min(1, max_norm / (grad_norm + 1e-6))`.
pub fn clip_coefficient(grad_norm: f64, max_norm: f64) -> f64 {
    (max_norm / (grad_norm + 1e-6)).min(1.0)
}

/// What to do with this iteration's gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepDecision {
    /// Step every slice with `state`.
    Apply {
        /// Step number and gradient scale to hand to the kernel.
        state: StepState,
        /// Global L2 norm of the unscaled gradients.
        grad_norm: f64,
        /// Clipping coefficient applied (1.0 when not clipped).
        clip_coef: f64,
    },
    /// Some gradient was inf or NaN: leave parameters and moments alone.
    Skip {
        /// The loss scale for the next iteration (lowered when a scaler is active).
        loss_scale: f32,
    },
}

/// Checkpointable state of a [`StepController`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControllerState {
    /// Steps applied so far.
    pub step: u64,
    /// Loss scaler state, when one is configured.
    pub loss_scaler: Option<LossScalerState>,
}

/// Step count, clipping and loss scaling for one optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct StepController {
    step: u64,
    max_grad_norm: Option<f64>,
    scaler: Option<DynamicLossScaler>,
}

impl StepController {
    /// `max_grad_norm`: clip the global norm to this (> 0) when given. `loss_scaler`:
    /// dynamic loss scaling (fp16) when given.
    pub fn new(max_grad_norm: Option<f32>, loss_scaler: Option<LossScalerConfig>) -> Result<Self> {
        if let Some(mx) = max_grad_norm {
            if !(mx.is_finite() && mx > 0.0) {
                return Err(OptimError::InvalidParam {
                    name: "max_grad_norm",
                    value: f64::from(mx),
                    reason: "must be finite and > 0",
                });
            }
        }
        Ok(StepController {
            step: 0,
            max_grad_norm: max_grad_norm.map(f64::from),
            scaler: loss_scaler.map(DynamicLossScaler::new).transpose()?,
        })
    }

    /// Steps applied so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The factor to multiply the loss by before backward (1.0 without a scaler).
    pub fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, DynamicLossScaler::scale)
    }

    /// The loss scaler, when configured.
    pub fn loss_scaler(&self) -> Option<&DynamicLossScaler> {
        self.scaler.as_ref()
    }

    /// Decides this iteration from the squared L2 norm of all raw (loss-scaled)
    /// gradients. A non-finite sum is an overflow: skip, and back the scale off. Otherwise
    /// the step count advances and the returned state carries
    /// `grad_scale = clip_coef / loss_scale`; then the scaler counts a clean step.
    pub fn decide(&mut self, raw_sq_norm: f64) -> StepDecision {
        let loss_scale = f64::from(self.loss_scale());
        if !raw_sq_norm.is_finite() {
            let loss_scale = match &mut self.scaler {
                Some(s) => s.update(true),
                None => 1.0,
            };
            tracing::info!(
                step = self.step + 1,
                loss_scale,
                "gradient overflow, step skipped"
            );
            return StepDecision::Skip { loss_scale };
        }
        let grad_norm = raw_sq_norm.sqrt() / loss_scale;
        let clip_coef = self
            .max_grad_norm
            .map_or(1.0, |mx| clip_coefficient(grad_norm, mx));
        self.step += 1;
        if let Some(s) = &mut self.scaler {
            s.update(false);
        }
        // clip_coef is in (0, 1] and loss_scale in [min_scale, max_scale], so the
        // quotient is finite and > 0 unless it underflows f32, which the max() guards.
        let grad_scale = ((clip_coef / loss_scale) as f32).max(f32::MIN_POSITIVE);
        StepDecision::Apply {
            state: StepState {
                step: self.step,
                grad_scale,
            },
            grad_norm,
            clip_coef,
        }
    }

    /// The state to checkpoint.
    pub fn state(&self) -> ControllerState {
        ControllerState {
            step: self.step,
            loss_scaler: self.scaler.as_ref().map(DynamicLossScaler::state),
        }
    }

    /// Restores a checkpointed state; a scaler state is ignored when no scaler is
    /// configured.
    pub fn restore(&mut self, state: ControllerState) -> Result<()> {
        if let (Some(s), Some(ls)) = (&mut self.scaler, state.loss_scaler) {
            s.restore(ls)?;
        }
        self.step = state.step;
        Ok(())
    }
}
