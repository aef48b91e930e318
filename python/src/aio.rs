//! `AioHandle`: asynchronous reads and writes of tensor memory to files through
//! tidestore's I/O engine (io_uring, O_DIRECT, registered buffers; the thread-pool
//! engine where io_uring is unavailable) — what DeepSpeed DeepNVMe's `aio_handle`
//! offers: `async_pread` / `async_pwrite` queue a transfer and return at once, `wait`
//! blocks until every queued transfer has finished, `sync_pread` / `sync_pwrite` do one
//! and wait.
//!
//! One worker thread per handle runs the transfers in submission order. It owns a pool
//! of 4096-aligned bounce buffers registered with the ring: a read lands there by
//! O_DIRECT and is copied into the caller's memory as each piece completes, a write is
//! copied into them and then submitted, with every bounce buffer in flight at once. The
//! part of a transfer that is not a whole number of 4096-byte blocks (its tail, or all of
//! it at an unaligned offset) goes through a buffered `pread`/`pwrite`, so any tensor
//! size works; both paths check that every byte moved.
//!
//! Invariants:
//! - the caller's buffer of a queued transfer stays exported (kept alive, not resized)
//!   in the handle until `wait` has its result; `wait` and the handle's drop both wait for
//!   the worker first, so the worker never touches memory that was given back;
//! - every transfer gets one result: bytes moved, or the first error (a short read past
//!   the end of the file is an error, not a short count); `wait` raises the first error
//!   only after every queued transfer has finished.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use tidestore_train::aio::{BufferPool, Engine, IoConfig, IoError, IoRequest, Op, ALIGN_BYTES};

use crate::error::{Error, Result};

/// How a handle moves bytes.
#[derive(Debug, Clone)]
pub struct AioConfig {
    /// Engine settings (block size, queue depth, O_DIRECT, engine choice).
    pub io: IoConfig,
    /// Bytes of each bounce buffer (a multiple of 4096).
    pub bounce_bytes: usize,
    /// Bounce buffers (transfers of one request in flight at once).
    pub bounce_count: usize,
}

/// Caller memory of one transfer, as an address the worker may use (see the module's
/// invariants for why it stays valid).
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub addr: usize,
    pub len: usize,
}

struct Job {
    id: u64,
    op: Op,
    path: PathBuf,
    offset_bytes: u64,
    mem: Memory,
}

/// A transfer's result: its id and bytes moved, or the error.
pub type Done = (u64, Result<usize>);

/// The worker thread and its channels.
pub struct Worker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts a worker: the bounce pool is made here, so a bad size fails now.
    pub fn start(cfg: AioConfig) -> Result<Self> {
        cfg.io.validate().map_err(|e| Error::Io {
            path: "aio handle".into(),
            source: e,
        })?;
        if cfg.bounce_bytes == 0 || !cfg.bounce_bytes.is_multiple_of(ALIGN_BYTES) {
            return Err(Error::bad(
                "bounce_size",
                format!(
                    "{} bytes is not a positive multiple of 4096",
                    cfg.bounce_bytes
                ),
            ));
        }
        if cfg.bounce_count == 0 || cfg.bounce_count > 1024 {
            return Err(Error::bad(
                "bounce_buffers",
                format!("{} is outside 1..=1024", cfg.bounce_count),
            ));
        }
        let pool = BufferPool::new(cfg.bounce_bytes, cfg.bounce_count).map_err(|e| Error::Io {
            path: "aio bounce buffers".into(),
            source: e,
        })?;
        // Bounded: at most this many transfers wait for the worker; `submit` then blocks.
        let (job_tx, job_rx) = crossbeam_channel::bounded::<Job>(1024);
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let thread = std::thread::Builder::new()
            .name("tidestore-aio".into())
            .spawn(move || {
                for job in job_rx {
                    let r = run(&cfg, &pool, &job);
                    if done_tx.send((job.id, r)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Protocol(format!("cannot start the aio worker thread: {e}")))?;
        Ok(Worker {
            jobs: Some(job_tx),
            done: done_rx,
            thread: Some(thread),
        })
    }

    /// Queues a transfer.
    ///
    /// # Safety
    /// `mem` must stay valid for the transfer (writable for a read) until its result
    /// has been received from [`Worker::recv`] (or the worker has been joined), and
    /// nothing else may access it meanwhile.
    pub unsafe fn submit(
        &self,
        id: u64,
        op: Op,
        path: PathBuf,
        offset_bytes: u64,
        mem: Memory,
    ) -> Result<()> {
        let job = Job {
            id,
            op,
            path,
            offset_bytes,
            mem,
        };
        self.jobs
            .as_ref()
            .ok_or_else(|| Error::Protocol("the aio handle is closed".into()))?
            .send(job)
            .map_err(|_| Error::Protocol("the aio worker thread has stopped".into()))
    }

    /// The next finished transfer, waiting for it.
    pub fn recv(&self) -> Result<Done> {
        self.done
            .recv()
            .map_err(|_| Error::Protocol("the aio worker thread has stopped".into()))
    }

    /// Stops taking transfers and waits for the queued ones to finish.
    pub fn join(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("aio worker thread panicked");
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.join();
    }
}

/// The caller's memory of `job` as a slice.
fn user_slice(mem: Memory) -> &'static mut [u8] {
    if mem.len == 0 {
        return &mut [];
    }
    // SAFETY: `Worker::submit`'s contract: `mem` is valid (and writable for a read) and
    // untouched by anyone else until this job's result is received, which happens after
    // `run` returns and drops this slice; the 'static lifetime never escapes `run`.
    unsafe { std::slice::from_raw_parts_mut(mem.addr as *mut u8, mem.len) }
}

fn io_err(path: &Path, source: IoError) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One transfer: the whole-block body through the engine, the tail buffered.
fn run(cfg: &AioConfig, pool: &BufferPool, job: &Job) -> Result<usize> {
    let user = user_slice(job.mem);
    let aligned = job.offset_bytes.is_multiple_of(ALIGN_BYTES as u64);
    let body = if aligned && cfg.io.direct {
        user.len() / ALIGN_BYTES * ALIGN_BYTES
    } else {
        0
    };
    if job.op == Op::Write {
        // Create (never truncate) before either path opens it.
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&job.path)
            .map_err(|e| {
                io_err(
                    &job.path,
                    IoError::Setup {
                        what: "creating",
                        path: job.path.clone(),
                        source: e,
                    },
                )
            })?;
    }
    if body > 0 {
        run_engine(cfg, pool, job, &mut user[..body])?;
    }
    if body < user.len() {
        run_buffered(job, body, &mut user[body..])?;
    }
    Ok(user.len())
}

