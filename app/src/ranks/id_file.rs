//! How NCCL ranks agree on their communicator's id when launched by torchrun: NCCL's own
//! rendezvous at `NCCL_COMM_ID`, or a file rank 0 writes where the others read it (see
//! `nccl.rs`). Apart from the engine, so that its tests run in every build.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, Result};

/// How long a rank waits for rank 0's id file.
pub const ID_WAIT: Duration = Duration::from_secs(300);

/// An id file older than this before a rank starts waiting is a stale one (a run that
/// ended without removing it); the rank waits for rank 0's new one instead.
const ID_STALE: Duration = Duration::from_secs(60);

/// Bytes of NCCL's unique id.
pub const ID_BYTES: usize = 128;

/// How the ranks agree on the communicator's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdExchange {
    /// `NCCL_COMM_ID` names rank 0's address; NCCL derives the id from it on every rank.
    Env,
    /// Rank 0 writes the id into this file; the others read it.
    File(PathBuf),
}

impl IdExchange {
    /// The exchange the environment asks for (see the module doc).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|var| std::env::var(var).ok(), std::env::temp_dir())
    }

    /// [`IdExchange::from_env`] from the variables `get` gives; `temp` is the default
    /// directory.
    fn from_vars(get: impl Fn(&str) -> Option<String>, temp: PathBuf) -> Result<Self> {
        if get("NCCL_COMM_ID").is_some() {
            return Ok(IdExchange::Env);
        }
        let port = get("MASTER_PORT").ok_or_else(|| {
            Error::Finetune(
                "NCCL ranks need NCCL_COMM_ID (host:port of rank 0) or MASTER_PORT (set by \
                 torchrun) to agree on their communicator; neither is set"
                    .into(),
            )
        })?;
        let addr = get("MASTER_ADDR").unwrap_or_else(|| "localhost".into());
        let dir = get("TIDESTORE_NCCL_ID_DIR").map_or(temp, PathBuf::from);
        let safe = |s: &str| -> String {
            s.trim()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '.' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        Ok(IdExchange::File(dir.join(format!(
            "tidestore-nccl-{}-{}.id",
            safe(&addr),
            safe(&port)
        ))))
    }
}

/// Writes `bytes` to `path` whole or not at all (a sibling file, then a rename), so a
/// reader never sees part of it.
pub fn publish(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::Finetune(format!(
                "rank 0 cannot write NCCL's id to {}: {e}",
                path.display()
            ))
        })
}

/// Rank 0's id from `path`, once a file of [`ID_BYTES`] written no earlier than
/// [`ID_STALE`] before `since` is there; gives up after `wait`.
pub fn await_id(path: &Path, since: SystemTime, wait: Duration) -> Result<Vec<u8>> {
    let oldest = since
        .checked_sub(ID_STALE)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let start = Instant::now();
    loop {
        let fresh = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= oldest);
        if fresh {
            if let Ok(bytes) = std::fs::read(path) {
                if bytes.len() == ID_BYTES {
                    return Ok(bytes);
                }
            }
        }
        if start.elapsed() >= wait {
            return Err(Error::Finetune(format!(
                "rank 0 did not write NCCL's id to {} within {} s (is rank 0 running, and \
                 do the ranks share that directory? TIDESTORE_NCCL_ID_DIR names another, \
                 NCCL_COMM_ID=host:port uses NCCL's own rendezvous)",
                path.display(),
                wait.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::super::env_of as vars;
    use super::*;

    #[test]
    fn the_id_goes_through_nccls_address_or_a_file_named_after_torchruns() {
        let tmp = PathBuf::from("/tmp");
        let env = IdExchange::from_vars(vars(&[("NCCL_COMM_ID", "10.0.0.1:29600")]), tmp.clone());
        assert_eq!(env.unwrap(), IdExchange::Env);
        let file = IdExchange::from_vars(
            vars(&[("MASTER_ADDR", "node/1:x"), ("MASTER_PORT", "29500")]),
            tmp.clone(),
        );
        assert_eq!(
            file.unwrap(),
            IdExchange::File(PathBuf::from("/tmp/tidestore-nccl-node_1_x-29500.id"))
        );
        let dir = IdExchange::from_vars(
            vars(&[("MASTER_PORT", "1"), ("TIDESTORE_NCCL_ID_DIR", "/shared")]),
            tmp.clone(),
        );
        assert_eq!(
            dir.unwrap(),
            IdExchange::File(PathBuf::from("/shared/tidestore-nccl-localhost-1.id"))
        );
        let e = IdExchange::from_vars(vars(&[]), tmp).unwrap_err();
        assert!(e.to_string().contains("NCCL_COMM_ID"), "{e}");
    }

    #[test]
    fn a_rank_reads_rank_0s_id_whole_and_not_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id");
        let id: Vec<u8> = (0..ID_BYTES as u8).collect();
        publish(&path, &id).unwrap();
        assert_eq!(
            await_id(&path, SystemTime::now(), Duration::ZERO).unwrap(),
            id
        );
        // A file from a run that ended long before this rank started is not taken.
        let later = SystemTime::now() + ID_STALE + Duration::from_secs(5);
        let e = await_id(&path, later, Duration::from_millis(120)).unwrap_err();
        assert!(e.to_string().contains("did not write NCCL's id"), "{e}");
        // A file of the wrong length (a torn or foreign one) is not taken either.
        std::fs::write(&path, [1u8; 7]).unwrap();
        assert!(await_id(&path, SystemTime::now(), Duration::from_millis(120)).is_err());
        // Written while a rank waits: taken.
        let writer = {
            let path = path.clone();
            let id = id.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                publish(&path, &id).unwrap();
            })
        };
        let got = await_id(&path, SystemTime::now(), Duration::from_secs(10)).unwrap();
        writer.join().unwrap();
        assert_eq!(got, id);
    }
}
