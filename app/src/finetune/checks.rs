//! What a fine-tuning run refuses before step 1, and the non-finite checks during it:
//! - settings `finetune` cannot honour: `device.kind = "cuda"` on a build without
//!   CUDA or a machine without a GPU, `nvme.compression` (the trainer's swap file is
//!   uncompressed), an `nvme.size` smaller than the swap file the model needs, and the
//!   bench-only keys of the sections it reads, each when set to anything but its
//!   default — the error names the key and the command;
//! - micro-batches whose activations (a lower bound of them) cannot fit: beside the
//!   chunk slab on a GPU (`device.budget`), in the memory available on the CPU
//!   (`train.micro_batch`);
//! - tensors in the model's files that the model does not use (but for the two kinds
//!   that are known to be derived: `rotary_emb.inv_freq` buffers, and `lm_head.weight`
//!   with tied embeddings);
//! - a weight that is NaN or infinite (naming the tensor, the index and the file);
//! - a tokenizer without ids, and a token id the embedding has no row for (naming the
//!   tokenizer file and both numbers);
//! - a step whose loss or gradient is not finite: no loss scaler is configured, so
//!   there is no overflow to skip; the run stops naming the step and the first tensor.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tidestore_train::hf;

use crate::error::{Error, Result};
use tidestore::config::{as_toml, CompressionName, Config, DeviceKindName, SavedInputsName, Size};

const COMMAND: &str = "tidestore finetune";

/// Refuses `key` = `value` unless it is `default`, the only value finetune runs with.
fn only_default<T>(key: &str, value: T, default: T) -> Result<()>
where
    T: PartialEq + std::fmt::Debug + serde::Serialize,
{
    if value == default {
        return Ok(());
    }
    Err(Error::config(
        key,
        format!(
            "{} is not read by `{COMMAND}`, which always runs with {}; remove the key from \
             this config (it is a `tidestore bench` setting)",
            as_toml(&value),
            as_toml(&default)
        ),
    ))
}

/// Refuses the settings `finetune` would otherwise ignore (see the module doc).
pub fn refuse_unread_settings(cfg: &Config) -> Result<()> {
    if cfg.device.kind == DeviceKindName::Cuda && !cfg!(feature = "cuda") {
        return Err(Error::config(
            "device.kind",
            format!(
                "\"cuda\", but this build of `{COMMAND}` has no CUDA support (build with \
                 --features cuda), so it would run on the simulated device; set \"sim\" \
                 or \"auto\""
            ),
        ));
    }
    let (d, p) = (
        tidestore::config::DeviceSection::default(),
        tidestore::config::PolicySection::default(),
    );
    let c = &cfg.device;
    only_default(
        "nvme.compression",
        cfg.nvme.compression,
        CompressionName::Off,
    )?;
    only_default("device.tidal_margin", c.tidal_margin, d.tidal_margin)?;
    only_default("device.sim_memory", c.sim_memory, d.sim_memory)?;
    only_default("device.pcie_gbps", c.pcie_gbps, d.pcie_gbps)?;
    only_default("policy.eviction", cfg.policy.eviction, p.eviction)?;
    only_default(
        "policy.prefetch_lookahead",
        cfg.policy.prefetch_lookahead,
        p.prefetch_lookahead,
    )?;
    only_default(
        "policy.host_prefetch_lookahead",
        cfg.policy.host_prefetch_lookahead,
        p.host_prefetch_lookahead,
    )
}

/// Refuses `device.kind = "cuda"` when the trainer's device is not a CUDA GPU (a CUDA
/// build on a machine without one falls back to the simulation).
pub fn check_device(asked: DeviceKindName, opened: tidestore_tiers::DeviceKind) -> Result<()> {
    if asked == DeviceKindName::Cuda && opened != tidestore_tiers::DeviceKind::Cuda {
        return Err(Error::config(
            "device.kind",
            format!(
                "\"cuda\", but `{COMMAND}` found no CUDA GPU and opened the {opened} device; \
                 set \"sim\" or \"auto\" to run on it"
            ),
        ));
    }
    Ok(())
}

