//! What a [`Config`] says a training run's store is: the [`TrainerConfig`] every front
//! end opens its [`tidestore_train::Trainer`] with (`tidestore finetune`, the bench, the
//! Python engine), decided here once from the TOML file's sections.

use std::path::PathBuf;

use tidestore_optimizer::{HyperParams, Mode};
use tidestore_train::{Budget, DeviceChoice, Overlap, Precision, TrainerConfig};

use super::{AutoSize, Config, DecayMode, DeviceKindName, OverlapName, PrecisionName};
use crate::error::Result;

impl Config {
    /// `[optimizer]`'s AdamW hyper-parameters.
    pub fn hyper_params(&self) -> HyperParams {
        let o = &self.optimizer;
        HyperParams {
            lr: o.lr as f32,
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
            mode: match o.mode {
                DecayMode::Adamw => Mode::AdamW,
                DecayMode::AdamL2 => Mode::AdamL2,
            },
        }
    }

    /// The store of a training run as the config lays it out: `train.precision`,
    /// `optimizer` (hyper-parameters, clipping, moments, threads), `chunk.size`, the
    /// `device` and `host` budgets, `device.kind` and `[io]`; its swap file in
    /// `swap_dir`. `device.kind = "cuda"` asks for the GPU the build may have
    /// ([`DeviceChoice::Auto`]); a front end that must refuse the simulation it falls
    /// back to checks the opened device.
    pub fn trainer_config(&self, swap_dir: PathBuf) -> Result<TrainerConfig> {
        let mut tc = TrainerConfig::new(self.hyper_params(), swap_dir);
        tc.precision = match self.train.precision {
            PrecisionName::Bf16 => Precision::Bf16,
            PrecisionName::F32 => Precision::F32,
        };
        tc.overlap = self.optimizer.overlap.into();
        tc.max_grad_norm =
            (self.optimizer.max_grad_norm > 0.0).then_some(self.optimizer.max_grad_norm as f32);
        tc.chunk_elements = match self.chunk.size {
            AutoSize::Auto => None,
            AutoSize::Fixed(s) => Some(s.bytes() / 4),
        };
        tc.device_budget = Budget::Bytes(self.device.budget.bytes());
        tc.host_budget = Budget::Bytes(self.host.budget.bytes());
        tc.moments = self.optimizer.states.moments();
        tc.io = self.io_config()?;
        tc.optimizer_threads = self.optimizer.threads as usize;
        tc.device = match self.device.kind {
            DeviceKindName::Sim => DeviceChoice::Sim,
            DeviceKindName::Auto | DeviceKindName::Cuda => DeviceChoice::Auto,
        };
        tc.gpu_ordinal = self.device.ordinal.resolve(None);
        tc.step_device = self.optimizer.device.step_device();
        Ok(tc)
    }
}

impl From<OverlapName> for Overlap {
    fn from(name: OverlapName) -> Overlap {
        match name {
            OverlapName::Off => Overlap::Off,
            OverlapName::Backward => Overlap::Backward,
            OverlapName::Forward => Overlap::Forward,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_toml_file_decides_the_trainer_config() {
        let cfg = Config::from_toml_str(
            "[train]\nprecision = \"f32\"\n[optimizer]\nlr = 0.002\nstates = \"int8\"\n\
             max_grad_norm = 1.0\ndevice = \"gpu\"\n[chunk]\nsize = \"4MiB\"\n[host]\nbudget = \"64MiB\"\n\
             [device]\nkind = \"sim\"\nbudget = \"32MiB\"\n[nvme]\ndir = \"/tmp\"\n",
        )
        .unwrap();
        let tc = cfg.trainer_config(PathBuf::from("/tmp/swap")).unwrap();
        assert_eq!(tc.precision, Precision::F32);
        assert_eq!(tc.hp.lr, 0.002);
        assert_eq!(tc.moments, tidestore_chunk::MomentForm::Int8);
        assert_eq!(tc.max_grad_norm, Some(1.0));
        assert_eq!(tc.chunk_elements, Some(1 << 20));
        assert_eq!(tc.host_budget, Budget::Bytes(64 << 20));
        assert_eq!(tc.device_budget, Budget::Bytes(32 << 20));
        assert_eq!(tc.device, DeviceChoice::Sim);
        assert_eq!(tc.gpu_ordinal, 0, "\"auto\" outside data parallel: GPU 0");
        let mut on_two = cfg.clone();
        on_two.device.ordinal = crate::config::GpuOrdinal::Index(2);
        let tc2 = on_two.trainer_config(PathBuf::from("/tmp/swap")).unwrap();
        assert_eq!(tc2.gpu_ordinal, 2);
        assert_eq!(tc.step_device, tidestore_train::StepDevice::Gpu);
        assert_eq!(tc.swap_dir, PathBuf::from("/tmp/swap"));
        assert_eq!(tc.overlap, Overlap::Off, "the default");
    }

    /// `"forward"` reaches the trainer with clipping on (it decides the step after
    /// backward); `"backward"` with clipping and an unknown mode are refused, naming
    /// the key.
    #[test]
    fn overlap_forward_takes_clipping_and_the_others_are_checked() {
        let with = |overlap: &str| {
            Config::from_toml_str(&format!(
                "[optimizer]\nmax_grad_norm = 1.0\noverlap = \"{overlap}\"\n[nvme]\ndir = \"/tmp\"\n"
            ))
        };
        let tc = with("forward")
            .unwrap()
            .trainer_config(PathBuf::from("/tmp/swap"))
            .unwrap();
        assert_eq!(
            (tc.overlap, tc.max_grad_norm),
            (Overlap::Forward, Some(1.0))
        );
        for bad in ["backward", "sideways"] {
            let e = with(bad).unwrap_err().to_string();
            eprintln!("{bad}: {e}");
            assert!(e.contains("optimizer.overlap"), "{bad}: {e}");
        }
    }
}
