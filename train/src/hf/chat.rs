//! Chat templates: a conversation (`messages` with roles) rendered to text as
//! `transformers`' `apply_chat_template` renders it, and the byte spans of that text
//! that are the assistant's, which are the ones a chat fine-tune trains on.
//!
//! # Where the template comes from
//! A file given by the caller (`train.chat_template`), else the model directory's
//! `chat_template.jinja` (what `save_pretrained` writes since transformers 4.47), else
//! the `chat_template` key of its `tokenizer_config.json` (a string, or a list of named
//! templates of which `default` is taken). The template sees what transformers hands
//! it: `messages`, `add_generation_prompt`, `tools` and `documents` as none, and the
//! tokenizer's special tokens as strings (`bos_token`, `eos_token`, ... from
//! `tokenizer_config.json`). Not `strftime_now`: a template that writes today's date
//! when it can (Llama 3.2's) falls back to its fixed one, so the tokens of a run do not
//! change with the day it is resumed on.
//!
//! # Rendering as Jinja2 does
//! `minijinja` with transformers' settings: `trim_blocks` and `lstrip_blocks` on, loop
//! controls, the Python string methods templates call (`minijinja-contrib`'s
//! `pycompat`), `raise_exception(msg)` failing the render with `msg`, `tojson`, and
//! transformers' `{% generation %}` block tags rendering their content only.
//!
//! # The assistant's spans
//! For an assistant message `i`, its span is what the template adds between rendering
//! `messages[..i]` with the generation prompt and rendering `messages[..=i]`: the
//! message's content and the end-of-turn marker the template writes after it. That
//! needs the renders of the prefixes to be prefixes of the whole render; a template for
//! which they are not (one that rewrites earlier turns depending on what follows) is
//! refused, as is a render that leaves out a message's content (a role the template
//! does not know, silently skipped) or that fails: never a silent change of what is
//! trained.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Result, TrainError};

/// The tokenizer config file of a model directory.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The chat template file `save_pretrained` writes beside it.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, or another role the template knows.
    pub role: String,
    /// The text.
    pub content: String,
}

/// The assistant's role name.
pub const ASSISTANT: &str = "assistant";

/// What a model directory's `tokenizer_config.json` says that training uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// The special tokens as strings (`bos_token`, `eos_token`, `pad_token`, ...).
    pub special: serde_json::Map<String, serde_json::Value>,
    /// `add_bos_token`, when set.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when set.
    pub add_eos_token: Option<bool>,
    /// `chat_template`, when set (the `default` one of a list).
    pub chat_template: Option<String>,
}

const SPECIAL_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// A special token's text: a string, or an `AddedToken` object's `content`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl TokenizerConfig {
    /// `dir/tokenizer_config.json`, or the empty config when there is none.
    pub fn for_model(dir: &Path) -> Result<TokenizerConfig> {
        let path = dir.join(TOKENIZER_CONFIG_FILE);
        if !path.is_file() {
            return Ok(TokenizerConfig::default());
        }
        let bad = |reason: String| TrainError::Tokenizer {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut special = serde_json::Map::new();
        for key in SPECIAL_KEYS {
            if let Some(t) = v.get(key).and_then(token_text) {
                special.insert(key.to_string(), t.into());
            }
        }
        if let Some(extra) = v
            .get("additional_special_tokens")
            .and_then(|a| a.as_array())
        {
            let texts: Vec<serde_json::Value> = extra
                .iter()
                .filter_map(token_text)
                .map(Into::into)
                .collect();
            special.insert("additional_special_tokens".into(), texts.into());
        }
        let chat_template = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str().map(str::to_string)),
            Some(other) => return Err(bad(format!("chat_template is {other}, not a string"))),
        };
        Ok(TokenizerConfig {
            special,
            add_bos_token: flag(&v, "add_bos_token").map_err(bad)?,
            add_eos_token: flag(&v, "add_eos_token").map_err(bad)?,
            chat_template,
        })
    }

    /// A special token's text (`bos_token`, `eos_token`, `pad_token`, ...).
    pub fn token(&self, key: &str) -> Option<&str> {
        self.special.get(key).and_then(|v| v.as_str())
    }
}

