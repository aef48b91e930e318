//! Scratch paths a run makes and must not leave behind: a run's swap directory,
//! `io-bench`'s test file, the temporary files of checkpoints and exports.
//!
//! Each is held by a [`Scratch`] guard that removes its path when dropped — at a clean
//! exit and when an error unwinds the run — and is listed, while it lives, in one
//! process-wide registry, so that the binary's SIGINT/SIGTERM handler can remove what
//! the guards would have ([`remove_registered`]) before the process exits. A guard made
//! with [`Scratch::temps_in`] stands for the `.NAME.tmp.PID` files and directories this
//! process makes in a folder (the atomic-write temporaries of checkpoints and exports).
//!
//! A run also removes what a dead process of its own kind left ([`remove_dead`]): every
//! scratch name carries the id of the process that made it, and a name whose process no
//! longer exists (no `/proc/PID`) and none of whose files is locked (`flock`, as a
//! store holds its swap file) is stale. A name of a live process is never touched, so
//! two runs side by side — in this PID namespace or, by the lock, another sharing the
//! folder — never remove each other's files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// What a guard removes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// A file or a directory (with everything in it).
    Path(PathBuf),
    /// Every `.*.tmp.PID` entry of this process in a folder.
    TempsIn(PathBuf),
}

static REGISTRY: Mutex<BTreeMap<u64, Target>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, BTreeMap<u64, Target>> {
    // A panic while the lock was held left the map itself intact (inserts and removes
    // only): the paths in it are still the ones to clean up.
    REGISTRY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Atomic writes under way (live [`Scratch::temps_in`] guards), and whether
/// [`close_writes`] has closed the run to new ones.
static WRITES: Mutex<(usize, bool)> = Mutex::new((0, false));
static WRITES_CHANGED: Condvar = Condvar::new();

fn writes() -> MutexGuard<'static, (usize, bool)> {
    WRITES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// For a signal handler, before [`remove_registered`]: waits for the atomic writes
/// under way to end (each file then complete and renamed, or removed by its guard)
/// and lets no new one start — a [`Scratch::temps_in`] made after this blocks until the
/// process exits. Without it a checkpoint's temporary made between the handler's
/// clean-up and its exit stays behind.
pub fn close_writes() {
    let mut w = writes();
    w.1 = true;
    while w.0 > 0 {
        w = WRITES_CHANGED
            .wait(w)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }
}

/// A scratch path, removed when the guard drops unless [`Scratch::keep`] was called.
#[derive(Debug)]
pub struct Scratch {
    id: u64,
    target: Target,
    keep: bool,
}

impl Scratch {
    fn register(target: Target) -> Scratch {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        registry().insert(id, target.clone());
        Scratch {
            id,
            target,
            keep: false,
        }
    }

    /// Guards `path` (a file or a directory, made now or later by the caller).
    pub fn path(path: impl Into<PathBuf>) -> Scratch {
        Scratch::register(Target::Path(path.into()))
    }

    /// Guards the `.NAME.tmp.PID` entries this process makes in `dir`: one atomic
    /// write under way while it lives (see [`close_writes`]).
    pub fn temps_in(dir: impl Into<PathBuf>) -> Scratch {
        let mut w = writes();
        while w.1 {
            w = WRITES_CHANGED
                .wait(w)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        w.0 += 1;
        drop(w);
        Scratch::register(Target::TempsIn(dir.into()))
    }

    /// The guarded path (for [`Scratch::temps_in`], the folder).
    pub fn target(&self) -> &Path {
        match &self.target {
            Target::Path(p) | Target::TempsIn(p) => p,
        }
    }

    /// Leaves the path in place when the guard drops (a setting or flag keeps it); a
    /// signal still removes it until then.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        registry().remove(&self.id);
        if !self.keep {
            for path in remove(&self.target) {
                tracing::debug!(path = %path.display(), "scratch removed");
            }
        }
        if matches!(self.target, Target::TempsIn(_)) {
            writes().0 -= 1;
            WRITES_CHANGED.notify_all();
        }
    }
}

/// Removes what every live guard stands for and forgets the guards; returns the paths
/// removed. For a signal handler: the process exits right after.
pub fn remove_registered() -> Vec<PathBuf> {
    let targets: Vec<Target> = std::mem::take(&mut *registry()).into_values().collect();
    targets.iter().flat_map(remove).collect()
}

/// Removes `target`; returns what was there and is gone now. Failures are logged (the
/// caller is leaving: there is nobody to hand an error to).
fn remove(target: &Target) -> Vec<PathBuf> {
    match target {
        Target::Path(p) => remove_path(p).into_iter().collect(),
        Target::TempsIn(dir) => {
            let mark = format!(".tmp.{}", std::process::id());
            entries(dir)
                .into_iter()
                .filter(|(name, _)| name.starts_with('.') && name.ends_with(&mark))
                .filter_map(|(_, path)| remove_path(&path))
                .collect()
        }
    }
}

/// Removes a file or a directory tree; `Some(path)` when something was removed.
fn remove_path(path: &Path) -> Option<PathBuf> {
    let result = match std::fs::symlink_metadata(path) {
        Err(_) => return None,
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
    };
    match result {
        Ok(()) => Some(path.to_path_buf()),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a scratch path");
            None
        }
    }
}

