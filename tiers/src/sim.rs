//! The simulated device: "device memory" in host memory, copies on a worker thread.
//!
//! It has the device's budget, its asynchronous interface and its failure modes, so that
//! every layer above runs the same code with or without a GPU:
//! - memory is an [`AlignedBuf`] per chunk, allocated within the budget and, like a real
//!   device, only while the simulated device has room left after the chunks and the
//!   non-model memory the caller reports ([`TierError::DeviceOutOfMemory`] otherwise);
//! - copies run on one worker thread standing in for the copy stream: they finish in
//!   submission order and their completions really arrive asynchronously, optionally
//!   paced to a given link bandwidth;
//! - the job and completion channels are bounded by the copy queue depth, and the device
//!   never has more copies in flight than that, so neither side ever blocks on a send.

#![deny(unsafe_code)]

use std::sync::mpsc::{Receiver, RecvError, SyncSender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tidestore_io::{align_up, AlignedBuf, BufferPool};

use crate::budget::{Lease, TierKind};
use crate::device::{
    CopyDir, CopyId, CopyRequest, DeviceBackend, DeviceConfig, DeviceCore, DeviceMem, DeviceView,
    DeviceViewMut, MemInfo, PinnedRegion, RawDone,
};
use crate::error::{Result, TierError};

/// Simulated device memory holding one chunk.
#[derive(Debug)]
pub struct SimMem {
    buf: AlignedBuf,
    bytes: usize,
    chunk: u64,
    device_id: u32,
    _lease: Lease,
}

impl SimMem {
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn chunk(&self) -> u64 {
        self.chunk
    }

    pub(crate) fn device_id(&self) -> u32 {
        self.device_id
    }

    pub(crate) fn view(&self) -> DeviceView<'_> {
        DeviceView::Host(&self.buf[..self.bytes])
    }

    pub(crate) fn view_mut(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut::Host(&mut self.buf[..self.bytes])
    }
}

type Job = (CopyId, CopyRequest);

/// The host simulation of a device.
#[derive(Debug)]
pub struct SimDevice {
    core: DeviceCore,
    /// `None` only while dropping.
    jobs: Option<SyncSender<Job>>,
    done: Receiver<RawDone>,
    worker: Option<JoinHandle<()>>,
    in_flight: usize,
    non_model_bytes: u64,
}

impl SimDevice {
    /// A simulated device of `cfg.sim_total_bytes` (default: the budget).
    pub fn new(cfg: &DeviceConfig) -> Result<Self> {
        let total_bytes = cfg.sim_total_bytes.unwrap_or(cfg.budget_bytes);
        let core = DeviceCore::new(cfg, total_bytes)?;
        let (jobs_tx, jobs_rx) = std::sync::mpsc::sync_channel(cfg.copy_queue_depth);
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(cfg.copy_queue_depth);
        let link_bytes_per_s = cfg.sim_link_bytes_per_s;
        let worker = std::thread::Builder::new()
            .name(format!("tidestore-sim-copy-{}", core.device_id))
            .spawn(move || copy_worker(jobs_rx, done_tx, link_bytes_per_s))
            .map_err(|e| TierError::CopyEngineStopped {
                reason: format!("spawning the simulated copy worker failed: {e}"),
            })?;
        tracing::debug!(
            device = core.device_id,
            total_bytes,
            budget_bytes = cfg.budget_bytes,
            "simulated device opened"
        );
        Ok(SimDevice {
            core,
            jobs: Some(jobs_tx),
            done: done_rx,
            worker: Some(worker),
            in_flight: 0,
            non_model_bytes: 0,
        })
    }

    fn lost(&mut self) -> Option<RawDone> {
        tracing::error!(
            in_flight = self.in_flight,
            "simulated copy worker stopped; its copies are lost"
        );
        self.in_flight = 0;
        None
    }
}

