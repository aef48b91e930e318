//! Guards `tidestore finetune` on JSONL chat data and its LoRA exports, as a user runs
//! them: the tokens that carry loss must be exactly the assistant tokens transformers
//! marks in the rendered template (a run that trained on the prompt, or on padding,
//! would count more); the PEFT adapter and the merged export of one run must compute the
//! same logits when tidestore loads them back (a merge with the wrong scale, or a
//! transposed product, would not); the adapter must name its base by name, not by a
//! machine path; a sharded merged export must round-trip byte-identical through a
//! second run that changes nothing (lr 0); and bad chat input is refused naming the
//! file and line.

use std::path::{Path, PathBuf};
use std::process::Output;

use candle_core::{Device, Tensor};
use tidestore::train::hf;
use tidestore_candle::{InMemory, Llama, LlamaLora};

mod common;

use common::{ok, run};

fn chat_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/tests/fixtures/chat")
}

const STORE: &str = "[device]\nkind = \"sim\"\nbudget = \"16MiB\"\n[host]\nbudget = \"16MiB\"\n\
    [nvme]\ndir = \"swap\"\nsize = \"256MiB\"\n[optimizer]\nlr = 1e-2\nthreads = 1\n";

/// The tiny model with the fixture's tokenizer and Llama 3 chat template.
fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("swap")).unwrap();
    ok(dir.path(), common::TINY_MODEL_ARGS);
    let model = dir.path().join("model");
    std::fs::copy(
        chat_fixtures().join("tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        chat_fixtures().join("llama3/tokenizer_config.json"),
        model.join("tokenizer_config.json"),
    )
    .unwrap();
    dir
}

fn chat_config(extra: &str) -> String {
    let data = chat_fixtures().join("conversations.jsonl");
    format!(
        "{STORE}[train]\nmodel_dir = \"model\"\ndata_format = \"chat\"\ndata = \"{}\"\n\
         steps = 3\nsequence = 128\nmicro_batch = 2\nmode = \"lora\"\nlora_rank = 4\n{extra}",
        data.display()
    )
}

fn finetune(dir: &Path, config: &str) -> Output {
    std::fs::write(dir.join("tidestore.toml"), config).unwrap();
    run(dir, &["finetune", "--json"])
}