/// The UTF-8 names in `dir` with their paths (nothing when it cannot be read).
fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    read.filter_map(|e| {
        let e = e.ok()?;
        Some((e.file_name().into_string().ok()?, e.path()))
    })
    .collect()
}

/// Whether process `pid` exists (Linux: `/proc/PID`). Where `/proc` is not mounted
/// every process counts as alive, so nothing is removed.
pub fn process_alive(pid: u32) -> bool {
    !Path::new("/proc/self").exists() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `path` (a file, or any file directly in a directory) is locked by a live
/// process (`flock`, as the swap file is while a store has it open): a run of another
/// PID namespace or host sharing the folder, whose PID this process cannot see.
fn in_use(path: &Path) -> bool {
    let locked = |p: &Path| {
        std::fs::File::open(p)
            .is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)))
    };
    if path.is_dir() {
        entries(path).iter().any(|(_, p)| p.is_file() && locked(p))
    } else {
        locked(path)
    }
}

/// Removes the entries of `dir` named `{prefix}{PID}` (exactly: digits after the
/// prefix) whose process is dead and none of whose files is locked — what a killed run
/// of this kind left; returns them.
pub fn remove_dead(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for (name, path) in entries(dir) {
        let Some(pid) = name.strip_prefix(prefix).and_then(|d| {
            (!d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                .then(|| d.parse::<u32>().ok())
                .flatten()
        }) else {
            continue;
        };
        if pid == std::process::id() || process_alive(pid) || in_use(&path) {
            continue;
        }
        if let Some(p) = remove_path(&path) {
            tracing::info!(path = %p.display(), pid, "removed what a dead run left");
            removed.push(p);
        }
    }
    removed
}

/// The name of this process's scratch entry `{prefix}{PID}`.
pub fn own_name(prefix: &str) -> String {
    format!("{prefix}{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_removes_its_path_and_keep_leaves_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("x"), b"x").unwrap();
        drop(Scratch::path(&a));
        assert!(!a.exists());
        let b = dir.path().join("b");
        std::fs::write(&b, b"b").unwrap();
        Scratch::path(&b).keep();
        assert!(b.exists());
    }

    #[test]
    fn temps_in_removes_only_this_process_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let pid = std::process::id();
        let mine = dir.path().join(format!(".out.tmp.{pid}"));
        let theirs = dir.path().join(".out.tmp.1");
        let plain = dir.path().join("out");
        for p in [&mine, &theirs, &plain] {
            std::fs::create_dir(p).unwrap();
        }
        drop(Scratch::temps_in(dir.path()));
        assert!(!mine.exists());
        assert!(theirs.exists() && plain.exists());
    }

    #[test]
    fn remove_dead_spares_live_processes_and_other_names() {
        let dir = tempfile::tempdir().unwrap();
        // PID 1 is alive on every Linux; no PID reaches u32::MAX - 1.
        let dead = dir.path().join(format!("run.{}", u32::MAX - 1));
        let live = dir.path().join("run.1");
        let own = dir.path().join(own_name("run."));
        let other = dir.path().join("run.x1");
        for p in [&dead, &live, &own, &other] {
            std::fs::create_dir(p).unwrap();
        }
        assert_eq!(remove_dead(dir.path(), "run."), vec![dead.clone()]);
        assert!(!dead.exists());
        assert!(live.exists() && own.exists() && other.exists());
    }

    #[test]
    fn remove_dead_spares_a_folder_whose_file_is_locked() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join(format!("run.{}", u32::MAX - 2));
        std::fs::create_dir(&other).unwrap();
        let swap = other.join("swap");
        std::fs::write(&swap, b"s").unwrap();
        let held = std::fs::File::open(&swap).unwrap();
        held.try_lock().unwrap();
        assert!(remove_dead(dir.path(), "run.").is_empty());
        assert!(swap.exists());
        drop(held);
        assert_eq!(remove_dead(dir.path(), "run."), vec![other]);
    }

    #[test]
    fn remove_registered_empties_the_registry() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"f").unwrap();
        let guard = Scratch::path(&f);
        assert!(remove_registered().contains(&f));
        assert!(!f.exists());
        guard.keep();
    }
}
