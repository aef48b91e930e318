//! Registration of tensors, in model (forward) order, into chunk lists.
//!
//! PatrickStar's layout: one chunk size `C`, counted in **element slots** and shared by
//! every list, and one packing decision made on the [`ListKind::Param16`] list that all
//! other lists mirror. So chunk `i` of every list holds the same tensors (the trainable
//! ones among them, for the trainable-only lists), and the optimizer updates group `i`
//! (grads `i`, master `i`, M `i`, V `i`) together.
//!
//! Lists and what they hold:
//! - `Param16`: every tensor, in 2-byte slots. 16-bit tensors keep their dtype. A
//!   trainable fp32 tensor gets a 16-bit compute copy there (dtype
//!   [`LayoutConfig::param16_dtype`]); its fp32 values live in `MasterF32`. A **frozen
//!   fp32 tensor stays fp32** (it has no master copy, so casting it would silently
//!   change its bytes) and takes two slots per element.
//! - `MasterF32`: trainable tensors only, fp32.
//! - `MomentumF32`, `VarianceF32` (M, V): trainable tensors only, in the form of
//!   [`LayoutConfig::moments`] (fp32 by default, whence the names; bf16 or block-wise
//!   int8, see [`crate::moments`]), with that form's slot size (4, 2 or 1 bytes). Their
//!   offsets count the moment slots of the trainable tensors before them in the chunk,
//!   so compact chunks are dense too, and their chunks are as small as their bytes.
//! - `GradF16`: trainable tensors only, in their Param16 dtype, and only when gradient
//!   accumulation is on. Otherwise a gradient reuses its tensor's Param16 space once
//!   the layer's backward is done ([`Layout::grad_location`] returns that space).
//!
//! Packing is next-fit in registration order: a tensor goes after the previous one in
//! its open chunk if it fits, else it closes that chunk and opens a new one, which takes
//! the next chunk index. A tensor is never split; one larger than a chunk is an error
//! naming it ([`crate::search`] only proposes sizes at least as large as the largest
//! tensor).
//!
//! **Frozen and trainable tensors are packed apart** (by default;
//! [`LayoutConfig::separate_frozen`]): two chunks are open at a time, one receiving the
//! frozen tensors and one receiving the trainable ones, each filled next-fit in model
//! order. A Param16 chunk then holds only frozen or only trainable tensors, so only the
//! groups made of trainable tensors get master, M, V (and grad) chunks, and those are
//! as full as their Param16 chunk. Without it, a LoRA model (a frozen base with small
//! trainable adapters interleaved in model order) would put an adapter in nearly every
//! group and allocate full-size fp32 chunks for each: LLaMA-70B with rank-16 adapters
//! would get ~78 GiB each of master, M and V for 32.8M trainable parameters. When
//! every tensor is trainable, or every one frozen, only one chunk is ever open and the
//! packing is the same either way. With the flag off, all tensors share one open chunk
//! (plain next-fit, PatrickStar's mirroring), and a group's trainable lists exist as
//! soon as it holds one trainable tensor.
//!
//! With separate packing, chunk indices follow the order in which chunks are opened, so
//! a tensor's chunk index is non-decreasing in model order among the tensors of its own
//! kind (frozen or trainable) but not across kinds: a LoRA layer's base weights and its
//! adapters sit in different chunks.
//!
//! In a trainable-only list, a tensor's offset counts only the trainable tensors before
//! it in the same chunk, so those chunks are dense too. A chunk of a trainable-only list
//! exists only when its group holds at least one trainable tensor (a frozen group has
//! no master, M or V chunk).
//!
//! Invariants (checked by `tests/layout_props.rs`): every tensor is placed exactly once
//! per list it belongs to; placements in one chunk do not overlap and end within `C`;
//! a tensor has the same chunk index in every list; frozen tensors are only in Param16;
//! with separate packing, no Param16 chunk holds both frozen and trainable tensors.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::moments::MomentStates;
use crate::Result;

/// What a chunk's allocated and moved bytes are rounded up to (a page: O_DIRECT I/O and
/// the tiers' budgets count in pages).
pub const CHUNK_ALIGN_BYTES: u64 = 4096;

/// A tensor as the model declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// A unique name (e.g. `layers.3.mlp.up.weight`).
    pub name: String,
    /// Its shape; the element count is the product (a scalar has shape `[]`).
    pub shape: Vec<usize>,
    /// Its dtype as loaded.
    pub dtype: DType,
    /// Whether the optimizer updates it; frozen tensors get no grad, master, M or V.
    pub trainable: bool,
}

impl TensorSpec {
    /// A tensor spec.
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType, trainable: bool) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
            trainable,
        }
    }

    /// The element count, or an error when it is zero or overflows.
    pub fn elements(&self) -> Result<u64> {
        let mut n: u64 = 1;
        for &d in &self.shape {
            n = n
                .checked_mul(d as u64)
                .ok_or_else(|| ChunkError::TensorOverflow {
                    tensor: self.name.clone(),
                    shape: self.shape.clone(),
                })?;
        }
        if n == 0 {
            return Err(ChunkError::EmptyTensor {
                tensor: self.name.clone(),
                shape: self.shape.clone(),
            });
        }
        Ok(n)
    }

    /// The dtype this tensor has in the Param16 list (see the module doc).
    pub fn param16_dtype(&self, param16_dtype: DType) -> DType {
        match (self.dtype, self.trainable) {
            (DType::F32, true) => param16_dtype,
            (d, _) => d,
        }
    }
}

