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

/// The methods both spans have: narrowing by a range, and the parts for FFI.
macro_rules! span_methods {
    ($span:ident) => {
        impl<'a> $span<'a> {
            /// The span of `len_bytes` at `ptr`, only for memory lent for `'a`: a range
            /// of a span being narrowed, or what `from_raw`'s caller promised.
            fn from_parts(ptr: u64, len_bytes: usize) -> Self {
                $span {
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
            pub fn get(self, range: Range<usize>) -> Option<Self> {
                (range.start <= range.end && range.end <= self.len_bytes).then(|| {
                    Self::from_parts(self.ptr + range.start as u64, range.end - range.start)
                })
            }
        }
    };
}

span_methods!(CudaSpan);
span_methods!(CudaSpanMut);

impl<'a> CudaSpan<'a> {
    /// A span over `len_bytes` at device address `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` is live GPU memory of the device tier's context that nobody
    /// writes while the span (or anything narrowed from it) is in use, and stays
    /// allocated for `'a`.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(ptr: u64, len_bytes: usize) -> Self {
        Self::from_parts(ptr, len_bytes)
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
        Self::from_parts(ptr, len_bytes)
    }

    /// A read-only span of the same bytes, for as long as this one is borrowed.
    pub fn as_span(&self) -> CudaSpan<'_> {
        CudaSpan::from_parts(self.ptr, self.len_bytes)
    }

    /// The same bytes, read-only, for the rest of `'a` (as `&mut` becomes `&`).
    pub fn into_span(self) -> CudaSpan<'a> {
        CudaSpan::from_parts(self.ptr, self.len_bytes)
    }

    /// The same bytes, borrowed from this span for a shorter time.
    pub fn reborrow(&mut self) -> CudaSpanMut<'_> {
        CudaSpanMut::from_parts(self.ptr, self.len_bytes)
    }

    /// Two disjoint spans, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at(self, mid: usize) -> Option<(CudaSpanMut<'a>, CudaSpanMut<'a>)> {
        (mid <= self.len_bytes).then(|| {
            (
                Self::from_parts(self.ptr, mid),
                Self::from_parts(self.ptr + mid as u64, self.len_bytes - mid),
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
