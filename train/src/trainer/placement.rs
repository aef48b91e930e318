//! Where the optimizer step runs ([`StepDevice`]): one rule for every front end (the
//! trainer decides it at open; the bench, which opens its own store, calls
//! [`decide_step_place`] with its budget). The step on the device holds a trainable
//! tensor's chunks there at once; `auto` takes the device where every chunk of trainable
//! state fits its budget, so that no step moves one.

use tidestore_chunk::{Layout, ListKind, TensorId};
use tidestore_io::human_bytes;
use tidestore_optimizer::OptimError;

use super::config::StepDevice;
use crate::error::{Result, TrainError};

/// Device bytes the step on the device needs, counted as the store allocates chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepNeeds {
    /// The trainable tensor whose step chunks take most (in use at once).
    pub largest_tensor: String,
    /// Its chunks, per list it has a place in.
    pub largest_chunks: Vec<(ListKind, u64)>,
    /// Their sum.
    pub largest_bytes: u64,
    /// Every chunk holding a place of a trainable tensor, once: what lets the step move
    /// nothing.
    pub all_bytes: u64,
}

impl StepNeeds {
    /// For the tensors of `layout` that `trainable` says are trained.
    pub fn of(layout: &Layout, trainable: impl Fn(TensorId) -> bool) -> StepNeeds {
        let bytes = layout.dense_chunk_bytes();
        let mut needs = StepNeeds {
            largest_tensor: String::new(),
            largest_chunks: Vec::new(),
            largest_bytes: 0,
            all_bytes: 0,
        };
        let mut seen = vec![false; bytes.len()];
        for id in (0..layout.tensors().len() as u32).map(TensorId) {
            if !trainable(id) {
                continue;
            }
            let chunks: Vec<(ListKind, usize)> = ListKind::ALL
                .iter()
                .filter_map(|&l| layout.location(id, l).map(|loc| (l, loc.chunk.dense())))
                .collect();
            for &(_, d) in &chunks {
                if !std::mem::replace(&mut seen[d], true) {
                    needs.all_bytes += bytes[d];
                }
            }
            let sum = chunks.iter().map(|&(_, d)| bytes[d]).sum();
            if sum > needs.largest_bytes {
                needs.largest_bytes = sum;
                needs.largest_tensor = layout
                    .tensor(id)
                    .map_or_else(String::new, |t| t.name.clone());
                needs.largest_chunks = chunks.iter().map(|&(l, d)| (l, bytes[d])).collect();
            }
        }
        needs
    }
}

/// Where the step runs, asked `asked`, on a CUDA GPU (`on_gpu`) or the simulated
/// device, with `budget_bytes` of device memory for chunks during the step (made as
/// `budget_how` says, for messages) and the GPU kernel's readiness: whether on the
/// device, and why in one phrase. `gpu` that cannot run is a config error naming
/// `optimizer.device`, the largest tensor's chunks and the bytes short.
pub fn decide_step_place(
    asked: StepDevice,
    on_gpu: bool,
    budget_bytes: u64,
    budget_how: &str,
    needs: &StepNeeds,
    gpu_kernel: std::result::Result<(), OptimError>,
) -> Result<(bool, String)> {
    let budget = human_bytes(budget_bytes);
    match asked {
        StepDevice::Cpu => Ok((false, "optimizer.device = \"cpu\"".into())),
        StepDevice::Auto if !on_gpu => Ok((false, "auto: the device is simulated".into())),
        StepDevice::Auto => match gpu_kernel {
            Err(e) => Ok((false, format!("auto: no GPU AdamW kernel ({e})"))),
            Ok(()) if needs.all_bytes > budget_bytes => Ok((
                false,
                format!(
                    "auto: the trainable state ({}) does not fit the step's device budget \
                     ({budget})",
                    human_bytes(needs.all_bytes)
                ),
            )),
            Ok(()) => Ok((
                true,
                format!(
                    "auto: a CUDA GPU whose step budget ({budget}) holds all trainable state \
                     ({})",
                    human_bytes(needs.all_bytes)
                ),
            )),
        },
        StepDevice::Gpu => {
            if let (true, Err(e)) = (on_gpu, gpu_kernel) {
                return Err(TrainError::Config {
                    key: "optimizer.device",
                    reason: format!("\"gpu\": the GPU AdamW kernel is not ready: {e}"),
                });
            }
            if needs.largest_bytes > budget_bytes {
                return Err(too_small(needs, budget_bytes, budget_how));
            }
            Ok((
                true,
                if on_gpu {
                    "optimizer.device = \"gpu\"".into()
                } else {
                    "optimizer.device = \"gpu\" on the simulated device (the CPU kernel over \
                     its memory)"
                        .into()
                },
            ))
        }
    }
}

/// The refusal of `gpu` whose largest tensor's chunks exceed the step's device budget.
fn too_small(needs: &StepNeeds, budget_bytes: u64, budget_how: &str) -> TrainError {
    let parts: Vec<String> = needs
        .largest_chunks
        .iter()
        .map(|&(l, b)| format!("{} {}", l.as_str(), human_bytes(b)))
        .collect();
    TrainError::Config {
        key: "optimizer.device",
        reason: format!(
            "\"gpu\" steps each trainable tensor with its chunks on the device at once: \
             tensor `{}` needs {} ({}), but the device budget during the step is {} \
             ({budget_how}), {} short; use \"cpu\" or \"auto\", or more device memory",
            needs.largest_tensor,
            human_bytes(needs.largest_bytes),
            parts.join(", "),
            human_bytes(budget_bytes),
            human_bytes(needs.largest_bytes - budget_bytes)
        ),
    }
}
