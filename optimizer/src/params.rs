//! Hyper-parameters of a parameter group and the per-step state, and the constants the
//! kernels derive from them.
//!
//! The derived [`Consts`] are computed once per call, in f64 and rounded to f32, and
//! shared by every SIMD level, so all levels evaluate the very same f32 expression per
//! element (see [`crate::cpu`] for the operation order).

use crate::error::{OptimError, Result};

/// How weight decay enters the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Decoupled weight decay (Loshchilov & Hutter): `p *= 1 - lr * wd` before the Adam
    /// update; the moments never see the decay term. PyTorch's `AdamW`.
    #[default]
    AdamW,
    /// Adam with L2 regularisation: `g += wd * p` before the moments. PyTorch's `Adam`
    /// with `weight_decay`.
    AdamL2,
}

/// Hyper-parameters of one parameter group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HyperParams {
    /// Learning rate (>= 0, finite).
    pub lr: f32,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f32,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f32,
    /// Added to the bias-corrected `sqrt(v)` (> 0, finite).
    pub eps: f32,
    /// Weight decay (>= 0, finite); its meaning depends on `mode`.
    pub weight_decay: f32,
    /// Decoupled (AdamW) or L2 (Adam) weight decay.
    pub mode: Mode,
}

impl Default for HyperParams {
    /// PyTorch's `AdamW` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01.
    fn default() -> Self {
        HyperParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            mode: Mode::AdamW,
        }
    }
}

impl HyperParams {
    /// AdamW (decoupled weight decay) with `torch.optim.AdamW`'s arguments.
    pub fn adamw(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        HyperParams {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
            mode: Mode::AdamW,
        }
    }

    /// Checks every field's range; the error names the field and its value.
    pub fn validate(&self) -> Result<()> {
        fn bad(name: &'static str, value: f32, reason: &'static str) -> Result<()> {
            Err(OptimError::InvalidParam {
                name,
                value: f64::from(value),
                reason,
            })
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "must be finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2, "must be in [0, 1)");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", self.eps, "must be finite and > 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        Ok(())
    }
}

/// What changes from step to step (shared by all groups of one step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepState {
    /// 1-based count of applied steps, including this one (drives bias correction).
    pub step: u64,
    /// Every gradient is multiplied by this before use: `1 / loss_scale` times the
    /// global clipping coefficient (1.0 for neither). Finite and > 0.
    pub grad_scale: f32,
}

impl StepState {
    /// Step `step` with gradients used as they are.
    pub fn new(step: u64) -> Self {
        StepState {
            step,
            grad_scale: 1.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.step == 0 {
            return Err(OptimError::InvalidParam {
                name: "step",
                value: 0.0,
                reason: "steps count from 1",
            });
        }
        if !(self.grad_scale.is_finite() && self.grad_scale > 0.0) {
            return Err(OptimError::InvalidParam {
                name: "grad_scale",
                value: f64::from(self.grad_scale),
                reason: "must be finite and > 0",
            });
        }
        Ok(())
    }
}

/// Per-call constants of the update, shared by every SIMD level.
///
/// Per element, with `g` the raw gradient widened to f32 and `fma(a, b, c) = a * b + c`
/// rounded once:
/// ```text
/// g  = g * grad_scale
/// g  = fma(wd_l2, p, g)                 (AdamL2 only)
/// m  = fma(beta1, m, one_minus_beta1 * g)
/// v  = fma(beta2, v, (one_minus_beta2 * g) * g)
/// d  = fma(sqrt(v), inv_sqrt_bc2, eps)
/// p  = fma(neg_lr_wd, p, p)             (AdamW only: p * (1 - lr * wd), one rounding)
/// p  = fma(neg_step, m / d, p)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Consts {
    pub grad_scale: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub wd_l2: f32,
    pub neg_lr_wd: f32,
    pub neg_step: f32,
    pub inv_sqrt_bc2: f32,
    pub eps: f32,
    pub l2: bool,
}

impl Consts {
    /// Validates both inputs and derives the constants (bias correction in f64).
    pub(crate) fn new(state: StepState, hp: &HyperParams) -> Result<Self> {
        hp.validate()?;
        state.validate()?;
        // Steps beyond i32::MAX only make the bias corrections 1.0, which powi of the
        // clamped exponent already gives.
        let t = i32::try_from(state.step).unwrap_or(i32::MAX);
        let bc1 = 1.0 - f64::from(hp.beta1).powi(t);
        let bc2 = 1.0 - f64::from(hp.beta2).powi(t);
        let lr = f64::from(hp.lr);
        let wd = f64::from(hp.weight_decay);
        let l2 = hp.mode == Mode::AdamL2;
        Ok(Consts {
            grad_scale: state.grad_scale,
            beta1: hp.beta1,
            one_minus_beta1: (1.0 - f64::from(hp.beta1)) as f32,
            beta2: hp.beta2,
            one_minus_beta2: (1.0 - f64::from(hp.beta2)) as f32,
            wd_l2: if l2 { hp.weight_decay } else { 0.0 },
            neg_lr_wd: if l2 { 0.0 } else { (-(lr * wd)) as f32 },
            neg_step: (-(lr / bc1)) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: hp.eps,
            l2,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_correction_and_decay_constants() {
        let hp = HyperParams::default();
        let c = Consts::new(StepState::new(1), &hp).unwrap();
        // Step 1: lr / (1 - beta1) and 1 / sqrt(1 - beta2), from the f32 betas.
        let bc1 = 1.0 - f64::from(hp.beta1);
        let bc2 = 1.0 - f64::from(hp.beta2);
        assert_eq!(c.neg_step, (-(f64::from(hp.lr) / bc1)) as f32);
        assert_eq!(c.inv_sqrt_bc2, (1.0 / bc2.sqrt()) as f32);
        assert_eq!(
            c.neg_lr_wd,
            (-(1e-3f64 as f32 as f64 * f64::from(0.01f32))) as f32
        );
        assert_eq!(c.wd_l2, 0.0);
        let l2 = Consts::new(
            StepState::new(1),
            &HyperParams {
                mode: Mode::AdamL2,
                ..hp
            },
        )
        .unwrap();
        assert_eq!((l2.wd_l2, l2.neg_lr_wd), (hp.weight_decay, 0.0));
        // Far steps: corrections reach 1 without overflow of the exponent.
        let far = Consts::new(StepState::new(u64::MAX), &hp).unwrap();
        assert_eq!(far.neg_step, -hp.lr);
        assert_eq!(far.inv_sqrt_bc2, 1.0);
    }

    #[test]
    fn invalid_state_is_rejected() {
        let hp = HyperParams::default();
        for s in [
            StepState {
                step: 0,
                grad_scale: 1.0,
            },
            StepState {
                step: 1,
                grad_scale: 0.0,
            },
            StepState {
                step: 1,
                grad_scale: f32::INFINITY,
            },
        ] {
            assert!(Consts::new(s, &hp).is_err(), "{s:?}");
        }
    }
}
