//! The pinned host tier: a fixed pool of chunk-sized buffers made once at start-up.
//!
//! Invariants:
//! - the pool holds `budget / chunk bytes` buffers (the largest chunk's bytes rounded up
//!   to 4096) in one contiguous mapping, allocated before the first iteration and never
//!   grown, so the tier can never exceed its budget and nothing is allocated on the hot
//!   path;
//! - a chunk of at most half a buffer takes a part of one (see [`tidestore_io`]'s pool:
//!   a buffer split into equal parts for chunks of one size), so chunks of smaller lists
//!   (16-bit parameters, compact moments) hold the pool bytes they need, not a whole
//!   largest-chunk buffer each, and the pool can never do worse than one buffer a chunk;
//! - where the device is a GPU, the whole mapping is page-locked and registered with it
//!   (asynchronous copies need that); a refusal is logged and the tier stays usable,
//!   unpinned, with copies that are then staged by the driver;
//! - the bytes in use are counted from the pool itself (a buffer dropped anywhere goes
//!   back to it), so the accounting cannot drift; the peak is sampled at every take;
//! - an empty pool is a typed error ([`TierError::HostPoolExhausted`]), never a wait
//!   without a bound.

#![deny(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tidestore_io::{align_up, AlignedBuf, BufferPool};

use crate::budget::{Budget, TierKind};
use crate::device::{Device, PinnedRegion};
use crate::error::{Result, TierError};

/// The pinned host tier.
#[derive(Debug)]
pub struct HostTier {
    pool: BufferPool,
    pinned: PinnedRegion,
    /// Locked in RAM ([`HostTier::with_pinning`]).
    locked: bool,
    capacity_bytes: u64,
    peak_bytes: AtomicU64,
}

impl HostTier {
    /// Allocate `budget_bytes / align_up(chunk_bytes)` buffers and pin them for `device`.
    pub fn new(budget_bytes: u64, chunk_bytes: usize, device: &Device) -> Result<Self> {
        Self::with_pinning(budget_bytes, chunk_bytes, device, true)
    }