/// `user` (whole blocks) at the job's offset, through the engine and the bounce pool.
fn run_engine(cfg: &AioConfig, pool: &BufferPool, job: &Job, user: &mut [u8]) -> Result<()> {
    let mut engine =
        Engine::open(&job.path, &cfg.io, job.op == Op::Write).map_err(|e| io_err(&job.path, e))?;
    if cfg.io.fixed_buffers {
        engine
            .register_pool(pool)
            .map_err(|e| io_err(&job.path, e))?;
    }
    let (mut next, mut in_flight) = (0usize, 0usize);
    let mut first_error: Option<IoError> = None;
    loop {
        while next < user.len() && first_error.is_none() {
            let Some(mut buf) = pool.try_take() else {
                break;
            };
            let n = pool.buf_bytes().min(user.len() - next);
            if job.op == Op::Write {
                buf[..n].copy_from_slice(&user[next..next + n]);
            }
            engine.submit(IoRequest {
                op: job.op,
                offset_bytes: job.offset_bytes + next as u64,
                len_bytes: n,
                buf,
                user_data: next as u64,
            });
            next += n;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        let Some(c) = engine.wait() else {
            return Err(Error::Protocol(format!(
                "aio: {in_flight} transfers of `{}` lost by the engine",
                job.path.display()
            )));
        };
        in_flight -= 1;
        match c.result {
            Ok(()) if job.op == Op::Read => {
                let at = c.user_data as usize;
                user[at..at + c.len_bytes].copy_from_slice(&c.buf[..c.len_bytes]);
            }
            Ok(()) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(io_err(&job.path, e)),
        None => Ok(()),
    }
}

/// `user` at the job's offset + `skip`, by `pread`/`pwrite` (every byte or an error).
fn run_buffered(job: &Job, skip: usize, user: &mut [u8]) -> Result<()> {
    let offset_bytes = job.offset_bytes + skip as u64;
    let file = OpenOptions::new()
        .read(job.op == Op::Read)
        .write(job.op == Op::Write)
        .open(&job.path)
        .map_err(|e| {
            io_err(
                &job.path,
                IoError::Setup {
                    what: "opening",
                    path: job.path.clone(),
                    source: e,
                },
            )
        })?;
    let mut done = 0;
    while done < user.len() {
        let at = offset_bytes + done as u64;
        let r = match job.op {
            Op::Read => file.read_at(&mut user[done..], at),
            Op::Write => file.write_at(&user[done..], at),
        };
        let source = match r {
            Ok(0) => IoError::UnexpectedEof {
                op: job.op,
                offset_bytes: at,
                remaining_bytes: user.len() - done,
            },
            Ok(n) => {
                done += n;
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => IoError::Device {
                op: job.op,
                offset_bytes: at,
                len_bytes: user.len() - done,
                source: e,
            },
        };
        return Err(io_err(&job.path, source));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Worker {
        Worker::start(AioConfig {
            io: IoConfig {
                block_bytes: 64 * 1024,
                ..IoConfig::default()
            },
            bounce_bytes: 128 * 1024,
            bounce_count: 2,
        })
        .expect("worker starts")
    }

    fn transfer(
        w: &Worker,
        op: Op,
        path: &Path,
        offset_bytes: u64,
        mem: &mut [u8],
    ) -> Result<usize> {
        let m = Memory {
            addr: mem.as_mut_ptr() as usize,
            len: mem.len(),
        };
        // SAFETY: `mem` outlives the transfer: its result is received before returning.
        unsafe { w.submit(7, op, path.to_path_buf(), offset_bytes, m)? };
        let (id, r) = w.recv()?;
        assert_eq!(id, 7);
        r
    }

    #[test]
    fn round_trip_of_blocks_and_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        let w = worker();
        let mut src: Vec<u8> = (0..(300 * 1024 + 77))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let n = src.len();
        assert_eq!(transfer(&w, Op::Write, &path, 0, &mut src).unwrap(), n);
        let mut out = vec![0u8; n];
        assert_eq!(transfer(&w, Op::Read, &path, 0, &mut out).unwrap(), n);
        assert_eq!(out, src);
    }

    #[test]
    fn read_past_the_end_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.bin");
        std::fs::write(&path, vec![1u8; 8192]).unwrap();
        let w = worker();
        let mut out = vec![0u8; 3 * 4096];
        let e = transfer(&w, Op::Read, &path, 0, &mut out).unwrap_err();
        let msg = crate::error::message(&e);
        assert!(
            msg.contains("short.bin") && msg.contains("end of file"),
            "{msg}"
        );
    }
}
