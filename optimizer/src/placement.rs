//! Where each group is updated: on the GPU when its arrays are device memory of a CUDA
//! device, on the CPU otherwise (host memory, the device simulation, or streamed from
//! NVMe), and the report that says which.
//!
//! [`HybridAdamW::step_resident`] takes groups as they are resident — host slices
//! ([`ResidentGroup::Host`]) or device memory ([`ResidentGroup::Device`]) — and updates
//! each where its data is; NVMe groups go through [`crate::stream`] and are reported by
//! [`StreamingOptimizer::placement`]. With the simulated device (no GPU, or no `cuda`
//! feature) a device group is updated by the CPU kernel over the simulation's host bytes
//! and reported as `Gpu` with `simulated: true`, so every path above runs everywhere.
//! A group in CUDA memory with no usable GPU kernel is an error naming why
//! ([`OptimError::NotCompiledWithCuda`], [`OptimError::NoGpu`]), never a silent skip.

use tidestore_tiers::{DeviceMem, DeviceView, DeviceViewMut};

use crate::cpu::AdamW;
use crate::error::{check_len, OptimError, Result};
use crate::gpu::GpuAdamW;
use crate::group::ParamGroup;
use crate::params::{HyperParams, StepState};
use crate::slices::{Dtype, Grads, ParamOut};
use crate::stream::StreamingOptimizer;

/// The processor that updated a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// The CPU kernel.
    Cpu,
    /// The GPU kernel (or, with `simulated`, the CPU kernel over simulated device memory).
    Gpu,
}

/// Where one group was updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPlacement {
    /// The group's index (as the caller numbers them).
    pub group: usize,
    /// Where it was updated.
    pub placement: Placement,
    /// Its state was streamed from NVMe.
    pub streamed: bool,
    /// Its device memory is the host simulation.
    pub simulated: bool,
}

/// Group → placement for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementReport {
    /// One entry per group, in the order updated.
    pub groups: Vec<GroupPlacement>,
}

impl PlacementReport {
    /// Groups updated on `p`.
    pub fn count(&self, p: Placement) -> usize {
        self.groups.iter().filter(|g| g.placement == p).count()
    }
}

/// A group whose arrays are device memory.
#[derive(Debug)]
pub struct DeviceGroup<'a> {
    /// Parameters in the group.
    pub len: usize,
    /// fp32 master parameters (at least `4 * len` bytes).
    pub master: &'a mut DeviceMem,
    /// First moments.
    pub m: &'a mut DeviceMem,
    /// Second moments.
    pub v: &'a mut DeviceMem,
    /// Gradients, `len` elements of `grad_dtype`.
    pub grads: &'a DeviceMem,
    /// Their dtype.
    pub grad_dtype: Dtype,
    /// 16-bit parameters to refresh, and their dtype (F16 or Bf16).
    pub out: Option<(&'a mut DeviceMem, Dtype)>,
}

/// A group as it is resident for this step.
#[derive(Debug)]
pub enum ResidentGroup<'a> {
    /// Arrays in host memory.
    Host {
        /// The caller's group index (for the report).
        index: usize,
        /// The arrays and hyper-parameters.
        group: ParamGroup<'a>,
    },
    /// Arrays in device memory.
    Device {
        /// The caller's group index (for the report).
        index: usize,
        /// Hyper-parameters.
        hp: HyperParams,
        /// The arrays.
        group: DeviceGroup<'a>,
    },
}

/// The CPU kernel, and the GPU kernel where one could be made.
#[derive(Debug)]
pub struct HybridAdamW {
    cpu: AdamW,
    gpu: std::result::Result<GpuAdamW, OptimError>,
}

impl HybridAdamW {
    /// The CPU kernel, with the GPU kernel of CUDA device `ordinal` when the build has
    /// CUDA and the machine a GPU (why not is kept, see [`HybridAdamW::gpu_status`]).
    pub fn new(cpu: AdamW, ordinal: usize) -> Self {
        let gpu = GpuAdamW::new(ordinal);
        if let Err(e) = &gpu {
            tracing::info!(error = %e, "GPU AdamW unavailable; device groups need the simulated device");
        }
        HybridAdamW { cpu, gpu }
    }

