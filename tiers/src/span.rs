//! Ranges of GPU memory handed out for kernels: [`CudaSpan`] (read) and [`CudaSpanMut`]
//! (write), the CUDA side of [`crate::DeviceView`] and [`crate::DeviceViewMut`].
//!
//! A span is a device address and a length that borrows the allocation it points into
//! for `'a`, as a slice borrows its bytes. Only the device tier makes one from memory it
//! allocated; everyone else can only narrow one ([`CudaSpan::get`],
//! [`CudaSpanMut::split_at`]) — or promise, through the `unsafe`
//! [`CudaSpan::from_raw`], that an address is such memory. So code that launches a kernel
//! on a span it was given writes only where its caller lent it memory, never at an
//! arbitrary address (which, with unified addressing, could be host memory Rust has
//! borrowed elsewhere).
//!
//! The spans never dereference their address themselves: only kernels and copies do,
//! through FFI, under their own `// SAFETY:` contracts.

use std::marker::PhantomData;
use std::ops::Range;

/// A read-only range of GPU memory, borrowed for `'a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaSpan<'a> {
    ptr: u64,
    len_bytes: usize,
    _mem: PhantomData<&'a [u8]>,
}

/// A writable range of GPU memory, borrowed exclusively for `'a`.
#[derive(Debug, PartialEq, Eq)]
pub struct CudaSpanMut<'a> {
    ptr: u64,
    len_bytes: usize,
    _mem: PhantomData<&'a mut [u8]>,
}

impl<'a> CudaSpan<'a> {
    /// A span over `len_bytes` at device address `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` is live GPU memory of the device tier's context that nobody
    /// writes while the span (or anything narrowed from it) is in use, and stays
    /// allocated for `'a`.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(ptr: u64, len_bytes: usize) -> Self {
        CudaSpan {
            ptr,
            len_bytes,
            _mem: PhantomData,
        }
    }

    /// The device address of its first byte (for FFI: a kernel argument).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The bytes `range` of this span, or `None` when the range is out of bounds.
    pub fn get(self, range: Range<usize>) -> Option<CudaSpan<'a>> {
        (range.start <= range.end && range.end <= self.len_bytes).then(|| CudaSpan {
            ptr: self.ptr + range.start as u64,
            len_bytes: range.end - range.start,
            _mem: PhantomData,
        })
    }
}

impl<'a> CudaSpanMut<'a> {
    /// A writable span over `len_bytes` at device address `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` is live GPU memory of the device tier's context that nobody
    /// else reads or writes while the span (or anything narrowed from it) is in use, and
    /// stays allocated for `'a`.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(ptr: u64, len_bytes: usize) -> Self {
        CudaSpanMut {
            ptr,
            len_bytes,
            _mem: PhantomData,
        }
    }

    /// The device address of its first byte (for FFI: a kernel argument).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// A read-only span of the same bytes, for as long as this one is borrowed.
    pub fn as_span(&self) -> CudaSpan<'_> {
        CudaSpan {
            ptr: self.ptr,
            len_bytes: self.len_bytes,
            _mem: PhantomData,
        }
    }

    /// The same bytes, read-only, for the rest of `'a` (as `&mut` becomes `&`).
    pub fn into_span(self) -> CudaSpan<'a> {
        CudaSpan {
            ptr: self.ptr,
            len_bytes: self.len_bytes,
            _mem: PhantomData,
        }
    }

    /// The same bytes, borrowed from this span for a shorter time.
    pub fn reborrow(&mut self) -> CudaSpanMut<'_> {
        CudaSpanMut {
            ptr: self.ptr,
            len_bytes: self.len_bytes,
            _mem: PhantomData,
        }
    }

    /// The bytes `range` of this span, or `None` when the range is out of bounds.
    pub fn get(self, range: Range<usize>) -> Option<CudaSpanMut<'a>> {
        (range.start <= range.end && range.end <= self.len_bytes).then(|| CudaSpanMut {
            ptr: self.ptr + range.start as u64,
            len_bytes: range.end - range.start,
            _mem: PhantomData,
        })
    }

    /// Two disjoint spans, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at(self, mid: usize) -> Option<(CudaSpanMut<'a>, CudaSpanMut<'a>)> {
        (mid <= self.len_bytes).then(|| {
            (
                CudaSpanMut {
                    ptr: self.ptr,
                    len_bytes: mid,
                    _mem: PhantomData,
                },
                CudaSpanMut {
                    ptr: self.ptr + mid as u64,
                    len_bytes: self.len_bytes - mid,
                    _mem: PhantomData,
                },
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_only_narrow() {
        // SAFETY: never dereferenced: only its arithmetic is tested.
        #[allow(unsafe_code)]
        let s = unsafe { CudaSpanMut::from_raw(1 << 32, 100) };
        assert_eq!(
            s.as_span().get(10..30).map(|r| (r.ptr(), r.len_bytes())),
            Some(((1 << 32) + 10, 20))
        );
        assert_eq!(s.as_span().get(90..101), None);
        let (start, end) = (5, 4);
        assert_eq!(s.as_span().get(start..end), None);
        let (a, b) = s.split_at(40).unwrap();
        assert_eq!((a.ptr(), a.len_bytes()), (1 << 32, 40));
        assert_eq!((b.ptr(), b.len_bytes()), ((1 << 32) + 40, 60));
        assert!(b.split_at(61).is_none());
    }
}
