//! [`TierStats`]: the counters of the three tiers gathered in one plain struct, and how
//! the binary prints them.

#![deny(unsafe_code)]

use crate::device::Device;
use crate::host::HostTier;
use crate::nvme::NvmeTier;
use crate::stats::{write_usage_lines, LinkStats, NvmeLinkStats, TierUsage};

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
        write_usage_lines(f, self.device, self.host, self.nvme)?;
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
