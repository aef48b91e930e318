//! Summaries of repeated measurements, and how figures are written.
//!
//! The disks this runs on are noisy: runs alternate, and what is quoted is the median,
//! with min and max beside it so the spread is visible.

/// Median, minimum and maximum of a set of measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// `None` for an empty set; NaNs sort last and so never become the median of a set
    /// that has real figures in its lower half.
    pub fn of(values: &[f64]) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Summary {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// MB/s (10^6 bytes per second) of `bytes` moved in `secs`.
pub fn mb_per_s(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e6
    } else {
        f64::INFINITY
    }
}

/// An average request size as `1024 KiB`, or `n/a` when the device is unknown.
pub fn request_kib(bytes: Option<f64>) -> String {
    match bytes {
        Some(b) => format!("{:.0} KiB", b / 1024.0),
        None => "n/a".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_sets() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Summary::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn units() {
        assert_eq!(mb_per_s(2_000_000, 1.0), 2.0);
        assert_eq!(request_kib(Some(4_194_304.0)), "4096 KiB");
        assert_eq!(request_kib(None), "n/a");
    }
}