/// How tensors are packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutConfig {
    /// Chunk size in element slots, shared by all lists (bytes = slots x slot size).
    pub chunk_elements: u64,
    /// Whether gradients get their own `GradF16` list (gradient accumulation).
    pub grad_accumulation: bool,
    /// The 16-bit dtype of the compute copy of trainable fp32 tensors.
    pub param16_dtype: DType,
    /// Whether frozen and trainable tensors are packed into separate chunks (two open
    /// chunks during packing; see the module doc). On by default: only groups of
    /// trainable tensors then get master, M and V chunks. Off, every tensor shares one
    /// open chunk and any group holding a trainable tensor gets full-size optimizer
    /// chunks (PatrickStar's plain mirroring; it keeps a LoRA layer's base weights and
    /// adapters in the same chunk, at the cost of mostly empty fp32 chunks). Layouts
    /// where every tensor is trainable, or every one frozen, are the same either way.
    pub separate_frozen: bool,
    /// The stored form of the M and V lists (`optimizer.states`); fp32 by default.
    pub moments: MomentStates,
}

impl LayoutConfig {
    /// `chunk_elements` slots per chunk, no gradient accumulation, bf16 compute copies,
    /// frozen and trainable tensors in separate chunks.
    pub fn new(chunk_elements: u64) -> Self {
        LayoutConfig {
            chunk_elements,
            grad_accumulation: false,
            param16_dtype: DType::BF16,
            separate_frozen: true,
            moments: MomentStates::F32,
        }
    }

    /// With the M and V lists stored as `moments`.
    pub fn with_moments(mut self, moments: MomentStates) -> Self {
        self.moments = moments;
        self
    }

    /// Bytes per slot of `list` under this configuration (the moment lists' depends on
    /// [`LayoutConfig::moments`]).
    pub fn slot_bytes(&self, list: ListKind) -> u64 {
        match list {
            ListKind::MomentumF32 | ListKind::VarianceF32 => self.moments.slot_bytes(),
            l => l.slot_bytes(),
        }
    }

    /// With or without a separate gradient list.
    pub fn with_grad_accumulation(mut self, on: bool) -> Self {
        self.grad_accumulation = on;
        self
    }

    /// With another 16-bit dtype for compute copies of trainable fp32 tensors.
    pub fn with_param16_dtype(mut self, dtype: DType) -> Self {
        self.param16_dtype = dtype;
        self
    }

    /// With frozen and trainable tensors packed into separate chunks (`true`, the
    /// default) or sharing chunks (`false`); see [`LayoutConfig::separate_frozen`].
    pub fn with_separate_frozen(mut self, on: bool) -> Self {
        self.separate_frozen = on;
        self
    }

    /// The packing stream a tensor goes to: its own open chunk. 0 for every tensor
    /// without separate packing; else 0 for frozen and 1 for trainable tensors.
    pub(crate) fn stream(&self, trainable: bool) -> usize {
        usize::from(self.separate_frozen && trainable)
    }

    fn validate(&self) -> Result<()> {
        if !self.param16_dtype.is_16bit() {
            return Err(ChunkError::NotSixteenBit {
                dtype: self.param16_dtype,
            });
        }
        if self.chunk_elements == 0 {
            return Err(ChunkError::InvalidChunkSize {
                chunk_elements: 0,
                reason: "a chunk must hold at least one element",
            });
        }
        if self.chunk_elements.checked_mul(4).is_none() {
            return Err(ChunkError::InvalidChunkSize {
                chunk_elements: self.chunk_elements,
                reason: "the chunk's byte size overflows u64",
            });
        }
        Ok(())
    }

    /// Bytes per element of the optimizer-state lists of one trainable element
    /// (master + M + V, plus a 16-bit gradient with accumulation).
    pub(crate) fn trainable_state_bytes(&self) -> u64 {
        self.trainable_lists().map(|l| self.slot_bytes(l)).sum()
    }

    /// The trainable-only lists that exist under this configuration.
    pub(crate) fn trainable_lists(&self) -> impl Iterator<Item = ListKind> {
        let acc = self.grad_accumulation;
        ListKind::ALL
            .into_iter()
            .filter(move |l| l.trainable_only() && (acc || *l != ListKind::GradF16))
    }
}

/// Where one tensor lives in one list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorLocation {
    /// Its chunk.
    pub chunk: ChunkId,
    /// Offset in the chunk, in the list's element slots.
    pub offset_elements: u64,
    /// The tensor's element count.
    pub elements: u64,
    /// The tensor's dtype in this list.
    pub dtype: DType,
    /// Bytes per slot of this list (see [`LayoutConfig::slot_bytes`]).
    pub slot_bytes: u64,
}