/// Refuses a `device.budget` that leaves the blocks' activations no room on the GPU:
/// `beside_slab` bytes are free beside the chunk slab (the CUDA context and other
/// processes hold the rest of `total`), and the activations take at least `need`.
pub fn check_activation_room(cfg: &Config, total: u64, beside_slab: u64, need: u64) -> Result<()> {
    if need <= beside_slab {
        return Ok(());
    }
    let h = tidestore::config::human_bytes;
    let or_host = match cfg.train.saved_inputs {
        SavedInputsName::Device => {
            ", or keep the saved block inputs in host memory \
                                    (train.saved_inputs = \"host\")"
        }
        SavedInputsName::Host => "",
    };
    Err(Error::config(
        "device.budget",
        format!(
            "{}: the chunk slab leaves {} of the GPU's {} free beside it, but the blocks' \
             activations take at least {}, {} short; lower device.budget, \
             train.micro_batch or train.sequence{or_host}",
            cfg.device.budget,
            h(beside_slab),
            h(total),
            activations(cfg, need),
            h(need - beside_slab)
        ),
    ))
}

/// Refuses micro-batches whose activations cannot fit in this machine's memory when the
/// blocks compute on the CPU: `need` is a lower bound of them (as for a GPU,
/// [`check_activation_room`]), `available` the memory the kernel says can still be
/// given to processes (`MemAvailable`). Only a run that cannot fit is refused (the
/// store's pools and the allocator's slack come on top of `need`), before step 1,
/// rather than killed for memory inside it.
pub fn check_host_activation_room(cfg: &Config, available: u64, need: u64) -> Result<()> {
    if need <= available {
        return Ok(());
    }
    Err(Error::config(
        "train.micro_batch",
        format!(
            "{}: the blocks compute on the CPU and their activations take at least {}, more \
             than the {} of memory this machine has available; lower train.micro_batch or \
             train.sequence",
            cfg.train.micro_batch,
            activations(cfg, need),
            tidestore::config::human_bytes(available)
        ),
    ))
}

/// `need` bytes of activations, with the settings that size them.
fn activations(cfg: &Config, need: u64) -> String {
    let t = &cfg.train;
    format!(
        "{} (train.micro_batch = {}, train.sequence = {}, train.accumulation = {}, \
         train.micro_batch_order = {}, train.saved_inputs = {})",
        tidestore::config::human_bytes(need),
        t.micro_batch,
        t.sequence,
        t.accumulation,
        as_toml(&t.micro_batch_order),
        as_toml(&t.saved_inputs)
    )
}

/// The memory the kernel says can still be given to processes (`MemAvailable` of
/// `/proc/meminfo`); `None` where that is not known.
pub fn mem_available_bytes() -> Option<u64> {
    proc_bytes("/proc/meminfo", "MemAvailable:")
}

/// The `key` line of a `/proc` file that counts kB (`/proc/meminfo`,
/// `/proc/self/status`), in bytes; `None` where the file or the line is missing.
pub(super) fn proc_bytes(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses an `nvme.size` below the swap file the run made (`file_bytes`, at `path`).
pub fn check_nvme_size(size: Size, file_bytes: u64, path: &Path) -> Result<()> {
    if file_bytes > size.bytes() {
        return Err(Error::config(
            "nvme.size",
            format!(
                "{size}, but `{COMMAND}` needs a swap file of {} ({}) for this model at \
                 these budgets; raise nvme.size, or the host budget",
                tidestore::config::human_bytes(file_bytes),
                path.display()
            ),
        ));
    }
    Ok(())
}

/// The first index of a value that is NaN or infinite.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|v| !v.is_finite())
}

/// Refuses a weight that is not finite, naming the tensor, the index and the file.
pub fn check_finite_weight(name: &str, values: &[f32], file: &Path) -> Result<()> {
    if let Some(i) = first_non_finite(values) {
        return Err(Error::Finetune(format!(
            "{}: tensor `{name}` holds {} at index {i} (of {}): a model with NaN or \
             infinite weights cannot be trained",
            file.display(),
            values[i],
            values.len()
        )));
    }
    Ok(())
}