/// A conversation rendered: the text and the assistant's byte spans in it, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The text, as `apply_chat_template(messages, tokenize=False)` gives it.
    pub text: String,
    /// Byte ranges of `text` that are the assistant's (see the module doc).
    pub assistant: Vec<Range<usize>>,
}

/// A chat template, compiled.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special: serde_json::Map<String, serde_json::Value>,
    source: PathBuf,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// The template of `given` (a file) or of the model directory (see the module doc);
    /// an error naming the directory when it has none.
    pub fn for_model(dir: &Path, given: Option<&Path>, config: &TokenizerConfig) -> Result<Self> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TrainError::Io {
                op: "reading the chat template",
                path: path.to_path_buf(),
                source,
            })
        };
        if let Some(path) = given {
            return ChatTemplate::new(read(path)?, &config.special, path.to_path_buf());
        }
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            return ChatTemplate::new(read(&file)?, &config.special, file);
        }
        match &config.chat_template {
            Some(t) => {
                ChatTemplate::new(t.clone(), &config.special, dir.join(TOKENIZER_CONFIG_FILE))
            }
            None => Err(TrainError::ChatTemplate {
                path: dir.to_path_buf(),
                reason: format!(
                    "no chat template: neither {CHAT_TEMPLATE_FILE} nor a chat_template in \
                     {TOKENIZER_CONFIG_FILE}; set train.chat_template"
                ),
            }),
        }
    }

    /// `template` compiled, `source` naming it in errors; `special` are the special
    /// tokens the template sees.
    pub fn new(
        template: String,
        special: &serde_json::Map<String, serde_json::Value>,
        source: PathBuf,
    ) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&source, &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(NAME, without_generation_tags(&template))
            .map_err(|e| template_error(&source, &e))?;
        Ok(ChatTemplate {
            env,
            special: special.clone(),
            source,
        })
    }

    /// Where the template was read.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// `messages` rendered, with the generation prompt when `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut ctx = self.special.clone();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages)
                .unwrap_or_else(|e| unreachable!("messages always serialise: {e}")),
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        // transformers passes these as None: `tools is not none` must be false.
        ctx.insert("tools".into(), serde_json::Value::Null);
        ctx.insert("documents".into(), serde_json::Value::Null);
        let value = minijinja::Value::from(minijinja::value::Serde(ctx));
        self.env
            .get_template(NAME)
            .and_then(|t| t.render(value))
            .map_err(|e| template_error(&self.source, &e))
    }

    /// `messages` rendered whole, with the assistant's spans (see the module doc).
    pub fn render_spans(&self, messages: &[Message]) -> Result<Rendered> {
        let text = self.render(messages, false)?;
        let mut assistant = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let trimmed = m.content.trim();
            if !trimmed.is_empty() && !text.contains(trimmed) {
                return Err(self.refuse(format!(
                    "message {} (role `{}`) is not in the rendered text: the template does \
                     not know the role, or drops the message",
                    i + 1,
                    m.role
                )));
            }
            if m.role != ASSISTANT {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let after = self.render(&messages[..=i], false)?;
            if !after.starts_with(&before) || !text.starts_with(&after) {
                return Err(self.refuse(format!(
                    "the conversation up to message {} does not render as a prefix of the \
                     whole: the assistant's tokens cannot be told apart",
                    i + 1
                )));
            }
            assistant.push(before.len()..after.len());
        }
        Ok(Rendered { text, assistant })
    }

    fn refuse(&self, reason: String) -> TrainError {
        TrainError::ChatTemplate {
            path: self.source.clone(),
            reason,
        }
    }
}

