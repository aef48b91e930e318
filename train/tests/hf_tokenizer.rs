//! Guards against the `tokenizers` build (no default features, `fancy-regex` instead of
//! onig) failing on the `tokenizer.json` of real LLaMA models: a LLaMA-3-style
//! byte-level BPE with its split regex (look-ahead included) and a LLaMA-2-style
//! SentencePiece BPE with byte fallback, each small but in the real files' structure.

use tidestore_train::hf::tokenizer::byte_level_tokenizer_json;
use tidestore_train::hf::Tokenizer;

fn load(tmp: &std::path::Path, json: &serde_json::Value) -> Tokenizer {
    std::fs::write(tmp.join("tokenizer.json"), json.to_string()).unwrap();
    Tokenizer::for_model(tmp).unwrap()
}

#[test]
fn llama3_style_split_regex_and_merges() {
    let tmp = tempfile::tempdir().unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&byte_level_tokenizer_json()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    // Merged tokens right after the bytes; added tokens after the whole vocabulary, as
    // in real files (the crate numbers added tokens from the vocabulary's end).
    vocab.insert("he".into(), 256.into());
    vocab.insert("ll".into(), 257.into());
    vocab.insert("Ġw".into(), 258.into());
    json["model"]["merges"] = serde_json::json!(["h e", "l l", "Ġ w"]);
    json["model"]["ignore_merges"] = true.into();
    json["added_tokens"] = serde_json::json!([{"id": 259, "content": "<|begin_of_text|>",
        "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
        "special": true}]);
    let regex = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    let tok = load(tmp.path(), &json);
    let text = "hello world's 1234  \n\nünï";
    let ids = tok.encode(text).unwrap();
    assert_eq!(&ids[..3], &[256, 257, u32::from(b'o')]);
    assert_eq!(ids[3], 258);
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert_eq!(tok.token_id("<|begin_of_text|>"), Some(259));
}

#[test]
fn llama2_style_sentencepiece_bpe_with_byte_fallback() {
    let tmp = tempfile::tempdir().unwrap();
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    for (i, t) in ["▁", "h", "i", "▁h", "▁hi"].iter().enumerate() {
        vocab.insert(t.to_string(), (259 + i).into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "vocab": vocab,
            "merges": ["▁ h", "▁h i"]},
    });
    let tok = load(tmp.path(), &json);
    let ids = tok.encode("hi é").unwrap();
    assert_eq!(ids, vec![263, 259, 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tok.decode(&ids).unwrap(), "hi é");
    assert_eq!(tok.token_id("</s>"), Some(2));
}
