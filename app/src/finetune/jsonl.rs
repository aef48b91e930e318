//! JSON Lines training data (`train.data`): one record a line, blank lines skipped.
//!
//! - `data_format = "jsonl"`: `{"text": "..."}`, a document. Its tokens are the text's
//!   (a special token's text in it read as text), with BOS before and EOS after where
//!   the tokenizer says: `tokenizer_config.json`'s `add_bos_token` / `add_eos_token`
//!   when set, else what `tokenizer.json`'s post-processor adds. Every token but the
//!   first carries loss.
//! - `data_format = "chat"`: `{"messages": [{"role": "...", "content": "..."}, ...]}`,
//!   rendered with the model's chat template as transformers renders it
//!   ([`hf::ChatTemplate`]) and tokenized as transformers tokenizes the result (special
//!   tokens the template wrote are special, nothing added). Only the assistant's
//!   tokens carry loss: its content and the end-of-turn marker after it.
//!
//! Other fields of a record are ignored; a message with keys other than `role` and
//! `content` (`tool_calls`, ...) is refused, as is a line that is not such a record, a
//! conversation the template cannot render, and a token id past the vocabulary: each
//! error names the file and the line. A sample longer than `train.sequence + 1` tokens
//! is dropped or truncated (`train.too_long`), one with no token carrying loss is
//! dropped; both are counted in the [`DataSummary`], never silent.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use tidestore_train::hf;

use super::data::{DataSummary, Row, Samples};
use super::model::Loaded;
use crate::error::{Error, Result};
use tidestore::config::{DataFormat, TooLong, TrainSection};

#[derive(Deserialize)]
struct TextRecord {
    text: String,
}

#[derive(Deserialize)]
struct ChatRecord {
    messages: Vec<ChatMessage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    content: String,
}

fn data_error(path: &Path, line: Option<usize>, reason: impl Into<String>) -> Error {
    Error::Data {
        path: path.to_path_buf(),
        line,
        reason: reason.into(),
    }
}

/// Calls `each(line, record)` for every record of `path` (see the module doc).
fn read_records<T: DeserializeOwned>(
    path: &Path,
    mut each: impl FnMut(usize, T) -> Result<()>,
) -> Result<u64> {
    let text = hf::read_text(path)?;
    let mut records = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| data_error(path, Some(i + 1), reason);
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if !value.is_object() {
            return Err(bad(format!(
                "{} is not a JSON object: a record is an object with named fields \
                 ({{\"text\": ...}} or {{\"messages\": [...]}}), never read by position",
                json_kind(&value)
            )));
        }
        let record = T::deserialize(value).map_err(|e| bad(e.to_string()))?;
        each(i + 1, record)?;
        records += 1;
    }
    Ok(records)
}

/// What a JSON value is, for an error (`an array`, `a string`).
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// BOS and EOS ids a document gets (see the module doc).
fn document_affixes(loaded: &Loaded) -> Result<(Vec<u32>, Vec<u32>)> {
    let (mut bos, mut eos) = loaded.tokenizer.special_affixes()?;
    let cfg = &loaded.tokenizer_config;
    let id_of = |key: &str| -> Result<Vec<u32>> {
        let token = cfg.token(key).ok_or_else(|| {
            Error::Finetune(format!(
                "{}: add_{key} is true but no {key} is named",
                loaded.dir.join(hf::chat::TOKENIZER_CONFIG_FILE).display()
            ))
        })?;
        let id = loaded.tokenizer.token_id(token).ok_or_else(|| {
            Error::Finetune(format!(
                "{key} `{token}` is not a token of {}",
                loaded.tokenizer.source()
            ))
        })?;
        Ok(vec![id])
    };
    match cfg.add_bos_token {
        Some(true) => bos = id_of("bos_token")?,
        Some(false) => bos.clear(),
        None => {}
    }
    match cfg.add_eos_token {
        Some(true) => eos = id_of("eos_token")?,
        Some(false) => eos.clear(),
        None => {}
    }
    Ok((bos, eos))
}

/// A conversation rendered and tokenized, its assistant tokens flagged.
fn chat_row(
    template: &hf::ChatTemplate,
    loaded: &Loaded,
    messages: Vec<ChatMessage>,
) -> Result<Row> {
    let messages: Vec<hf::Message> = messages
        .into_iter()
        .map(|m| hf::Message {
            role: m.role,
            content: m.content,
        })
        .collect();
    let rendered = template.render_spans(&messages)?;
    let (ids, starts) = loaded.tokenizer.encode_rendered(&rendered.text)?;
    let loss = starts
        .iter()
        .map(|s| rendered.assistant.iter().any(|a| a.contains(s)))
        .collect();
    Ok(Row { ids, loss })
}

