//! The simulated device: "device memory" in host memory, copies on a worker thread.
//!
//! It has the device's budget, its asynchronous interface and its failure modes, so that
//! every layer above runs the same code with or without a GPU:
//! - chunk memory is a block of one host mapping made at start-up (the slab, see
//!   [`crate::slab`]; pages are faulted in once and reused, never zeroed again), handed
//!   out within the budget and, like a real device, only while the simulated device has
//!   room left after the chunks and the non-model memory the caller reports
//!   ([`TierError::DeviceOutOfMemory`] otherwise);
//! - the simulated driver holds the slab only, rounded up to its allocation granularity
//!   (`sim_alloc_granularity_bytes`), so the non-model memory measured beyond the slab is
//!   zero and what the caller reports is the whole of it, as on a GPU where it is measured;
//! - copies run on two worker threads, one per direction, standing in for the GPU's two
//!   copy streams (and engines): a device-to-host copy overlaps a host-to-device one, each
//!   direction finishes in submission order, each paced to the link bandwidth when one is
//!   given (full duplex), and completions really arrive asynchronously; the device hands
//!   them back in submission order by waiting on the direction of the oldest;
//! - each job and completion channel is bounded by the copy queue depth, and the device
//!   never has more copies in flight than that, so neither side ever blocks on a send.

#![deny(unsafe_code)]

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tidestore_io::{AlignedBuf, BufferPool};

use crate::backend::{
    CopyOf, DeviceBackend, DeviceConfig, DeviceCore, MemInfo, MemTag, RawDone, SlabPlace,
};
use crate::budget::{Lease, TierKind};
use crate::copy::{CopyDir, CopyId};
use crate::error::{Result, TierError};
use crate::slab::{HostRegion, OverflowLease, Placement, SlabBlock};
use crate::view::{DeviceView, DeviceViewMut};

/// Simulated device memory holding one chunk: a block of the simulated slab (or, when
/// the slab was too fragmented, a buffer of its own).
#[derive(Debug)]
pub struct SimMem {
    store: SimStore,
    tag: MemTag,
    _lease: Lease,
}

impl SimMem {
    pub(crate) fn tag(&self) -> MemTag {
        self.tag
    }

    pub(crate) fn view(&self) -> DeviceView<'_> {
        DeviceView::Host(match &self.store {
            SimStore::Slab { region, block } => region.bytes(block, self.tag.bytes),
            SimStore::Overflow { buf, .. } => &buf[..self.tag.bytes],
        })
    }

    pub(crate) fn view_mut(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut::Host(match &mut self.store {
            SimStore::Slab { region, block } => region.bytes_mut(block, self.tag.bytes),
            SimStore::Overflow { buf, .. } => &mut buf[..self.tag.bytes],
        })
    }
}

#[derive(Debug)]
enum SimStore {
    Slab {
        region: Arc<HostRegion>,
        block: SlabBlock,
    },
    Overflow {
        buf: AlignedBuf,
        _accounting: OverflowLease,
    },
}

type Job = (CopyId, CopyOf<SimMem>);

/// One direction's copy worker and its channels.
#[derive(Debug)]
struct CopyLane {
    /// `None` only while dropping.
    jobs: Option<SyncSender<Job>>,
    done: Receiver<RawDone<SimMem>>,
    worker: Option<JoinHandle<()>>,
}

impl CopyLane {
    fn spawn(cfg: &DeviceConfig, device_id: u32, dir: CopyDir) -> Result<Self> {
        let (jobs_tx, jobs_rx) = std::sync::mpsc::sync_channel(cfg.copy_queue_depth);
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(cfg.copy_queue_depth);
        let link_bytes_per_s = cfg.sim_link_bytes_per_s;
        let name = match dir {
            CopyDir::HostToDevice => "h2d",
            CopyDir::DeviceToHost => "d2h",
        };
        let worker = std::thread::Builder::new()
            .name(format!("tidestore-sim-{name}-{device_id}"))
            .spawn(move || copy_worker(jobs_rx, done_tx, link_bytes_per_s))
            .map_err(|e| TierError::CopyEngineStopped {
                reason: format!("spawning the simulated {dir} copy worker failed: {e}"),
            })?;
        Ok(CopyLane {
            jobs: Some(jobs_tx),
            done: done_rx,
            worker: Some(worker),
        })
    }

