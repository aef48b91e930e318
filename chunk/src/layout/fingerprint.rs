//! The layout's fingerprint: a stable hash of where every byte is, kept in the swap file
//! so that a store adopts chunks only from a file of the same layout.

use super::Layout;
use crate::dtype::DType;
use crate::id::{ListKind, TensorId};
use crate::moments::MomentForm;

impl Layout {
    /// A stable 64-bit hash (FNV-1a) of everything that decides where a tensor's bytes
    /// are: the layout config (chunk size, gradient accumulation, the 16-bit dtype,
    /// frozen packing), every tensor's name, shape, dtype and trainability in order, its
    /// place (chunk, offset, dtype) in every list, and every chunk's stored length. Two
    /// layouts with equal fingerprints put every byte at the same place; the chunk store
    /// keeps it in the swap file and adopts the chunks there only under an equal one.
    /// Stable across runs, builds and machines (fixed byte order, no `std` hasher).
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv64::new();
        h.bytes(b"tidestore-layout-v1");
        let c = &self.config;
        h.u64(c.chunk_elements);
        h.u64(u64::from(c.grad_accumulation));
        h.u64(dtype_code(c.param16_dtype));
        h.u64(u64::from(c.separate_frozen));
        // fp32 moments hash as before compact moments existed (same fingerprints).
        if c.moments != MomentForm::F32 {
            h.bytes(c.moments.as_str().as_bytes());
        }
        h.u64(self.specs.len() as u64);
        for (i, spec) in self.specs.iter().enumerate() {
            h.u64(spec.name.len() as u64);
            h.bytes(spec.name.as_bytes());
            h.u64(spec.shape.len() as u64);
            for &d in &spec.shape {
                h.u64(d as u64);
            }
            h.u64(dtype_code(spec.dtype));
            h.u64(u64::from(spec.trainable));
            for list in ListKind::ALL {
                match self.location(TensorId(i as u32), list) {
                    Some(loc) => {
                        h.u64(loc.chunk.dense() as u64);
                        h.u64(loc.offset_elements);
                        h.u64(loc.elements);
                        h.u64(dtype_code(loc.dtype));
                    }
                    None => h.u64(u64::MAX),
                }
            }
        }
        let stored = self.dense_chunk_bytes();
        h.u64(stored.len() as u64);
        for b in stored {
            h.u64(b);
        }
        h.finish()
    }
}

/// 64-bit FNV-1a, fed in little-endian words: the fingerprint's hash.
struct Fnv64(u64);

impl Fnv64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Fnv64(Self::OFFSET)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A dtype's fixed code in the fingerprint (independent of the enum's order).
fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::Q8 => 4,
    }
}
