//! Tensor states, their legal transitions, and chunk states kept incrementally.
//!
//! A tensor is in one of five states (PatrickStar's set; Colossal-AI Gemini's is the
//! same idea). The legal transitions, and why each exists:
//!
//! | from           | to             | when                                                  |
//! |----------------|----------------|-------------------------------------------------------|
//! | `Free`         | `Hold`         | payload materialised (loaded, initialised)            |
//! | `Free`         | `Compute`      | first use writes the payload (e.g. a gradient)        |
//! | `Hold`         | `Compute`      | `access` before forward, or by the optimizer step     |
//! | `Hold`         | `Free`         | payload no longer needed                              |
//! | `Compute`      | `Hold`         | generic `release`                                     |
//! | `Compute`      | `HoldAfterFwd` | `release` at the end of the tensor's forward          |
//! | `Compute`      | `HoldAfterBwd` | `release` after backward wrote its gradient           |
//! | `HoldAfterFwd` | `Compute`      | backward (or activation recomputation) accesses it    |
//! | `HoldAfterFwd` | `Hold`         | iteration reset (e.g. forward-only evaluation)        |
//! | `HoldAfterFwd` | `Free`         | payload dropped after forward                         |
//! | `HoldAfterBwd` | `Compute`      | optimizer step, or the next micro-batch's backward    |
//! | `HoldAfterBwd` | `Hold`         | optimizer step done; held for the next iteration      |
//! | `HoldAfterBwd` | `Free`         | gradient consumed and payload dropped                 |
//!
//! Everything else is illegal, in particular every self-transition (a second `access`
//! without `release` is a bug), `Compute -> Free` (a computed payload may be dirty; it
//! must be held, and written back if needed, before it is dropped), and entering a
//! `HoldAfter*` state from anything but `Compute`.
//!
//! A chunk's state follows from its tensors: any `Compute` -> [`ChunkState::Compute`];
//! else any `Hold`/`HoldAfterFwd`/`HoldAfterBwd` -> [`ChunkState::Hold`]; else
//! [`ChunkState::Free`]. A chunk that becomes `Free` through
//! [`crate::ChunkStore::set_state`] is discarded: no payload of it is needed, so its
//! copies are dropped unwritten and its bytes are unspecified until written again. [`StateTable`] keeps per-chunk counters of each tensor state,
//! so a transition and a chunk-state query are O(1). Invariant: for every chunk the
//! counters sum to its tensor count and equal a recount from the tensor states.

use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::layout::Layout;
use crate::Result;

pub use crate::tensor_state::TensorState;

/// The state of a chunk, derived from its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkState {
    /// Every tensor is free (or the chunk has none): its memory may be released.
    Free,
    /// Some tensor is in use: the chunk must stay on the compute device.
    Compute,
    /// No tensor in use, some held: the chunk may be moved or evicted.
    Hold,
}

/// The chunk of one tensor before and after a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkTransition {
    /// The tensor's chunk.
    pub chunk: ChunkId,
    /// The chunk's state before.
    pub before: ChunkState,
    /// The chunk's state after.
    pub after: ChunkState,
}

/// Tensor states and per-chunk state counters; every tensor starts `Free`.
#[derive(Debug, Clone)]
pub struct StateTable {
    names: Vec<Box<str>>,
    tensor_chunk: Vec<ChunkId>,
    tensor_state: Vec<TensorState>,
    /// Per dense chunk: number of its tensors in each state.
    chunk_counts: Vec<[u32; 5]>,
}

impl StateTable {
    /// A table for tensors named `names` living in `tensor_chunk` (same length).
    ///
    /// # Panics
    /// If the two vectors differ in length.
    pub fn new(names: Vec<String>, tensor_chunk: Vec<ChunkId>) -> Self {
        assert_eq!(names.len(), tensor_chunk.len(), "one chunk per tensor name");
        let dense_len = tensor_chunk
            .iter()
            .map(|c| c.dense() + 1)
            .max()
            .unwrap_or(0);
        let mut chunk_counts = vec![[0u32; 5]; dense_len];
        for c in &tensor_chunk {
            chunk_counts[c.dense()][TensorState::Free as usize] += 1;
        }
        StateTable {
            names: names.into_iter().map(String::into_boxed_str).collect(),
            tensor_state: vec![TensorState::Free; tensor_chunk.len()],
            tensor_chunk,
            chunk_counts,
        }
    }