    /// The CPU kernel only (the GPU kernel reported as not compiled / no GPU).
    pub fn cpu_only(cpu: AdamW, why: OptimError) -> Self {
        HybridAdamW { cpu, gpu: Err(why) }
    }

    /// Ok when the GPU kernel is ready, else why not.
    pub fn gpu_status(&self) -> Result<()> {
        self.gpu.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The CPU kernel.
    pub fn cpu(&self) -> &AdamW {
        &self.cpu
    }

    /// Updates every group where its data is, with one `state` for all (from
    /// [`crate::StepController::decide`]), and reports where.
    pub fn step_resident(
        &self,
        state: StepState,
        groups: &mut [ResidentGroup<'_>],
    ) -> Result<PlacementReport> {
        let mut report = PlacementReport {
            groups: Vec::with_capacity(groups.len()),
        };
        for rg in groups.iter_mut() {
            match rg {
                ResidentGroup::Host { index, group } => {
                    self.cpu.step_slice(
                        state,
                        &group.hp,
                        group.master,
                        group.m,
                        group.v,
                        group.grads,
                        group.out.as_mut().map(ParamOut::reborrow),
                    )?;
                    report.groups.push(GroupPlacement {
                        group: *index,
                        placement: Placement::Cpu,
                        streamed: false,
                        simulated: false,
                    });
                }
                ResidentGroup::Device { index, hp, group } => {
                    let simulated = matches!(group.master, DeviceMem::Sim(_));
                    if simulated {
                        step_sim(&self.cpu, state, hp, group)?;
                    } else {
                        let gpu = self.gpu.as_ref().map_err(Clone::clone)?;
                        gpu.step(state, hp, reborrow(group))?;
                    }
                    report.groups.push(GroupPlacement {
                        group: *index,
                        placement: Placement::Gpu,
                        streamed: false,
                        simulated,
                    });
                }
            }
        }
        Ok(report)
    }
}

fn reborrow<'b>(g: &'b mut DeviceGroup<'_>) -> DeviceGroup<'b> {
    DeviceGroup {
        len: g.len,
        master: g.master,
        m: g.m,
        v: g.v,
        grads: g.grads,
        grad_dtype: g.grad_dtype,
        out: g.out.as_mut().map(|(o, d)| (&mut **o, *d)),
    }
}

fn sim_err(what: &str) -> OptimError {
    OptimError::Stream {
        reason: format!("device group: {what}"),
    }
}

fn host_f32_mut<'a>(mem: &'a mut DeviceMem, len: usize, what: &str) -> Result<&'a mut [f32]> {
    match mem.view_mut() {
        DeviceViewMut::Host(bytes) => {
            check_len(
                "device bytes / 4",
                bytes.len() / 4,
                "group",
                len.max(bytes.len() / 4),
            )?;
            // SAFETY: every bit pattern is a valid f32; `align_to_mut` only puts in the
            // middle part what is aligned and in bounds.
            let (pre, mid, _) = unsafe { bytes.align_to_mut::<f32>() };
            if !pre.is_empty() || mid.len() < len {
                return Err(sim_err(&format!("{what} is not 4-aligned or too short")));
            }
            Ok(&mut mid[..len])
        }
        DeviceViewMut::Cuda { .. } => Err(sim_err(&format!(
            "{what} is CUDA memory in a simulated group"
        ))),
    }
}

fn host_bytes<'a>(mem: &'a DeviceMem, what: &str) -> Result<&'a [u8]> {
    match mem.view() {
        DeviceView::Host(b) => Ok(b),
        DeviceView::Cuda { .. } => Err(sim_err(&format!(
            "{what} is CUDA memory in a simulated group"
        ))),
    }
}