    /// As [`HostTier::new`], pinned (locked, registered with `device`) only when `pin`.
    /// Unpinned, for a store whose chunks never leave this tier, a buffer's pages are
    /// made when it is first used, so a pool sized for chunks that are never made costs
    /// no memory for them.
    pub fn with_pinning(
        budget_bytes: u64,
        chunk_bytes: usize,
        device: &Device,
        pin: bool,
    ) -> Result<Self> {
        if chunk_bytes == 0 {
            return Err(TierError::Config {
                key: "chunk_size",
                reason: "a chunk of zero bytes".into(),
            });
        }
        let buf_bytes = align_up(chunk_bytes);
        let count = budget_bytes / buf_bytes as u64;
        if count == 0 {
            return Err(TierError::BudgetTooSmall {
                tier: TierKind::Host,
                capacity_bytes: budget_bytes,
                chunk_bytes: buf_bytes as u64,
            });
        }
        let count = usize::try_from(count).map_err(|_| TierError::Config {
            key: "host.budget",
            reason: format!("{count} buffers do not fit in this address space"),
        })?;
        let pool = BufferPool::with_lock(buf_bytes, count, pin)
            .map_err(|e| TierError::io(TierKind::Host, None, e))?;
        let pinned = match pin.then(|| device.pin_pool(&pool)) {
            None => PinnedRegion::unpinned(),
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                tracing::warn!(error = %e, bytes = count * buf_bytes,
                    "host tier: pinning refused; copies will be staged by the driver");
                PinnedRegion::unpinned()
            }
        };
        tracing::debug!(
            buffers = count,
            buf_bytes,
            pinned = pinned.is_pinned(),
            "host tier allocated"
        );
        Ok(HostTier {
            capacity_bytes: (count * buf_bytes) as u64,
            pool,
            pinned,
            locked: pin,
            peak_bytes: AtomicU64::new(0),
        })
    }

    /// Take a buffer for `chunk` of `len_bytes`, or [`TierError::HostPoolExhausted`] when
    /// none is free (or a chunk of this size is more than a buffer holds).
    pub fn try_take(&self, chunk: u64, len_bytes: u64) -> Result<AlignedBuf> {
        let buf = self
            .pool
            .try_take_bytes(len_bytes as usize)
            .ok_or_else(|| self.exhausted(chunk))?;
        self.sample_peak();
        Ok(buf)
    }

    /// Take a buffer for `chunk` of `len_bytes`, waiting up to `timeout` for one to come
    /// back.
    pub fn take_timeout(
        &self,
        chunk: u64,
        len_bytes: u64,
        timeout: Duration,
    ) -> Result<AlignedBuf> {
        let buf = self
            .pool
            .take_bytes_timeout(len_bytes as usize, timeout)
            .ok_or_else(|| self.exhausted(chunk))?;
        self.sample_peak();
        Ok(buf)
    }

    /// Pool bytes a chunk of `len_bytes` holds while in the pool (a whole buffer, or a
    /// part of one); `None` when it does not fit in a buffer.
    pub fn held_bytes(&self, len_bytes: u64) -> Option<u64> {
        self.take_class(len_bytes).map(|(_, held)| held)
    }

    /// How the pool serves a chunk of `len_bytes`: `(per, held bytes)`, `per == 1` a
    /// whole buffer, else a part of a buffer split `per` ways; `None` when it does not
    /// fit in a buffer.
    pub fn take_class(&self, len_bytes: u64) -> Option<(u32, u64)> {
        self.pool
            .take_class_for(len_bytes as usize)
            .map(|(per, b)| (per, b as u64))
    }

    /// The buffers split into parts now: `(buffer index, per, part bytes, parts
    /// free)`. Free parts serve chunks of their own size class only (see
    /// [`HostTier::take_class`]).
    pub fn splits(&self) -> Vec<(u32, u32, u64, u64)> {
        self.pool
            .splits()
            .into_iter()
            .map(|(index, per, bytes, free)| (index, per, bytes as u64, free as u64))
            .collect()
    }

    /// Return a buffer (dropping it anywhere does the same).
    pub fn give_back(&self, buf: AlignedBuf) {
        if buf.fixed_index().map(|(pool, _)| pool) != Some(self.pool.id()) {
            tracing::debug!("host tier: a buffer of another pool was given back; dropped");
        }
        drop(buf);
    }

    fn exhausted(&self, chunk: u64) -> TierError {
        TierError::HostPoolExhausted {
            chunk,
            buffers: self.pool.count(),
            buf_bytes: self.pool.buf_bytes(),
        }
    }

    fn sample_peak(&self) {
        self.peak_bytes
            .fetch_max(self.used_bytes(), Ordering::Relaxed);
    }

    /// Bytes of each whole buffer (the largest chunk's size rounded up to 4096).
    pub fn buf_bytes(&self) -> usize {
        self.pool.buf_bytes()
    }

    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.pool.count()
    }

    /// Whole buffers free now.
    pub fn available(&self) -> usize {
        self.pool.available()
    }

    /// Bytes of the pool taken now (buffers and parts handed out, and the unusable tail
    /// of buffers split into parts that do not fill them exactly).
    pub fn used_bytes(&self) -> u64 {
        self.capacity_bytes - self.pool.free_bytes() as u64
    }

    /// Bytes of the buffers and parts handed out now (without the unusable tails that
    /// [`HostTier::used_bytes`] counts).
    pub fn taken_bytes(&self) -> u64 {
        self.pool.taken_bytes() as u64
    }

    /// Capacity, used and peak bytes as a [`Budget`].
    pub fn budget(&self) -> Budget {
        Budget::from_parts(
            TierKind::Host,
            self.capacity_bytes,
            self.used_bytes(),
            self.peak_bytes.load(Ordering::Relaxed),
        )
    }

    /// Restart peak tracking from what is in use now.
    pub fn reset_peak(&self) {
        self.peak_bytes.store(self.used_bytes(), Ordering::Relaxed);
    }

    /// Whether the buffers are pinned for a GPU.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_pinned()
    }

    /// Whether the pool is locked in RAM (every page made at allocation); an unlocked
    /// one is kept out of the io engine's fixed buffers, whose registration would lock
    /// it.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The pool, for registering it with the io engine (fixed buffers).
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }
}
