//! Running fio on the benchmark's own file, for `io-bench --compare-fio`.
//!
//! One fio job per run: the same file, block size, queue depth and byte count as ours,
//! `direct=1`, `ioengine=io_uring`, sequential `rw=write` or `rw=read`, JSON output. The
//! figure taken is fio's own `bw_bytes` for the job. fio not being installed is a clear
//! error, found before any run starts.

use std::path::Path;
use std::process::Command;

use super::Error;

/// fio's version line, or an error saying how to get fio.
pub fn check_installed() -> Result<String, Error> {
    match Command::new("fio").arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
        Ok(out) => Err(Error::Fio(format!(
            "`fio --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Fio(
            "fio is not installed, and --compare-fio needs it: install it (Debian/Ubuntu: \
             `apt-get install -y fio`) or leave out --compare-fio"
                .to_string(),
        )),
        Err(e) => Err(Error::Fio(format!("cannot run fio: {e}"))),
    }
}

/// fio separates file names with `:`; escape it.
fn escape_filename(path: &Path) -> String {
    path.display().to_string().replace(':', "\\:")
}

/// Run one sequential fio job over the first `size_bytes` of `path` and return its
/// bandwidth in bytes per second.
pub fn run(
    path: &Path,
    write: bool,
    block_bytes: usize,
    queue_depth: u32,
    size_bytes: u64,
) -> Result<f64, Error> {
    let rw = if write { "write" } else { "read" };
    let out = Command::new("fio")
        .arg(format!("--name=tidestore-{rw}"))
        .arg(format!("--filename={}", escape_filename(path)))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={block_bytes}"))
        .arg(format!("--iodepth={queue_depth}"))
        .arg("--direct=1")
        .arg("--ioengine=io_uring")
        .arg(format!("--size={size_bytes}"))
        .arg("--numjobs=1")
        .arg("--output-format=json")
        .output()
        .map_err(|e| Error::Fio(format!("cannot run fio: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr
            .lines()
            .chain(stdout.lines())
            .find(|l| !l.trim().is_empty());
        return Err(Error::Fio(format!(
            "fio {rw} failed ({}): {}",
            out.status,
            why.unwrap_or("no output").trim()
        )));
    }
    parse_bw_bytes(&stdout, rw)
}

/// `jobs[0].<rw>.bw_bytes` of fio's JSON output (fio may print notes before the JSON).
fn parse_bw_bytes(stdout: &str, rw: &str) -> Result<f64, Error> {
    let start = stdout
        .find('{')
        .ok_or_else(|| Error::Fio(format!("no JSON in fio's output: {}", stdout.trim())))?;
    let json: serde_json::Value = serde_json::from_str(&stdout[start..])
        .map_err(|e| Error::Fio(format!("unreadable JSON from fio: {e}")))?;
    let job = &json["jobs"][0];
    if let Some(err) = job["error"].as_i64().filter(|&e| e != 0) {
        return Err(Error::Fio(format!("fio {rw} job ended with error {err}")));
    }
    job[rw]["bw_bytes"]
        .as_f64()
        .filter(|&bw| bw > 0.0)
        .ok_or_else(|| Error::Fio(format!("fio's JSON has no positive jobs[0].{rw}.bw_bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_is_read_from_json_after_notes() {
        let out = "note: both iodepth >= 1 and synchronous I/O engine are selected\n\
                   {\"jobs\": [{\"error\": 0, \"read\": {\"bw_bytes\": 2000000000}, \"write\": {\"bw_bytes\": 0}}]}";
        assert_eq!(parse_bw_bytes(out, "read").unwrap(), 2e9);
        assert!(parse_bw_bytes(out, "write").is_err());
        assert!(parse_bw_bytes("garbage", "read").is_err());
    }

    #[test]
    fn colons_are_escaped() {
        assert_eq!(escape_filename(Path::new("/a:b/c")), "/a\\:b/c");
    }
}
