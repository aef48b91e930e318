//! Accounting per tier and per link, as plain data the binary prints (gathered from the
//! three tiers into [`TierStats`](crate::TierStats)).
//!
//! Peaks come from the tiers' budgets; bytes moved are counted when a transfer has
//! finished successfully (a failed copy counts only in `failed_copies`).

#![deny(unsafe_code)]

use crate::budget::Budget;
use crate::copy::CopyDir;

/// Traffic over the host↔device link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub host_to_device_bytes: u64,
    pub device_to_host_bytes: u64,
    pub host_to_device_copies: u64,
    pub device_to_host_copies: u64,
    pub failed_copies: u64,
}

impl LinkStats {
    pub(crate) fn record(&mut self, dir: CopyDir, bytes: u64) {
        match dir {
            CopyDir::HostToDevice => {
                self.host_to_device_bytes += bytes;
                self.host_to_device_copies += 1;
            }
            CopyDir::DeviceToHost => {
                self.device_to_host_bytes += bytes;
                self.device_to_host_copies += 1;
            }
        }
    }
}

/// Traffic over the host↔NVMe link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvmeLinkStats {
    pub host_to_nvme_bytes: u64,
    pub nvme_to_host_bytes: u64,
    pub writes: u64,
    pub reads: u64,
    pub failed: u64,
}

/// Bytes in use, peak bytes and capacity of one tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub peak_bytes: u64,
}

/// Writes one line per tier (device, host, NVMe): its peak, bytes in use and capacity in
/// MiB, as the binary prints them ([`crate::TierStats`] and the chunk store's stats).
pub fn write_usage_lines(
    f: &mut std::fmt::Formatter<'_>,
    device: TierUsage,
    host: TierUsage,
    nvme: TierUsage,
) -> std::fmt::Result {
    const MIB: f64 = (1u64 << 20) as f64;
    for (name, u) in [("device", device), ("host", host), ("nvme", nvme)] {
        writeln!(
            f,
            "{name:>6}: peak {:>10.1} MiB, in use {:>10.1} MiB of {:>10.1} MiB",
            u.peak_bytes as f64 / MIB,
            u.used_bytes as f64 / MIB,
            u.capacity_bytes as f64 / MIB
        )?;
    }
    Ok(())
}

impl From<Budget> for TierUsage {
    fn from(b: Budget) -> Self {
        TierUsage {
            capacity_bytes: b.capacity_bytes(),
            used_bytes: b.used_bytes(),
            peak_bytes: b.peak_bytes(),
        }
    }
}
