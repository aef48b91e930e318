//! A whole optimizer step over parameter groups held in memory: global norm, overflow
//! check, clipping and loss scaling through a [`StepController`], then the kernel on
//! every group with that group's hyper-parameters.
//!
//! Every length is checked before the controller is touched, so an error leaves the step
//! count and the loss scaler as they were.

use crate::controller::{StepController, StepDecision};
use crate::cpu::AdamW;
use crate::error::{check_len, Result};
use crate::params::HyperParams;
use crate::slices::{Grads, ParamOut};

/// One parameter group: its hyper-parameters and the arrays of its parameters.
#[derive(Debug)]
pub struct ParamGroup<'a> {
    /// Hyper-parameters of this group.
    pub hp: HyperParams,
    /// fp32 master parameters.
    pub master: &'a mut [f32],
    /// First moments.
    pub m: &'a mut [f32],
    /// Second moments.
    pub v: &'a mut [f32],
    /// Gradients (raw: still multiplied by the loss scale when one is used).
    pub grads: Grads<'a>,
    /// Optional 16-bit copy of the parameters to refresh.
    pub out: Option<ParamOut<'a>>,
}

impl AdamW {
    /// One optimizer step over `groups`: sums the squared gradient norms of all groups,
    /// lets `ctrl` decide (skip on overflow; clip; unscale), and applies the kernel to
    /// every group. Returns the decision.
    pub fn step_groups(
        &self,
        ctrl: &mut StepController,
        groups: &mut [ParamGroup<'_>],
    ) -> Result<StepDecision> {
        for g in groups.iter() {
            let n = g.master.len();
            check_len("m", g.m.len(), "master", n)?;
            check_len("v", g.v.len(), "master", n)?;
            check_len("grads", g.grads.len(), "master", n)?;
            if let Some(o) = &g.out {
                check_len("out", o.len(), "master", n)?;
            }
            g.hp.validate()?;
        }
        let sq: f64 = groups.iter().map(|g| self.grad_sq_norm(g.grads)).sum();
        let decision = ctrl.decide(sq);
        if let StepDecision::Apply { state, .. } = decision {
            for g in groups.iter_mut() {
                self.step_slice(
                    state,
                    &g.hp,
                    g.master,
                    g.m,
                    g.v,
                    g.grads,
                    g.out.as_mut().map(ParamOut::reborrow),
                )?;
            }
        }
        Ok(decision)
    }
}