/// Logits of `tokens` by the model in `dir`, LoRA adapters from `adapter` when given.
fn logits(dir: &Path, adapter: Option<&Path>, tokens: &Tensor) -> Vec<f32> {
    let cfg = hf::LlamaConfig::load(dir).unwrap();
    let weights = hf::HfWeights::open(dir, &cfg).unwrap();
    let lora = adapter.map(|_| LlamaLora {
        rank: 4,
        alpha: 32.0,
        targets: vec!["q_proj".into(), "v_proj".into()],
    });
    let model = Llama::from_hf(&cfg, lora).unwrap();
    let adapters = adapter
        .map(|a| candle_core::safetensors::load(a.join(hf::ADAPTER_FILE), &Device::Cpu).unwrap());
    let params: Vec<_> = model
        .specs()
        .into_iter()
        .map(|spec| {
            let values = match weights.tensor_f32(&spec.name) {
                Some(v) => v,
                None => adapters.as_ref().unwrap()[&hf::peft_key(&spec.name)]
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            };
            (spec, values)
        })
        .collect();
    let mut mem = InMemory::new(&params, &Device::Cpu).unwrap();
    let out = model.forward(&mut mem, tokens).unwrap();
    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn a_chat_lora_run_trains_on_assistant_tokens_and_its_two_exports_agree() {
    let d = setup();
    let config = chat_config(
        "export_dir = \"adapter\"\nexport_merged = \"merged\"\nexport_dtype = \"f32\"\n\
         export_shard_size = \"64KiB\"\n",
    );
    let out = finetune(d.path(), &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // transformers' assistant masks for the fixture (make_chat_fixtures.py).
    let expected: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(chat_fixtures().join("llama3/expected.json")).unwrap(),
    )
    .unwrap();
    let assistant: u64 = expected
        .iter()
        .map(|e| e["assistant_tokens"].as_u64().unwrap())
        .sum();
    let data = &report["data"];
    eprintln!(
        "loss tokens: tidestore {}, transformers' assistant masks {assistant}",
        data["loss_tokens"]
    );
    assert_eq!(data["loss_tokens"].as_u64(), Some(assistant), "{data}");
    assert_eq!(data["records"], 4);
    assert_eq!(data["samples"], 3);
    assert_eq!(
        data["dropped_no_loss"], 1,
        "the conversation without an answer"
    );
    let padding: u64 = expected[..3]
        .iter()
        .map(|e| 129 - e["ids"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(data["padding_tokens"].as_u64(), Some(padding));

    // The adapter names its base by the model's name, not where it lies.
    let peft: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.path().join("adapter").join(hf::ADAPTER_CONFIG_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(peft["base_model_name_or_path"], "model");
    // The merged export is sharded with an index.
    let merged = d.path().join("merged");
    assert!(merged.join(hf::INDEX_FILE).is_file());
    assert!(merged.join("tokenizer_config.json").is_file());

    let tokens = Tensor::from_vec(
        (0..48u32).map(|i| (i * 7) % 266).collect(),
        (2, 24),
        &Device::Cpu,
    )
    .unwrap();
    let via_adapter = logits(
        &d.path().join("model"),
        Some(&d.path().join("adapter")),
        &tokens,
    );
    let via_merged = logits(&merged, None, &tokens);
    let base = logits(&d.path().join("model"), None, &tokens);
    let diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    eprintln!(
        "logits: adapter vs merged max |diff| {}, adapter vs base {}",
        diff(&via_adapter, &via_merged),
        diff(&via_adapter, &base)
    );
    assert!(
        diff(&via_adapter, &via_merged) <= 1e-5,
        "{}",
        diff(&via_adapter, &via_merged)
    );
    assert!(
        diff(&via_adapter, &base) > 1e-4,
        "the adapters trained: {}",
        diff(&via_adapter, &base)
    );
}

#[test]
fn a_sharded_export_round_trips_byte_identical() {
    let d = setup();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/genesis-kjv.txt");
    // A full export, sharded, then that export fine-tuned with lr 0 and exported again.
    let first = format!(
        "{STORE}[train]\nmodel_dir = \"model\"\ntext = \"{}\"\nsteps = 1\nsequence = 16\n\
         micro_batch = 1\nexport_dir = \"one\"\nexport_dtype = \"f32\"\nexport_shard_size = \"40KiB\"\n",
        text.display()
    );
    let out = finetune(d.path(), &first);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second = first
        .replace("lr = 1e-2", "lr = 0.0")
        .replace("model_dir = \"model\"", "model_dir = \"one\"")
        .replace("export_dir = \"one\"", "export_dir = \"two\"");
    let out = finetune(d.path(), &second);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = |dir: &str| {
        let mut names: Vec<_> = std::fs::read_dir(d.path().join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let names = files("one");
    assert!(names.len() > 3, "several shards: {names:?}");
    assert!(names.iter().any(|n| n == hf::INDEX_FILE));
    assert_eq!(names, files("two"));
    eprintln!(
        "sharded export: {} files, compared byte for byte",
        names.len()
    );
    for n in names {
        let (a, b) = (d.path().join("one").join(&n), d.path().join("two").join(&n));
        assert!(
            std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
            "{n:?} differs"
        );
    }
}

#[test]
fn bad_chat_input_is_refused_naming_the_file_and_line() {
    let d = setup();
    let bad = d.path().join("bad.jsonl");
    let cases = [
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\nnot json\n",
            ":2",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"tool_calls\": []}]}\n",
            "tool_calls",
        ),
        ("{\"text\": \"no messages\"}\n", "messages"),
    ];
    for (text, want) in cases {
        std::fs::write(&bad, text).unwrap();
        let config = chat_config("").replace(
            &chat_fixtures()
                .join("conversations.jsonl")
                .display()
                .to_string(),
            &bad.display().to_string(),
        );
        let out = finetune(d.path(), &config);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("bad.jsonl") && err.contains(want),
            "{want}: {err}"
        );
    }
    // A template that fails to render: the template and the line.
    std::fs::write(
        &bad,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    std::fs::write(
        d.path().join("t.jinja"),
        "{{ raise_exception('only assistants here') }}",
    )
    .unwrap();
    let config = chat_config("chat_template = \"t.jinja\"\n").replace(
        &chat_fixtures()
            .join("conversations.jsonl")
            .display()
            .to_string(),
        &bad.display().to_string(),
    );
    let out = finetune(d.path(), &config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.jsonl:1") && err.contains("t.jinja") && err.contains("only assistants"),
        "{err}"
    );
    // Every sample longer than the sequence, dropped: the counts in the error.
    let config = chat_config("").replace("sequence = 128", "sequence = 16");
    let out = finetune(d.path(), &config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no sample to train on") && err.contains("4 longer"),
        "{err}"
    );
}

#[test]
fn jsonl_documents_get_bos_and_eos_as_the_tokenizer_config_says() {
    let d = setup();
    let tc = d.path().join("model/tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    cfg["add_bos_token"] = true.into();
    cfg["add_eos_token"] = true.into();
    std::fs::write(&tc, cfg.to_string()).unwrap();
    // A literal `<s>` in a document is its three bytes, not the special token.
    let docs = ["abc", "hello world", "a <s>"];
    let lines: Vec<String> = docs
        .iter()
        .map(|t| serde_json::json!({ "text": t, "id": 1 }).to_string())
        .collect();
    std::fs::write(d.path().join("docs.jsonl"), lines.join("\n\n")).unwrap();
    let config = format!(
        "{STORE}[train]\nmodel_dir = \"model\"\ndata_format = \"jsonl\"\ndata = \"docs.jsonl\"\n\
         steps = 1\nsequence = 16\nmicro_batch = 2\n"
    );
    let out = finetune(d.path(), &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // BOS + bytes + EOS, every token but the first a target.
    let want: usize = docs.iter().map(|t| t.len() + 1).sum();
    assert_eq!(report["data"]["loss_tokens"].as_u64(), Some(want as u64));
    assert_eq!(report["data"]["records"], 3);
}

#[test]
fn too_long_samples_are_truncated_or_dropped_and_counted() {
    let d = setup();
    let expected: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(chat_fixtures().join("llama3/expected.json")).unwrap(),
    )
    .unwrap();
    let masks: Vec<Vec<u64>> = expected
        .iter()
        .map(|e| serde_json::from_value(e["assistant_masks"].clone()).unwrap())
        .collect();
    let window = 65; // sequence 64 + 1
    let longer = masks.iter().filter(|m| m.len() > window).count() as u64;
    assert!(
        longer >= 2,
        "the fixture has conversations longer than the window"
    );
    for (mode, kept) in [("truncate", true), ("drop", false)] {
        let config = chat_config(&format!("too_long = \"{mode}\"\n"))
            .replace("sequence = 128", "sequence = 64");
        let out = finetune(d.path(), &config);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let data =
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["data"].clone();
        // The window's assistant tokens, past its first token, of each sample kept.
        let loss: u64 = masks
            .iter()
            .filter(|m| kept || m.len() <= window)
            .map(|m| m[1..m.len().min(window)].iter().sum::<u64>())
            .sum();
        assert_eq!(data["loss_tokens"].as_u64(), Some(loss), "{mode}: {data}");
        let (truncated, dropped) = if kept { (longer, 0) } else { (0, longer) };
        assert_eq!(data["truncated"].as_u64(), Some(truncated), "{mode}");
        assert_eq!(data["dropped_too_long"].as_u64(), Some(dropped), "{mode}");
    }
}