fn reinterpret<'a, T>(bytes: &'a [u8], len: usize, what: &str) -> Result<&'a [T]>
where
    T: Copy,
{
    // SAFETY: only used with f32, half::f16 and half::bf16, for which every bit pattern
    // is valid; `align_to` only puts aligned, in-bounds elements in the middle part.
    let (pre, mid, _) = unsafe { bytes.align_to::<T>() };
    if !pre.is_empty() || mid.len() < len {
        return Err(sim_err(&format!("{what} is misaligned or too short")));
    }
    Ok(&mid[..len])
}

/// The simulated device: the CPU kernel over the simulation's host bytes.
fn step_sim(
    cpu: &AdamW,
    state: StepState,
    hp: &HyperParams,
    g: &mut DeviceGroup<'_>,
) -> Result<()> {
    let n = g.len;
    let gb = host_bytes(g.grads, "grads")?;
    let grads = match g.grad_dtype {
        Dtype::F32 => Grads::F32(reinterpret::<f32>(gb, n, "grads")?),
        Dtype::F16 => Grads::F16(reinterpret::<half::f16>(gb, n, "grads")?),
        Dtype::Bf16 => Grads::Bf16(reinterpret::<half::bf16>(gb, n, "grads")?),
    };
    let out = match g.out.as_mut() {
        None => None,
        Some((o, d)) => {
            let bytes = match o.view_mut() {
                DeviceViewMut::Host(b) => b,
                DeviceViewMut::Cuda { .. } => return Err(sim_err("out is CUDA memory")),
            };
            // SAFETY: every bit pattern is a valid u16; `align_to_mut` only puts aligned,
            // in-bounds elements in the middle part.
            let (pre, mid, _) = unsafe { bytes.align_to_mut::<u16>() };
            if !pre.is_empty() || mid.len() < n {
                return Err(sim_err("out is misaligned or too short"));
            }
            let mid = &mut mid[..n];
            Some(match d {
                Dtype::F16 => {
                    ParamOut::F16(half::slice::HalfBitsSliceExt::reinterpret_cast_mut(mid))
                }
                Dtype::Bf16 => {
                    ParamOut::Bf16(half::slice::HalfBitsSliceExt::reinterpret_cast_mut(mid))
                }
                Dtype::F32 => {
                    return Err(OptimError::InvalidParam {
                        name: "out dtype",
                        value: 32.0,
                        reason: "16-bit output only (F16 or Bf16)",
                    })
                }
            })
        }
    };
    let p = host_f32_mut(g.master, n, "master")?;
    let m = host_f32_mut(g.m, n, "m")?;
    let v = host_f32_mut(g.v, n, "v")?;
    cpu.step_slice(state, hp, p, m, v, grads, out)
}

/// The device pointer of CUDA memory holding at least `bytes`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_ptr(mem: &DeviceMem, bytes: usize, what: &str) -> Result<u64> {
    match mem.view() {
        DeviceView::Cuda { ptr, len_bytes } if len_bytes >= bytes => Ok(ptr),
        DeviceView::Cuda { len_bytes, .. } => Err(sim_err(&format!(
            "{what} holds {len_bytes} bytes, the group needs {bytes}"
        ))),
        DeviceView::Host(_) => Err(sim_err(&format!(
            "{what} is simulated memory in a GPU group"
        ))),
    }
}

/// The device pointer of writable CUDA memory holding at least `bytes`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_ptr_mut(mem: &mut DeviceMem, bytes: usize, what: &str) -> Result<u64> {
    device_ptr(mem, bytes, what)
}

impl StreamingOptimizer {
    /// Where this optimizer's groups are updated: all on the CPU, streamed.
    pub fn placement(&self) -> PlacementReport {
        PlacementReport {
            groups: (0..self.groups().len())
                .map(|group| GroupPlacement {
                    group,
                    placement: Placement::Cpu,
                    streamed: true,
                    simulated: false,
                })
                .collect(),
        }
    }
}
