//! [`Guard`]: one tensor in COMPUTE, naming one access of one store, and the check that
//! a guard is still current.
//!
//! Invariant: a guard is current only while its tensor is in COMPUTE in the same store,
//! at the same place, by the same access (generation); every call taking a stale one
//! returns [`ChunkError::StaleGuard`] and changes nothing.

use crate::dtype::DType;
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::state::TensorState;
use crate::Result;

use super::{ChunkStore, Place};

/// One tensor in COMPUTE, handed out by [`ChunkStore::access`]; views come from
/// [`ChunkStore::view`] / [`ChunkStore::view_mut`], and [`ChunkStore::release`] ends
/// it. Dropping a guard without releasing leaves the tensor in COMPUTE (its chunk stays
/// pinned); [`ChunkStore::release_tensor`] releases by id. [`ChunkStore::with_access`]
/// and [`ChunkStore::with_host_views`] release on every path instead.
///
/// A guard names one access: its store and the access's generation. Once that access
/// ends (released by id, perhaps accessed again since), or given to another store, it is
/// stale, and every call taking it returns [`ChunkError::StaleGuard`] and changes
/// nothing.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a guard must be released, or its chunk stays pinned"]
pub struct Guard {
    /// The store that made it ([`ChunkStore`]'s `id`).
    pub(super) store: u64,
    /// The access it names (the tensor's generation in its list then).
    pub(super) generation: u64,
    pub(super) tensor: TensorId,
    pub(super) list: ListKind,
    pub(super) chunk: ChunkId,
    pub(super) place: Place,
    pub(super) offset_bytes: usize,
    pub(super) len_bytes: usize,
    pub(super) dtype: DType,
}

impl Guard {
    /// The tensor.
    pub fn tensor(&self) -> TensorId {
        self.tensor
    }

    /// The list it was accessed in.
    pub fn list(&self) -> ListKind {
        self.list
    }

    /// Its chunk.
    pub fn chunk(&self) -> ChunkId {
        self.chunk
    }

    /// Where it is.
    pub fn place(&self) -> Place {
        self.place
    }

    /// Offset of the tensor in its chunk, in bytes.
    pub fn offset_bytes(&self) -> usize {
        self.offset_bytes
    }

    /// The tensor's bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The tensor's dtype in this list.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl ChunkStore {
    /// Whether `g` names the current access of its tensor in this store.
    pub(super) fn check_guard(&self, g: &Guard) -> Result<()> {
        let current = g.store == self.id
            && self.lists[g.list as usize].as_ref().is_some_and(|ls| {
                let local = ls.local.get(g.tensor.index()).copied().unwrap_or(u32::MAX) as usize;
                ls.table.state(TensorId(local as u32)) == Some(TensorState::Compute)
                    && ls.place.get(local).copied().flatten() == Some(g.place)
                    && ls.generation.get(local) == Some(&g.generation)
            });
        if current {
            // What the mover promised the access: the chunk stays pinned and current
            // where the guard is until the tensor is released.
            debug_assert!(
                self.mover.pins(g.chunk, g.place) > 0 && self.mover.is_current(g.chunk, g.place),
                "a current guard's chunk {} is not pinned and current on the {:?} tier",
                g.chunk,
                g.place
            );
            Ok(())
        } else {
            Err(ChunkError::StaleGuard {
                tensor: self.name(g.tensor),
                list: g.list,
                chunk: g.chunk,
            })
        }
    }
}
