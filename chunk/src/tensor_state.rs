//! The state of one tensor ([`TensorState`]) and its legal transitions; the table and
//! why each transition exists are in [`crate::state`], which keeps the states of a
//! store's tensors. A leaf: the crate's error type names states without depending on
//! the state table.

use std::fmt;

/// The state of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorState {
    /// No payload is needed; its space may be reused (a chunk whose tensors are all
    /// FREE is discarded: see [`crate::ChunkStore::set_state`]).
    Free = 0,
    /// In use by a computation: its chunk must stay resident on the compute device.
    Compute = 1,
    /// Payload valid and kept; the chunk may move between tiers.
    Hold = 2,
    /// Held after its forward use (backward will need it again).
    HoldAfterFwd = 3,
    /// Held after backward; its gradient is ready for the optimizer.
    HoldAfterBwd = 4,
}

impl TensorState {
    /// All states, in declaration order.
    pub const ALL: [TensorState; 5] = [
        TensorState::Free,
        TensorState::Compute,
        TensorState::Hold,
        TensorState::HoldAfterFwd,
        TensorState::HoldAfterBwd,
    ];

    /// Whether `self -> to` is in the legal table (see the module doc).
    pub const fn can_become(self, to: TensorState) -> bool {
        use TensorState::*;
        matches!(
            (self, to),
            (Free, Hold)
                | (Free, Compute)
                | (Hold, Compute)
                | (Hold, Free)
                | (Compute, Hold)
                | (Compute, HoldAfterFwd)
                | (Compute, HoldAfterBwd)
                | (HoldAfterFwd, Compute)
                | (HoldAfterFwd, Hold)
                | (HoldAfterFwd, Free)
                | (HoldAfterBwd, Compute)
                | (HoldAfterBwd, Hold)
                | (HoldAfterBwd, Free)
        )
    }

    /// Whether this is one of the three hold states.
    pub const fn is_hold(self) -> bool {
        matches!(
            self,
            TensorState::Hold | TensorState::HoldAfterFwd | TensorState::HoldAfterBwd
        )
    }

    /// The upper-case name used in the literature (`COMPUTE`, `HOLD_AFTER_FWD`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            TensorState::Free => "FREE",
            TensorState::Compute => "COMPUTE",
            TensorState::Hold => "HOLD",
            TensorState::HoldAfterFwd => "HOLD_AFTER_FWD",
            TensorState::HoldAfterBwd => "HOLD_AFTER_BWD",
        }
    }
}

impl fmt::Display for TensorState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
