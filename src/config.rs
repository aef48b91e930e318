//! The `tidestore.toml` configuration: parsing, sizes, and validation that names keys.
//!
//! One TOML file, one section per layer (`[io]`, `[chunk]`, `[nvme]` for now; tier
//! budgets, policy, optimizer and workload sections come with the store above the io
//! crate). Every struct rejects unknown keys, every size is a [`Size`] ("24GiB", "512MiB",
//! "4096" or a plain integer), and every error is an [`Error::Config`] that names the key
//! as written in TOML and the reason, with the file, line and column where the parser
//! points at it. Invariants kept:
//! - [`Config::from_toml_str`] never touches the filesystem; [`Config::load`] also
//!   resolves `nvme.dir` against the config file's folder and checks that it can be
//!   written (creating its last component if missing);
//! - a `Config` that passed [`Config::validate`] converts into an [`IoConfig`] the io
//!   crate accepts.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use tidestore_io::{EngineChoice, IoConfig, ALIGN_BYTES};

use crate::error::{from_io_validation, Error, Location, Result};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// A number of bytes, written in TOML or on the command line as a plain integer
/// (`4096`) or a string with an optional unit: `"4096"`, `"64MiB"`, `"1.5 GiB"`, `"2TB"`.
/// Binary units (`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`, any case) are powers of
/// 1024, decimal ones (`kB`, `MB`, `GB`, `TB`) powers of 1000. A negative, fractional
/// (below one byte) or unparsable size is an error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(u64);

impl Size {
    /// `bytes` bytes.
    pub const fn from_bytes(bytes: u64) -> Self {
        Size(bytes)
    }

    /// `mib` MiB.
    pub const fn from_mib(mib: u64) -> Self {
        Size(mib * MIB)
    }

    /// `gib` GiB.
    pub const fn from_gib(gib: u64) -> Self {
        Size(gib * GIB)
    }

    /// The size in bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Size {
    /// The largest binary unit that divides the size exactly (`64MiB`, `4096B` is written
    /// `4KiB`), so the text parses back to the same size and can be pasted into TOML.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (unit, name) in [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")] {
            if b != 0 && b % unit == 0 {
                return write!(f, "{}{name}", b / unit);
            }
        }
        write!(f, "{b}B")
    }
}

fn unit_multiplier(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => KIB,
        "m" | "mi" | "mib" => MIB,
        "g" | "gi" | "gib" => GIB,
        "t" | "ti" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    })
}

impl FromStr for Size {
    /// Why the text is not a size.
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        if t.is_empty() {
            return Err("an empty string is not a size".into());
        }
        if t.starts_with('-') {
            return Err(format!("`{s}` is negative; a size cannot be"));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let unit = unit.trim();
        let bad = || {
            format!(
                "`{s}` is not a size (expected bytes or a number with a unit such as \
                 \"4096\", \"512MiB\", \"24GiB\", \"2TB\")"
            )
        };
        let multiplier = unit_multiplier(unit).ok_or_else(bad)?;
        let number = number.replace('_', "");
        let (int_text, frac_text) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number.as_str(), ""),
        };
        if (int_text.is_empty() && frac_text.is_empty()) || frac_text.contains('.') {
            return Err(bad());
        }
        let too_large = || format!("`{s}` is too large");
        let int: u64 = if int_text.is_empty() {
            0
        } else {
            int_text.parse().map_err(|_| too_large())?
        };
        let mut bytes = int.checked_mul(multiplier).ok_or_else(too_large)?;
        if !frac_text.is_empty() {
            let digits = u32::try_from(frac_text.len()).map_err(|_| bad())?;
            if digits > 18 {
                return Err(format!("`{s}` has more decimals than a size can use"));
            }
            let frac: u128 = frac_text.parse().map_err(|_| bad())?;
            let scaled = frac * u128::from(multiplier);
            let denominator = 10u128.pow(digits);
            if scaled % denominator != 0 {
                return Err(format!("`{s}` is not a whole number of bytes"));
            }
            let extra = u64::try_from(scaled / denominator).map_err(|_| too_large())?;
            bytes = bytes.checked_add(extra).ok_or_else(too_large)?;
        }
        Ok(Size(bytes))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct SizeVisitor;

        impl Visitor<'_> for SizeVisitor {
            type Value = Size;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: bytes as an integer, or a string such as \"64MiB\"")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Size, E> {
                Ok(Size(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("{v} is negative; a size cannot be")))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Size, E> {
                Err(E::custom(format!(
                    "{v} is a float; write a size as an integer or a string such as \"1.5GiB\""
                )))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Size, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_any(SizeVisitor)
    }
}

