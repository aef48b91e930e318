//! tidestore: a three-tier (GPU / pinned host / NVMe) storage engine for training state.
//!
//! This facade crate ties the layers together behind one configuration and one error
//! type: [`Config`] is read from a `tidestore.toml` (unknown keys and impossible values
//! are errors naming the key), and [`Error`] wraps the errors of every layer below. The
//! layers are re-exported under their own names ([`io`] for now). Nothing here prints;
//! the `tidestore` binary does, and everything else is logged with `tracing`.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;

pub use config::{ChunkSection, Config, EngineName, IoSection, NvmeSection, Size};
pub use error::{Error, Location, Result};
pub use tidestore_io as io;
