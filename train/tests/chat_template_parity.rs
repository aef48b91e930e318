//! Guards against a chat fine-tune that trains on other text than transformers would
//! feed the model, or on other tokens than the assistant's: for each template in
//! `fixtures/chat/` (Qwen2.5's ChatML and Llama 3's, as published), each conversation of
//! `conversations.jsonl` must render to the text transformers' `apply_chat_template`
//! produced, tokenize to its ids, and have as assistant tokens exactly those of
//! transformers' `return_assistant_tokens_mask` (`make_chat_fixtures.py` made the
//! expected files; `VERSIONS.txt` says with what).

use std::path::{Path, PathBuf};

use tidestore_train::hf::{ChatTemplate, Message, Tokenizer, TokenizerConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn conversations() -> Vec<Vec<Message>> {
    let text = std::fs::read_to_string(fixtures().join("conversations.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            serde_json::from_value(v["messages"].clone()).unwrap()
        })
        .collect()
}

#[test]
fn renders_ids_and_assistant_tokens_match_transformers() {
    let tok = Tokenizer::from_file(&fixtures().join("tokenizer.json")).unwrap();
    let convs = conversations();
    for name in ["chatml", "llama3"] {
        let dir = fixtures().join(name);
        let cfg = TokenizerConfig::for_model(&dir).unwrap();
        let template = ChatTemplate::for_model(&dir, None, &cfg).unwrap();
        let expected: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        assert_eq!(expected.len(), convs.len());
        for (i, (messages, want)) in convs.iter().zip(&expected).enumerate() {
            let r = template.render_spans(messages).unwrap();
            assert_eq!(r.text, want["text"].as_str().unwrap(), "{name} #{i}");
            let (ids, starts) = tok.encode_rendered(&r.text).unwrap();
            let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
            assert_eq!(ids, want_ids, "{name} #{i}");
            let mask: Vec<u32> = starts
                .iter()
                .map(|s| u32::from(r.assistant.iter().any(|a| a.contains(s))))
                .collect();
            let want_mask: Vec<u32> =
                serde_json::from_value(want["assistant_masks"].clone()).unwrap();
            assert_eq!(mask, want_mask, "{name} #{i}");
        }
    }
}

#[test]
fn a_model_without_a_template_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TokenizerConfig::for_model(dir.path()).unwrap();
    let e = ChatTemplate::for_model(dir.path(), None, &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.chat_template"), "{e}");
}
