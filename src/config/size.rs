//! Sizes in the configuration: [`Size`] (bytes, with binary or decimal units) and
//! [`AutoSize`] (a size, or `"auto"`), parsed from TOML integers or strings and from
//! the command line, every bad one an error saying why.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

pub(super) const KIB: u64 = 1 << 10;
pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;
pub(super) const TIB: u64 = 1 << 40;

/// A number of bytes, written in TOML or on the command line as a plain integer
/// (`4096`) or a string with an optional unit: `"4096"`, `"64MiB"`, `"1.5 GiB"`, `"2TB"`.
/// Binary units (`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`, any case) are powers of
/// 1024, decimal ones (`kB`, `MB`, `GB`, `TB`) powers of 1000. A negative, fractional
/// (below one byte) or unparsable size is an error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(pub(super) u64);

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
            if b != 0 && b.is_multiple_of(unit) {
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
            if !scaled.is_multiple_of(denominator) {
                return Err(format!("`{s}` is not a whole number of bytes"));
            }
            let extra = u64::try_from(scaled / denominator).map_err(|_| too_large())?;
            bytes = bytes.checked_add(extra).ok_or_else(too_large)?;
        }
        Ok(Size(bytes))
    }
}

/// Reads a [`Size`] from an integer or a string; [`AutoSize`] hands it its numbers.
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

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// A size, or `"auto"`: let tidestore choose (see each key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AutoSize {
    /// Chosen by tidestore.
    Auto,
    /// This many bytes.
    Fixed(Size),
}

impl AutoSize {
    /// The fixed size, or `None` for `"auto"`.
    pub fn fixed(self) -> Option<Size> {
        match self {
            AutoSize::Auto => None,
            AutoSize::Fixed(s) => Some(s),
        }
    }
}

/// As its text (`"64MiB"`), which parses back to the same size.
impl serde::Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// As its text (`"auto"`, `"64MiB"`).
impl serde::Serialize for AutoSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for AutoSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutoSize::Auto => f.write_str("auto"),
            AutoSize::Fixed(s) => s.fmt(f),
        }
    }
}

impl FromStr for AutoSize {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(AutoSize::Auto)
        } else {
            s.parse().map(AutoSize::Fixed)
        }
    }
}

impl<'de> Deserialize<'de> for AutoSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct AutoVisitor;

        impl Visitor<'_> for AutoVisitor {
            type Value = AutoSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "\"auto\" or a size: bytes as an integer, or a string such as \"64MiB\"",
                )
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<AutoSize, E> {
                SizeVisitor.visit_u64(v).map(AutoSize::Fixed)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<AutoSize, E> {
                SizeVisitor.visit_i64(v).map(AutoSize::Fixed)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<AutoSize, E> {
                SizeVisitor.visit_f64(v).map(AutoSize::Fixed)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<AutoSize, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_any(AutoVisitor)
    }
}

/// `1.50 GiB`, `512.00 MiB`, `4.00 KiB`, `12 B` (see [`tidestore_io::human_bytes`]).
pub use tidestore_io::human_bytes;
