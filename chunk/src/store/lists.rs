//! The lookups from a tensor to its place in a list, and to its list's states
//! ([`ListStates`]).

use crate::error::ChunkError;
use crate::id::{ListKind, TensorId};
use crate::layout::TensorLocation;
use crate::state::TensorState;
use crate::Result;

use super::list_states::ListStates;
use super::ChunkStore;

impl ChunkStore {
    /// A tensor's state in `list`.
    pub fn state(&self, tensor: TensorId, list: ListKind) -> Option<TensorState> {
        let ls = self.lists.get(list as usize)?.as_ref()?;
        let local = *ls.local.get(tensor.index())?;
        ls.table.state(TensorId(local))
    }

    pub(super) fn location(&self, tensor: TensorId, list: ListKind) -> Result<TensorLocation> {
        let count = self.layout.tensors().len() as u32;
        let spec = self
            .layout
            .tensor(tensor)
            .ok_or(ChunkError::UnknownTensor {
                id: tensor.0,
                count,
            })?;
        self.layout
            .location(tensor, list)
            .ok_or_else(|| ChunkError::NoPlace {
                tensor: spec.name.clone(),
                list,
            })
    }

    pub(super) fn name(&self, tensor: TensorId) -> String {
        self.layout
            .tensor(tensor)
            .map_or_else(|| tensor.to_string(), |s| s.name.clone())
    }

    /// (list index, local id) of a tensor placed in `list`.
    pub(super) fn local(&self, tensor: TensorId, list: ListKind) -> Result<u32> {
        self.lists[list as usize]
            .as_ref()
            .and_then(|ls| ls.local.get(tensor.index()).copied())
            .filter(|&l| l != u32::MAX)
            .ok_or_else(|| ChunkError::NoPlace {
                tensor: self.name(tensor),
                list,
            })
    }

    pub(super) fn list_states(&mut self, list: ListKind) -> &mut ListStates {
        // `local` succeeded for this list, so its states exist.
        self.lists[list as usize]
            .as_mut()
            .expect("list states exist for a list with a placed tensor")
    }
}
