//! Where each group is updated: on the GPU when its arrays are device memory of a CUDA
//! device, on the CPU otherwise (host memory or the device simulation), and the report
//! that says which.
//!
//! [`HybridAdamW::step_resident`] takes groups as they are resident — host slices
//! ([`ResidentGroup::Host`]) or device memory ([`ResidentGroup::Device`]) — and updates
//! each where its data is. Bringing a group's data there (from NVMe included) is the
//! chunk store's work, driven by the step loop of `tidestore-train`; this module only
//! computes. [`HybridAdamW::step_device_slices`] does the same for one range of device
//! views ([`DeviceSlices`]: a tensor at an offset inside its chunks), with the 16-bit
//! gradient either in its own memory or in the very bytes the new 16-bit parameters are
//! written to ([`crate::DeviceGrads::InPlace`]). A whole-chunk [`DeviceGroup`] is converted
//! into [`DeviceSlices`] and takes the same path.
//!
//! M and V are views in the tensor's stored form ([`DeviceSlices::moments`]: fp32,
//! bf16, or int8 codes + absmax as the layout places them, [`crate::moment_view_bytes`]); the
//! GPU runs the matching kernel, the simulation [`AdamW::step_moments`](crate::AdamW::step_moments).
//!
//! With the simulated device (no GPU, or no `cuda` feature) device memory is updated by
//! the CPU kernel over the simulation's host bytes and reported as `Gpu` with
//! `simulated: true`, so every path above runs everywhere. Memory on a CUDA device with
//! no usable GPU kernel is an error naming why ([`OptimError::NotCompiledWithCuda`],
//! [`OptimError::NoGpu`]), never a silent skip.
//!
//! The views and their checks are in [`crate::device_slices`]; the simulated device's
//! CPU path in `simulated.rs`.

use tidestore_tiers::DeviceViewMut;

use crate::cpu::AdamW;
use crate::device_slices::{DeviceGroup, DeviceSlices};
use crate::error::{OptimError, Result};
use crate::gpu::GpuAdamW;
use crate::group::ParamGroup;
use crate::params::{HyperParams, StepState};
use crate::simulated::step_host;
use crate::slices::ParamOut;

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
                        simulated: false,
                    });
                }
                ResidentGroup::Device { index, hp, group } => {
                    let done =
                        self.step_device_slices(state, hp, DeviceSlices::from(reborrow(group)))?;
                    report.groups.push(GroupPlacement {
                        group: *index,
                        ..done
                    });
                }
            }
        }
        Ok(report)
    }

    /// Steps the slices where they are: the GPU kernel when they are CUDA memory, the CPU
    /// kernel over the simulation's host bytes otherwise; returns where
    /// ([`Placement::Gpu`], `simulated` true or false; `group` 0, for the caller to
    /// renumber). Finished when this returns (the GPU stream is synchronized).
    ///
    /// Every view is checked before anything is read or written: mixed host/CUDA views,
    /// a view shorter than `len` elements of its dtype, a view not aligned to its
    /// element, overlapping CUDA views, F32 in-place gradients or an F32 output are typed
    /// errors naming the view; CUDA views without a GPU kernel are the reason there is
    /// none ([`HybridAdamW::gpu_status`]). With [`crate::DeviceGrads::InPlace`] the bits are
    /// those of [`AdamW::step_slice`] given a separate copy of the gradient.
    ///
    /// CUDA views are spans of the device tier's allocations
    /// ([`tidestore_tiers::CudaSpanMut`]): borrowed, so alive and untouched by anyone
    /// else during the call; they must be on the GPU kernel's device (the same ordinal).
    pub fn step_device_slices(
        &self,
        state: StepState,
        hp: &HyperParams,
        s: DeviceSlices<'_>,
    ) -> Result<GroupPlacement> {
        let simulated = matches!(s.master, DeviceViewMut::Host(_));
        if simulated {
            step_host(&self.cpu, state, hp, s)?;
        } else {
            let ptrs = s.into_cuda()?;
            let gpu = self.gpu.as_ref().map_err(Clone::clone)?;
            gpu.step_ptrs(state, hp, ptrs)?;
        }
        Ok(GroupPlacement {
            group: 0,
            placement: Placement::Gpu,
            simulated,
        })
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
