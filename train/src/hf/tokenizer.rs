//! Text to token ids: a model directory's `tokenizer.json` through Hugging Face's
//! `tokenizers` crate, or byte-level where the directory has none; and the training text
//! file, read and checked.
//!
//! The `tokenizers` crate is built without default features and with `fancy-regex` (a
//! pure-Rust regex, instead of the onig C library): that reads the `tokenizer.json` of
//! LLaMA 2 (SentencePiece-style BPE with byte fallback) and LLaMA 3 (byte-level BPE with
//! a split regex).
//!
//! Byte-level: token `b` (0..=255) is the byte `b` of the UTF-8 text, `<s>` is 256 and
//! `</s>` is 257 ([`BYTE_LEVEL_VOCAB`] ids). [`byte_level_tokenizer_json`] writes the same
//! mapping as a `tokenizer.json` (GPT-2 byte-level BPE with no merges), so a model made
//! by [`crate::hf::init_model`] tokenizes the same with or without its file.
//!
//! [`Tokenizer::encode`] never adds special tokens and reads a special token's text in
//! the training text (a literal `<s>`) as text, as the byte-level tokenizer does (the
//! `tokenizers` crate's `encode_special_tokens`, transformers' `split_special_tokens`);
//! the caller places BOS/EOS where it wants them. [`Tokenizer::encode_rendered`], for a
//! chat template's output, reads them as the special tokens the template wrote.

use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};
use crate::hf::config::{LlamaConfig, CONFIG_FILE};

/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Ids of the byte-level tokenizer: 256 bytes, `<s>`, `</s>`.
pub const BYTE_LEVEL_VOCAB: usize = 258;
/// `<s>` of the byte-level tokenizer.
pub const BYTE_LEVEL_BOS: u32 = 256;
/// `</s>` of the byte-level tokenizer.
pub const BYTE_LEVEL_EOS: u32 = 257;
/// Texts longer than this are encoded in pieces cut after a newline (see [`Tokenizer::encode`]).
pub const ENCODE_PIECE_BYTES: usize = 1 << 20;

/// A tokenizer: a `tokenizer.json`, or byte-level.
#[derive(Debug)]
pub struct Tokenizer {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Hf {
        /// Special tokens' texts read as the special tokens.
        tokenizer: Box<tokenizers::Tokenizer>,
        /// The same, reading them as text.
        literal: Box<tokenizers::Tokenizer>,
        path: PathBuf,
    },
    Bytes,
}

impl Tokenizer {
    /// `dir/tokenizer.json` when it exists, else byte-level (anything else by that
    /// name, a directory say, is refused rather than taken for no tokenizer).
    pub fn for_model(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join(TOKENIZER_FILE);
        if path.is_file() {
            Tokenizer::from_file(&path)
        } else if path.exists() {
            Err(TrainError::Tokenizer {
                path,
                reason: "is not a file".into(),
            })
        } else {
            tracing::info!(dir = %dir.display(), "no tokenizer.json: byte-level tokens");
            Ok(Tokenizer::byte_level())
        }
    }

