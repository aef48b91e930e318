//! Byte budgets: how much of a tier may be used, how much is, and the most that ever was.
//!
//! Invariants:
//! - `used_bytes <= capacity_bytes` at every moment: a reservation that does not fit is
//!   refused with [`TierError::OverBudget`] (tier, bytes needed, bytes free, capacity) and
//!   changes nothing; a capacity below what is in use is refused with
//!   [`TierError::ShrinkBelowUsed`], which says how much must be evicted first;
//! - `peak_bytes >= used_bytes`, and it only grows until [`Budget::reset_peak`];
//! - a [`Lease`] (from a [`SharedBudget`]) releases exactly the bytes it reserved, once,
//!   when dropped: memory that carries a lease cannot leave the accounting.
//!
//! The device budget is tidal: small during forward/backward (activations need the rest),
//! nearly all of the device during the optimizer step. [`Budget::set_capacity`] and
//! [`Budget::excess_bytes_at`] are how the layer above moves it.

#![deny(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Result, TierError};
pub use crate::kind::TierKind;

/// A tier's byte budget. Plain data: copy it to look at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    tier: TierKind,
    capacity_bytes: u64,
    used_bytes: u64,
    peak_bytes: u64,
}

impl Budget {
    /// An empty budget of `capacity_bytes` for `tier`.
    pub fn new(tier: TierKind, capacity_bytes: u64) -> Self {
        Budget {
            tier,
            capacity_bytes,
            used_bytes: 0,
            peak_bytes: 0,
        }
    }

    /// A budget from counts kept elsewhere (the host tier counts its pool); `used` and
    /// `peak` are clamped so the invariants hold.
    pub(crate) fn from_parts(
        tier: TierKind,
        capacity_bytes: u64,
        used_bytes: u64,
        peak_bytes: u64,
    ) -> Self {
        let used_bytes = used_bytes.min(capacity_bytes);
        Budget {
            tier,
            capacity_bytes,
            used_bytes,
            peak_bytes: peak_bytes.max(used_bytes),
        }
    }

    /// The tier this budget belongs to.
    pub fn tier(&self) -> TierKind {
        self.tier
    }

    /// Bytes that may be reserved in all.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes reserved now.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Bytes that can still be reserved.
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes - self.used_bytes
    }

    /// The most bytes ever reserved at once (since creation or [`Budget::reset_peak`]).
    pub fn peak_bytes(&self) -> u64 {
        self.peak_bytes
    }

    /// Whether `bytes` more would fit now.
    pub fn fits(&self, bytes: u64) -> bool {
        bytes <= self.free_bytes()
    }

    /// Reserve `bytes`, or say why not (changing nothing).
    pub fn try_reserve(&mut self, bytes: u64) -> Result<()> {
        if !self.fits(bytes) {
            return Err(TierError::OverBudget {
                tier: self.tier,
                needed_bytes: bytes,
                free_bytes: self.free_bytes(),
                capacity_bytes: self.capacity_bytes,
            });
        }
        self.used_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.used_bytes);
        Ok(())
    }

    /// Give back `bytes` reserved earlier. Releasing more than is reserved is refused
    /// (a caller's bookkeeping bug) and changes nothing.
    pub fn release(&mut self, bytes: u64) -> Result<()> {
        if bytes > self.used_bytes {
            return Err(TierError::ReleaseExceedsUsed {
                tier: self.tier,
                released_bytes: bytes,
                used_bytes: self.used_bytes,
            });
        }
        self.used_bytes -= bytes;
        Ok(())
    }

    /// Bytes that would have to be evicted before the capacity could become
    /// `capacity_bytes` (zero when it can be set now).
    pub fn excess_bytes_at(&self, capacity_bytes: u64) -> u64 {
        self.used_bytes.saturating_sub(capacity_bytes)
    }

    /// Change the capacity. Growing always works; shrinking below what is in use is
    /// refused with [`TierError::ShrinkBelowUsed`], which carries the bytes to evict.
    pub fn set_capacity(&mut self, capacity_bytes: u64) -> Result<()> {
        let excess_bytes = self.excess_bytes_at(capacity_bytes);
        if excess_bytes > 0 {
            return Err(TierError::ShrinkBelowUsed {
                tier: self.tier,
                capacity_bytes,
                used_bytes: self.used_bytes,
                excess_bytes,
            });
        }
        self.capacity_bytes = capacity_bytes;
        Ok(())
    }

    /// Start peak tracking again from what is in use now.
    pub fn reset_peak(&mut self) {
        self.peak_bytes = self.used_bytes;
    }
}

