//! [`Place`]: where an access wants a tensor's chunk, and the tier that is.

use tidestore_tiers::TierKind;

/// Where an access wants the tensor's chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// The compute device (GPU, or its simulation).
    Device,
    /// The pinned host pool (CPU work, e.g. the CPU optimizer).
    Host,
}

impl Place {
    /// The tier this place is.
    pub fn tier(self) -> TierKind {
        match self {
            Place::Device => TierKind::Device,
            Place::Host => TierKind::Host,
        }
    }
}
