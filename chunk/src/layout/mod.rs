//! Registration of tensors, in model (forward) order, into chunk lists.
//!
//! PatrickStar's layout: one chunk size `C`, counted in **element slots** and shared by
//! every list, and one packing decision made on the [`ListKind::Params`] list that all
//! other lists mirror. So chunk `i` of every list holds the same tensors (the trainable
//! ones among them, for the trainable-only lists), and the optimizer updates group `i`
//! (grads `i`, master `i`, M `i`, V `i`) together.
//!
//! Lists and what they hold:
//! - `Params`: every tensor, in 2-byte slots. 16-bit tensors keep their dtype. A
//!   trainable fp32 tensor gets a 16-bit compute copy there (dtype
//!   [`LayoutConfig::param16_dtype`]); its fp32 values live in `Master`. A **frozen
//!   fp32 tensor stays fp32** (it has no master copy, so casting it would silently
//!   change its bytes) and takes two slots per element.
//! - `Master`: trainable tensors only, fp32.
//! - `Momentum`, `Variance` (M, V): trainable tensors only, in the form of
//!   [`LayoutConfig::moments`] (fp32 by default, whence the names; bf16 or block-wise
//!   int8, see [`crate::moments`]), with that form's slot size (4, 2 or 1 bytes). Their
//!   offsets count the moment slots of the trainable tensors before them in the chunk,
//!   so compact chunks are dense too, and their chunks are as small as their bytes.
//! - `Grads`: trainable tensors only, and only when gradient accumulation is on: in
//!   their Params dtype, or fp32 in 4-byte slots with [`LayoutConfig::fp32_grads`]
//!   (fp32 compute: a gradient neither rounded nor spread over two 16-bit slots).
//!   Otherwise a gradient reuses its tensor's Params space once the layer's backward
//!   is done ([`Layout::grad_location`] returns that space).
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
//! order. A Params chunk then holds only frozen or only trainable tensors, so only the
//! groups made of trainable tensors get master, M, V (and grad) chunks, and those are
//! as full as their Params chunk. Without it, a LoRA model (a frozen base with small
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
//! a tensor has the same chunk index in every list; frozen tensors are only in Params;
//! with separate packing, no Params chunk holds both frozen and trainable tensors.
//!
//! # Files, one concept each
//! - this file: the declarations ([`TensorSpec`], [`LayoutConfig`]) and the finished
//!   [`Layout`]'s queries (where a tensor is, a chunk's and a list's bytes);
//! - `pack`: registration and next-fit packing ([`LayoutBuilder`], which grows a
//!   [`Layout`]) and the packing counts the chunk-size search uses;
//! - `fingerprint`: [`Layout::fingerprint`], the stable hash of where every byte is.

mod fingerprint;
mod pack;

use std::collections::HashMap;

pub use pack::LayoutBuilder;
pub(crate) use pack::{allocated_bytes, pack_counts, pack_streams, PackItem};

use crate::dtype::DType;
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::moments::MomentForm;
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

    /// The dtype this tensor has in the Params list (see the module doc).
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
    /// Whether gradients get their own `Grads` list (gradient accumulation).
    pub grad_accumulation: bool,
    /// Whether the `Grads` list holds fp32 gradients in 4-byte slots (else the compute
    /// copy's 16-bit dtype in 2-byte slots); needs `grad_accumulation`. For fp32
    /// compute, whose gradients would otherwise take two 16-bit slots per element in a
    /// chunk sized for one: half of every gradient chunk empty.
    pub fp32_grads: bool,
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
    pub moments: MomentForm,
}

impl LayoutConfig {
    /// `chunk_elements` slots per chunk, no gradient accumulation, bf16 compute copies,
    /// frozen and trainable tensors in separate chunks.
    pub fn new(chunk_elements: u64) -> Self {
        LayoutConfig {
            chunk_elements,
            grad_accumulation: false,
            fp32_grads: false,
            param16_dtype: DType::BF16,
            separate_frozen: true,
            moments: MomentForm::F32,
        }
    }

    /// With the M and V lists stored as `moments`.
    pub fn with_moments(mut self, moments: MomentForm) -> Self {
        self.moments = moments;
        self
    }

