//! Views of device memory for compute, as each backend gives them: host bytes in the
//! simulation, a span of GPU memory (see [`CudaSpan`]) on a GPU. A leaf the backends
//! and [`crate::Device`] share.

#![deny(unsafe_code)]

use crate::span::{CudaSpan, CudaSpanMut};

/// A read-only view of device memory for compute: host bytes in the simulation, a span
/// of GPU memory (see [`CudaSpan`]) on a GPU.
#[derive(Debug)]
pub enum DeviceView<'a> {
    Host(&'a [u8]),
    Cuda(CudaSpan<'a>),
}

/// A writable view of device memory for compute.
#[derive(Debug)]
pub enum DeviceViewMut<'a> {
    Host(&'a mut [u8]),
    Cuda(CudaSpanMut<'a>),
}