    /// A `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|e| TrainError::Tokenizer {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let mut literal = tokenizer.clone();
        literal.set_encode_special_tokens(true);
        Ok(Tokenizer {
            inner: Inner::Hf {
                tokenizer: Box::new(tokenizer),
                literal: Box::new(literal),
                path: path.to_path_buf(),
            },
        })
    }

    /// The byte-level tokenizer (see the module doc).
    pub fn byte_level() -> Tokenizer {
        Tokenizer {
            inner: Inner::Bytes,
        }
    }

    /// Whether this is the built-in byte-level tokenizer.
    pub fn is_byte_level(&self) -> bool {
        matches!(self.inner, Inner::Bytes)
    }

    /// Ids in use: the model's `vocab_size` must be at least this.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Hf { tokenizer, .. } => tokenizer.get_vocab_size(true),
            Inner::Bytes => BYTE_LEVEL_VOCAB,
        }
    }

    /// Refuses a model whose embedding has fewer rows than this tokenizer has ids
    /// ([`TrainError::HfConfig`] on `vocab_size`, naming the model's `config.json`).
    pub fn check_fits(&self, cfg: &LlamaConfig, model_dir: &Path) -> Result<()> {
        let ids = self.vocab_size();
        if ids > cfg.vocab_size {
            return Err(TrainError::HfConfig {
                path: model_dir.join(CONFIG_FILE),
                key: "vocab_size".into(),
                reason: format!(
                    "{} rows, but the tokenizer ({}) uses {ids} ids",
                    cfg.vocab_size,
                    self.source()
                ),
            });
        }
        Ok(())
    }

    /// Where the tokenizer comes from: its file, or `byte-level`.
    pub fn source(&self) -> String {
        match &self.inner {
            Inner::Hf { path, .. } => path.display().to_string(),
            Inner::Bytes => "byte-level".into(),
        }
    }

    /// The id of a token (`<s>`, `</s>`, `<|begin_of_text|>`, ...).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf { tokenizer, .. } => tokenizer.token_to_id(token),
            Inner::Bytes => match token {
                "<s>" => Some(BYTE_LEVEL_BOS),
                "</s>" => Some(BYTE_LEVEL_EOS),
                _ => None,
            },
        }
    }

    /// The ids of `text`, without special tokens, a special token's text read as text.
    /// A text longer than
    /// [`ENCODE_PIECE_BYTES`] is encoded in pieces cut just after a newline (bounded
    /// memory; a SentencePiece-style tokenizer may then tokenize the first word of a
    /// piece as the start of a text).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let (tokenizer, path) = match &self.inner {
            Inner::Bytes => return Ok(text.bytes().map(u32::from).collect()),
            Inner::Hf { literal, path, .. } => (literal, path),
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        for piece in pieces(text, ENCODE_PIECE_BYTES) {
            let enc = encode_with(tokenizer, path, piece, false)?;
            ids.extend_from_slice(enc.get_ids());
        }
        Ok(ids)
    }

    /// The ids of a chat template's output `text` with the byte offset in `text` where
    /// each token starts: special tokens' texts are the special tokens (as transformers
    /// tokenizes `apply_chat_template`'s text), nothing added.
    pub fn encode_rendered(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>)> {
        match &self.inner {
            Inner::Hf {
                tokenizer, path, ..
            } => {
                let enc = encode_with(tokenizer, path, text, false)?;
                let starts = enc.get_offsets().iter().map(|o| o.0).collect();
                Ok((enc.get_ids().to_vec(), starts))
            }
            Inner::Bytes => Ok(byte_level_rendered(text)),
        }
    }

    /// The ids `tokenizer.json`'s post-processor puts before and after a text (BOS,
    /// EOS: what transformers' `add_special_tokens=True` adds); none for byte-level.
    pub fn special_affixes(&self) -> Result<(Vec<u32>, Vec<u32>)> {
        let Inner::Hf { literal, path, .. } = &self.inner else {
            return Ok((Vec::new(), Vec::new()));
        };
        let encode = |specials: bool| {
            encode_with(literal, path, "a", specials).map(|e| e.get_ids().to_vec())
        };
        let (plain, with) = (encode(false)?, encode(true)?);
        let at = (0..=with.len().saturating_sub(plain.len()))
            .find(|&i| with[i..].starts_with(&plain))
            .ok_or_else(|| TrainError::Tokenizer {
                path: path.clone(),
                reason: "the post-processor changes a text's own tokens".into(),
            })?;
        Ok((with[..at].to_vec(), with[at + plain.len()..].to_vec()))
    }

    /// The text of `ids`, special tokens skipped (invalid UTF-8 from a byte-level
    /// sequence cut mid-character is replaced by U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Inner::Hf {
                tokenizer, path, ..
            } => tokenizer
                .decode(ids, true)
                .map_err(|e| TrainError::Tokenizer {
                    path: path.clone(),
                    reason: format!("decoding: {e}"),
                }),
            Inner::Bytes => {
                let mut bytes = Vec::with_capacity(ids.len());
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(b) => bytes.push(b),
                        Err(_) if (id as usize) < BYTE_LEVEL_VOCAB => {}
                        Err(_) => {
                            return Err(TrainError::Tokenizer {
                                path: PathBuf::from("<byte-level>"),
                                reason: format!("id {id} is not a byte-level token"),
                            })
                        }
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

/// [`Tokenizer::encode_rendered`] of the byte-level tokenizer: `<s>` and `</s>` are
/// its special tokens, every other byte itself.
fn byte_level_rendered(text: &str) -> (Vec<u32>, Vec<usize>) {
    let bytes = text.as_bytes();
    let (mut ids, mut starts) = (
        Vec::with_capacity(bytes.len()),
        Vec::with_capacity(bytes.len()),
    );
    let mut at = 0;
    while at < bytes.len() {
        starts.push(at);
        if bytes[at..].starts_with(b"<s>") {
            ids.push(BYTE_LEVEL_BOS);
            at += 3;
        } else if bytes[at..].starts_with(b"</s>") {
            ids.push(BYTE_LEVEL_EOS);
            at += 4;
        } else {
            ids.push(u32::from(bytes[at]));
            at += 1;
        }
    }
    (ids, starts)
}

/// `text` cut into pieces of about `max` bytes, each ending just after a newline where
/// one is found (else at a character boundary).
fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.len() <= max {
            return Some(std::mem::take(&mut rest));
        }
        let mut cut = max;
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if let Some(nl) = rest[..cut].rfind('\n') {
            cut = nl + 1;
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// Reads a training text file: refused when it cannot be read, is empty, or is not
/// UTF-8 (naming the byte offset of the first invalid byte).
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
        op: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.is_empty() {
        return Err(TrainError::TextFile {
            path: path.to_path_buf(),
            reason: "empty: nothing to train on".into(),
        });
    }
    String::from_utf8(bytes).map_err(|e| TrainError::TextFile {
        path: path.to_path_buf(),
        reason: format!(
            "not UTF-8: invalid byte at offset {}",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// GPT-2's map from bytes to printable characters (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or_else(|| unreachable!("256..324 are characters"))
}

/// A `tokenizer.json` that maps every byte `b` to id `b`, with `<s>` = 256 and
/// `</s>` = 257 (see the module doc).
pub fn byte_level_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), u32::from(b).into()))
        .collect();
    let special = |id: u32, content: &str| {
        serde_json::json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true,
        })
    };
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true,
    });
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(BYTE_LEVEL_BOS, "<s>"), special(BYTE_LEVEL_EOS, "</s>")],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [],
        },
    });
    serde_json::to_string_pretty(&json)
        .unwrap_or_else(|e| unreachable!("a JSON value always serialises: {e}"))
}

