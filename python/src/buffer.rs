//! Tensor memory handed over from Python through numpy's array interface.
//!
//! The Python layer passes every tensor as a flat, C-contiguous `uint8` numpy array over
//! its memory (an array of the caller's, or a CPU torch tensor's
//! `.view(torch.uint8).numpy()`), with the element dtype beside it. (The buffer protocol
//! is not in CPython's limited API before 3.11, and the wheel is abi3 for 3.9.) Here a
//! [`Bytes`] reads `__array_interface__` and checks it — one-byte items, contiguous,
//! writable when it will be written — and only then lends the memory out as a slice. The
//! two `unsafe` blocks that make those slices live in [`Bytes::as_slice`] and
//! [`Bytes::as_mut_slice`].

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tidestore_train::DType;

use crate::error::{Error, Result};

/// A checked byte view of a numpy array's memory. Holding it holds a reference to the
/// array, which keeps the memory alive and in place (numpy refuses to resize an array
/// that something else references).
pub struct Bytes {
    _owner: Py<PyAny>,
    addr: usize,
    len: usize,
    readonly: bool,
    what: String,
}

impl Bytes {
    /// Checks `obj`'s array interface: `|u1` items, C-contiguous, writable when
    /// `writable`.
    pub fn new(obj: &Bound<'_, PyAny>, what: &str, writable: bool) -> Result<Self> {
        let bad = |reason: String| Error::bad(what, reason);
        let iface = obj.getattr("__array_interface__").map_err(|_| {
            bad(format!(
                "a {} is not a numpy array (pass a uint8 view)",
                type_name(obj)
            ))
        })?;
        let iface = iface
            .downcast::<PyDict>()
            .map_err(|_| bad("__array_interface__ is not a dict".into()))?;
        let get = |key: &str| -> Result<Bound<'_, PyAny>> {
            iface
                .get_item(key)
                .ok()
                .flatten()
                .ok_or_else(|| bad(format!("__array_interface__ has no `{key}`")))
        };
        let typestr: String = get("typestr")?
            .extract()
            .map_err(|_| bad("typestr is not a string".into()))?;
        if typestr != "|u1" {
            return Err(bad(format!(
                "items of type `{typestr}`, expected uint8 (`|u1`)"
            )));
        }
        let shape: Vec<usize> = get("shape")?
            .extract()
            .map_err(|_| bad("shape is not a tuple of sizes".into()))?;
        let len: usize = shape.iter().product();
        let strides = iface.get_item("strides").ok().flatten();
        if let Some(strides) = strides.filter(|s| !s.is_none()) {
            let strides: Vec<isize> = strides
                .extract()
                .map_err(|_| bad("strides is not a tuple of integers".into()))?;
            let mut expect = 1isize;
            for (dim, stride) in shape.iter().zip(&strides).rev() {
                if *dim > 1 && *stride != expect {
                    return Err(bad(format!(
                        "not C-contiguous (shape {shape:?}, strides {strides:?})"
                    )));
                }
                expect *= *dim as isize;
            }
        }
        let data = get("data")?;
        let data = data.downcast::<PyTuple>().map_err(|_| {
            bad("data is not an (address, read-only) pair (a buffer-backed array?)".into())
        })?;
        let (addr, readonly): (usize, bool) = data
            .extract()
            .map_err(|_| bad("data is not an (address, read-only) pair".into()))?;
        if addr == 0 && len > 0 {
            return Err(bad("null data address".into()));
        }
        if writable && readonly {
            return Err(bad("array is read-only but will be written".into()));
        }
        Ok(Bytes {
            _owner: obj.clone().unbind(),
            addr,
            len,
            readonly,
            what: what.to_string(),
        })
    }

    /// The memory, read-only.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `addr` is the data pointer numpy reported for a C-contiguous array of
        // `len` one-byte items (checked in `new`); `_owner` holds a reference to the array
        // for as long as `self` lives, so the memory stays allocated and in place (numpy
        // refuses to resize a referenced array), and the slice borrows `self`. Python code
        // on another thread may still write it while the GIL is released: as with numpy's
        // own GIL-free loops, a caller racing its own array gets torn values, which u8
        // slices tolerate (no invalid bit patterns).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The memory, writable (refused for read-only arrays).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if self.readonly {
            return Err(Error::bad(&self.what, "array is read-only"));
        }
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`, and numpy reported the array writable; the `&mut
        // self` borrow makes this the only slice made from `self` while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) })
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// A gradient handed to a step: its buffer (`what` names it in errors) held for the
/// call, with its dtype.
pub fn held_grad(buf: &Bound<'_, PyAny>, dtype: &str, what: &str) -> Result<(Bytes, DType)> {
    Ok((Bytes::new(buf, what, false)?, parse_dtype("dtype", dtype)?))
}

/// A dtype named as the Python layer names it (`float32`, `bfloat16`, `float16`).
pub fn parse_dtype(what: &str, name: &str) -> Result<DType> {
    match name {
        "float32" | "f32" | "fp32" => Ok(DType::F32),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        "float16" | "f16" | "fp16" => Ok(DType::F16),
        other => Err(Error::bad(
            what,
            format!("dtype `{other}` is not one of float32, bfloat16, float16"),
        )),
    }
}

/// Runs `f` over `core` and the read-only uint8 array `buf` of `dtype` elements (named
/// `what` in errors) with the GIL released: how every method of the Python classes that
/// takes values reads them.
pub(crate) fn with_input<C: Send, R: Send>(
    py: Python<'_>,
    core: &mut C,
    what: &str,
    buf: &Bound<'_, PyAny>,
    dtype: &str,
    f: impl FnOnce(&mut C, &[u8], DType) -> Result<R> + Send,
) -> PyResult<R> {
    let dtype = parse_dtype("dtype", dtype)?;
    let bytes = Bytes::new(buf, what, false)?;
    let src = bytes.as_slice();
    Ok(py.allow_threads(|| f(core, src, dtype))?)
}