impl TensorLocation {
    /// Slots occupied (elements x dtype size / slot size; 2 per element for a frozen
    /// fp32 tensor in Param16, otherwise equal to `elements`).
    pub fn slots(&self) -> u64 {
        self.bytes().div_ceil(self.slot_bytes)
    }

    /// The slot just past the tensor.
    pub fn end_elements(&self) -> u64 {
        self.offset_elements + self.slots()
    }

    /// Offset in the chunk, in bytes.
    pub fn offset_bytes(&self) -> u64 {
        self.offset_elements * self.slot_bytes
    }

    /// The tensor's size in bytes in this list (for a [`DType::Q8`] moment: codes,
    /// padding and absmax; without the padding to the next place).
    pub fn bytes(&self) -> u64 {
        self.dtype.place_bytes(self.elements)
    }
}

/// One tensor as seen by the packer: slots in Param16, elements in trainable lists.
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
            .checked_mul(dtype.size_bytes() / ListKind::Param16.slot_bytes())
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
    /// Param16 chunks (= chunk indices).
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
    counts.chunks * chunk_elements * ListKind::Param16.slot_bytes()
        + counts.trainable_chunks * chunk_elements * config.trainable_state_bytes()
}

#[derive(Debug, Clone, Copy)]
struct Placement {
    index: u32,
    offset_slots: u64,
    elements: u64,
    param16_dtype: DType,
    /// Offset within the chunk's trainable tensors; `None` for a frozen tensor.
    trainable_offset: Option<u64>,
    /// Offset in the chunk's M and V lists, in their slots; `None` for a frozen tensor.
    moment_offset: Option<u64>,
}

/// Registers tensors one by one, in model order.
#[derive(Debug, Clone)]
pub struct LayoutBuilder {
    config: LayoutConfig,
    specs: Vec<TensorSpec>,
    by_name: HashMap<String, TensorId>,
    places: Vec<Placement>,
    chunk_tensors: Vec<Vec<TensorId>>,
    chunk_trainable: Vec<Vec<TensorId>>,
    fill_slots: Vec<u64>,
    fill_trainable: Vec<u64>,
    fill_moments: Vec<u64>,
    /// The open chunk of each packing stream ([`LayoutConfig::stream`]).
    open: [Option<usize>; 2],
}

impl LayoutBuilder {
    /// A builder; fails when the configuration is unusable.
    pub fn new(config: LayoutConfig) -> Result<Self> {
        config.validate()?;
        Ok(LayoutBuilder {
            config,
            specs: Vec::new(),
            by_name: HashMap::new(),
            places: Vec::new(),
            chunk_tensors: Vec::new(),
            chunk_trainable: Vec::new(),
            fill_slots: Vec::new(),
            fill_trainable: Vec::new(),
            fill_moments: Vec::new(),
            open: [None, None],
        })
    }

    /// Places the next tensor in model order and returns its id.
    ///
    /// Errors (nothing is registered then): an empty or overflowing shape, a duplicate
    /// name, a tensor larger than a chunk, more chunks than a [`ChunkId`] can number.
    pub fn register(&mut self, spec: TensorSpec) -> Result<TensorId> {
        let item = PackItem::of(&spec, &self.config)?;
        if self.by_name.contains_key(&spec.name) {
            return Err(ChunkError::DuplicateTensor { tensor: spec.name });
        }
        let chunk_elements = self.config.chunk_elements;
        if item.slots > chunk_elements {
            return Err(ChunkError::TensorTooLarge {
                tensor: spec.name,
                needed_elements: item.slots,
                chunk_elements,
            });
        }
        let id = TensorId(u32::try_from(self.specs.len()).map_err(|_| {
            ChunkError::InvalidChunkSize {
                chunk_elements,
                reason: "more than u32::MAX tensors",
            }
        })?);
        let stream = self.config.stream(spec.trainable);
        let at = match self.open[stream] {
            Some(open) if self.fill_slots[open] + item.slots <= chunk_elements => open,
            _ => {
                let chunks = self.fill_slots.len() as u64 + 1;
                if chunks > u64::from(ChunkId::INDEX_MAX) + 1 {
                    return Err(ChunkError::TooManyChunks {
                        chunks,
                        limit: u64::from(ChunkId::INDEX_MAX) + 1,
                    });
                }
                self.fill_slots.push(0);
                self.fill_trainable.push(0);
                self.fill_moments.push(0);
                self.chunk_tensors.push(Vec::new());
                self.chunk_trainable.push(Vec::new());
                let opened = self.fill_slots.len() - 1;
                self.open[stream] = Some(opened);
                opened
            }
        };
        // `at` < INDEX_MAX + 1 <= u32::MAX, checked when the chunk was opened.
        let index = at as u32;
        let offset_slots = self.fill_slots[at];
        self.fill_slots[at] += item.slots;
        self.chunk_tensors[at].push(id);
        let (trainable_offset, moment_offset) = if spec.trainable {
            let off = self.fill_trainable[at];
            let moff = self.fill_moments[at];
            self.fill_trainable[at] += item.trainable_elements;
            self.fill_moments[at] += self.config.moments.place_slots(item.elements);
            self.chunk_trainable[at].push(id);
            (Some(off), Some(moff))
        } else {
            (None, None)
        };
        self.places.push(Placement {
            index,
            offset_slots,
            elements: item.elements,
            param16_dtype: spec.param16_dtype(self.config.param16_dtype),
            trainable_offset,
            moment_offset,
        });
        self.by_name.insert(spec.name.clone(), id);
        self.specs.push(spec);
        Ok(id)
    }

