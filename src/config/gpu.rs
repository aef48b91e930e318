//! `device.ordinal`: which CUDA GPU, as a number or `"auto"`.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// Which CUDA GPU the device tier and the compute open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuOrdinal {
    /// GPU 0, or under data parallel the rank's place among the ranks on its machine,
    /// so that each rank has a GPU of its own.
    #[default]
    Auto,
    /// This GPU, numbered as CUDA numbers the visible ones (0-based).
    Index(usize),
}

impl GpuOrdinal {
    /// The GPU to open, for a process whose launcher gave it `local_rank` (`None`: not
    /// launched as one of several ranks).
    pub fn resolve(self, local_rank: Option<usize>) -> usize {
        match self {
            GpuOrdinal::Index(i) => i,
            GpuOrdinal::Auto => local_rank.unwrap_or(0),
        }
    }
}

impl fmt::Display for GpuOrdinal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuOrdinal::Auto => f.write_str("auto"),
            GpuOrdinal::Index(i) => i.fmt(f),
        }
    }
}

impl<'de> Deserialize<'de> for GpuOrdinal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OrdinalVisitor;
        impl Visitor<'_> for OrdinalVisitor {
            type Value = GpuOrdinal;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a GPU number (0, 1, …) or \"auto\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<GpuOrdinal, E> {
                usize::try_from(v).map(GpuOrdinal::Index).map_err(|_| {
                    E::custom(format!("{v} is not a GPU number (0, 1, …) or \"auto\""))
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<GpuOrdinal, E> {
                if v.trim().eq_ignore_ascii_case("auto") {
                    Ok(GpuOrdinal::Auto)
                } else {
                    Err(E::custom(format!(
                        "{v:?} is not a GPU number (0, 1, …) or \"auto\""
                    )))
                }
            }
        }
        deserializer.deserialize_any(OrdinalVisitor)
    }
}
