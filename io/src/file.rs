//! Opening files for block I/O: O_DIRECT where the filesystem allows it, buffered (and
//! logged) where it refuses (tmpfs, some FUSE and overlay filesystems).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{IoError, Result};

/// Open `path` for reading and writing. Returns the file and whether it is in O_DIRECT
/// mode (the caller must then keep offsets, lengths and buffers 4096-aligned).
pub fn open(path: &Path, direct: bool, create: bool) -> Result<(File, bool)> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(create);
    if direct {
        let mut direct_opts = opts.clone();
        direct_opts.custom_flags(libc::O_DIRECT);
        match direct_opts.open(path) {
            Ok(f) => return Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "filesystem refuses O_DIRECT; using buffered I/O");
            }
            Err(e) => {
                return Err(IoError::Setup {
                    what: "opening",
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        }
    }
    let f = opts.open(path).map_err(|e| IoError::Setup {
        what: "opening",
        path: path.to_path_buf(),
        source: e,
    })?;
    Ok((f, false))
}

/// Take an exclusive advisory lock (`flock`) on the file at `path` for as long as the
/// returned handle lives, so two processes (or two owners in one) never write the same
/// swap file at once: each would overwrite the other's chunks and read them back as
/// corrupt. A file locked elsewhere is [`IoError::Setup`] with `EWOULDBLOCK`; a
/// filesystem without `flock` support is logged and not locked.
pub fn lock_exclusive(path: &Path) -> Result<Option<File>> {
    use std::os::fd::AsRawFd;
    let file = File::open(path).map_err(|e| IoError::Setup {
        what: "opening (to lock)",
        path: path.to_path_buf(),
        source: e,
    })?;
    // SAFETY: plain syscall on a descriptor that is open for the duration of the call; it
    // touches no memory of ours.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(Some(file));
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Err(IoError::Setup {
            what: "locking (another process or handle is using it)",
            path: path.to_path_buf(),
            source: err,
        }),
        _ => {
            tracing::warn!(path = %path.display(), error = %err, "cannot lock the file; it is not protected from concurrent use");
            Ok(None)
        }
    }
}

/// Reserve `len_bytes` of real blocks for `file` (fallocate), growing it if needed.
/// Filesystems without fallocate get `set_len` (sparse), logged.
pub fn allocate(file: &File, len_bytes: u64) -> Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len_bytes).map_err(|_| IoError::InvalidRequest {
        reason: format!("file length {len_bytes} is too large"),
    })?;
    // SAFETY: the descriptor is open for writing for the duration of the call; fallocate
    // touches no memory of ours.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENOSPC) => Err(IoError::NoSpace {
            offset_bytes: 0,
            len_bytes: len_bytes as usize,
        }),
        Some(libc::EOPNOTSUPP) => {
            tracing::warn!("filesystem has no fallocate; the file stays sparse");
            file.set_len(len_bytes).map_err(|e| IoError::Device {
                op: crate::Op::Write,
                offset_bytes: 0,
                len_bytes: len_bytes as usize,
                source: e,
            })
        }
        _ => Err(IoError::Device {
            op: crate::Op::Write,
            offset_bytes: 0,
            len_bytes: len_bytes as usize,
            source: err,
        }),
    }
}

/// `fdatasync` as a typed error.
pub fn sync_data(file: &File) -> Result<()> {
    file.sync_data().map_err(|e| IoError::Device {
        op: crate::Op::Write,
        offset_bytes: 0,
        len_bytes: 0,
        source: e,
    })
}

/// Current length of `file`.
pub fn len_bytes(file: &File) -> Result<u64> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|e| IoError::Device {
            op: crate::Op::Read,
            offset_bytes: 0,
            len_bytes: 0,
            source: e,
        })
}