/// `io.engine`: which engine moves the bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineName {
    /// io_uring where the kernel allows it, else the thread pool (logged).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// `pread`/`pwrite` on a thread pool.
    Threads,
}

impl From<EngineName> for EngineChoice {
    fn from(e: EngineName) -> Self {
        match e {
            EngineName::Auto => EngineChoice::Auto,
            EngineName::IoUring => EngineChoice::IoUring,
            EngineName::Threads => EngineChoice::ThreadPool,
        }
    }
}

/// `[io]`: how block I/O is done.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct IoSection {
    pub engine: EngineName,
    /// Size of the requests a chunk is split into; a positive multiple of 4096.
    pub block_size: Size,
    /// Most requests in flight at once, 1..=4096.
    pub queue_depth: u32,
    /// Open files with O_DIRECT.
    pub direct: bool,
    /// Register the buffer pool with io_uring (READ_FIXED / WRITE_FIXED).
    pub fixed_buffers: bool,
    /// Workers of the thread-pool engine, 1..=256.
    pub threads: u32,
}

impl Default for IoSection {
    fn default() -> Self {
        let io = IoConfig::default();
        IoSection {
            engine: match io.engine {
                EngineChoice::IoUring => EngineName::IoUring,
                EngineChoice::ThreadPool => EngineName::Threads,
                _ => EngineName::Auto,
            },
            block_size: Size(io.block_bytes as u64),
            queue_depth: io.queue_depth,
            direct: io.direct,
            fixed_buffers: io.fixed_buffers,
            threads: u32::try_from(io.threads).unwrap_or(u32::MAX),
        }
    }
}

/// `[chunk]`: the unit every transfer moves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ChunkSection {
    /// Bytes of one chunk, and of one slot of the swap file; a positive multiple of 4096.
    pub size: Size,
}

impl Default for ChunkSection {
    fn default() -> Self {
        ChunkSection {
            size: Size::from_mib(64),
        }
    }
}

/// `[nvme]`: the NVMe tier.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct NvmeSection {
    /// Folder of the swap file (and of `io-bench`'s file). Required. Relative paths are
    /// relative to the configuration file's folder.
    pub dir: Option<PathBuf>,
    /// Size of the swap file; holds at least one chunk.
    pub size: Size,
}