    /// Tensors registered so far.
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Whether nothing is registered yet.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// The finished layout.
    pub fn finish(self) -> Layout {
        Layout {
            config: self.config,
            specs: self.specs,
            by_name: self.by_name,
            places: self.places,
            chunk_tensors: self.chunk_tensors,
            chunk_trainable: self.chunk_trainable,
            fill_slots: self.fill_slots,
            fill_trainable: self.fill_trainable,
            fill_moments: self.fill_moments,
        }
    }
}

/// Tensors placed in chunk lists; immutable once built.
#[derive(Debug, Clone)]
pub struct Layout {
    config: LayoutConfig,
    specs: Vec<TensorSpec>,
    by_name: HashMap<String, TensorId>,
    places: Vec<Placement>,
    chunk_tensors: Vec<Vec<TensorId>>,
    chunk_trainable: Vec<Vec<TensorId>>,
    fill_slots: Vec<u64>,
    fill_trainable: Vec<u64>,
    fill_moments: Vec<u64>,
}

impl Layout {
    /// Registers `specs` in order and finishes the layout.
    pub fn new(config: LayoutConfig, specs: impl IntoIterator<Item = TensorSpec>) -> Result<Self> {
        let mut b = LayoutBuilder::new(config)?;
        for s in specs {
            b.register(s)?;
        }
        Ok(b.finish())
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }

    /// The chunk size in element slots.
    pub fn chunk_elements(&self) -> u64 {
        self.config.chunk_elements
    }

    /// Registered tensors, in order (indexed by [`TensorId`]).
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// One tensor's spec.
    pub fn tensor(&self, id: TensorId) -> Option<&TensorSpec> {
        self.specs.get(id.index())
    }

    /// The id of the tensor called `name`.
    pub fn tensor_id(&self, name: &str) -> Option<TensorId> {
        self.by_name.get(name).copied()
    }

    /// The lists that hold at least one chunk, in [`ListKind::ALL`] order.
    pub fn lists(&self) -> Vec<ListKind> {
        ListKind::ALL
            .into_iter()
            .filter(|&l| self.list_chunk_count(l) > 0)
            .collect()
    }

    /// Chunk indices (= Param16 chunks); every list's indices are below this.
    pub fn chunks_per_list(&self) -> u32 {
        // Bounded by ChunkId::INDEX_MAX + 1 at registration.
        self.fill_slots.len() as u32
    }

    /// The length of a dense per-chunk array indexed by [`ChunkId::dense`].
    pub fn dense_len(&self) -> usize {
        self.fill_slots.len() * ListKind::COUNT as usize
    }

    /// Whether `chunk` exists in this layout.
    pub fn chunk_exists(&self, chunk: ChunkId) -> bool {
        let i = chunk.index() as usize;
        if i >= self.fill_slots.len() {
            return false;
        }
        match chunk.list() {
            ListKind::Param16 => true,
            ListKind::GradF16 if !self.config.grad_accumulation => false,
            _ => !self.chunk_trainable[i].is_empty(),
        }
    }

