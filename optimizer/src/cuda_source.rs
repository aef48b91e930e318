//! The CUDA C sources of the GPU AdamW, shipped in every build so they can be inspected
//! and compiled without a GPU: the fp32 kernels ([`ADAMW_CU`]) and the kernels over
//! compact moments (`optimizer.states = bf16 | int8`, [`ADAMW_COMPACT_CU`], appended to
//! the fp32 source, whose helpers they use), the compact kernels' entry points, and the
//! map table the int8 kernels read. Compiling them is [`crate::gpu`]'s work.
//!
//! Compiled to PTX and assembled by ptxas for sm_86 / sm_89 in CI
//! (`tests/kernel_compile.rs`); [`crate::gpu::GpuAdamW`] builds them into its module with the
//! fp32 kernels and launches them for [`crate::DeviceSlices`] whose `moments` is bf16 or
//! int8 (`tests/device_compact.rs` compares them with the CPU kernel bit for bit on a
//! GPU; not yet run on one at the time of writing).
//! Without the `cuda` feature, [`crate::gpu::compile_compact_ptx`] returns
//! [`crate::OptimError::NotCompiledWithCuda`] like every GPU entry point.

use crate::quant::maps;

/// The integer types and 16-bit float conversions every kernel source of the workspace
/// is compiled after (the bench's kernels too).
pub const HALF_BITS_CU: &str = include_str!("kernels/half_bits.cuh");

/// The CUDA C source of the fp32 kernels, [`HALF_BITS_CU`] ahead of them.
pub const ADAMW_CU: &str = concat!(
    include_str!("kernels/half_bits.cuh"),
    "\n",
    include_str!("kernels/adamw.cu")
);

/// The CUDA C source of the compact-moment kernels (appended to the AdamW source).
pub const ADAMW_COMPACT_CU: &str = include_str!("kernels/adamw_compact.cu");

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