impl Default for NvmeSection {
    fn default() -> Self {
        NvmeSection {
            dir: None,
            size: Size::from_gib(16),
        }
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct Config {
    pub io: IoSection,
    pub chunk: ChunkSection,
    pub nvme: NvmeSection,
}

impl Config {
    /// Parse and validate a configuration from TOML text. Does not touch the filesystem:
    /// `nvme.dir` is checked for presence only (see [`Config::check_dirs`]).
    pub fn from_toml_str(src: &str) -> Result<Config> {
        let cfg = parse(src)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read, parse and validate the file at `path`; resolve a relative `nvme.dir` against
    /// the file's folder, and check that it is a writable folder (creating its last
    /// component if it is missing). Errors carry the file name.
    pub fn load(path: &Path) -> Result<Config> {
        let src = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg = Config::from_toml_str(&src).map_err(|e| e.in_file(path))?;
        if let Some(dir) = &cfg.nvme.dir {
            if dir.is_relative() {
                let base = path.parent().unwrap_or(Path::new(""));
                cfg.nvme.dir = Some(base.join(dir));
            }
        }
        cfg.check_dirs().map_err(|e| e.in_file(path))?;
        Ok(cfg)
    }

    /// Check every value, without touching the filesystem; the error names the first bad
    /// key.
    pub fn validate(&self) -> Result<()> {
        self.io_config()?.validate().map_err(from_io_validation)?;
        let chunk_bytes = self.chunk.size.bytes();
        if chunk_bytes == 0 || chunk_bytes % ALIGN_BYTES as u64 != 0 {
            return Err(Error::config(
                "chunk.size",
                format!(
                    "{chunk_bytes} bytes is not a positive multiple of {ALIGN_BYTES} \
                     (chunks are moved with O_DIRECT)"
                ),
            ));
        }
        match &self.nvme.dir {
            None => {
                return Err(Error::config(
                    "nvme.dir",
                    "missing: set the folder that holds the swap file, e.g. dir = \"/mnt/nvme/tidestore\"",
                ))
            }
            Some(dir) if dir.as_os_str().is_empty() => {
                return Err(Error::config("nvme.dir", "is empty: set the folder that holds the swap file"))
            }
            Some(_) => {}
        }
        if self.nvme.size.bytes() < chunk_bytes {
            return Err(Error::config(
                "nvme.size",
                format!(
                    "a swap file of {} is too small for one chunk of {} (chunk.size)",
                    self.nvme.size, self.chunk.size
                ),
            ));
        }
        Ok(())
    }

    /// Check that `nvme.dir` is a folder we can write to, creating it first if only its
    /// last component is missing (a missing parent is an error, not a tree to build).
    pub fn check_dirs(&self) -> Result<()> {
        let dir = self.nvme_dir()?;
        if !dir.exists() {
            if let Err(e) = std::fs::create_dir(dir) {
                return Err(Error::config(
                    "nvme.dir",
                    format!(
                        "{} does not exist and cannot be created: {e}",
                        dir.display()
                    ),
                ));
            }
            tracing::info!(dir = %dir.display(), "created nvme.dir");
        }
        tidestore_io::check_writable_dir("nvme.dir", dir).map_err(from_io_validation)
    }

    /// The folder of the NVMe tier (an error naming `nvme.dir` when it is not set).
    pub fn nvme_dir(&self) -> Result<&Path> {
        self.nvme.dir.as_deref().ok_or_else(|| {
            Error::config(
                "nvme.dir",
                "missing: set the folder that holds the swap file",
            )
        })
    }

    /// The `[io]` section as the io crate's configuration (not yet validated).
    pub fn io_config(&self) -> Result<IoConfig> {
        let io = &self.io;
        let block_bytes = usize::try_from(io.block_size.bytes()).map_err(|_| {
            Error::config(
                "io.block_size",
                format!("{} does not fit in memory", io.block_size),
            )
        })?;
        Ok(IoConfig {
            engine: io.engine.into(),
            block_bytes,
            queue_depth: io.queue_depth,
            direct: io.direct,
            fixed_buffers: io.fixed_buffers,
            threads: io.threads as usize,
        })
    }
}

/// Deserialize without validating; type errors and unknown keys name their key.
fn parse(src: &str) -> Result<Config> {
    let de = toml::Deserializer::parse(src).map_err(|e| Error::Syntax {
        at: locate(src, e.span()),
        message: one_line(e.message()),
    })?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let (key, reason) = key_and_reason(&path, inner.message());
        Error::Config {
            at: locate(src, inner.span()),
            key,
            reason,
        }
    })
}

/// The dotted key and a readable reason for a deserialization error at `path`.
/// serde reports unknown and missing fields by name in the message, at their parent.
fn key_and_reason(path: &str, message: &str) -> (String, String) {
    let parent = if path == "." { "" } else { path };
    // The path may or may not end with the field already.
    let join = |field: &str| {
        if parent.is_empty() || parent == field {
            field.to_string()
        } else if parent.ends_with(&format!(".{field}")) {
            parent.to_string()
        } else {
            format!("{parent}.{field}")
        }
    };
    for (prefix, what) in [
        ("unknown field `", "unknown key"),
        ("missing field `", "missing"),
    ] {
        if let Some(rest) = message.strip_prefix(prefix) {
            if let Some((field, tail)) = rest.split_once('`') {
                let tail = tail.trim_start_matches(',').trim();
                let reason = if tail.is_empty() {
                    what.to_string()
                } else {
                    format!("{what}; {tail}")
                };
                return (join(field), one_line(&reason));
            }
        }
    }
    let key = if parent.is_empty() {
        "(top level)".to_string()
    } else {
        parent.to_string()
    };
    // serde names our Rust types; the user wrote a TOML table.
    let message = match message.find("expected struct ") {
        Some(i) => format!("{}expected a table", &message[..i]),
        None => message.to_string(),
    };
    (key, one_line(&message))
}

/// 1-based line and column (in characters) of byte `span.start` in `src`.
fn locate(src: &str, span: Option<std::ops::Range<usize>>) -> Location {
    let line_column = span.map(|span| {
        let at = span.start.min(src.len());
        let at = (0..=at)
            .rev()
            .find(|&i| src.is_char_boundary(i))
            .unwrap_or(0);
        let before = &src[..at];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before[line_start..].chars().count() + 1;
        (line, column)
    });
    Location {
        file: None,
        line_column,
    }
}

fn one_line(s: &str) -> String {
    s.trim()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        let cases = [
            ("4096", 4096),
            ("0", 0),
            ("64MiB", 64 * MIB),
            ("64 MiB", 64 * MIB),
            ("64m", 64 * MIB),
            ("24GiB", 24 * GIB),
            ("1.5GiB", 3 * GIB / 2),
            ("2TB", 2_000_000_000_000),
            ("4kB", 4000),
            ("1_048_576", MIB),
            ("512B", 512),
        ];
        for (text, bytes) in cases {
            assert_eq!(text.parse::<Size>(), Ok(Size(bytes)), "{text}");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        for (text, why) in [
            ("-4096", "negative"),
            ("-1GiB", "negative"),
            ("12 parsecs", "not a size"),
            ("", "empty"),
            ("GiB", "not a size"),
            ("1.2.3MiB", "not a size"),
            ("0.1KiB", "whole number"),
            ("99999999999TiB", "too large"),
        ] {
            let err = text.parse::<Size>().unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn size_display_round_trips() {
        for bytes in [0, 1, 4096, 6144, MIB, 3 * GIB / 2, 5 * TIB] {
            let s = Size(bytes);
            assert_eq!(s.to_string().parse::<Size>(), Ok(s));
        }
        assert_eq!(Size::from_mib(64).to_string(), "64MiB");
    }

    #[test]
    fn key_of_unknown_and_missing_fields_includes_the_field() {
        let (k, r) = key_and_reason("io", "unknown field `blok_size`, expected one of `engine`");
        assert_eq!(k, "io.blok_size");
        assert!(r.starts_with("unknown key"), "{r}");
        let (k, _) = key_and_reason(".", "unknown field `cuda`, expected one of `io`");
        assert_eq!(k, "cuda");
        let (k, _) = key_and_reason("cuda", "unknown field `cuda`, expected one of `io`");
        assert_eq!(k, "cuda");
        let (k, _) = key_and_reason("io.blok", "unknown field `blok`, expected one of `a`");
        assert_eq!(k, "io.blok");
        let (k, _) = key_and_reason("io.queue_depth", "invalid type: string \"x\", expected u32");
        assert_eq!(k, "io.queue_depth");
    }

    #[test]
    fn locations_are_one_based() {
        let src = "a = 1\nbé = 2\n";
        assert_eq!(locate(src, Some(0..1)).line_column, Some((1, 1)));
        assert_eq!(locate(src, Some(10..11)).line_column, Some((2, 4)));
        assert_eq!(locate(src, None).line_column, None);
    }

    #[test]
    fn defaults_need_only_a_dir() {
        let cfg = Config::from_toml_str("[nvme]\ndir = \"/tmp\"\n").unwrap();
        assert_eq!(cfg.io, IoSection::default());
        assert_eq!(cfg.io_config().unwrap(), IoConfig::default());
    }

    proptest::proptest! {
        #[test]
        fn any_size_round_trips_through_its_text(bytes in 0u64..u64::MAX / 2) {
            let s = Size(bytes);
            proptest::prop_assert_eq!(s.to_string().parse::<Size>(), Ok(s));
        }
    }
}