    /// Bytes per slot of `list` under this configuration (the moment lists' depends on
    /// [`LayoutConfig::moments`]).
    pub fn slot_bytes(&self, list: ListKind) -> u64 {
        match list {
            ListKind::Momentum | ListKind::Variance => self.moments.slot_bytes(),
            ListKind::Grads if self.fp32_grads => DType::F32.size_bytes(),
            l => l.slot_bytes(),
        }
    }

    /// The dtype of a trainable tensor's `Grads` place, given its Params dtype.
    fn grads_dtype(&self, param16_dtype: DType) -> DType {
        if self.fp32_grads {
            DType::F32
        } else {
            param16_dtype
        }
    }

    /// With or without a separate gradient list.
    pub fn with_grad_accumulation(mut self, on: bool) -> Self {
        self.grad_accumulation = on;
        self
    }

    /// With the `Grads` list in fp32 (`true`) or in the compute copy's 16-bit dtype; see
    /// [`LayoutConfig::fp32_grads`].
    pub fn with_fp32_grads(mut self, on: bool) -> Self {
        self.fp32_grads = on;
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
        if self.fp32_grads && !self.grad_accumulation {
            return Err(ChunkError::Fp32GradsWithoutGradList);
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
            .filter(move |l| l.trainable_only() && (acc || *l != ListKind::Grads))
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
    /// fp32 tensor in Params, otherwise equal to `elements`).
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

/// Where one tensor was placed: its chunk index and offsets.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placement {
    pub(super) index: u32,
    pub(super) offset_slots: u64,
    pub(super) elements: u64,
    pub(super) param16_dtype: DType,
    /// Offset within the chunk's trainable tensors; `None` for a frozen tensor.
    pub(super) trainable_offset: Option<u64>,
    /// Offset in the chunk's M and V lists, in their slots; `None` for a frozen tensor.
    pub(super) moment_offset: Option<u64>,
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

    /// Chunk indices (= Params chunks); every list's indices are below this.
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
            ListKind::Params => true,
            ListKind::Grads if !self.config.grad_accumulation => false,
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
            ListKind::Params => &self.chunk_tensors[i],
            _ => &self.chunk_trainable[i],
        }
    }

    /// Where tensor `id` lives in `list`; `None` for an unknown id, a frozen tensor in
    /// a trainable-only list, or `Grads` without gradient accumulation.
    pub fn location(&self, id: TensorId, list: ListKind) -> Option<TensorLocation> {
        let p = self.places.get(id.index())?;
        let (offset_elements, dtype) = match list {
            ListKind::Params => (p.offset_slots, p.param16_dtype),
            ListKind::Grads if !self.config.grad_accumulation => return None,
            ListKind::Grads => (
                p.trainable_offset?,
                self.config.grads_dtype(p.param16_dtype),
            ),
            ListKind::Master => (p.trainable_offset?, DType::F32),
            ListKind::Momentum | ListKind::Variance => {
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

    /// Where tensor `id`'s gradient lives: its `Grads` place with gradient
    /// accumulation, else its own Params space (reused once its layer's backward is
    /// done). `None` for a frozen tensor.
    pub fn grad_location(&self, id: TensorId) -> Option<TensorLocation> {
        let p = self.places.get(id.index())?;
        p.trainable_offset?;
        if self.config.grad_accumulation {
            self.location(id, ListKind::Grads)
        } else {
            self.location(id, ListKind::Params)
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
            ListKind::Momentum | ListKind::Variance if self.config.moments == MomentForm::Int8 => {
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
            ListKind::Params => self.fill_slots[i] * ListKind::Params.slot_bytes(),
            l @ (ListKind::Momentum | ListKind::Variance) => {
                self.fill_moments[i] * self.config.slot_bytes(l)
            }
            l => self.fill_trainable[i] * self.config.slot_bytes(l),
        }
    }

    /// Number of chunks of `list`.
    pub fn list_chunk_count(&self, list: ListKind) -> u64 {
        match list {
            ListKind::Params => self.fill_slots.len() as u64,
            ListKind::Grads if !self.config.grad_accumulation => 0,
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

    /// Bytes the store allocates and moves for `chunk` (see
    /// [`Layout::dense_chunk_bytes`]); 0 for a chunk that does not exist.
    pub fn chunk_stored_bytes(&self, chunk: ChunkId) -> u64 {
        self.chunk_used_bytes(chunk)
            .next_multiple_of(CHUNK_ALIGN_BYTES)
            .min(self.chunk_bytes(chunk.list()))
    }
}

#[cfg(test)]
mod tests;
