//! Compact identifiers: tensors, chunk lists and chunks.
//!
//! A [`TensorId`] is the tensor's registration index (model order). A [`ChunkId`] names
//! chunk `index` of list `list` and packs both into one `u32` as
//! `index * ListKind::COUNT + list`, so that
//! - it is usable directly as a dense index into per-chunk arrays ([`ChunkId::dense`]),
//! - the chunks of one optimizer group (same index, every list) are adjacent.
//!
//! Invariant: `ChunkId::from_dense(id.dense()) == id` for every id, and a dense index
//! below `chunks_per_list * ListKind::COUNT` belongs to a chunk index below
//! `chunks_per_list`.

use std::fmt;

/// A registered tensor: its index in registration (forward model) order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

impl TensorId {
    /// The id as an index into per-tensor arrays.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// A chunk list: one kind of training state, each chunk holding one element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListKind {
    /// Parameters as used by forward/backward, in 2-byte slots (see [`crate::layout`]).
    Param16 = 0,
    /// fp32 master parameters of trainable tensors.
    MasterF32 = 1,
    /// fp32 Adam first moment (M) of trainable tensors.
    MomentumF32 = 2,
    /// fp32 Adam second moment (V) of trainable tensors.
    VarianceF32 = 3,
    /// 16-bit gradients of trainable tensors; only with gradient accumulation.
    GradF16 = 4,
}

impl ListKind {
    /// Number of list kinds; the stride of [`ChunkId`]'s packing.
    pub const COUNT: u32 = 5;

    /// All lists, in packing order.
    pub const ALL: [ListKind; 5] = [
        ListKind::Param16,
        ListKind::MasterF32,
        ListKind::MomentumF32,
        ListKind::VarianceF32,
        ListKind::GradF16,
    ];

    /// Bytes per element slot of this list's chunks.
    pub const fn slot_bytes(self) -> u64 {
        match self {
            ListKind::Param16 | ListKind::GradF16 => 2,
            ListKind::MasterF32 | ListKind::MomentumF32 | ListKind::VarianceF32 => 4,
        }
    }

    /// Whether only trainable tensors have a place in this list.
    pub const fn trainable_only(self) -> bool {
        !matches!(self, ListKind::Param16)
    }

    /// A short lower-case name, as [`fmt::Display`] writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            ListKind::Param16 => "param16",
            ListKind::MasterF32 => "master",
            ListKind::MomentumF32 => "m",
            ListKind::VarianceF32 => "v",
            ListKind::GradF16 => "grad16",
        }
    }

    const fn from_ordinal(ordinal: u32) -> ListKind {
        match ordinal {
            0 => ListKind::Param16,
            1 => ListKind::MasterF32,
            2 => ListKind::MomentumF32,
            3 => ListKind::VarianceF32,
            _ => ListKind::GradF16,
        }
    }
}

impl fmt::Display for ListKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Chunk `index` of list `list`, packed into one `u32` (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(u32);

impl ChunkId {
    /// The largest chunk index a [`ChunkId`] can carry.
    pub const INDEX_MAX: u32 = u32::MAX / ListKind::COUNT - 1;

    /// Chunk `index` of `list`.
    ///
    /// # Panics
    /// If `index > ChunkId::INDEX_MAX` (more than 858 million chunks per list); the
    /// layout refuses such registrations before building ids.
    pub const fn new(list: ListKind, index: u32) -> ChunkId {
        assert!(index <= Self::INDEX_MAX, "chunk index out of range");
        ChunkId(index * ListKind::COUNT + list as u32)
    }

    /// The list this chunk belongs to.
    pub const fn list(self) -> ListKind {
        ListKind::from_ordinal(self.0 % ListKind::COUNT)
    }

    /// The chunk's index within its list; equal indices across lists form one
    /// optimizer group.
    pub const fn index(self) -> u32 {
        self.0 / ListKind::COUNT
    }

    /// The id as a dense index into per-chunk arrays.
    pub const fn dense(self) -> usize {
        self.0 as usize
    }

    /// The id whose [`ChunkId::dense`] is `dense`.
    ///
    /// # Panics
    /// If `dense` does not fit the packing (above `u32::MAX`).
    pub fn from_dense(dense: usize) -> ChunkId {
        let raw = u32::try_from(dense).expect("dense chunk index above u32::MAX");
        assert!(
            raw / ListKind::COUNT <= Self::INDEX_MAX,
            "dense chunk index out of range"
        );
        ChunkId(raw)
    }

    /// The same chunk index in another list (the chunk of the same optimizer group).
    pub const fn in_list(self, list: ListKind) -> ChunkId {
        ChunkId::new(list, self.index())
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.list(), self.index())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_id_roundtrip_and_grouping() {
        for index in [0u32, 1, 7, 1000, ChunkId::INDEX_MAX] {
            for list in ListKind::ALL {
                let id = ChunkId::new(list, index);
                assert_eq!(id.list(), list);
                assert_eq!(id.index(), index);
                assert_eq!(ChunkId::from_dense(id.dense()), id);
                assert_eq!(id.in_list(ListKind::Param16).index(), index);
            }
        }
        // One group is adjacent in dense order.
        let p = ChunkId::new(ListKind::Param16, 3).dense();
        let g = ChunkId::new(ListKind::GradF16, 3).dense();
        assert_eq!(g - p, ListKind::COUNT as usize - 1);
        assert_eq!(ChunkId::new(ListKind::MasterF32, 2).to_string(), "master#2");
    }
}