    /// The chunks of `list`, in index order.
    pub fn chunks(&self, list: ListKind) -> impl Iterator<Item = ChunkId> + '_ {
        (0..self.chunks_per_list())
            .map(move |i| ChunkId::new(list, i))
            .filter(move |&c| self.chunk_exists(c))
    }

    /// The tensors of `chunk` in order (empty for a chunk that does not exist).
    pub fn chunk_tensors(&self, chunk: ChunkId) -> &[TensorId] {
        if !self.chunk_exists(chunk) {
            return &[];
        }
        let i = chunk.index() as usize;
        match chunk.list() {
            ListKind::Param16 => &self.chunk_tensors[i],
            _ => &self.chunk_trainable[i],
        }
    }

    /// Where tensor `id` lives in `list`; `None` for an unknown id, a frozen tensor in
    /// a trainable-only list, or `GradF16` without gradient accumulation.
    pub fn location(&self, id: TensorId, list: ListKind) -> Option<TensorLocation> {
        let p = self.places.get(id.index())?;
        let (offset_elements, dtype) = match list {
            ListKind::Param16 => (p.offset_slots, p.param16_dtype),
            ListKind::GradF16 if !self.config.grad_accumulation => return None,
            ListKind::GradF16 => (p.trainable_offset?, p.param16_dtype),
            ListKind::MasterF32 => (p.trainable_offset?, DType::F32),
            ListKind::MomentumF32 | ListKind::VarianceF32 => {
                (p.moment_offset?, self.config.moments.dtype_for(p.elements))
            }
        };
        Some(TensorLocation {
            chunk: ChunkId::new(list, p.index),
            offset_elements,
            elements: p.elements,
            dtype,
            slot_bytes: self.config.slot_bytes(list),
        })
    }

    /// Where tensor `id`'s gradient lives: its `GradF16` place with gradient
    /// accumulation, else its own Param16 space (reused once its layer's backward is
    /// done). `None` for a frozen tensor.
    pub fn grad_location(&self, id: TensorId) -> Option<TensorLocation> {
        let p = self.places.get(id.index())?;
        p.trainable_offset?;
        if self.config.grad_accumulation {
            self.location(id, ListKind::GradF16)
        } else {
            self.location(id, ListKind::Param16)
        }
    }

    /// Bytes of one chunk of `list`.
    ///
    /// An int8 moment list's chunk is as large as its fullest chunk needs (codes, absmax
    /// and the fp32 places of small tensors), page-rounded, and at least the chunk
    /// size's codes and absmax.
    pub fn chunk_bytes(&self, list: ListKind) -> u64 {
        let c = self.config.chunk_elements;
        match list {
            ListKind::MomentumF32 | ListKind::VarianceF32
                if self.config.moments == MomentStates::Int8 =>
            {
                let fullest = self.fill_moments.iter().copied().max().unwrap_or(0);
                fullest
                    .max(DType::Q8.place_bytes(c))
                    .next_multiple_of(CHUNK_ALIGN_BYTES)
            }
            l => c * self.config.slot_bytes(l),
        }
    }

    /// Bytes of `chunk` occupied by tensors (0 for a chunk that does not exist).
    pub fn chunk_used_bytes(&self, chunk: ChunkId) -> u64 {
        if !self.chunk_exists(chunk) {
            return 0;
        }
        let i = chunk.index() as usize;
        match chunk.list() {
            ListKind::Param16 => self.fill_slots[i] * ListKind::Param16.slot_bytes(),
            l @ (ListKind::MomentumF32 | ListKind::VarianceF32) => {
                self.fill_moments[i] * self.config.slot_bytes(l)
            }
            l => self.fill_trainable[i] * l.slot_bytes(),
        }
    }

    /// Number of chunks of `list`.
    pub fn list_chunk_count(&self, list: ListKind) -> u64 {
        match list {
            ListKind::Param16 => self.fill_slots.len() as u64,
            ListKind::GradF16 if !self.config.grad_accumulation => 0,
            _ => self
                .chunk_trainable
                .iter()
                .filter(|t| !t.is_empty())
                .count() as u64,
        }
    }

    /// Bytes allocated for `list` (its chunks x chunk size).
    pub fn list_bytes(&self, list: ListKind) -> u64 {
        self.list_chunk_count(list) * self.chunk_bytes(list)
    }

    /// Bytes the store allocates and moves for `list`: the sum of its chunks'
    /// [`Layout::dense_chunk_bytes`] (used prefixes, page-rounded).
    pub fn list_stored_bytes(&self, list: ListKind) -> u64 {
        self.chunks(list).map(|c| self.chunk_stored_bytes(c)).sum()
    }

    /// Bytes of `list` occupied by tensors.
    pub fn list_payload_bytes(&self, list: ListKind) -> u64 {
        self.chunks(list).map(|c| self.chunk_used_bytes(c)).sum()
    }

    /// Bytes allocated over every list.
    pub fn total_bytes(&self) -> u64 {
        ListKind::ALL.into_iter().map(|l| self.list_bytes(l)).sum()
    }

    /// Bytes occupied by tensors over every list.
    pub fn payload_bytes(&self) -> u64 {
        ListKind::ALL
            .into_iter()
            .map(|l| self.list_payload_bytes(l))
            .sum()
    }

    /// Allocated bytes not occupied by any tensor.
    pub fn waste_bytes(&self) -> u64 {
        self.total_bytes() - self.payload_bytes()
    }

    /// [`Layout::waste_bytes`] as a fraction of [`Layout::total_bytes`] (0 when empty).
    pub fn waste_fraction(&self) -> f64 {
        let total = self.total_bytes();
        if total == 0 {
            0.0
        } else {
            self.waste_bytes() as f64 / total as f64
        }
    }

    /// Bytes the store allocates and moves for each dense chunk id, every list (0 for
    /// ids of chunks that do not exist); the `chunk_bytes` of an [`crate::AccessTrace`].
    ///
    /// Tensors pack from a chunk's start, so what they occupy is a prefix: a chunk is
    /// that prefix rounded up to [`CHUNK_ALIGN_BYTES`] (never past [`Layout::chunk_bytes`]).
    /// The unused tail of a partly filled chunk — a list's last chunk, or the master, M
    /// and V chunks of a few LoRA adapters — is never allocated on the device, copied
    /// or written to NVMe.
    pub fn dense_chunk_bytes(&self) -> Vec<u64> {
        let mut v = vec![0; self.dense_len()];
        for list in ListKind::ALL {
            for c in self.chunks(list) {
                v[c.dense()] = self.chunk_stored_bytes(c);
            }
        }
        v
    }

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
        if c.moments != MomentStates::F32 {
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

    /// Bytes the store allocates and moves for `chunk` (see
    /// [`Layout::dense_chunk_bytes`]); 0 for a chunk that does not exist.
    pub fn chunk_stored_bytes(&self, chunk: ChunkId) -> u64 {
        self.chunk_used_bytes(chunk)
            .next_multiple_of(CHUNK_ALIGN_BYTES)
            .min(self.chunk_bytes(chunk.list()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The failure: a fingerprint that misses a change of where bytes are (so another
    /// model's chunks are adopted), or one that moves between builds (so a clean file
    /// is refused after an upgrade that changed nothing).
    #[test]
    fn the_fingerprint_sees_every_change_of_place_and_is_stable() {
        let base = |chunk: u64, name: &str, n: usize, dtype: DType, trainable: bool| {
            Layout::new(
                LayoutConfig::new(chunk),
                [
                    TensorSpec::new("a", &[64, 32], DType::F32, true),
                    TensorSpec::new(name, &[n], dtype, trainable),
                ],
            )
            .unwrap()
            .fingerprint()
        };
        let fp = base(4096, "b", 100, DType::F16, true);
        assert_eq!(fp, base(4096, "b", 100, DType::F16, true));
        for (what, other) in [
            ("chunk size", base(8192, "b", 100, DType::F16, true)),
            ("name", base(4096, "c", 100, DType::F16, true)),
            ("shape", base(4096, "b", 101, DType::F16, true)),
            ("dtype", base(4096, "b", 100, DType::BF16, true)),
            ("trainable", base(4096, "b", 100, DType::F16, false)),
        ] {
            assert_ne!(fp, other, "a change of {what} kept the fingerprint");
        }
        let accum = Layout::new(
            LayoutConfig::new(4096).with_grad_accumulation(true),
            [
                TensorSpec::new("a", &[64, 32], DType::F32, true),
                TensorSpec::new("b", &[100], DType::F16, true),
            ],
        )
        .unwrap();
        assert_ne!(fp, accum.fingerprint(), "gradient accumulation");
        // Pinned: the same layout hashes the same in every build.
        assert_eq!(fp, GOLDEN_FINGERPRINT, "{fp:#018x}");
    }

    const GOLDEN_FINGERPRINT: u64 = 0xdab0_3e0b_f036_ab3e;

    fn t(name: &str, n: usize, dtype: DType, trainable: bool) -> TensorSpec {
        TensorSpec::new(name, &[n], dtype, trainable)
    }

    #[test]
    fn next_fit_and_mirrored_lists() {
        // Shared packing: frozen and trainable tensors in the same open chunk.
        let layout = Layout::new(
            LayoutConfig::new(100).with_separate_frozen(false),
            [
                t("a", 60, DType::F16, true),
                t("b", 30, DType::F16, false),
                t("c", 20, DType::F16, true), // does not fit 90 + 20 -> chunk 1
                t("d", 80, DType::F16, true),
            ],
        )
        .unwrap();
        assert_eq!(layout.chunks_per_list(), 2);
        let c = layout.location(TensorId(2), ListKind::Param16).unwrap();
        assert_eq!((c.chunk.index(), c.offset_elements), (1, 0));
        let d = layout.location(TensorId(3), ListKind::MasterF32).unwrap();
        assert_eq!((d.chunk.index(), d.offset_elements), (1, 20));
        assert_eq!(d.offset_bytes(), 80);
        assert!(layout.location(TensorId(1), ListKind::MasterF32).is_none());
        assert_eq!(
            layout.chunk_tensors(ChunkId::new(ListKind::MasterF32, 0)),
            &[TensorId(0)]
        );
        // No accumulation: the grad reuses the param space.
        assert_eq!(
            layout.grad_location(TensorId(0)),
            layout.location(TensorId(0), ListKind::Param16)
        );
        assert!(layout.grad_location(TensorId(1)).is_none());
        assert_eq!(layout.list_chunk_count(ListKind::GradF16), 0);
        // Bytes: 2 param chunks of 200 B, 2 x 3 fp32 chunks of 400 B.
        assert_eq!(layout.total_bytes(), 2 * 200 + 6 * 400);
        let payload = (60 + 30 + 20 + 80) * 2 + (60 + 20 + 80) * 12;
        assert_eq!(layout.payload_bytes(), payload);
        assert_eq!(layout.waste_bytes(), 2800 - payload);
    }

    #[test]
    fn frozen_f32_stays_f32_in_two_slots_and_trainable_f32_is_cast() {
        let layout = Layout::new(
            LayoutConfig::new(64).with_param16_dtype(DType::F16),
            [
                t("norm", 10, DType::F32, false),
                t("w", 10, DType::F32, true),
            ],
        )
        .unwrap();
        let norm = layout.location(TensorId(0), ListKind::Param16).unwrap();
        assert_eq!(
            (norm.dtype, norm.slots(), norm.bytes()),
            (DType::F32, 20, 40)
        );
        // Packed apart from the frozen norm: its own chunk.
        let w = layout.location(TensorId(1), ListKind::Param16).unwrap();
        assert_eq!(
            (w.chunk.index(), w.dtype, w.offset_elements, w.slots()),
            (1, DType::F16, 0, 10)
        );
        let m = layout.location(TensorId(1), ListKind::MasterF32).unwrap();
        assert_eq!((m.dtype, m.offset_elements), (DType::F32, 0));
        // Shared packing: after the norm's 20 slots.
        let shared = Layout::new(
            layout.config().with_separate_frozen(false),
            layout.tensors().to_vec(),
        )
        .unwrap();
        let w = shared.location(TensorId(1), ListKind::Param16).unwrap();
        assert_eq!((w.chunk.index(), w.offset_elements), (0, 20));
        let m = shared.location(TensorId(1), ListKind::MasterF32).unwrap();
        assert_eq!((m.chunk.index(), m.offset_elements), (0, 0));
    }

    #[test]
    fn grad_accumulation_adds_a_list() {
        let layout = Layout::new(
            LayoutConfig::new(64).with_grad_accumulation(true),
            [
                t("a", 10, DType::BF16, false),
                t("b", 10, DType::BF16, true),
            ],
        )
        .unwrap();
        let g = layout.grad_location(TensorId(1)).unwrap();
        assert_eq!(g.chunk.list(), ListKind::GradF16);
        assert_eq!((g.offset_elements, g.dtype), (0, DType::BF16));
        assert_eq!(layout.lists().len(), 5);
    }

    #[test]
    fn lora_base_chunks_have_no_optimizer_chunks() {
        let mut specs: Vec<_> = (0..4)
            .map(|i| t(&format!("base{i}"), 50, DType::BF16, false))
            .collect();
        specs.push(t("lora_a", 8, DType::BF16, true));
        let layout = Layout::new(LayoutConfig::new(100), specs).unwrap();
        assert_eq!(layout.list_chunk_count(ListKind::Param16), 3);
        assert_eq!(layout.list_chunk_count(ListKind::MasterF32), 1);
        assert!(!layout.chunk_exists(ChunkId::new(ListKind::VarianceF32, 0)));
        assert!(layout.chunk_exists(ChunkId::new(ListKind::VarianceF32, 2)));
    }

    #[test]
    fn errors_name_the_tensor() {
        let mut b = LayoutBuilder::new(LayoutConfig::new(16)).unwrap();
        b.register(t("ok", 16, DType::F16, true)).unwrap();
        let e = b.register(t("big", 17, DType::F16, true)).unwrap_err();
        assert!(
            matches!(&e, ChunkError::TensorTooLarge { tensor, needed_elements: 17, .. } if tensor == "big")
        );
        let e = b.register(t("f32big", 9, DType::F32, false)).unwrap_err();
        assert!(matches!(
            &e,
            ChunkError::TensorTooLarge {
                needed_elements: 18,
                ..
            }
        ));
        let e = b.register(t("ok", 1, DType::F16, true)).unwrap_err();
        assert!(matches!(&e, ChunkError::DuplicateTensor { tensor } if tensor == "ok"));
        let e = b
            .register(TensorSpec::new("empty", &[3, 0], DType::F16, true))
            .unwrap_err();
        assert!(e.to_string().contains("empty"));
        assert_eq!(b.len(), 1);
        assert!(LayoutBuilder::new(LayoutConfig::new(16).with_param16_dtype(DType::F32)).is_err());
        assert!(LayoutBuilder::new(LayoutConfig::new(0)).is_err());
    }

    #[test]
    fn frozen_and_trainable_packed_apart() {
        // The same tensors as above, packed apart (the default): a and c share the
        // trainable chunk 0, b opens the frozen chunk 1, d opens trainable chunk 2.
        let layout = Layout::new(
            LayoutConfig::new(100),
            [
                t("a", 60, DType::F16, true),
                t("b", 30, DType::F16, false),
                t("c", 20, DType::F16, true),
                t("d", 80, DType::F16, true),
            ],
        )
        .unwrap();
        assert_eq!(layout.chunks_per_list(), 3);
        let at = |i: u32| {
            let l = layout.location(TensorId(i), ListKind::Param16).unwrap();
            (l.chunk.index(), l.offset_elements)
        };
        assert_eq!(
            [at(0), at(1), at(2), at(3)],
            [(0, 0), (1, 0), (0, 60), (2, 0)]
        );
        let c = layout.location(TensorId(2), ListKind::MasterF32).unwrap();
        assert_eq!((c.chunk.index(), c.offset_elements), (0, 60));
        assert!(!layout.chunk_exists(ChunkId::new(ListKind::MasterF32, 1)));
        assert_eq!(layout.list_chunk_count(ListKind::MasterF32), 2);
        assert_eq!(
            layout.chunk_tensors(ChunkId::new(ListKind::MomentumF32, 0)),
            &[TensorId(0), TensorId(2)]
        );
        assert_eq!(
            layout.grad_location(TensorId(2)),
            layout.location(TensorId(2), ListKind::Param16)
        );
        // Bytes: 3 param chunks of 200 B, 2 x 3 fp32 chunks of 400 B.
        assert_eq!(layout.total_bytes(), 3 * 200 + 6 * 400);
    }

    #[test]
    fn chunks_are_allocated_and_moved_as_their_used_prefix() {
        // 16Ki-element chunks: a 64 KiB master chunk holding one 1000-element adapter
        // is one page, a full 16-bit chunk stays whole, a list's last chunk is cut.
        let specs = vec![
            t("base0", 16 * 1024, DType::BF16, false),
            t("base1", 5000, DType::BF16, false),
            t("lora", 1000, DType::BF16, true),
        ];
        let layout = Layout::new(LayoutConfig::new(16 * 1024), specs).unwrap();
        let dense = layout.dense_chunk_bytes();
        let size = |c: ChunkId| dense[c.dense()];
        let p16: Vec<ChunkId> = layout.chunks(ListKind::Param16).collect();
        assert_eq!(size(p16[0]), 32 * 1024, "a full chunk is whole");
        assert_eq!(size(p16[1]), 12 * 1024, "10000 B used, rounded to pages");
        assert_eq!(size(p16[2]), 4096, "2000 B of adapter");
        for list in [
            ListKind::MasterF32,
            ListKind::MomentumF32,
            ListKind::VarianceF32,
        ] {
            let c = layout.chunks(list).next().unwrap();
            assert_eq!(layout.chunk_bytes(list), 64 * 1024);
            assert_eq!(size(c), 4096, "{list:?}: 4000 B of fp32 state");
        }
        // A chunk size that is not a page multiple never rounds past the chunk.
        let odd = Layout::new(
            LayoutConfig::new(1001),
            vec![t("a", 1000, DType::BF16, true)],
        )
        .unwrap();
        let c = odd.chunks(ListKind::MasterF32).next().unwrap();
        assert_eq!(odd.dense_chunk_bytes()[c.dense()], 4004);
    }

    #[test]
    fn lora_adapters_get_full_optimizer_chunks() {
        // A frozen base of 8 x 50 with a trainable adapter of 10 after every base
        // tensor. Shared packing puts an adapter in every group: 5 groups with fp32
        // chunks. Apart, the 80 adapter elements fill one trainable chunk.
        let mut specs = Vec::new();
        for i in 0..8 {
            specs.push(t(&format!("base{i}"), 50, DType::BF16, false));
            specs.push(t(&format!("lora{i}"), 10, DType::BF16, true));
        }
        let shared = Layout::new(
            LayoutConfig::new(100).with_separate_frozen(false),
            specs.clone(),
        )
        .unwrap();
        assert_eq!(shared.list_chunk_count(ListKind::Param16), 8);
        assert_eq!(shared.list_chunk_count(ListKind::MasterF32), 8);
        let apart = Layout::new(LayoutConfig::new(100), specs).unwrap();
        assert_eq!(apart.list_chunk_count(ListKind::Param16), 5);
        assert_eq!(apart.list_chunk_count(ListKind::MasterF32), 1);
        let m = apart.chunks(ListKind::MasterF32).next().unwrap();
        assert_eq!(m.index(), 1);
        assert_eq!(apart.chunk_used_bytes(m), 80 * 4);
        assert_eq!(apart.chunk_tensors(m).len(), 8);
        assert_eq!(
            apart.chunk_tensors(m.in_list(ListKind::Param16)),
            apart.chunk_tensors(m)
        );
    }

    #[test]
    fn all_trainable_or_all_frozen_pack_the_same_either_way() {
        for trainable in [false, true] {
            let specs: Vec<_> = [60, 30, 20, 80, 100, 1, 99]
                .iter()
                .enumerate()
                .map(|(i, &n)| t(&format!("t{i}"), n, DType::F16, trainable))
                .collect();
            let a = Layout::new(LayoutConfig::new(100), specs.clone()).unwrap();
            let b = Layout::new(LayoutConfig::new(100).with_separate_frozen(false), specs).unwrap();
            for i in 0..7 {
                for list in ListKind::ALL {
                    assert_eq!(a.location(TensorId(i), list), b.location(TensorId(i), list));
                }
            }
            assert_eq!(a.total_bytes(), b.total_bytes());
        }
    }

    #[test]
    fn pack_counts_agree_with_layout() {
        let specs = vec![
            t("a", 60, DType::F16, false),
            t("b", 50, DType::F16, false),
            t("c", 40, DType::F16, true),
            t("d", 30, DType::F16, false),
            t("e", 70, DType::F16, true),
        ];
        for separate in [true, false] {
            let cfg = LayoutConfig::new(100).with_separate_frozen(separate);
            let items: Vec<_> = specs
                .iter()
                .map(|s| PackItem::of(s, &cfg).unwrap())
                .collect();
            let counts = pack_counts(&items, 100, &cfg);
            let layout = Layout::new(cfg, specs.clone()).unwrap();
            assert_eq!(counts.chunks, layout.list_chunk_count(ListKind::Param16));
            assert_eq!(
                counts.trainable_chunks,
                layout.list_chunk_count(ListKind::MasterF32)
            );
            assert_eq!(allocated_bytes(counts, 100, &cfg), layout.total_bytes());
            assert_eq!(
                pack_streams(&items, &cfg).len(),
                if separate { 2 } else { 1 }
            );
        }
    }
}