/// The tensor names in a safetensors file's header (its first 8 + N bytes only).
fn header_names(path: &Path) -> Result<Vec<String>> {
    use std::io::Read;
    let bad = |reason: String| Error::Finetune(format!("{}: {reason}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| bad(e.to_string()))?;
    let n = u64::from_le_bytes(len);
    let mut header = Vec::new();
    f.take(n)
        .read_to_end(&mut header)
        .map_err(|e| bad(e.to_string()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    Ok(v.as_object()
        .map(|o| {
            o.keys()
                .filter(|k| k.as_str() != "__metadata__")
                .cloned()
                .collect()
        })
        .unwrap_or_default())
}

/// Refuses a tensor in the model's files (or its shard index) that the model does not
/// use, naming it and its file.
pub fn refuse_unused_tensors(
    dir: &Path,
    used: &[String],
    files: &BTreeSet<PathBuf>,
    tied: bool,
) -> Result<()> {
    let used: BTreeSet<&str> = used.iter().map(String::as_str).collect();
    let derived = |n: &str| n.ends_with("rotary_emb.inv_freq");
    let mut listed: Vec<(String, PathBuf)> = Vec::new();
    for file in files {
        listed.extend(header_names(file)?.into_iter().map(|n| (n, file.clone())));
    }
    let index = dir.join(hf::INDEX_FILE);
    if let Ok(text) = std::fs::read_to_string(&index) {
        if let Some(map) = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("weight_map").and_then(|m| m.as_object()).cloned())
        {
            listed.extend(map.keys().map(|n| (n.clone(), index.clone())));
        }
    }
    match listed
        .into_iter()
        .find(|(n, _)| !used.contains(n.as_str()) && !derived(n))
    {
        Some((name, file)) if tied && name == hf::names::LM_HEAD => Err(Error::Finetune(format!(
            "{}: tensor `{name}` would be silently dropped: config.json's \
             tie_word_embeddings is true, so the head reuses model.embed_tokens.weight; set \
             tie_word_embeddings to false to train this head, or remove the tensor",
            file.display()
        ))),
        Some((name, file)) => Err(Error::Finetune(format!(
            "{}: tensor `{name}` is not used by the model its config.json describes \
             (a LLaMA of these dimensions): it would be silently dropped; remove it, or \
             fix config.json",
            file.display()
        ))),
        None => Ok(()),
    }
}

/// Refuses a tokenizer without ids, and token ids the embedding has no row for.
pub fn check_tokens(tokens: &[u32], vocab: usize, tokenizer: &str, text: &Path) -> Result<()> {
    if let Some((at, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(Error::Finetune(format!(
            "tokenizer {tokenizer} gives token id {id} (at token {at} of {}), but the \
             model's vocab_size is {vocab}: ids must be below it; use the model's own \
             tokenizer",
            text.display()
        )));
    }
    Ok(())
}

/// Refuses a tokenizer that has no ids at all (naming its file, not the text).
pub fn check_tokenizer(ids: usize, tokenizer: &str) -> Result<()> {
    if ids == 0 {
        return Err(Error::Finetune(format!(
            "tokenizer {tokenizer} has an empty vocabulary (0 ids): it cannot tokenize \
             any text"
        )));
    }
    Ok(())
}

/// The error of step `step` whose loss or gradient was not finite.
pub fn non_finite_step(step: u32, loss: f32, tensor: Option<&str>, applied: bool) -> Error {
    let grad = match tensor {
        Some(t) => format!("the first non-finite gradient is `{t}`'s"),
        None => "every gradient was finite".into(),
    };
    Error::Finetune(format!(
        "step {step}: loss {loss}, {grad}; no loss scaler is configured, so this is not an \
         overflow to skip: the run has diverged (lower optimizer.lr, or check the data). \
         The step was {}; the checkpoints written so far are intact, nothing is exported",
        if applied { "applied" } else { "not applied" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_weight_is_named_with_its_index() {
        let e = check_finite_weight("w", &[0.0, 1.0, f32::NAN], Path::new("m.safetensors"));
        let text = e.unwrap_err().to_string();
        assert!(text.contains("`w`") && text.contains("index 2"), "{text}");
        check_finite_weight("w", &[0.0, -1e30], Path::new("m")).unwrap();
    }

    /// A bench-only setting is refused in the words of the TOML file (once `Zstd` and
    /// `Size(1099511627776)`, Rust's names).
    #[test]
    fn a_bench_setting_is_named_as_the_file_writes_it() {
        let e = only_default(
            "nvme.compression",
            CompressionName::Zstd,
            CompressionName::Off,
        );
        let text = e.unwrap_err().to_string();
        assert!(
            text.contains("\"zstd\" is not read") && text.contains("with \"off\""),
            "{text}"
        );
        let e = only_default(
            "device.tidal_margin",
            Size::from_bytes(1 << 40),
            Size::from_bytes(0),
        );
        let text = e.unwrap_err().to_string();
        assert!(
            text.contains("\"1TiB\"") && text.contains("\"0B\""),
            "{text}"
        );
        only_default("policy.prefetch_lookahead", 4u32, 4u32).unwrap();
    }

    #[test]
    fn a_token_beyond_the_vocabulary_names_both_numbers() {
        let e = check_tokens(&[1, 5000], 300, "tok.json", Path::new("t.txt")).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("5000") && text.contains("300") && text.contains("tok.json"));
        check_tokens(&[299], 300, "tok.json", Path::new("t.txt")).unwrap();
    }

    /// A device budget that leaves the activations no room on the GPU is a config
    /// error naming `device.budget` and the bytes short, before step 1; the bound is
    /// the model's (saved block inputs per kept micro-batch, plus the larger of what a
    /// layer and the head allocate).
    #[test]
    fn a_slab_that_leaves_the_activations_no_room_is_refused() {
        use tidestore_candle::llama::{Llama, LlamaConfig};
        let cfg = Config::from_toml_str(
            "[device]\nbudget = \"70GiB\"\n[nvme]\ndir = \"swap\"\n\
             [train]\nmicro_batch = 4\nsequence = 128\naccumulation = 2\n",
        )
        .unwrap();
        let model = Llama::new(LlamaConfig {
            vocab: 512,
            hidden: 256,
            intermediate: 704,
            layers: 4,
            heads: 8,
            kv_heads: 4,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            tie_embeddings: false,
            lora: None,
        })
        .unwrap();
        // Saved per micro-batch: the tokens 4 · 128 · 4 and five hidden states
        // 4 · 128 · 256 · 4. At the head, its logits (HEAD_COPIES) 3 · 4 · 128 · 512 · 4
        // with the last layer's probabilities 4 · 8 · 128² · 4 and MLP activations
        // 2 · 4 · 128 · 704 · 4 exceed a layer's output 4 · 128 · 256 · 4 with its scores
        // 3 · 4 · 8 · 128² · 4.
        let need =
            model.activation_bytes_at_least(4, 128, 2, tidestore_train::SavedInputs::Compute);
        let head = 3 * 4 * 128 * 512 * 4 + 4 * 8 * 128 * 128 * 4 + 2 * 4 * 128 * 704 * 4;
        assert!(head > 4 * 128 * 256 * 4 + 3 * 4 * 8 * 128 * 128 * 4);
        assert_eq!(need, 2 * (4 * 128 * 4 + 5 * 4 * 128 * 256 * 4) + head);
        let gib = 1u64 << 30;
        check_activation_room(&cfg, 80 * gib, need, need).unwrap();
        let e = check_activation_room(&cfg, 80 * gib, need - 4096, need).unwrap_err();
        assert_eq!(e.key(), Some("device.budget"));
        let text = e.to_string();
        assert!(
            text.contains("4.00 KiB short")
                && text.contains("vertical")
                && text.contains("train.saved_inputs = \"host\""),
            "{text}"
        );
    }

    /// On the CPU, micro-batches whose activations' lower bound exceeds the memory
    /// available are a config error naming `train.micro_batch`, the bound and what is
    /// available; one that fits passes.
    #[test]
    fn activations_beyond_the_memory_available_are_refused_on_the_cpu() {
        let cfg = Config::from_toml_str(
            "[nvme]\ndir = \"swap\"\n[train]\nmicro_batch = 64\nsequence = 4096\n",
        )
        .unwrap();
        let gib = 1u64 << 30;
        check_host_activation_room(&cfg, 16 * gib, 16 * gib).unwrap();
        let e = check_host_activation_room(&cfg, 16 * gib, 16 * gib + 1).unwrap_err();
        assert_eq!(e.key(), Some("train.micro_batch"));
        let text = e.to_string();
        assert!(
            text.contains("16.00 GiB of memory") && text.contains("train.sequence = 4096"),
            "{text}"
        );
        assert!(mem_available_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn cuda_asked_and_the_simulation_opened_is_refused() {
        use tidestore_tiers::DeviceKind;
        let e = check_device(DeviceKindName::Cuda, DeviceKind::Sim).unwrap_err();
        assert_eq!(e.key(), Some("device.kind"));
        check_device(DeviceKindName::Cuda, DeviceKind::Cuda).unwrap();
        check_device(DeviceKindName::Auto, DeviceKind::Sim).unwrap();
    }

    #[test]
    fn unread_settings_name_the_key() {
        let mut cfg = Config::default();
        refuse_unread_settings(&cfg).unwrap();
        cfg.nvme.compression = CompressionName::Zstd;
        assert_eq!(
            refuse_unread_settings(&cfg).unwrap_err().key(),
            Some("nvme.compression")
        );
    }
}