    /// The table of a layout's compute list: each tensor in its Params chunk.
    pub fn for_layout(layout: &Layout) -> Self {
        let ids = (0..layout.tensors().len() as u32).map(TensorId);
        let chunks = ids
            .filter_map(|id| layout.location(id, ListKind::Params))
            .map(|l| l.chunk)
            .collect();
        let names = layout.tensors().iter().map(|s| s.name.clone()).collect();
        StateTable::new(names, chunks)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensor_state.len()
    }

    /// Whether the table has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensor_state.is_empty()
    }

    /// A tensor's state.
    pub fn state(&self, tensor: TensorId) -> Option<TensorState> {
        self.tensor_state.get(tensor.index()).copied()
    }

    /// A tensor's chunk.
    pub fn chunk_of(&self, tensor: TensorId) -> Option<ChunkId> {
        self.tensor_chunk.get(tensor.index()).copied()
    }

    /// Moves `tensor` to `to`, O(1). An unknown tensor or an illegal transition is an
    /// error and changes nothing.
    pub fn transition(&mut self, tensor: TensorId, to: TensorState) -> Result<ChunkTransition> {
        let i = tensor.index();
        let Some(&from) = self.tensor_state.get(i) else {
            return Err(ChunkError::UnknownTensor {
                id: tensor.0,
                count: self.tensor_state.len() as u32,
            });
        };
        let chunk = self.tensor_chunk[i];
        if !from.can_become(to) {
            return Err(ChunkError::IllegalTransition {
                tensor: self.names[i].to_string(),
                chunk,
                from,
                to,
            });
        }
        let counts = &mut self.chunk_counts[chunk.dense()];
        let before = derive(counts);
        counts[from as usize] -= 1;
        counts[to as usize] += 1;
        let after = derive(counts);
        self.tensor_state[i] = to;
        Ok(ChunkTransition {
            chunk,
            before,
            after,
        })
    }

    /// A chunk's state, O(1); `Free` for a chunk without tensors.
    pub fn chunk_state(&self, chunk: ChunkId) -> ChunkState {
        self.chunk_counts
            .get(chunk.dense())
            .map_or(ChunkState::Free, derive)
    }

    /// How many of a chunk's tensors are in `state`.
    pub fn count(&self, chunk: ChunkId, state: TensorState) -> u32 {
        self.chunk_counts
            .get(chunk.dense())
            .map_or(0, |c| c[state as usize])
    }

    /// Whether a chunk may leave the compute device (no tensor in `Compute`).
    pub fn is_evictable(&self, chunk: ChunkId) -> bool {
        self.count(chunk, TensorState::Compute) == 0
    }

    /// Whether every tensor of a non-empty chunk is in `state` (e.g. all
    /// `HoldAfterBwd`: the chunk's gradients are complete).
    pub fn all_in(&self, chunk: ChunkId, state: TensorState) -> bool {
        self.chunk_counts.get(chunk.dense()).is_some_and(|c| {
            let total: u32 = c.iter().sum();
            total > 0 && c[state as usize] == total
        })
    }
}

