//! The thread-pool backend: positional `pread`/`pwrite` on a few worker threads.
//!
//! Chosen when io_uring cannot be set up (seccomp, an old kernel, `io_uring_disabled`) or
//! when the configuration asks for it. Its queue is bounded: at most `queue_depth`
//! operations are pushed and not yet reaped, so the job and completion channels (both of
//! that capacity) never block a sender.
//!
//! Invariant: every pushed operation produces exactly one completion; dropping the
//! backend closes the job channel and joins the workers, so no worker touches a buffer
//! after the backend is gone.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::backend::{Backend, BackendKind, RawCompletion, RawOp};
use crate::error::{IoError, Op, Result};

/// A [`RawOp`] that may cross to a worker thread.
struct Job(RawOp);

// SAFETY: the pointer inside is only dereferenced by the one worker that receives the
// job, and `Backend::push`'s contract keeps the memory valid and unshared until the
// completion is reaped.
unsafe impl Send for Job {}

/// `pread`/`pwrite` on a pool of threads.
pub struct ThreadPoolBackend {
    file: Arc<File>,
    queue_depth: usize,
    staged: Vec<Job>,
    jobs_tx: Option<Sender<Job>>,
    done_rx: Receiver<RawCompletion>,
    workers: Vec<JoinHandle<()>>,
    unreaped: usize,
}

impl ThreadPoolBackend {
    /// Start `threads` workers over `file`, holding at most `queue_depth` operations.
    pub fn new(file: File, queue_depth: usize, threads: usize) -> Result<Self> {
        let queue_depth = queue_depth.max(1);
        let file = Arc::new(file);
        let (jobs_tx, jobs_rx) = crossbeam_channel::bounded::<Job>(queue_depth);
        let (done_tx, done_rx) = crossbeam_channel::bounded(queue_depth);
        let mut workers = Vec::with_capacity(threads.max(1));
        for i in 0..threads.max(1) {
            let file = Arc::clone(&file);
            let jobs_rx = jobs_rx.clone();
            let done_tx = done_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("tidestore-io-{i}"))
                .spawn(move || worker(&file, &jobs_rx, &done_tx))
                .map_err(|e| IoError::Setup {
                    what: "spawning io worker for",
                    path: "thread pool".into(),
                    source: e,
                })?;
            workers.push(handle);
        }
        Ok(ThreadPoolBackend {
            file,
            queue_depth,
            staged: Vec::with_capacity(queue_depth),
            jobs_tx: Some(jobs_tx),
            done_rx,
            workers,
            unreaped: 0,
        })
    }
}

fn worker(file: &File, jobs: &Receiver<Job>, done: &Sender<RawCompletion>) {
    while let Ok(Job(op)) = jobs.recv() {
        let len = op.len_bytes as usize;
        let res = match op.op {
            Op::Read => {
                // SAFETY: `push`'s contract: `ptr..ptr+len` is valid, and nobody else
                // reads or writes it until this completion is reaped.
                let dst = unsafe { std::slice::from_raw_parts_mut(op.ptr, len) };
                file.read_at(dst, op.offset_bytes)
            }
            Op::Write => {
                // SAFETY: as above; the region is only read here.
                let src = unsafe { std::slice::from_raw_parts(op.ptr as *const u8, len) };
                file.write_at(src, op.offset_bytes)
            }
        };
        let result = match res {
            Ok(n) => n as i32,
            Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
        };
        if done.send(RawCompletion { id: op.id, result }).is_err() {
            return;
        }
    }
}

impl Backend for ThreadPoolBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::ThreadPool
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    unsafe fn push(&mut self, op: RawOp) -> Result<()> {
        if self.unreaped + self.staged.len() >= self.queue_depth {
            return Err(IoError::InvalidRequest {
                reason: format!("thread-pool queue full ({} operations)", self.queue_depth),
            });
        }
        self.staged.push(Job(op));
        Ok(())
    }

    fn submit_and_reap(&mut self, min_complete: usize, out: &mut Vec<RawCompletion>) -> Result<()> {
        let tx = self.jobs_tx.as_ref().expect("sender lives until drop");
        for job in self.staged.drain(..) {
            // Capacity is queue_depth and at most that many are unreaped: never blocks.
            if tx.send(job).is_err() {
                return Err(IoError::Setup {
                    what: "io workers exited under",
                    path: "thread pool".into(),
                    source: std::io::Error::other("worker channel closed"),
                });
            }
            self.unreaped += 1;
        }
        let mut got = 0;
        while got < min_complete.min(self.unreaped) {
            match self.done_rx.recv() {
                Ok(c) => {
                    out.push(c);
                    got += 1;
                    self.unreaped -= 1;
                }
                Err(_) => break,
            }
        }
        while let Ok(c) = self.done_rx.try_recv() {
            out.push(c);
            self.unreaped -= 1;
        }
        Ok(())
    }

    fn sync_data(&mut self) -> Result<()> {
        crate::file::sync_data(&self.file)
    }

    fn len_bytes(&self) -> Result<u64> {
        crate::file::len_bytes(&self.file)
    }

    fn allocate(&mut self, len_bytes: u64) -> Result<()> {
        crate::file::allocate(&self.file, len_bytes)
    }
}

impl Drop for ThreadPoolBackend {
    fn drop(&mut self) {
        // Staged jobs were never started; closing the channel lets workers finish the
        // ones they hold and exit, so no buffer is touched after this returns.
        self.staged.clear();
        self.jobs_tx = None;
        // Keep draining completions so no worker blocks on a full channel.
        let done_rx = self.done_rx.clone();
        for w in self.workers.drain(..) {
            while !w.is_finished() {
                let _ = done_rx.recv_timeout(std::time::Duration::from_millis(1));
            }
            let _ = w.join();
        }
    }
}
