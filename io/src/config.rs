//! The io crate's part of the configuration, and its validation.
//!
//! Values arrive from TOML through the facade crate; every check here names the key as
//! the user wrote it (`io.block_size`, …) so the error points at the line to fix.

use std::path::Path;

use crate::error::{IoError, Result};

/// Largest queue depth accepted (io_uring's ring entries are capped well above this, but a
/// deeper queue buys nothing on one drive and pins more memory).
pub const QUEUE_DEPTH_MAX: u32 = 4096;

/// Which engine moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// io_uring when the kernel allows it, otherwise the thread pool (logged).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// `pread`/`pwrite` on a thread pool.
    ThreadPool,
}

impl std::str::FromStr for EngineChoice {
    type Err = IoError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "uring" => Ok(EngineChoice::IoUring),
            "threads" | "thread_pool" => Ok(EngineChoice::ThreadPool),
            other => Err(IoError::config(
                "io.engine",
                format!("`{other}` is not one of auto, io_uring, threads"),
            )),
        }
    }
}

/// How block I/O is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoConfig {
    pub engine: EngineChoice,
    /// Size of the requests a chunk is split into; a multiple of 4096.
    pub block_bytes: usize,
    /// Most requests in flight at once; 1 ..= 4096.
    pub queue_depth: u32,
    /// Open files with O_DIRECT (falls back to buffered I/O, logged, where refused).
    pub direct: bool,
    /// Register pool buffers with io_uring and use READ_FIXED / WRITE_FIXED.
    pub fixed_buffers: bool,
    /// Worker threads of the thread-pool engine.
    pub threads: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            engine: EngineChoice::Auto,
            block_bytes: 16 << 20,
            queue_depth: 32,
            direct: true,
            fixed_buffers: true,
            threads: 4,
        }
    }
}

impl IoConfig {
    /// Check every value; the error names the first bad key.
    pub fn validate(&self) -> Result<()> {
        if self.block_bytes == 0 || !self.block_bytes.is_multiple_of(crate::ALIGN_BYTES) {
            return Err(IoError::config(
                "io.block_size",
                format!(
                    "{} bytes is not a positive multiple of 4096",
                    self.block_bytes
                ),
            ));
        }
        if self.block_bytes > (1 << 30) {
            return Err(IoError::config(
                "io.block_size",
                format!(
                    "{} bytes is over the 1 GiB a single request may move",
                    self.block_bytes
                ),
            ));
        }
        if self.queue_depth == 0 || self.queue_depth > QUEUE_DEPTH_MAX {
            return Err(IoError::config(
                "io.queue_depth",
                format!("{} is outside 1..={QUEUE_DEPTH_MAX}", self.queue_depth),
            ));
        }
        if self.threads == 0 || self.threads > 256 {
            return Err(IoError::config(
                "io.threads",
                format!("{} is outside 1..=256", self.threads),
            ));
        }
        Ok(())
    }
}

/// Check that `dir` exists, is a directory and can be written to, naming `key` if not.
pub fn check_writable_dir(key: &'static str, dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir)
        .map_err(|e| IoError::config(key, format!("{}: {e}", dir.display())))?;
    if !meta.is_dir() {
        return Err(IoError::config(
            key,
            format!("{} is not a directory", dir.display()),
        ));
    }
    // Permission bits lie for root and for read-only mounts: try it.
    let probe = dir.join(format!(".tidestore-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(IoError::config(
            key,
            format!("{} is not writable: {e}", dir.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(r: Result<()>) -> &'static str {
        match r {
            Err(IoError::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn block_size_must_be_a_multiple_of_4096() {
        for bad in [0, 1000, 4097, 6144] {
            let cfg = IoConfig {
                block_bytes: bad,
                ..IoConfig::default()
            };
            assert_eq!(key_of(cfg.validate()), "io.block_size");
        }
        let ok = IoConfig {
            block_bytes: 8192,
            ..IoConfig::default()
        };
        ok.validate().unwrap();
    }

    #[test]
    fn queue_depth_must_be_in_range() {
        for bad in [0, 4097, 100_000] {
            let cfg = IoConfig {
                queue_depth: bad,
                ..IoConfig::default()
            };
            assert_eq!(key_of(cfg.validate()), "io.queue_depth");
        }
        for ok in [1, 4096] {
            IoConfig {
                queue_depth: ok,
                ..IoConfig::default()
            }
            .validate()
            .unwrap();
        }
    }

    #[test]
    fn missing_and_unwritable_dirs_name_the_key() {
        let missing = Path::new("/nonexistent/tidestore/swap");
        assert_eq!(key_of(check_writable_dir("nvme.dir", missing)), "nvme.dir");
        let file = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(
            key_of(check_writable_dir("nvme.dir", file.path())),
            "nvme.dir"
        );
        let dir = tempfile::tempdir().unwrap();
        check_writable_dir("nvme.dir", dir.path()).unwrap();
    }

    #[test]
    fn engine_names_parse() {
        assert_eq!("auto".parse::<EngineChoice>().unwrap(), EngineChoice::Auto);
        assert_eq!(
            "io_uring".parse::<EngineChoice>().unwrap(),
            EngineChoice::IoUring
        );
        assert_eq!(
            "threads".parse::<EngineChoice>().unwrap(),
            EngineChoice::ThreadPool
        );
        assert!("aio".parse::<EngineChoice>().is_err());
    }
}
