//! [`TierKind`]: the three tiers, by name. A leaf every other module may name.

#![deny(unsafe_code)]

/// The three tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierKind {
    /// GPU memory (or its host simulation).
    Device,
    /// Pinned host memory.
    Host,
    /// The NVMe swap file.
    Nvme,
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TierKind::Device => "device",
            TierKind::Host => "host",
            TierKind::Nvme => "nvme",
        })
    }
}
