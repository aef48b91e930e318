//! The one error type of the optimizer crate.
//!
//! Every variant names what was wrong in the caller's terms: which slices disagree in
//! length and by how much, which hyper-parameter is out of range and its value, which
//! SIMD level was asked for on a CPU that lacks it. The public shape names no type of
//! another crate (rayon's pool error is kept as text).

/// Errors of the optimizer crate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// Two slices that must have one element per parameter differ in length.
    #[error("slice `{slice}` has {len} elements but `{reference}` has {expected}")]
    LengthMismatch {
        /// The slice whose length is wrong (`m`, `v`, `grads`, `out`, ...).
        slice: &'static str,
        /// Its length.
        len: usize,
        /// The slice it is compared with (usually `master`).
        reference: &'static str,
        /// The length of that slice.
        expected: usize,
    },

    /// A hyper-parameter or option is out of its valid range.
    #[error("invalid `{name}` = {value}: {reason}")]
    InvalidParam {
        /// The field, as written in [`crate::HyperParams`] or the config struct.
        name: &'static str,
        /// Its value.
        value: f64,
        /// What the valid range is.
        reason: &'static str,
    },

    /// A device view handed to the optimizer cannot be stepped as given: of another
    /// kind than `master` (host vs CUDA), misaligned for its element, overlapping another
    /// view, or of a dtype the step cannot write.
    #[error("device view `{view}`: {reason}")]
    DeviceView {
        /// The view (`master`, `m`, `v`, `grads`, `out`, `bytes`).
        view: &'static str,
        /// What is wrong with it, with the numbers.
        reason: String,
    },

    /// A SIMD level was forced that this CPU cannot run.
    #[error("SIMD level {level:?} is not supported by this CPU")]
    SimdUnsupported {
        /// The level that was asked for.
        level: crate::SimdLevel,
    },

    /// The SIMD level environment variable names no level.
    #[error("{var}={name:?} names no SIMD level (scalar, avx2, avx512, avx512bf16)")]
    SimdUnknown {
        /// The variable read.
        var: &'static str,
        /// The value found.
        name: String,
    },

    /// The rayon thread pool could not be built.
    #[error("cannot build a thread pool of {threads} threads: {reason}")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// rayon's message.
        reason: String,
    },

    /// A benchmark could not allocate or was configured with nothing to do.
    #[error("benchmark: {reason}")]
    Bench {
        /// What went wrong.
        reason: String,
    },

    /// This build has no CUDA support (feature `cuda` off).
    #[error("this build of tidestore-optimizer has no CUDA support (feature `cuda`)")]
    NotCompiledWithCuda,

    /// CUDA support is compiled but there is no usable GPU (no libcuda, no device).
    #[error("no usable GPU: {reason}")]
    NoGpu {
        /// Why.
        reason: String,
    },

    /// A CUDA driver or NVRTC call failed (its error kept as text: the public shape names
    /// no cudarc type).
    #[error("CUDA {op} failed: {reason}")]
    Cuda {
        /// The operation (`nvrtc compile`, `kernel launch`, ...).
        op: &'static str,
        /// The driver's or compiler's message (the compile log for NVRTC).
        reason: String,
    },
}

/// Result alias of the crate.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;

/// Checks `len == expected`, naming both slices on failure.
pub(crate) fn check_len(
    slice: &'static str,
    len: usize,
    reference: &'static str,
    expected: usize,
) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch {
            slice,
            len,
            reference,
            expected,
        })
    }
}