/// `row` fitted to `sequence + 1` tokens per `too_long`, or `None` (counted).
fn fit(mut row: Row, sequence: usize, too_long: TooLong, summary: &mut DataSummary) -> Option<Row> {
    if row.ids.len() > sequence + 1 {
        if too_long == TooLong::Drop {
            summary.dropped_too_long += 1;
            return None;
        }
        summary.truncated += 1;
        row.ids.truncate(sequence + 1);
        row.loss.truncate(sequence + 1);
    }
    if !row.loss.iter().skip(1).any(|&l| l) {
        summary.dropped_no_loss += 1;
        return None;
    }
    Some(row)
}

/// The samples of `train.data` (see the module doc).
pub fn samples(t: &TrainSection, loaded: &Loaded) -> Result<Samples> {
    assert_ne!(
        t.data_format,
        DataFormat::Text,
        "plain text is cut into windows"
    );
    let path = t.data()?;
    let sequence = t.sequence as usize;
    let vocab = loaded.hf.vocab_size;
    let mut summary = DataSummary::default();
    let mut rows = Vec::new();
    let mut keep = |line: usize, row: Row, summary: &mut DataSummary| -> Result<()> {
        if let Some(id) = row.ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(data_error(
                path,
                Some(line),
                format!(
                    "token id {id} from {} is past the model's vocab_size {vocab}",
                    loaded.tokenizer.source()
                ),
            ));
        }
        rows.extend(fit(row, sequence, t.too_long, summary));
        Ok(())
    };
    summary.records = match t.data_format {
        DataFormat::Chat => {
            let template = hf::ChatTemplate::for_model(
                &loaded.dir,
                t.chat_template.as_deref(),
                &loaded.tokenizer_config,
            )?;
            read_records(path, |line, r: ChatRecord| {
                let row = chat_row(&template, loaded, r.messages)
                    .map_err(|e| data_error(path, Some(line), e.to_string()))?;
                keep(line, row, &mut summary)
            })?
        }
        DataFormat::Jsonl | DataFormat::Text => {
            let (bos, eos) = document_affixes(loaded)?;
            read_records(path, |line, r: TextRecord| {
                let ids: Vec<u32> = bos
                    .iter()
                    .copied()
                    .chain(loaded.tokenizer.encode(&r.text)?)
                    .chain(eos.iter().copied())
                    .collect();
                let loss = vec![true; ids.len()];
                keep(line, Row { ids, loss }, &mut summary)
            })?
        }
    };
    summary.format = format!("{:?}", t.data_format).to_lowercase();
    finish(path, t, loaded, &rows, summary)
}

/// The padded samples, or an error when none is left.
fn finish(
    path: &Path,
    t: &TrainSection,
    loaded: &Loaded,
    rows: &[Row],
    summary: DataSummary,
) -> Result<Samples> {
    if rows.is_empty() {
        return Err(data_error(
            path,
            None,
            format!(
                "no sample to train on: {} records, {} longer than train.sequence + 1 = {} \
                 (train.too_long = \"drop\"), {} with no token that carries loss",
                summary.records,
                summary.dropped_too_long,
                t.sequence + 1,
                summary.dropped_no_loss
            ),
        ));
    }
    tracing::info!(
        records = summary.records,
        samples = rows.len(),
        dropped_too_long = summary.dropped_too_long,
        truncated = summary.truncated,
        dropped_no_loss = summary.dropped_no_loss,
        "training data read"
    );
    Samples::padded(
        rows,
        pad_id(loaded),
        t.sequence as usize,
        t.micro_batch as usize,
        t.seed,
        summary,
    )
}

/// The id padding inputs get: the tokenizer's pad token, else its EOS, else 0. Which
/// one does not change what is trained: padding follows a sample's last token and its
/// targets carry no loss (see [`super::data`]).
fn pad_id(loaded: &Loaded) -> u32 {
    ["pad_token", "eos_token"]
        .iter()
        .filter_map(|k| loaded.tokenizer_config.token(k))
        .find_map(|t| loaded.tokenizer.token_id(t))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line holding an array (`["abc"]`) was once read as a record by position.
    #[test]
    fn a_record_must_be_an_object() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\": \"ok\"}\n[\"abc\"]\n").unwrap();
        let mut seen = Vec::new();
        let e = read_records(&path, |line, r: TextRecord| {
            seen.push((line, r.text));
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("d.jsonl:2") && e.contains("an array is not a JSON object"),
            "{e}"
        );
        assert_eq!(seen, [(1, "ok".to_string())]);
        std::fs::write(&path, "[[{\"role\": \"user\", \"content\": \"x\"}]]\n").unwrap();
        let e = read_records(&path, |_, _: ChatRecord| Ok(())).unwrap_err();
        assert!(e.to_string().contains("d.jsonl:1"), "{e}");
    }
}
