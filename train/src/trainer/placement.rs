//! Where the optimizer step runs ([`StepDevice`]), decided once at open from the layout,
//! the device budget and the device tier that was opened: the step's place and the
//! optimizer that steps there (with the GPU kernel only where it may be used).

use tidestore_chunk::{Layout, ListKind, TensorId};
use tidestore_optimizer::{AdamW, HybridAdamW, OptimError};
use tidestore_tiers::{Device, DeviceKind};

use super::config::{ParamSpec, StepDevice};
use crate::error::{Result, TrainError};
use crate::step::StepPlace;

/// The CUDA device the tier opens (`DeviceConfig`'s default ordinal).
const ORDINAL: usize = 0;

/// The step's place, its optimizer and why, in one phrase.
pub(super) struct Placed {
    pub(super) place: StepPlace,
    pub(super) opt: HybridAdamW,
    pub(super) reason: String,
}

/// Device bytes the step on the device needs: the chunks of the trainable tensor whose
/// step chunks take most (in use at once), and every chunk of the layout (what lets
/// nothing move, neither for the step nor for compute).
struct Needs {
    largest_bytes: u64,
    largest_tensor: String,
    all_bytes: u64,
}

fn needs(layout: &Layout, specs: &[ParamSpec]) -> Needs {
    let bytes = layout.dense_chunk_bytes();
    let mut n = Needs {
        largest_bytes: 0,
        largest_tensor: String::new(),
        all_bytes: bytes.iter().sum(),
    };
    let ids = specs
        .iter()
        .filter(|p| p.trainable)
        .filter_map(|p| layout.tensor_id(&p.name).map(|id| (p, id)));
    for (p, id) in ids {
        let sum = step_chunk_bytes(layout, id, &bytes);
        if sum > n.largest_bytes {
            n.largest_bytes = sum;
            n.largest_tensor = p.name.clone();
        }
    }
    n
}

/// Bytes of the distinct chunks holding tensor `id`'s places in every list.
fn step_chunk_bytes(layout: &Layout, id: TensorId, bytes: &[u64]) -> u64 {
    let mut chunks: Vec<usize> = ListKind::ALL
        .iter()
        .filter_map(|&l| layout.location(id, l))
        .map(|loc| loc.chunk.dense())
        .collect();
    chunks.sort_unstable();
    chunks.dedup();
    chunks.iter().map(|&d| bytes[d]).sum()
}

/// Decides where the step runs (see [`StepDevice`]) for `specs` laid out as `layout`
/// on `device` with `budget_bytes` of device budget; `cpu` is the CPU kernel. A `Gpu`
/// that cannot run is a config error naming `optimizer.device`.
pub(super) fn place_step(
    asked: StepDevice,
    layout: &Layout,
    specs: &[ParamSpec],
    device: &Device,
    budget_bytes: u64,
    cpu: AdamW,
) -> Result<Placed> {
    let on_gpu = device.kind() == DeviceKind::Cuda;
    let host = |opt, reason: String| Placed {
        place: StepPlace::Host,
        opt,
        reason,
    };
    let cpu_only =
        |cpu, why: &str| HybridAdamW::cpu_only(cpu, OptimError::NoGpu { reason: why.into() });
    let need = needs(layout, specs);
    match asked {
        StepDevice::Cpu => Ok(host(
            cpu_only(cpu, "the step runs in the host pool"),
            "optimizer.device = \"cpu\"".into(),
        )),
        StepDevice::Auto if !on_gpu => Ok(host(
            cpu_only(cpu, "the device is simulated"),
            "auto: the device is simulated".into(),
        )),
        StepDevice::Auto => {
            let opt = HybridAdamW::new(cpu, ORDINAL);
            if let Err(e) = opt.gpu_status() {
                return Ok(host(opt, format!("auto: no GPU AdamW kernel ({e})")));
            }
            if need.all_bytes > budget_bytes {
                return Ok(host(
                    opt,
                    format!(
                        "auto: the chunks ({} bytes) do not fit the device budget ({} bytes)",
                        need.all_bytes, budget_bytes
                    ),
                ));
            }
            Ok(Placed {
                place: StepPlace::Device,
                opt,
                reason: format!(
                    "auto: a CUDA GPU whose device budget ({budget_bytes} bytes) holds every \
                     chunk ({} bytes)",
                    need.all_bytes
                ),
            })
        }
        StepDevice::Gpu => {
            if need.largest_bytes > budget_bytes {
                return Err(TrainError::Config {
                    key: "optimizer.device",
                    reason: format!(
                        "\"gpu\" steps each trainable tensor with its chunks on the device at \
                         once: `{}` needs {} bytes, the device budget is {budget_bytes}, {} \
                         short",
                        need.largest_tensor,
                        need.largest_bytes,
                        need.largest_bytes - budget_bytes
                    ),
                });
            }
            let opt = if on_gpu {
                let opt = HybridAdamW::new(cpu, ORDINAL);
                opt.gpu_status().map_err(|e| TrainError::Config {
                    key: "optimizer.device",
                    reason: format!("\"gpu\": the GPU AdamW kernel is not ready: {e}"),
                })?;
                opt
            } else {
                cpu_only(cpu, "the device is simulated")
            };
            let reason = if on_gpu {
                "optimizer.device = \"gpu\""
            } else {
                "optimizer.device = \"gpu\" on the simulated device (the CPU kernel over its memory)"
            };
            Ok(Placed {
                place: StepPlace::Device,
                opt,
                reason: reason.into(),
            })
        }
    }
}