    /// Close the job channel and wait for the worker to finish what it holds; the
    /// completion channel has room for all of it, so the join cannot hang.
    fn close(&mut self) {
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                tracing::error!("simulated copy worker panicked");
            }
        }
    }
}

/// The host simulation of a device.
#[derive(Debug)]
pub struct SimDevice {
    core: DeviceCore,
    region: Arc<HostRegion>,
    /// Boxed: keeps [`crate::Device`]'s variants of similar size.
    h2d: Box<CopyLane>,
    d2h: Box<CopyLane>,
    /// Directions of the copies in flight, oldest first.
    order: VecDeque<CopyDir>,
}

impl SimDevice {
    /// A simulated device of `cfg.sim_total_bytes` (default: the budget), with a slab of
    /// `cfg.slab_bytes` (default: all of it).
    pub fn new(cfg: &DeviceConfig) -> Result<Self> {
        cfg.validate()?;
        let total_bytes = cfg.sim_total_bytes.unwrap_or(cfg.budget_bytes);
        let slab_bytes = cfg.slab_bytes.unwrap_or(total_bytes);
        if slab_bytes > total_bytes {
            return Err(TierError::Config {
                key: "device.slab_bytes",
                reason: format!("{slab_bytes} bytes is more than the device's {total_bytes}"),
            });
        }
        // The simulated driver allocates in granules, as a GPU's does; it never reports
        // more in use than it has.
        let slab_footprint_bytes = slab_bytes
            .div_ceil(cfg.sim_alloc_granularity_bytes)
            .saturating_mul(cfg.sim_alloc_granularity_bytes)
            .min(total_bytes);
        let region = HostRegion::new(slab_bytes).map_err(|e| {
            let reason = format!("mapping the simulated slab of {slab_bytes} bytes: {e}");
            TierError::io(
                TierKind::Device,
                None,
                tidestore_io::IoError::Pool { reason },
            )
        })?;
        let place = SlabPlace {
            bytes: slab_bytes,
            footprint_bytes: slab_footprint_bytes,
            base_addr: region.base_addr() as u64,
            granularity_bytes: cfg.sim_alloc_granularity_bytes,
        };
        let core = DeviceCore::new(cfg, total_bytes, place)?;
        let h2d = Box::new(CopyLane::spawn(cfg, core.device_id, CopyDir::HostToDevice)?);
        let d2h = Box::new(CopyLane::spawn(cfg, core.device_id, CopyDir::DeviceToHost)?);
        tracing::debug!(
            device = core.device_id,
            total_bytes,
            slab_bytes,
            budget_bytes = cfg.budget_bytes,
            "simulated device opened"
        );
        Ok(SimDevice {
            core,
            region: Arc::new(region),
            h2d,
            d2h,
            order: VecDeque::with_capacity(cfg.copy_queue_depth),
        })
    }

    fn lane(&self, dir: CopyDir) -> &CopyLane {
        match dir {
            CopyDir::HostToDevice => &self.h2d,
            CopyDir::DeviceToHost => &self.d2h,
        }
    }

    fn lost(&mut self) -> Option<RawDone<SimMem>> {
        tracing::error!(
            in_flight = self.order.len(),
            "simulated copy worker stopped; its copies are lost"
        );
        self.order.clear();
        None
    }
}

impl DeviceBackend for SimDevice {
    type Mem = SimMem;
    /// Host memory needs no pinning for the simulation.
    type Pinned = std::convert::Infallible;

