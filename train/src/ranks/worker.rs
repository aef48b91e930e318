//! The thread a rank's collectives run on, one after another in the order they were
//! asked for.
//!
//! Every rank must call the same collectives in the same order. With collectives
//! started ahead of their use (an all-gather for a parameter the next block computes
//! with, a reduce-scatter waited for only later), that order is the order of the
//! requests, not of the threads that happen to reach a lock first: one queue, one
//! thread draining it. A request made where the program is deterministic (the same
//! on every rank) is then matched on every rank.
//!
//! The engine goes back to the thread that drops the last handle, which drops it
//! there: MPI finalizes on the thread that ends the run, not on this one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::collective::Collective;
use crate::error::{Result, TrainError};

/// One request: runs on the worker with the engine.
type Job = Box<dyn FnOnce(&mut dyn Collective) + Send>;

/// The worker thread and the queue into it.
pub(super) struct Worker {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<Box<dyn Collective>>>,
    /// Nanoseconds the requesters blocked waiting for results.
    waited_ns: Arc<AtomicU64>,
}

impl Worker {
    /// Starts the worker over `group`.
    pub(super) fn start(mut group: Box<dyn Collective>) -> Result<Self> {
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let name = format!("tidestore-collectives-{}", group.rank());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in queue {
                    job(group.as_mut());
                }
                group
            })
            .map_err(|e| {
                TrainError::Collective(format!("starting the collectives' thread: {e}"))
            })?;
        Ok(Worker {
            jobs: Some(jobs),
            thread: Some(thread),
            waited_ns: Arc::default(),
        })
    }

    /// Queues `f` behind every request made before it; its result arrives through the
    /// returned [`Pending`].
    pub(super) fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let job: Job = Box::new(move |g| {
            // The requester may have gone (an error dropped it): nothing to tell.
            let _ = tx.send(f(g));
        });
        if let Some(jobs) = &self.jobs {
            // A send fails only when the worker is gone; `rx` then reports it.
            let _ = jobs.send(job);
        }
        Pending {
            rx,
            waited_ns: self.waited_ns.clone(),
        }
    }

    /// How long requesters blocked waiting for results, in all.
    pub(super) fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            match thread.join() {
                // Dropped here, on the thread that ends the run (see the module doc).
                Ok(group) => drop(group),
                Err(_) => tracing::error!("the collectives' thread panicked"),
            }
        }
    }
}

/// A collective's result to come ([`Worker::submit`]).
#[must_use = "a collective's result must be waited for"]
pub struct Pending<T> {
    rx: Receiver<Result<T>>,
    waited_ns: Arc<AtomicU64>,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").finish_non_exhaustive()
    }
}

impl<T> Pending<T> {
    /// The result, once the collective and every one queued before it are done (the
    /// time this call blocks is counted: [`crate::Ranks::waited`]).
    pub fn wait(self) -> Result<T> {
        let t0 = Instant::now();
        let r = self.rx.recv().unwrap_or_else(|_| Err(stopped()));
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }

    /// As [`Pending::wait`], giving up after `limit` (not counted).
    pub(super) fn wait_at_most(self, limit: Duration) -> Result<T> {
        match self.rx.recv_timeout(limit) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(TrainError::Collective(format!(
                "the collectives queued before it did not finish within {limit:?}"
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(stopped()),
        }
    }
}

fn stopped() -> TrainError {
    TrainError::Collective("the collectives' thread stopped (a collective panicked)".into())
}
