//! Dynamic loss scaling for fp16 training.
//!
//! The loss is multiplied by [`DynamicLossScaler::scale`] before backward so small fp16
//! gradients do not flush to zero; the step divides it back out (folded into the
//! kernel's `grad_scale`). An overflow (an inf or NaN anywhere in the gradients) means
//! the scale was too high: the step is skipped and the scale multiplied by
//! `backoff_factor`; after `growth_interval` clean steps in a row it is multiplied by
//! `growth_factor`. The scale stays within `[min_scale, max_scale]`. The whole state is
//! two numbers ([`LossScalerState`]) for checkpoints.

use crate::error::{OptimError, Result};

/// Settings of the dynamic loss scaler (PyTorch `GradScaler` defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerConfig {
    /// First scale (65536).
    pub init_scale: f32,
    /// Multiplier after `growth_interval` clean steps (2.0; > 1).
    pub growth_factor: f32,
    /// Multiplier after an overflow (0.5; in (0, 1)).
    pub backoff_factor: f32,
    /// Clean steps in a row before growing (2000; > 0).
    pub growth_interval: u32,
    /// Lowest scale (1.0; > 0).
    pub min_scale: f32,
    /// Highest scale (2^24; >= `min_scale`).
    pub max_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            max_scale: 16_777_216.0,
        }
    }
}

/// The scaler's mutable state, as plain numbers for checkpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerState {
    /// Current loss scale.
    pub scale: f32,
    /// Clean steps since the last overflow or growth.
    pub good_steps: u32,
}

/// The dynamic loss scaler.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    cfg: LossScalerConfig,
    state: LossScalerState,
}

fn invalid(name: &'static str, value: f32, reason: &'static str) -> OptimError {
    OptimError::InvalidParam {
        name,
        value: f64::from(value),
        reason,
    }
}

impl DynamicLossScaler {
    /// Checks the settings and starts at `init_scale`.
    pub fn new(cfg: LossScalerConfig) -> Result<Self> {
        if !(cfg.min_scale.is_finite() && cfg.min_scale > 0.0) {
            return Err(invalid(
                "min_scale",
                cfg.min_scale,
                "must be finite and > 0",
            ));
        }
        if !(cfg.max_scale.is_finite() && cfg.max_scale >= cfg.min_scale) {
            return Err(invalid(
                "max_scale",
                cfg.max_scale,
                "must be finite and >= min_scale",
            ));
        }
        if !(cfg.init_scale >= cfg.min_scale && cfg.init_scale <= cfg.max_scale) {
            return Err(invalid(
                "init_scale",
                cfg.init_scale,
                "must be in [min_scale, max_scale]",
            ));
        }
        if !(cfg.growth_factor.is_finite() && cfg.growth_factor > 1.0) {
            return Err(invalid(
                "growth_factor",
                cfg.growth_factor,
                "must be finite and > 1",
            ));
        }
        if !(cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0) {
            return Err(invalid(
                "backoff_factor",
                cfg.backoff_factor,
                "must be in (0, 1)",
            ));
        }
        if cfg.growth_interval == 0 {
            return Err(invalid("growth_interval", 0.0, "must be > 0"));
        }
        Ok(DynamicLossScaler {
            cfg,
            state: LossScalerState {
                scale: cfg.init_scale,
                good_steps: 0,
            },
        })
    }

    /// The settings.
    pub fn config(&self) -> &LossScalerConfig {
        &self.cfg
    }

    /// The scale to multiply the loss by for the next backward.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The state to checkpoint.
    pub fn state(&self) -> LossScalerState {
        self.state
    }

    /// Restores a checkpointed state (the scale is clamped to the configured range).
    pub fn restore(&mut self, state: LossScalerState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(invalid("loss_scale", state.scale, "must be finite and > 0"));
        }
        self.state = LossScalerState {
            scale: state.scale.clamp(self.cfg.min_scale, self.cfg.max_scale),
            good_steps: state.good_steps.min(self.cfg.growth_interval - 1),
        };
        Ok(())
    }

    /// Records the outcome of one backward: `overflow` when some gradient was inf/NaN.
    /// Returns the new scale.
    pub fn update(&mut self, overflow: bool) -> f32 {
        let s = &mut self.state;
        if overflow {
            s.scale = (s.scale * self.cfg.backoff_factor).max(self.cfg.min_scale);
            s.good_steps = 0;
            tracing::debug!(scale = s.scale, "loss scale backoff after overflow");
        } else {
            s.good_steps += 1;
            if s.good_steps >= self.cfg.growth_interval {
                s.scale = (s.scale * self.cfg.growth_factor).min(self.cfg.max_scale);
                s.good_steps = 0;
                tracing::debug!(scale = s.scale, "loss scale growth");
            }
        }
        s.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        for (cfg, name) in [
            (
                LossScalerConfig {
                    growth_factor: 1.0,
                    ..Default::default()
                },
                "growth_factor",
            ),
            (
                LossScalerConfig {
                    backoff_factor: 1.0,
                    ..Default::default()
                },
                "backoff_factor",
            ),
            (
                LossScalerConfig {
                    growth_interval: 0,
                    ..Default::default()
                },
                "growth_interval",
            ),
            (
                LossScalerConfig {
                    init_scale: 0.5,
                    ..Default::default()
                },
                "init_scale",
            ),
            (
                LossScalerConfig {
                    min_scale: 0.0,
                    ..Default::default()
                },
                "min_scale",
            ),
        ] {
            match DynamicLossScaler::new(cfg) {
                Err(OptimError::InvalidParam { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn grows_to_max_and_restores_clamped() {
        let mut s = DynamicLossScaler::new(LossScalerConfig {
            init_scale: 4.0,
            growth_interval: 1,
            max_scale: 16.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            [s.update(false), s.update(false), s.update(false)],
            [8.0, 16.0, 16.0]
        );
        s.restore(LossScalerState {
            scale: 1e9,
            good_steps: 7,
        })
        .unwrap();
        assert_eq!(
            s.state(),
            LossScalerState {
                scale: 16.0,
                good_steps: 0
            }
        );
        assert!(s
            .restore(LossScalerState {
                scale: f32::NAN,
                good_steps: 0
            })
            .is_err());
    }
}