/// `text` encoded by `tokenizer`, with the special tokens its post-processor adds when
/// `specials`; a failure names the file at `path`.
fn encode_with(
    tokenizer: &tokenizers::Tokenizer,
    path: &Path,
    text: &str,
    specials: bool,
) -> Result<tokenizers::Encoding> {
    tokenizer
        .encode(text, specials)
        .map_err(|e| TrainError::Tokenizer {
            path: path.to_path_buf(),
            reason: format!("encoding: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_are_distinct_and_match_gpt2() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'a'), 'a');
    }

    #[test]
    fn a_vocabulary_too_small_for_the_tokenizer_is_refused() {
        let shape = crate::hf::LlamaShape {
            hidden_size: 8,
            intermediate_size: 8,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            vocab_size: 200,
            tie_word_embeddings: true,
            max_position_embeddings: 16,
        };
        let cfg = LlamaConfig::from_shape(shape).unwrap();
        let e = Tokenizer::byte_level().check_fits(&cfg, Path::new("m"));
        assert!(matches!(e, Err(TrainError::HfConfig { ref key, .. }) if key == "vocab_size"));
        let cfg = LlamaConfig::from_shape(crate::hf::LlamaShape {
            vocab_size: 258,
            ..shape
        })
        .unwrap();
        Tokenizer::byte_level()
            .check_fits(&cfg, Path::new("m"))
            .unwrap();
    }

    /// A `tokenizer.json` that is not a file (a directory) was once taken for none:
    /// byte-level tokens, silently.
    #[test]
    fn a_tokenizer_json_that_is_no_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(TOKENIZER_FILE)).unwrap();
        let e = Tokenizer::for_model(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(TOKENIZER_FILE) && e.contains("is not a file"),
            "{e}"
        );
    }

    #[test]
    fn a_literal_special_token_in_the_text_is_text_with_or_without_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKENIZER_FILE);
        std::fs::write(&path, byte_level_tokenizer_json()).unwrap();
        let file = Tokenizer::from_file(&path).unwrap();
        let text = "a <s> b </s>";
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(file.encode(text).unwrap(), bytes);
        assert_eq!(Tokenizer::byte_level().encode(text).unwrap(), bytes);
        // A chat template's output: the special tokens it wrote are special.
        for t in [file, Tokenizer::byte_level()] {
            let (ids, starts) = t.encode_rendered("<s>hi</s>").unwrap();
            assert_eq!(ids, [BYTE_LEVEL_BOS, 104, 105, BYTE_LEVEL_EOS]);
            assert_eq!(starts, [0, 3, 4, 5]);
        }
    }

    #[test]
    fn pieces_cut_after_newlines_and_cover_the_text() {
        let text = "ab\ncd\néé\nxyz";
        let p: Vec<&str> = pieces(text, 5).collect();
        assert_eq!(p.concat(), text);
        assert_eq!(p[0], "ab\n");
        assert!(p.iter().all(|s| s.len() <= 5));
    }
}
