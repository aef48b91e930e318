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

/// A chunk list, named by its role in training whatever its element type (the layout
/// decides that: see [`crate::layout`] and [`crate::moments`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListKind {
    /// Parameters as compute uses them, in 2-byte slots (16-bit, or an fp32 frozen
    /// tensor over two slots per element); gradients reuse them without a `Grads` list.
    Params = 0,
    /// The fp32 master parameters of trainable tensors.
    Master = 1,
    /// Adam's first moment (M) of trainable tensors: fp32, bf16 or int8.
    Momentum = 2,
    /// Adam's second moment (V) of trainable tensors: fp32, bf16 or int8.
    Variance = 3,
    /// Gradients of trainable tensors kept apart from the parameters (only with
    /// gradient accumulation in the layout): 16-bit, or fp32 with the layout's
    /// `fp32_grads`.
    Grads = 4,
}

impl ListKind {
    /// Number of list kinds; the stride of [`ChunkId`]'s packing.
    pub const COUNT: u32 = 5;

    /// All lists, in packing order.
    pub const ALL: [ListKind; 5] = [
        ListKind::Params,
        ListKind::Master,
        ListKind::Momentum,
        ListKind::Variance,
        ListKind::Grads,
    ];

    /// Bytes per element slot of this list's chunks in the default layout (the layout's
    /// [`crate::LayoutConfig::slot_bytes`] says what its moments and gradients take).
    pub const fn slot_bytes(self) -> u64 {
        match self {
            ListKind::Params | ListKind::Grads => 2,
            ListKind::Master | ListKind::Momentum | ListKind::Variance => 4,
        }
    }

    /// Whether only trainable tensors have a place in this list.
    pub const fn trainable_only(self) -> bool {
        !matches!(self, ListKind::Params)
    }

    /// A short lower-case name, as [`fmt::Display`] writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            ListKind::Params => "param16",
            ListKind::Master => "master",
            ListKind::Momentum => "m",
            ListKind::Variance => "v",
            ListKind::Grads => "grads",
        }
    }

    const fn from_ordinal(ordinal: u32) -> ListKind {
        match ordinal {
            0 => ListKind::Params,
            1 => ListKind::Master,
            2 => ListKind::Momentum,
            3 => ListKind::Variance,
            _ => ListKind::Grads,
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
                assert_eq!(id.in_list(ListKind::Params).index(), index);
            }
        }
        // One group is adjacent in dense order.
        let p = ChunkId::new(ListKind::Params, 3).dense();
        let g = ChunkId::new(ListKind::Grads, 3).dense();
        assert_eq!(g - p, ListKind::COUNT as usize - 1);
        assert_eq!(ChunkId::new(ListKind::Master, 2).to_string(), "master#2");
    }
}
