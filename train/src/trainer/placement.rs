//! Where the optimizer step runs ([`StepDevice`]): one rule for every front end (the
//! trainer decides it at open; the bench, which opens its own store, calls
//! [`decide_step_place`] with its budget). The step on the device holds a trainable
//! tensor's chunks there at once; `auto` takes the device where every chunk of trainable
//! state fits its budget, so that no step moves one; on a GPU whose budget holds every
//! 16-bit parameter chunk and only some of the state, it splits the step
//! ([`DeviceShare`]): the tensors whose state fits beside the parameters are stepped
//! there, the others in the host pool.

use tidestore_chunk::{Layout, ListKind, TensorId};
use tidestore_io::human_bytes;
use tidestore_optimizer::OptimError;

use super::config::StepDevice;
use crate::error::{Result, TrainError};
use crate::step::{sharing_runs, tensor_chunks};

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
            let chunks: Vec<(ListKind, usize)> = tensor_chunks(layout, id).collect();
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

/// The trainable tensors whose state (master, M, V and gradient chunks) a device
/// budget holds beside every 16-bit parameter chunk, which compute streams through it:
/// with all of them resident nothing needs evicting in forward and backward, so these
/// tensors' state stays on the device between steps and their step moves none of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceShare {
    /// The tensors, latest in the layout first (the last blocks' gradients are final
    /// first in backward).
    pub tensors: Vec<TensorId>,
    /// Their state chunks' bytes, each chunk once.
    pub state_bytes: u64,
    /// Every 16-bit parameter chunk's bytes.
    pub params_bytes: u64,
    /// Trainable tensors in all.
    pub trainable: usize,
}

impl DeviceShare {
    /// For the tensors of `layout` that `trainable` says are trained, within
    /// `budget_bytes`: the 16-bit parameter chunks first, then the trainable tensors'
    /// state chunks, a run of tensors that share chunks at a time (a chunk goes to one
    /// place: its tensors are stepped together), from the last run back, where they fit
    /// in what is left. Empty where the parameters alone fill the budget.
    pub fn of(layout: &Layout, trainable: impl Fn(TensorId) -> bool, budget_bytes: u64) -> Self {
        let bytes = layout.dense_chunk_bytes();
        let ids: Vec<TensorId> = (0..layout.tensors().len() as u32).map(TensorId).collect();
        let mut counted = vec![false; bytes.len()];
        let mut params_bytes = 0;
        for &id in &ids {
            if let Some(loc) = layout.location(id, ListKind::Params) {
                let d = loc.chunk.dense();
                if !std::mem::replace(&mut counted[d], true) {
                    params_bytes += bytes[d];
                }
            }
        }
        let trained: Vec<TensorId> = ids.into_iter().filter(|&id| trainable(id)).collect();
        let mut share = DeviceShare {
            tensors: Vec::new(),
            state_bytes: 0,
            params_bytes,
            trainable: trained.len(),
        };
        let mut left = budget_bytes.saturating_sub(params_bytes);
        for run in sharing_runs(layout, &trained).iter().rev() {
            let mut new: Vec<usize> = run
                .iter()
                .flat_map(|&id| state_chunks(layout, id))
                .filter(|&d| !counted[d])
                .collect();
            new.sort_unstable();
            new.dedup();
            let need: u64 = new.iter().map(|&d| bytes[d]).sum();
            if need > left {
                continue;
            }
            left -= need;
            share.state_bytes += need;
            new.iter().for_each(|&d| counted[d] = true);
            share.tensors.extend(run.iter().rev());
        }
        share
    }
}

/// The dense chunks of `id`'s places but its 16-bit parameters.
fn state_chunks(layout: &Layout, id: TensorId) -> impl Iterator<Item = usize> + '_ {
    tensor_chunks(layout, id)
        .filter(|&(l, _)| l != ListKind::Params)
        .map(|(_, d)| d)
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

#[cfg(test)]
mod tests {
    use super::*;
    use tidestore_chunk::{DType, LayoutConfig, TensorSpec};

    /// A frozen tensor and four trainable ones in chunks of 2048 slots, a and b sharing
    /// theirs, c and d theirs: the share takes every 16-bit parameter chunk first, then
    /// whole runs of tensors sharing chunks from the last back, while their state fits.
    #[test]
    fn the_share_takes_the_last_runs_whose_state_fits_beside_the_parameters() {
        let spec =
            |name: &str, n: usize, trainable| TensorSpec::new(name, &[n], DType::F32, trainable);
        let tensors = vec![
            spec("frozen", 1000, false),
            spec("a", 1000, true),
            spec("b", 1000, true),
            spec("c", 600, true),
            spec("d", 400, true),
        ];
        let cfg = LayoutConfig::new(2048).with_param16_dtype(DType::BF16);
        let layout = Layout::new(cfg, tensors).unwrap();
        let runs = sharing_runs(&layout, &[1, 2, 3, 4].map(TensorId));
        assert_eq!(runs, [[1, 2].map(TensorId), [3, 4].map(TensorId)]);
        let trainable = |id: TensorId| id.0 > 0;
        let bytes = layout.dense_chunk_bytes();
        let state = |ids: &[u32]| -> u64 {
            let mut chunks: Vec<usize> = ids
                .iter()
                .flat_map(|&i| state_chunks(&layout, TensorId(i)))
                .collect();
            chunks.sort_unstable();
            chunks.dedup();
            chunks.iter().map(|&d| bytes[d]).sum()
        };
        let ids = |s: &DeviceShare| s.tensors.iter().map(|t| t.0).collect::<Vec<_>>();
        let all = DeviceShare::of(&layout, trainable, u64::MAX);
        assert_eq!((all.trainable, ids(&all)), (4, vec![4, 3, 2, 1]));
        assert_eq!(all.state_bytes, state(&[1, 2, 3, 4]));
        let params = all.params_bytes;
        assert!(DeviceShare::of(&layout, trainable, params)
            .tensors
            .is_empty());
        // Room for c and d's chunks, one byte short of a and b's too: c and d.
        let budget = params + state(&[1, 2, 3, 4]) - 1;
        let share = DeviceShare::of(&layout, trainable, budget);
        assert_eq!(
            (ids(&share), share.state_bytes),
            (vec![4, 3], state(&[3, 4]))
        );
        // One byte short of c and d's: nothing else fits either.
        let share = DeviceShare::of(&layout, trainable, params + state(&[3, 4]) - 1);
        assert!(share.tensors.is_empty(), "{share:?}");
    }
}
