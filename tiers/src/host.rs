//! The pinned host tier: a fixed pool of chunk-sized buffers made once at start-up.
//!
//! Invariants:
//! - the pool holds `budget / chunk bytes` buffers (chunk bytes rounded up to 4096) in
//!   one contiguous mapping, allocated before the first iteration and never grown, so the
//!   tier can never exceed its budget and nothing is allocated on the hot path;
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
    capacity_bytes: u64,
    peak_bytes: AtomicU64,
}

impl HostTier {
    /// Allocate `budget_bytes / align_up(chunk_bytes)` buffers and pin them for `device`.
    pub fn new(budget_bytes: u64, chunk_bytes: usize, device: &Device) -> Result<Self> {
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
        let pool = BufferPool::new(buf_bytes, count)
            .map_err(|e| TierError::io(TierKind::Host, None, e))?;
        let pinned = match device.pin_pool(&pool) {
            Ok(p) => p,
            Err(e) => {
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
            peak_bytes: AtomicU64::new(0),
        })
    }

    /// Take a buffer for `chunk`, or [`TierError::HostPoolExhausted`] when all are taken.
    pub fn try_take(&self, chunk: u64) -> Result<AlignedBuf> {
        let buf = self.pool.try_take().ok_or_else(|| self.exhausted(chunk))?;
        self.sample_peak();
        Ok(buf)
    }

    /// Take a buffer for `chunk`, waiting up to `timeout` for one to come back.
    pub fn take_timeout(&self, chunk: u64, timeout: Duration) -> Result<AlignedBuf> {
        let buf = self
            .pool
            .take_timeout(timeout)
            .ok_or_else(|| self.exhausted(chunk))?;
        self.sample_peak();
        Ok(buf)
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

    /// Bytes of each buffer (the chunk size rounded up to 4096).
    pub fn buf_bytes(&self) -> usize {
        self.pool.buf_bytes()
    }

    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.pool.count()
    }

    /// Buffers free now.
    pub fn available(&self) -> usize {
        self.pool.available()
    }

    /// Bytes of buffers taken now.
    pub fn used_bytes(&self) -> u64 {
        ((self.pool.count() - self.pool.available()) * self.pool.buf_bytes()) as u64
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

    /// The pool, for registering it with the io engine (fixed buffers).
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }
}
