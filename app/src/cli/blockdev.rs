//! The block device under a file, and the request sizes it saw.
//!
//! `stat(2)`'s `st_dev` names the device holding the file; `/sys/dev/block/MAJ:MIN`
//! links to its sysfs folder, whose parent is the whole disk when it is a partition.
//! `/sys/block/<disk>/stat` counts completed requests and 512-byte sectors per direction
//! (Documentation/block/stat.rst: field 1 read I/Os, 3 read sectors, 5 write I/Os,
//! 7 write sectors); the deltas around a run give the average request size the device
//! saw, after the block layer's merging and splitting. Filesystems with no block device
//! (tmpfs, overlay) have none: every figure is then `None`, never an error.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Bytes of one sector in `/sys/block/*/stat`, whatever the device's real sector size.
const SECTOR_BYTES: u64 = 512;

/// A whole disk found under a path.
#[derive(Debug, Clone)]
pub struct BlockDev {
    /// Kernel name (`nvme0n1`, `vda`).
    pub name: String,
    /// `major:minor` of the device holding the file (a partition's, if it is one).
    pub dev: String,
    /// Largest request the device accepts (`queue/max_sectors_kb`), in KiB.
    pub max_request_kib: Option<u64>,
    stat_path: PathBuf,
}

/// Counters of one `/sys/block/<dev>/stat` sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStat {
    pub read_ios: u64,
    pub read_sectors: u64,
    pub write_ios: u64,
    pub write_sectors: u64,
}

impl DiskStat {
    /// Parse the text of a `stat` file.
    fn parse(text: &str) -> Option<DiskStat> {
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some(DiskStat {
            read_ios: *fields.first()?,
            read_sectors: *fields.get(2)?,
            write_ios: *fields.get(4)?,
            write_sectors: *fields.get(6)?,
        })
    }

    /// Counters of `self` minus `before` (what happened between the two samples).
    pub fn since(&self, before: &DiskStat) -> DiskStat {
        DiskStat {
            read_ios: self.read_ios.saturating_sub(before.read_ios),
            read_sectors: self.read_sectors.saturating_sub(before.read_sectors),
            write_ios: self.write_ios.saturating_sub(before.write_ios),
            write_sectors: self.write_sectors.saturating_sub(before.write_sectors),
        }
    }

    /// Sum of two deltas.
    pub fn plus(&self, other: &DiskStat) -> DiskStat {
        DiskStat {
            read_ios: self.read_ios + other.read_ios,
            read_sectors: self.read_sectors + other.read_sectors,
            write_ios: self.write_ios + other.write_ios,
            write_sectors: self.write_sectors + other.write_sectors,
        }
    }

    /// Average bytes per completed request in this delta, for reads or writes.
    pub fn avg_request_bytes(&self, write: bool) -> Option<f64> {
        let (ios, sectors) = if write {
            (self.write_ios, self.write_sectors)
        } else {
            (self.read_ios, self.read_sectors)
        };
        (ios > 0).then(|| (sectors * SECTOR_BYTES) as f64 / ios as f64)
    }
}

/// Split a Linux `dev_t` as glibc's `gnu_dev_major` / `gnu_dev_minor` do.
fn major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff);
    (major, minor)
}

impl BlockDev {
    /// The disk holding `path` (a file or folder that exists), or why there is none.
    pub fn under(path: &Path) -> Result<BlockDev, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (major, minor) = major_minor(meta.dev());
        let dev = format!("{major}:{minor}");
        let link = PathBuf::from(format!("/sys/dev/block/{dev}"));
        let mut sys = std::fs::canonicalize(&link)
            .map_err(|e| format!("no block device {dev} under {} ({e})", path.display()))?;
        if sys.join("partition").exists() {
            sys = sys
                .parent()
                .ok_or_else(|| format!("partition {} has no parent disk", sys.display()))?
                .to_path_buf();
        }
        let name = sys
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("unreadable device name at {}", sys.display()))?
            .to_string();
        let max_request_kib = std::fs::read_to_string(sys.join("queue/max_sectors_kb"))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let stat_path = PathBuf::from(format!("/sys/block/{name}/stat"));
        let stat_path = if stat_path.exists() {
            stat_path
        } else {
            sys.join("stat")
        };
        let found = BlockDev {
            name,
            dev,
            max_request_kib,
            stat_path,
        };
        found
            .sample()
            .ok_or_else(|| format!("cannot read {}", found.stat_path.display()))?;
        Ok(found)
    }

    /// The counters now; `None` if the file cannot be read.
    pub fn sample(&self) -> Option<DiskStat> {
        DiskStat::parse(&std::fs::read_to_string(&self.stat_path).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_t_splits_like_glibc() {
        assert_eq!(major_minor(0xfe00), (254, 0));
        assert_eq!(major_minor(0x0803), (8, 3));
        assert_eq!(major_minor((259 << 8) | 1), (259, 1));
        assert_eq!(major_minor(0x0010_0000_0000_0105), (0x10_0001, 5));
    }

    #[test]
    fn stat_fields_and_averages() {
        let before = DiskStat::parse("10 0 80 5 4 0 2048 1 0 0 0").unwrap();
        let after = DiskStat::parse("   20 3 16464 9 6 0 10240 4 0 12 13 0 0 0 0 0 0\n").unwrap();
        let d = after.since(&before);
        assert_eq!(d.read_ios, 10);
        assert_eq!(d.avg_request_bytes(false), Some(16384.0 * 512.0 / 10.0));
        assert_eq!(d.avg_request_bytes(true), Some(8192.0 * 512.0 / 2.0));
        assert_eq!(DiskStat::default().avg_request_bytes(true), None);
        assert!(DiskStat::parse("1 2").is_none());
    }
}