/// `template` with transformers' `{% generation %}` / `{% endgeneration %}` block tags
/// (which mark the assistant's text for `return_assistant_tokens_mask` and render
/// nothing) as `{% if true %}` / `{% endif %}`: minijinja knows no such tag, and the
/// `if` keeps the tags' whitespace control (`{%- generation -%}`).
fn without_generation_tags(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (left, body, right) = trim_controls(inner);
        let replaced = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(r) => out.push_str(&format!("{{%{left} {r} {right}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// A tag's inside split into its leading whitespace control (`-`, `+` or none), its
/// trimmed body, and its trailing control.
fn trim_controls(inner: &str) -> (&str, &str, &str) {
    let control = |c: char| c == '-' || c == '+';
    let left = if inner.starts_with(control) {
        &inner[..1]
    } else {
        ""
    };
    let right = if inner.ends_with(control) && inner.len() > left.len() {
        &inner[inner.len() - 1..]
    } else {
        ""
    };
    let body = inner[left.len()..inner.len() - right.len()].trim();
    (left, body, right)
}

/// A boolean key of tokenizer_config.json (`add_bos_token`): true, false, or absent /
/// null (unset), as transformers reads it; anything else (`"yes"`, `1`) is refused
/// rather than taken as false.
fn flag(v: &serde_json::Value, key: &str) -> std::result::Result<Option<bool>, String> {
    match v.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!("{key} is {other}, not true, false or null")),
    }
}

/// A minijinja error as the crate's, with the template's line where it has one.
fn template_error(source: &Path, e: &minijinja::Error) -> TrainError {
    let line = e
        .line()
        .map_or(String::new(), |l| format!(" (template line {l})"));
    let detail = e.detail().map_or(String::new(), |d| format!(": {d}"));
    TrainError::ChatTemplate {
        path: source.to_path_buf(),
        reason: format!("{}{detail}{line}", e.kind()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    fn template(t: &str) -> ChatTemplate {
        ChatTemplate::new(t.into(), &serde_json::Map::new(), "t.jinja".into()).unwrap()
    }

    #[test]
    fn a_non_boolean_add_bos_token_is_refused_naming_the_file_and_key() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(TOKENIZER_CONFIG_FILE);
        for (value, want) in [("true", Some(true)), ("false", Some(false)), ("null", None)] {
            std::fs::write(&path, format!("{{\"add_bos_token\": {value}}}")).unwrap();
            let c = TokenizerConfig::for_model(d.path()).unwrap();
            assert_eq!(c.add_bos_token, want, "{value}");
        }
        for key in ["add_bos_token", "add_eos_token"] {
            for value in ["\"yes\"", "1"] {
                std::fs::write(&path, format!("{{\"{key}\": {value}}}")).unwrap();
                let e = TokenizerConfig::for_model(d.path())
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains(TOKENIZER_CONFIG_FILE) && e.contains(key) && e.contains(value),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn the_assistant_span_is_its_content_and_end_of_turn() {
        let r = template(CHATML)
            .render_spans(&[
                msg("user", "hi"),
                msg("assistant", "hello"),
                msg("user", "bye"),
            ])
            .unwrap();
        assert_eq!(r.assistant.len(), 1);
        assert_eq!(&r.text[r.assistant[0].clone()], "hello<|im_end|>\n");
        let tools = "{% if tools is not none %}T{% endif %}{% if strftime_now is defined %}D\
                     {% endif %}{{ messages[0]['content'] }}";
        assert_eq!(
            template(tools).render(&[msg("user", "x")], false).unwrap(),
            "x"
        );
    }

    #[test]
    fn generation_tags_render_nothing_and_keep_their_whitespace_control() {
        let tagged = "{% for m in messages %}{% if m['role'] == 'assistant' %}A: \
                      {%- generation %}{{ m['content'] }}|{% endgeneration -%}\n{% else %}\
                      U: {{ m['content'] }}\n{% endif %}{% endfor %}";
        let r = template(tagged)
            .render_spans(&[msg("user", "hi"), msg("assistant", " yo")])
            .unwrap();
        assert_eq!(r.text, "U: hi\nA: yo|", "the space before the tag trimmed");
        assert_eq!(
            without_generation_tags("{%generation%}x{%+ endgeneration %}{% if a %}"),
            "{% if true %}x{%+ endif %}{% if a %}"
        );
    }

    #[test]
    fn failures_and_dropped_roles_are_refused_naming_the_template() {
        let raising = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}";
        let e = template(raising)
            .render_spans(&[msg("system", "s"), msg("assistant", "a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no system role") && e.contains("t.jinja"), "{e}");
        let dropping = "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}{{ m['content'] }}{% endif %}{% endfor %}";
        let e = template(dropping)
            .render_spans(&[msg("narrator", "once upon"), msg("assistant", "a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("role `narrator`"), "{e}");
        let bad = ChatTemplate::new(
            "{% for %}".into(),
            &serde_json::Map::new(),
            "t.jinja".into(),
        );
        assert!(matches!(bad, Err(TrainError::ChatTemplate { .. })));
    }
}
