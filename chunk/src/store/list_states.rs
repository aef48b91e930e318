//! [`ListStates`]: per chunk list, the tensors' states ([`StateTable`]), where each
//! tensor in COMPUTE is and the generation of its latest access.
//!
//! Invariant: a tensor has a place exactly while it is in COMPUTE (checked by
//! [`super::ChunkStore::verify`]).

use crate::id::{ListKind, TensorId};
use crate::layout::Layout;
use crate::state::StateTable;

use crate::place::Place;

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
