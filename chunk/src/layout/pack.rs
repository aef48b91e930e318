//! Registration and packing: [`LayoutBuilder`] places tensors next-fit, in model order,
//! into the chunk lists (see the module doc of [`crate::layout`]), and the packing
//! counts [`crate::search`] sizes chunks with.

use std::collections::HashMap;

use super::{Layout, LayoutConfig, Placement, TensorSpec};
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::Result;

/// One tensor as seen by the packer: slots in Params, elements in trainable lists.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackItem {
    pub(crate) slots: u64,
    /// 0 for a frozen tensor.
    pub(crate) trainable_elements: u64,
    pub(crate) elements: u64,
}

impl PackItem {
    pub(crate) fn of(spec: &TensorSpec, config: &LayoutConfig) -> Result<PackItem> {
        let elements = spec.elements()?;
        let dtype = spec.param16_dtype(config.param16_dtype);
        let slots = elements
            .checked_mul(dtype.size_bytes() / ListKind::Params.slot_bytes())
            .ok_or_else(|| ChunkError::TensorOverflow {
                tensor: spec.name.clone(),
                shape: spec.shape.clone(),
            })?;
        Ok(PackItem {
            slots,
            trainable_elements: if spec.trainable { elements } else { 0 },
            elements,
        })
    }
}

/// Chunk counts of a packing: what the waste of a chunk size depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackCounts {
    /// Params chunks (= chunk indices).
    pub(crate) chunks: u64,
    /// Chunk indices holding at least one trainable tensor.
    pub(crate) trainable_chunks: u64,
}

/// Next-fit packing of `items` into chunks of `chunk_elements` slots, one open chunk
/// per stream ([`LayoutConfig::stream`]); the same rule as [`LayoutBuilder::register`].
/// Every item must fit (`slots <= chunk_elements`).
pub(crate) fn pack_counts(
    items: &[PackItem],
    chunk_elements: u64,
    config: &LayoutConfig,
) -> PackCounts {
    let mut counts = PackCounts {
        chunks: 0,
        trainable_chunks: 0,
    };
    // Per stream: the open chunk's fill (None before the stream's first tensor) and
    // whether it already holds a trainable tensor.
    let mut fill: [Option<u64>; 2] = [None, None];
    let mut has_trainable = [false; 2];
    for item in items {
        let trainable = item.trainable_elements > 0;
        let s = config.stream(trainable);
        match fill[s] {
            Some(f) if f + item.slots <= chunk_elements => fill[s] = Some(f + item.slots),
            _ => {
                counts.chunks += 1;
                fill[s] = Some(item.slots);
                has_trainable[s] = false;
            }
        }
        if trainable && !has_trainable[s] {
            counts.trainable_chunks += 1;
            has_trainable[s] = true;
        }
    }
    counts
}

/// The slot sizes of `items`, split into the streams packed next-fit independently
/// (one stream without separate packing): a chunk count changes only where the chunk
/// size crosses a sum of consecutive items of one stream.
pub(crate) fn pack_streams(items: &[PackItem], config: &LayoutConfig) -> Vec<Vec<u64>> {
    let mut streams = vec![Vec::new(), Vec::new()];
    for item in items {
        streams[config.stream(item.trainable_elements > 0)].push(item.slots);
    }
    streams.retain(|s| !s.is_empty());
    streams
}

/// Allocated and payload bytes over every list, for a packing.
pub(crate) fn allocated_bytes(
    counts: PackCounts,
    chunk_elements: u64,
    config: &LayoutConfig,
) -> u64 {
    counts.chunks * chunk_elements * ListKind::Params.slot_bytes()
        + counts.trainable_chunks * chunk_elements * config.trainable_state_bytes()
}

/// Registers tensors one by one, in model order: a [`Layout`] growing, and the open
/// chunk of each packing stream.
#[derive(Debug, Clone)]
pub struct LayoutBuilder {
    layout: Layout,
    /// The open chunk of each packing stream ([`LayoutConfig::stream`]).
    open: [Option<usize>; 2],
}