    fn core(&self) -> &DeviceCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        &mut self.core
    }

    fn alloc(&self, chunk: u64, bytes: usize, lease: Lease) -> Result<SimMem> {
        // Like a real device: room is what the chunks and the non-model memory leave.
        let used_bytes = self.core.budget.snapshot().used_bytes(); // includes `lease`
        let free_bytes = self
            .core
            .total_bytes
            .saturating_sub(used_bytes - lease.bytes())
            .saturating_sub(self.core.non_model_reported_bytes());
        if lease.bytes() > free_bytes {
            return Err(TierError::DeviceOutOfMemory {
                chunk,
                needed_bytes: lease.bytes(),
                free_bytes,
            });
        }
        let store = match self.core.slab.take(chunk, bytes as u64) {
            Placement::Slab(block) => {
                assert_eq!(block.bytes(), lease.bytes(), "a block is its lease's bytes");
                SimStore::Slab {
                    region: Arc::clone(&self.region),
                    block,
                }
            }
            Placement::Overflow(accounting) => SimStore::Overflow {
                buf: AlignedBuf::new_zeroed(bytes)
                    .map_err(|e| TierError::io(TierKind::Device, Some(chunk), e))?,
                _accounting: accounting,
            },
        };
        Ok(SimMem {
            store,
            tag: self.core.tag(chunk, bytes),
            _lease: lease,
        })
    }

    fn start_copy(
        &mut self,
        id: CopyId,
        req: CopyOf<SimMem>,
    ) -> Option<(TierError, CopyOf<SimMem>)> {
        let dir = req.dir;
        let Some(jobs) = &self.lane(dir).jobs else {
            return Some((stopped("the device is closing"), req));
        };
        // Never blocks: fewer than `copy_queue_depth` copies are in flight (the device
        // waits first otherwise), and that is the channel's capacity.
        match jobs.send((id, req)) {
            Ok(()) => {
                self.order.push_back(dir);
                None
            }
            Err(std::sync::mpsc::SendError((_, req))) => {
                Some((stopped("the copy worker has exited"), req))
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.order.len()
    }

    fn next_done(&mut self, block: bool) -> Option<RawDone<SimMem>> {
        // The oldest copy is the next one its direction's worker finishes.
        let dir = *self.order.front()?;
        let done = &self.lane(dir).done;
        let got = if block {
            done.recv().map_err(|RecvError| TryRecvError::Disconnected)
        } else {
            done.try_recv()
        };
        match got {
            Ok(done) => {
                self.order.pop_front();
                Some(done)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => self.lost(),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    fn driver_mem_info(&self) -> Result<MemInfo> {
        Ok(MemInfo {
            total_bytes: self.core.total_bytes,
            free_bytes: self
                .core
                .total_bytes
                .saturating_sub(self.core.slab_footprint_bytes)
                .saturating_sub(self.core.slab.stats().overflow_footprint_bytes),
        })
    }

    fn pin_pool(&self, _pool: &BufferPool) -> Result<Option<Self::Pinned>> {
        Ok(None)
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        self.h2d.close();
        self.d2h.close();
    }
}

fn stopped(reason: &str) -> TierError {
    TierError::CopyEngineStopped {
        reason: reason.into(),
    }
}

fn copy_worker(
    jobs: Receiver<Job>,
    done: SyncSender<RawDone<SimMem>>,
    link_bytes_per_s: Option<u64>,
) {
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

fn copy_bytes(id: CopyId, req: &mut CopyOf<SimMem>) -> Result<()> {
    let len = req.len_bytes;
    let chunk = req.chunk;
    let mem = &mut req.mem;
    // Lengths were checked at submit; `get` keeps a bad one an error, not a panic.
    let DeviceViewMut::Host(dev) = mem.view_mut() else {
        return Err(TierError::BadCopy {
            id,
            chunk,
            reason: "simulated memory without host bytes".into(),
        });
    };
    let (host, dev) = match (req.host.get_mut(..len), dev.get_mut(..len)) {
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