fn derive(counts: &[u32; 5]) -> ChunkState {
    if counts[TensorState::Compute as usize] > 0 {
        ChunkState::Compute
    } else if counts[TensorState::Hold as usize] > 0
        || counts[TensorState::HoldAfterFwd as usize] > 0
        || counts[TensorState::HoldAfterBwd as usize] > 0
    {
        ChunkState::Hold
    } else {
        ChunkState::Free
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use TensorState::*;

    fn table() -> StateTable {
        let c0 = ChunkId::new(ListKind::Params, 0);
        let c1 = ChunkId::new(ListKind::Params, 1);
        StateTable::new(vec!["a".into(), "b".into(), "c".into()], vec![c0, c0, c1])
    }

    #[test]
    fn legal_table_has_thirteen_entries_and_no_self_loops() {
        let mut n = 0;
        for from in TensorState::ALL {
            assert!(!from.can_become(from), "{from}");
            for to in TensorState::ALL {
                n += usize::from(from.can_become(to));
            }
        }
        assert_eq!(n, 13);
        assert!(!Compute.can_become(Free));
        assert!(!Hold.can_become(HoldAfterFwd));
        assert!(!Free.can_become(HoldAfterBwd));
    }

    #[test]
    fn chunk_state_follows_tensors() {
        let mut t = table();
        let c0 = ChunkId::new(ListKind::Params, 0);
        assert_eq!(t.chunk_state(c0), ChunkState::Free);
        let tr = t.transition(TensorId(0), Hold).unwrap();
        assert_eq!((tr.before, tr.after), (ChunkState::Free, ChunkState::Hold));
        t.transition(TensorId(1), Compute).unwrap();
        assert_eq!(t.chunk_state(c0), ChunkState::Compute);
        assert!(!t.is_evictable(c0));
        t.transition(TensorId(1), HoldAfterBwd).unwrap();
        assert_eq!(t.chunk_state(c0), ChunkState::Hold);
        assert!(!t.all_in(c0, HoldAfterBwd));
        t.transition(TensorId(0), Compute).unwrap();
        t.transition(TensorId(0), HoldAfterBwd).unwrap();
        assert!(t.all_in(c0, HoldAfterBwd));
        t.transition(TensorId(0), Free).unwrap();
        t.transition(TensorId(1), Free).unwrap();
        assert_eq!(t.chunk_state(c0), ChunkState::Free);
    }

    #[test]
    fn illegal_transition_is_an_error_naming_everything() {
        let mut t = table();
        t.transition(TensorId(2), Compute).unwrap();
        let e = t.transition(TensorId(2), Free).unwrap_err();
        assert_eq!(
            e,
            ChunkError::IllegalTransition {
                tensor: "c".into(),
                chunk: ChunkId::new(ListKind::Params, 1),
                from: Compute,
                to: Free,
            }
        );
        assert!(e.to_string().contains("`c`") && e.to_string().contains("COMPUTE -> FREE"));
        // Nothing changed.
        assert_eq!(t.state(TensorId(2)), Some(Compute));
        let e = t.transition(TensorId(2), Compute).unwrap_err();
        assert!(matches!(e, ChunkError::IllegalTransition { .. }));
        assert!(matches!(
            t.transition(TensorId(9), Hold),
            Err(ChunkError::UnknownTensor { id: 9, count: 3 })
        ));
    }

    proptest! {
        /// Random transition attempts: legal ones succeed, illegal ones fail and change
        /// nothing, and the incremental chunk state always equals a recount.
        #[test]
        fn counters_match_recount(steps in prop::collection::vec((0u32..6, 0usize..5), 0..200)) {
            let chunks: Vec<ChunkId> = (0..6).map(|i| ChunkId::new(ListKind::Params, i % 3)).collect();
            let names = (0..6).map(|i| format!("t{i}")).collect();
            let mut t = StateTable::new(names, chunks.clone());
            let mut model = [Free; 6];
            for (tensor, to) in steps {
                let to = TensorState::ALL[to];
                let from = model[tensor as usize];
                let r = t.transition(TensorId(tensor), to);
                prop_assert_eq!(r.is_ok(), from.can_become(to));
                if r.is_ok() { model[tensor as usize] = to; }
                for c in 0..3 {
                    let chunk = ChunkId::new(ListKind::Params, c);
                    let states: Vec<_> = (0..6).filter(|&i| chunks[i] == chunk).map(|i| model[i]).collect();
                    let expect = if states.contains(&Compute) { ChunkState::Compute }
                        else if states.iter().any(|s| s.is_hold()) { ChunkState::Hold }
                        else { ChunkState::Free };
                    prop_assert_eq!(t.chunk_state(chunk), expect);
                }
            }
        }
    }
}