impl DeviceBackend for SimDevice {
    fn core(&self) -> &DeviceCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        &mut self.core
    }

    fn alloc(&self, chunk: u64, bytes: usize, lease: Lease) -> Result<DeviceMem> {
        // Like a real device: room is what the chunks and the non-model memory leave.
        let used_bytes = self.core.budget.snapshot().used_bytes(); // includes `lease`
        let free_bytes = self
            .core
            .total_bytes
            .saturating_sub(used_bytes - lease.bytes())
            .saturating_sub(self.non_model_bytes);
        if lease.bytes() > free_bytes {
            return Err(TierError::DeviceOutOfMemory {
                chunk,
                needed_bytes: lease.bytes(),
                free_bytes,
            });
        }
        let buf = AlignedBuf::new_zeroed(bytes)
            .map_err(|e| TierError::io(TierKind::Device, Some(chunk), e))?;
        debug_assert_eq!(buf.capacity(), align_up(bytes));
        Ok(DeviceMem::Sim(SimMem {
            buf,
            bytes,
            chunk,
            device_id: self.core.device_id,
            _lease: lease,
        }))
    }

    fn start_copy(&mut self, id: CopyId, req: CopyRequest) -> Option<(TierError, CopyRequest)> {
        let Some(jobs) = &self.jobs else {
            return Some((stopped("the device is closing"), req));
        };
        // Never blocks: fewer than `copy_queue_depth` copies are in flight (the device
        // waits first otherwise), and that is the channel's capacity.
        match jobs.send((id, req)) {
            Ok(()) => {
                self.in_flight += 1;
                None
            }
            Err(std::sync::mpsc::SendError((_, req))) => {
                Some((stopped("the copy worker has exited"), req))
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn next_done(&mut self, block: bool) -> Option<RawDone> {
        if self.in_flight == 0 {
            return None;
        }
        let got = if block {
            self.done
                .recv()
                .map_err(|RecvError| TryRecvError::Disconnected)
        } else {
            self.done.try_recv()
        };
        match got {
            Ok(done) => {
                self.in_flight -= 1;
                Some(done)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => self.lost(),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let used_bytes = self.core.budget.snapshot().used_bytes();
        Ok(MemInfo {
            total_bytes: self.core.total_bytes,
            free_bytes: self
                .core
                .total_bytes
                .saturating_sub(used_bytes)
                .saturating_sub(self.non_model_bytes),
        })
    }

    fn report_non_model_bytes(&mut self, bytes: u64) {
        self.non_model_bytes = bytes;
    }

    fn non_model_bytes(&self) -> Result<u64> {
        Ok(self.non_model_bytes)
    }

    fn pin_pool(&self, _pool: &BufferPool) -> Result<PinnedRegion> {
        Ok(PinnedRegion::unpinned())
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        // Closing the job channel ends the worker once it has finished what it holds;
        // the completion channel has room for all of it, so the join cannot hang.
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                tracing::error!("simulated copy worker panicked");
            }
        }
    }
}

fn stopped(reason: &str) -> TierError {
    TierError::CopyEngineStopped {
        reason: reason.into(),
    }
}

fn copy_worker(jobs: Receiver<Job>, done: SyncSender<RawDone>, link_bytes_per_s: Option<u64>) {
    while let Ok((id, mut req)) = jobs.recv() {
        let started = Instant::now();
        let result = copy_bytes(id, &mut req);
        if let Some(rate) = link_bytes_per_s {
            let target = Duration::from_secs_f64(req.len_bytes as f64 / rate as f64);
            if let Some(rest) = target.checked_sub(started.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        if done.send((id, req, result)).is_err() {
            break;
        }
    }
}

fn copy_bytes(id: CopyId, req: &mut CopyRequest) -> Result<()> {
    let len = req.len_bytes;
    let chunk = req.chunk;
    let DeviceMem::Sim(mem) = &mut req.mem else {
        return Err(TierError::BadCopy {
            id,
            chunk,
            reason: "CUDA memory handed to the simulated device".into(),
        });
    };
    // Lengths were checked at submit; `get` keeps a bad one an error, not a panic.
    let (host, dev) = match (req.host.get_mut(..len), mem.buf.get_mut(..len)) {
        (Some(h), Some(d)) => (h, d),
        _ => {
            return Err(TierError::BadCopy {
                id,
                chunk,
                reason: format!("{len} bytes do not fit both ends"),
            })
        }
    };
    match req.dir {
        CopyDir::HostToDevice => dev.copy_from_slice(host),
        CopyDir::DeviceToHost => host.copy_from_slice(dev),
    }
    Ok(())
}
