//! The GPU kernels over compact moments (`optimizer.states = bf16 | int8`): their CUDA C
//! source, its NVRTC compilation (with the options of every tidestore kernel, appended
//! to [`crate::gpu::ADAMW_CU`], whose helpers it uses), their entry points, and the map
//! table the int8 kernels read.
//!
//! Compiled to PTX and assembled by ptxas for sm_86 / sm_89 in CI
//! (`tests/kernel_compile.rs`); [`crate::GpuAdamW`] builds them into its module with the
//! fp32 kernels and launches them for [`crate::DeviceSlices`] whose `moments` is bf16 or
//! int8 (`tests/device_compact.rs` compares them with the CPU kernel bit for bit on a
//! GPU; not yet run on one at the time of writing).
//! Without the `cuda` feature, [`compile_compact_ptx`] returns
//! [`crate::OptimError::NotCompiledWithCuda`] like every GPU entry point.

use crate::error::Result;
use crate::quant::maps;

/// The CUDA C source of the compact-moment kernels (appended to the AdamW source).
pub const ADAMW_COMPACT_CU: &str = include_str!("kernels/adamw_compact.cu");

/// Compiles the AdamW source followed by [`ADAMW_COMPACT_CU`] to PTX (`arch`: e.g.
/// `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_compact_ptx(arch: Option<&'static str>) -> Result<String> {
    let source = format!("{}\n{}", crate::gpu::ADAMW_CU, ADAMW_COMPACT_CU);
    crate::gpu::compile_source(&source, "adamw_compact.cu", arch, Vec::new())
}

/// The compact kernels' entry points: `adamw_{m16,q8}_<grad>_<out>_<mode>`.
pub fn compact_kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for g in ["f32", "f16", "bf16"] {
        for o in ["none", "f16", "bf16"] {
            for kind in ["m16", "q8"] {
                for mode in ["adamw", "l2"] {
                    v.push(format!("adamw_{kind}_{g}_{o}_{mode}"));
                }
            }
        }
    }
    v
}

/// The 1024 floats the int8 kernels' `maps` argument points to: signed values, signed
/// midpoints, unsigned values, unsigned midpoints.
pub fn map_table() -> Vec<f32> {
    let q = maps();
    let mut t = Vec::with_capacity(1024);
    t.extend_from_slice(&q.signed.values);
    t.extend_from_slice(&q.signed.midpoints);
    t.extend_from_slice(&q.unsigned.values);
    t.extend_from_slice(&q.unsigned.midpoints);
    t
}
