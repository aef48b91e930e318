//! Reading the TOML text: serde with the path of every type error and unknown key, and
//! the line and column the parser points at, turned into [`Error::Config`].

use serde::de::DeserializeOwned;

use crate::error::{Error, Location, Result};

/// Deserialize without validating (the config, or any of its sections); type errors and
/// unknown keys name their key.
pub(super) fn parse<T: DeserializeOwned>(src: &str) -> Result<T> {
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
pub(super) fn key_and_reason(path: &str, message: &str) -> (String, String) {
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
pub(super) fn locate(src: &str, span: Option<std::ops::Range<usize>>) -> Location {
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
