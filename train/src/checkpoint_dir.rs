//! A directory of numbered checkpoints: `ckpt-000120.safetensors`, the last N kept.
//!
//! [`CheckpointDir::save`] writes the checkpoint of step S as `ckpt-{S:06}.safetensors`
//! (atomically, see [`crate::checkpoint`]) and only once it is durable (renamed, the
//! directory `fsync`ed) removes the oldest ones beyond `keep`. So at every instant the
//! directory holds at least one complete checkpoint once one was ever saved, and
//! [`CheckpointDir::latest`] is the newest complete one: names are only ever created by
//! a rename of a complete, synced file.
//!
//! One writer per directory: [`CheckpointDir::open`] removes the temporary files a
//! killed writer left (`.ckpt-*.safetensors.tmp.*`), and saving a step behind the
//! directory's latest is refused, so `latest` is always the last one saved.

use std::path::{Path, PathBuf};

use tidestore_chunk::{ChunkStore, TensorId};

use crate::checkpoint::{self, sync_dir, CheckpointState};
use crate::error::{Result, TrainError};

const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";
const TEMP_MARK: &str = ".safetensors.tmp.";

/// A directory of numbered checkpoints, keeping the newest `keep`.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointDir {
    /// Opens (creating it if needed) `dir`, keeping the newest `keep` (>= 1) checkpoints,
    /// and removes temporary files left by a writer that was killed.
    pub fn open(dir: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let dir = dir.into();
        if keep == 0 {
            return Err(TrainError::Config {
                key: "checkpoint.keep",
                reason: "must keep at least one checkpoint".into(),
            });
        }
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Io {
            op: "creating the checkpoint directory",
            path: dir.clone(),
            source,
        })?;
        let d = CheckpointDir { dir, keep };
        d.remove_stale_temps()?;
        Ok(d)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of step `step`'s checkpoint.
    pub fn path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{PREFIX}{step:06}{SUFFIX}"))
    }

    /// The checkpoints in the directory, by ascending step.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        let mut out: Vec<(u64, PathBuf)> = self
            .names()?
            .into_iter()
            .filter_map(|name| Some((parse_step(&name)?, self.dir.join(name))))
            .collect();
        out.sort();
        Ok(out)
    }

    /// The newest checkpoint, if any.
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>> {
        Ok(self.list()?.pop())
    }

    /// Saves a checkpoint of `tensors` and `state` as step `state.controller.step`, then
    /// removes the oldest beyond `keep`. Returns its path. Refused with
    /// [`TrainError::CheckpointBehind`] when the directory holds a later step; the same
    /// step again replaces it (atomically).
    pub fn save(
        &self,
        store: &mut ChunkStore,
        tensors: &[TensorId],
        state: &CheckpointState,
    ) -> Result<PathBuf> {
        let step = state.controller.step;
        if let Some((latest, _)) = self.latest()? {
            if latest > step {
                return Err(TrainError::CheckpointBehind {
                    dir: self.dir.clone(),
                    step,
                    latest,
                });
            }
        }
        let path = self.path(step);
        checkpoint::save(store, tensors, state, &path)?;
        self.prune()?;
        Ok(path)
    }

    /// Loads the newest checkpoint into `store`; `None` when the directory holds none.
    /// A newest checkpoint that fails verification is an error, not a reason to fall
    /// back to an older one silently.
    pub fn load_latest(
        &self,
        store: &mut ChunkStore,
        tensors: &[TensorId],
    ) -> Result<Option<CheckpointState>> {
        match self.latest()? {
            Some((_, path)) => checkpoint::load(store, tensors, &path).map(Some),
            None => Ok(None),
        }
    }

    /// Removes all but the newest `keep` checkpoints. The new checkpoint is durable by
    /// now, so a removal that fails is logged, not returned: the old file stays, and the
    /// next save tries again.
    pub fn prune(&self) -> Result<()> {
        let all = self.list()?;
        let old = all.len().saturating_sub(self.keep);
        let mut removed = 0;
        for (step, path) in &all[..old] {
            match std::fs::remove_file(path) {
                Ok(()) => {
                    removed += 1;
                    tracing::debug!(step, path = %path.display(), "old checkpoint removed");
                }
                Err(e) => {
                    tracing::warn!(step, path = %path.display(), error = %e,
                        "could not remove an old checkpoint");
                }
            }
        }
        if removed > 0 {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }

    fn remove_stale_temps(&self) -> Result<()> {
        for name in self.names()? {
            if name.starts_with(&format!(".{PREFIX}")) && name.contains(TEMP_MARK) {
                let path = self.dir.join(&name);
                std::fs::remove_file(&path).map_err(|source| TrainError::Io {
                    op: "removing a stale temporary checkpoint",
                    path: path.clone(),
                    source,
                })?;
                tracing::info!(path = %path.display(), "stale temporary checkpoint removed");
            }
        }
        Ok(())
    }

    /// The UTF-8 file names in the directory.
    fn names(&self) -> Result<Vec<String>> {
        let io = |source| TrainError::Io {
            op: "listing the checkpoint directory",
            path: self.dir.clone(),
            source,
        };
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            if let Ok(name) = entry.map_err(io)?.file_name().into_string() {
                out.push(name);
            }
        }
        Ok(out)
    }
}

/// The step of a checkpoint file name (`ckpt-000120.safetensors` -> 120).
fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(parse_step("ckpt-000120.safetensors"), Some(120));
        assert_eq!(parse_step("ckpt-1234567.safetensors"), Some(1_234_567));
        assert_eq!(parse_step(".ckpt-000120.safetensors.tmp.77"), None);
        assert_eq!(parse_step("ckpt-.safetensors"), None);
        assert_eq!(parse_step("ckpt-+1.safetensors"), None);
    }

    #[test]
    fn open_removes_stale_temps_and_refuses_keep_zero() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join(".ckpt-000010.safetensors.tmp.999");
        let other = dir.path().join("notes.txt");
        std::fs::write(&stale, b"half").unwrap();
        std::fs::write(&other, b"keep").unwrap();
        let d = CheckpointDir::open(dir.path(), 2).unwrap();
        assert!(!stale.exists());
        assert!(other.exists());
        assert!(d.latest().unwrap().is_none());
        assert!(matches!(
            CheckpointDir::open(dir.path(), 0),
            Err(TrainError::Config { .. })
        ));
    }
}