/// A [`Budget`] shared between a tier and the memory it hands out, so that memory
/// releases its bytes when dropped, wherever that happens.
#[derive(Debug, Clone)]
pub struct SharedBudget {
    inner: Arc<Mutex<Budget>>,
}

impl SharedBudget {
    /// An empty shared budget of `capacity_bytes` for `tier`.
    pub fn new(tier: TierKind, capacity_bytes: u64) -> Self {
        SharedBudget {
            inner: Arc::new(Mutex::new(Budget::new(tier, capacity_bytes))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Budget> {
        // A panic while the lock is held cannot leave a half-updated budget: every method
        // checks first and then assigns, so a poisoned lock still guards consistent data.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of the budget as it is now.
    pub fn snapshot(&self) -> Budget {
        *self.lock()
    }

    /// Reserve `bytes`; they are released when the returned lease is dropped.
    pub fn try_lease(&self, bytes: u64) -> Result<Lease> {
        self.lock().try_reserve(bytes)?;
        Ok(Lease {
            budget: self.clone(),
            bytes,
        })
    }

    /// See [`Budget::set_capacity`].
    pub fn set_capacity(&self, capacity_bytes: u64) -> Result<()> {
        self.lock().set_capacity(capacity_bytes)
    }

    /// See [`Budget::excess_bytes_at`].
    pub fn excess_bytes_at(&self, capacity_bytes: u64) -> u64 {
        self.lock().excess_bytes_at(capacity_bytes)
    }

    /// See [`Budget::reset_peak`].
    pub fn reset_peak(&self) {
        self.lock().reset_peak();
    }
}

/// Bytes reserved in a [`SharedBudget`], released when this is dropped. No `Clone`: the
/// bytes are released exactly once.
#[derive(Debug)]
#[must_use = "dropping a lease releases its bytes at once"]
pub struct Lease {
    budget: SharedBudget,
    bytes: u64,
}

impl Lease {
    /// Bytes this lease holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The tier the bytes are reserved in.
    pub fn tier(&self) -> TierKind {
        self.budget.lock().tier()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Cannot fail: these bytes were reserved by `try_lease` and are released only here.
        if let Err(e) = self.budget.lock().release(self.bytes) {
            tracing::error!(error = %e, "budget lease released more than was reserved");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_release_peak() {
        let mut b = Budget::new(TierKind::Device, 100);
        b.try_reserve(60).unwrap();
        b.try_reserve(40).unwrap();
        assert_eq!(b.free_bytes(), 0);
        match b.try_reserve(1) {
            Err(TierError::OverBudget {
                tier: TierKind::Device,
                needed_bytes: 1,
                free_bytes: 0,
                capacity_bytes: 100,
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
        b.release(70).unwrap();
        assert_eq!(b.used_bytes(), 30);
        assert_eq!(b.peak_bytes(), 100);
        assert!(matches!(
            b.release(31),
            Err(TierError::ReleaseExceedsUsed { .. })
        ));
        b.reset_peak();
        assert_eq!(b.peak_bytes(), 30);
    }

    #[test]
    fn shrink_reports_excess() {
        let mut b = Budget::new(TierKind::Device, 100);
        b.try_reserve(80).unwrap();
        assert_eq!(b.excess_bytes_at(50), 30);
        match b.set_capacity(50) {
            Err(TierError::ShrinkBelowUsed {
                capacity_bytes: 50,
                used_bytes: 80,
                excess_bytes: 30,
                ..
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(b.capacity_bytes(), 100);
        b.set_capacity(80).unwrap();
        assert_eq!(b.free_bytes(), 0);
        b.set_capacity(1000).unwrap();
        assert_eq!(b.free_bytes(), 920);
    }

    #[test]
    fn lease_releases_once_on_drop() {
        let shared = SharedBudget::new(TierKind::Host, 10);
        let a = shared.try_lease(6).unwrap();
        assert!(shared.try_lease(5).is_err());
        let b = shared.try_lease(4).unwrap();
        assert_eq!(shared.snapshot().used_bytes(), 10);
        drop(a);
        assert_eq!(shared.snapshot().used_bytes(), 4);
        drop(b);
        assert_eq!(shared.snapshot().used_bytes(), 0);
        assert_eq!(shared.snapshot().peak_bytes(), 10);
    }
}
