//! Per list, the tensors' states ([`StateTable`]), where each tensor in COMPUTE is and
//! the generation of its latest access; and the lookups from a tensor to its place in a
//! list.
//!
//! Invariant: a tensor has a place exactly while it is in COMPUTE (checked by
//! [`ChunkStore::verify`]).

use crate::error::ChunkError;
use crate::id::{ListKind, TensorId};
use crate::layout::{Layout, TensorLocation};
use crate::state::{StateTable, TensorState};
use crate::Result;

use super::{ChunkStore, Place};

pub(super) struct ListStates {
    pub(super) table: StateTable,
    /// Global tensor index -> index in `table` (`u32::MAX`: not in this list).
    pub(super) local: Vec<u32>,
    /// Per local tensor: where it is in COMPUTE.
    pub(super) place: Vec<Option<Place>>,
    /// Per local tensor: the generation of its latest access (0: never accessed).
    pub(super) generation: Vec<u64>,
}

impl ListStates {
    /// The states of every list the layout places tensors in (`None` for the others),
    /// every tensor FREE and never accessed.
    pub(super) fn for_layout(layout: &Layout) -> Vec<Option<ListStates>> {
        let mut lists: Vec<Option<ListStates>> = (0..ListKind::COUNT).map(|_| None).collect();
        let n = layout.tensors().len();
        for list in ListKind::ALL {
            if layout.list_chunk_count(list) == 0 {
                continue;
            }
            let mut local = vec![u32::MAX; n];
            let mut names = Vec::new();
            let mut chunks = Vec::new();
            for (i, spec) in layout.tensors().iter().enumerate() {
                if let Some(loc) = layout.location(TensorId(i as u32), list) {
                    local[i] = names.len() as u32;
                    names.push(spec.name.clone());
                    chunks.push(loc.chunk);
                }
            }
            let count = names.len();
            lists[list as usize] = Some(ListStates {
                table: StateTable::new(names, chunks),
                local,
                place: vec![None; count],
                generation: vec![0; count],
            });
        }
        lists
    }
}

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
