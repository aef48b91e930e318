//! Accounting per tier and per link, as plain data the binary prints.
//!
//! Peaks come from the tiers' budgets; bytes moved are counted when a transfer has
//! finished successfully (a failed copy counts only in `failed_copies`).

#![deny(unsafe_code)]

use crate::device::{CopyDir, Device};
use crate::host::HostTier;
use crate::nvme::NvmeTier;

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

impl From<crate::budget::Budget> for TierUsage {
    fn from(b: crate::budget::Budget) -> Self {
        TierUsage {
            capacity_bytes: b.capacity_bytes(),
            used_bytes: b.used_bytes(),
            peak_bytes: b.peak_bytes(),
        }
    }
}

/// Everything the tiers count, in one plain struct.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub device: TierUsage,
    pub host: TierUsage,
    pub nvme: TierUsage,
    pub device_link: LinkStats,
    pub nvme_link: NvmeLinkStats,
}

impl TierStats {
    /// Gather the counters of the three tiers.
    pub fn collect(device: &Device, host: &HostTier, nvme: &NvmeTier) -> Self {
        TierStats {
            device: device.budget().into(),
            host: host.budget().into(),
            nvme: nvme.budget().into(),
            device_link: device.link_stats(),
            nvme_link: nvme.link_stats(),
        }
    }
}

impl std::fmt::Display for TierStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        for (name, u) in [
            ("device", self.device),
            ("host", self.host),
            ("nvme", self.nvme),
        ] {
            writeln!(
                f,
                "{name:>6}: peak {:>10.1} MiB, in use {:>10.1} MiB of {:>10.1} MiB",
                u.peak_bytes as f64 / MIB,
                u.used_bytes as f64 / MIB,
                u.capacity_bytes as f64 / MIB
            )?;
        }
        let d = &self.device_link;
        writeln!(
            f,
            "host->device {:.1} MiB in {} copies, device->host {:.1} MiB in {} copies, {} failed",
            d.host_to_device_bytes as f64 / MIB,
            d.host_to_device_copies,
            d.device_to_host_bytes as f64 / MIB,
            d.device_to_host_copies,
            d.failed_copies
        )?;
        let n = &self.nvme_link;
        write!(
            f,
            "host->nvme {:.1} MiB in {} writes, nvme->host {:.1} MiB in {} reads, {} failed",
            n.host_to_nvme_bytes as f64 / MIB,
            n.writes,
            n.nvme_to_host_bytes as f64 / MIB,
            n.reads,
            n.failed
        )
    }
}