impl LayoutBuilder {
    /// A builder; fails when the configuration is unusable.
    pub fn new(config: LayoutConfig) -> Result<Self> {
        config.validate()?;
        Ok(LayoutBuilder {
            layout: Layout {
                config,
                specs: Vec::new(),
                by_name: HashMap::new(),
                places: Vec::new(),
                chunk_tensors: Vec::new(),
                chunk_trainable: Vec::new(),
                fill_slots: Vec::new(),
                fill_trainable: Vec::new(),
                fill_moments: Vec::new(),
            },
            open: [None, None],
        })
    }

    /// Places the next tensor in model order and returns its id.
    ///
    /// Errors (nothing is registered then): an empty or overflowing shape, a duplicate
    /// name, a tensor larger than a chunk, more chunks than a [`ChunkId`] can number.
    pub fn register(&mut self, spec: TensorSpec) -> Result<TensorId> {
        let item = PackItem::of(&spec, &self.layout.config)?;
        if self.layout.by_name.contains_key(&spec.name) {
            return Err(ChunkError::DuplicateTensor { tensor: spec.name });
        }
        let chunk_elements = self.layout.config.chunk_elements;
        if item.slots > chunk_elements {
            return Err(ChunkError::TensorTooLarge {
                tensor: spec.name,
                needed_elements: item.slots,
                chunk_elements,
            });
        }
        let id = TensorId(u32::try_from(self.layout.specs.len()).map_err(|_| {
            ChunkError::InvalidChunkSize {
                chunk_elements,
                reason: "more than u32::MAX tensors",
            }
        })?);
        let stream = self.layout.config.stream(spec.trainable);
        let at = match self.open[stream] {
            Some(open) if self.layout.fill_slots[open] + item.slots <= chunk_elements => open,
            _ => {
                let chunks = self.layout.fill_slots.len() as u64 + 1;
                if chunks > u64::from(ChunkId::INDEX_MAX) + 1 {
                    return Err(ChunkError::TooManyChunks {
                        chunks,
                        limit: u64::from(ChunkId::INDEX_MAX) + 1,
                    });
                }
                self.layout.fill_slots.push(0);
                self.layout.fill_trainable.push(0);
                self.layout.fill_moments.push(0);
                self.layout.chunk_tensors.push(Vec::new());
                self.layout.chunk_trainable.push(Vec::new());
                let opened = self.layout.fill_slots.len() - 1;
                self.open[stream] = Some(opened);
                opened
            }
        };
        // `at` < INDEX_MAX + 1 <= u32::MAX, checked when the chunk was opened.
        let index = at as u32;
        let offset_slots = self.layout.fill_slots[at];
        self.layout.fill_slots[at] += item.slots;
        self.layout.chunk_tensors[at].push(id);
        let (trainable_offset, moment_offset) = if spec.trainable {
            let off = self.layout.fill_trainable[at];
            let moff = self.layout.fill_moments[at];
            self.layout.fill_trainable[at] += item.trainable_elements;
            self.layout.fill_moments[at] += self.layout.config.moments.place_slots(item.elements);
            self.layout.chunk_trainable[at].push(id);
            (Some(off), Some(moff))
        } else {
            (None, None)
        };
        self.layout.places.push(Placement {
            index,
            offset_slots,
            elements: item.elements,
            param16_dtype: spec.param16_dtype(self.layout.config.param16_dtype),
            trainable_offset,
            moment_offset,
        });
        self.layout.by_name.insert(spec.name.clone(), id);
        self.layout.specs.push(spec);
        Ok(id)
    }

    /// Tensors registered so far.
    pub fn len(&self) -> usize {
        self.layout.specs.len()
    }

    /// Whether nothing is registered yet.
    pub fn is_empty(&self) -> bool {
        self.layout.specs.is_empty()
    }

    /// The finished layout.
    pub fn finish(self) -> Layout {
        self.layout
    }
}
