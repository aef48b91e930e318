//! Guards against a checkpoint that does not bring back exactly what was saved: every
//! byte of every list (bf16, f16 and fp32; several chunks; chunks that live on NVMe
//! because the host pool holds two), the controller state and the caller's metadata;
//! and against a file other tools cannot read as a model.

mod common;

use common::*;
use tidestore_chunk::{ListKind, TensorId};
use tidestore_train::checkpoint::{self, CHECKPOINT_LISTS};
use tidestore_train::{CheckpointDir, TrainError, CHECKPOINT_FORMAT};

#[test]
fn round_trip_is_bit_identical_through_nvme() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_store(&dir.path().join("a"), layout(mixed_specs()));
    fill(&mut a, 1);
    let saved = snapshot(&mut a);
    // The lists that came first are on NVMe only now: the save streams them from there.
    let spilled = all_tensors(&a)
        .into_iter()
        .filter_map(|t| a.layout().location(t, ListKind::Master))
        .filter(|loc| a.residency(loc.chunk).is_some_and(|r| r.nvme && !r.host))
        .count();
    assert!(spilled > 0, "some master chunk lives on NVMe only");
    let before = a.stats();
    let path = dir.path().join("ckpt.safetensors");
    let tensors = all_tensors(&a);
    checkpoint::save(&mut a, &tensors, &state(42), &path).unwrap();
    assert!(
        a.stats().nvme_reads > before.nvme_reads,
        "save read chunks from NVMe"
    );
    assert_eq!(snapshot(&mut a), saved, "saving does not change the store");

    let mut b = open_store(&dir.path().join("b"), layout(mixed_specs()));
    fill(&mut b, 2);
    let got = checkpoint::load(&mut b, &tensors, &path).unwrap();
    assert_eq!(got, state(42));
    assert_eq!(snapshot(&mut b), saved, "every byte of every list is back");
    assert!(
        b.stats().host_to_nvme_bytes > 0,
        "loading spilled chunks to NVMe"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains(".tmp."))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no temporary file left: {leftovers:?}"
    );
}

#[test]
fn subset_of_tensors_and_no_loss_scaler() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_store(&dir.path().join("a"), layout(mixed_specs()));
    fill(&mut a, 3);
    let saved = snapshot(&mut a);
    let subset = [TensorId(2), TensorId(4)];
    let mut st = state(5);
    st.controller.loss_scaler = None;
    st.metadata.clear();
    let path = dir.path().join("part.safetensors");
    checkpoint::save(&mut a, &subset, &st, &path).unwrap();
    let mut b = open_store(&dir.path().join("b"), layout(mixed_specs()));
    fill(&mut b, 4);
    let untouched = snapshot(&mut b);
    assert_eq!(checkpoint::load(&mut b, &subset, &path).unwrap(), st);
    for (key, bytes) in snapshot(&mut b) {
        let want = if subset.contains(&TensorId(key.0)) {
            &saved[&key]
        } else {
            &untouched[&key]
        };
        assert_eq!(&bytes, want, "{key:?}");
    }
}

#[test]
fn plain_safetensors_reads_the_model_under_its_own_names() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_store(&dir.path().join("a"), layout(mixed_specs()));
    fill(&mut a, 5);
    let saved = snapshot(&mut a);
    let path = dir.path().join("model.safetensors");
    let tensors = all_tensors(&a);
    checkpoint::save(&mut a, &tensors, &state(9), &path).unwrap();

    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!((8 + header_len) % 8, 0, "data section 8-byte aligned");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    use safetensors::Dtype;
    let expect = [
        ("embed.weight", Dtype::BF16, vec![16, 64]),
        ("layers.0.w", Dtype::BF16, vec![32, 32]),
        ("layers.0.b", Dtype::BF16, vec![33]),
        ("norm.frozen", Dtype::F32, vec![8, 16]),
        ("rope.frozen", Dtype::F16, vec![100]),
        ("head.weight", Dtype::BF16, vec![2, 256]),
        ("optimizer.master.layers.0.w", Dtype::F32, vec![32, 32]),
        ("optimizer.exp_avg.embed.weight", Dtype::F32, vec![16, 64]),
        ("optimizer.exp_avg_sq.head.weight", Dtype::F32, vec![2, 256]),
    ];
    for (name, dtype, shape) in &expect {
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), *dtype, "{name}");
        assert_eq!(t.shape(), &shape[..], "{name}");
        let offset = t.data().as_ptr() as usize - bytes.as_ptr() as usize;
        assert_eq!(
            offset % (t.dtype().bitsize() / 8),
            0,
            "{name} aligned to its element"
        );
    }
    // 6 params + master/M/V of the 4 trainable ones; no gradients.
    assert_eq!(st.len(), 6 + 3 * 4);
    assert!(!st
        .names()
        .iter()
        .any(|n| n.contains("frozen") && n.starts_with("optimizer.")));
    let id = a.layout().tensor_id("layers.0.b").unwrap();
    assert_eq!(
        st.tensor("layers.0.b").unwrap().data(),
        &saved[&(id.0, ListKind::Params)][..]
    );
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let kv = meta.metadata().as_ref().unwrap();
    assert_eq!(kv["format"], CHECKPOINT_FORMAT);
    assert_eq!(kv["step"], "9");
    assert_eq!(kv["user.data.cursor"], "123456");
    let crc = format!(
        "0x{:08x}",
        crc32c::crc32c(st.tensor("layers.0.b").unwrap().data())
    );
    assert_eq!(kv["crc32c.layers.0.b"], crc);
    assert_eq!(CHECKPOINT_LISTS.len(), 4);
}

#[test]
fn directory_keeps_the_newest_and_refuses_to_go_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_store(&dir.path().join("a"), layout(mixed_specs()));
    let tensors = all_tensors(&a);
    let ckpts = CheckpointDir::open(dir.path().join("ckpt"), 2).unwrap();
    assert!(ckpts.latest().unwrap().is_none());
    let mut b = open_store(&dir.path().join("b"), layout(mixed_specs()));
    assert!(ckpts.load_latest(&mut b, &tensors).unwrap().is_none());
    for step in [10, 20, 30, 40] {
        fill(&mut a, step);
        let p = ckpts.save(&mut a, &tensors, &state(step)).unwrap();
        assert_eq!(p, ckpts.path(step));
    }
    let steps: Vec<u64> = ckpts.list().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [30, 40]);
    assert!(ckpts.path(40).ends_with("ckpt-000040.safetensors"));
    // The same step again overwrites (a skipped overflow step keeps the count).
    fill(&mut a, 41);
    ckpts.save(&mut a, &tensors, &state(40)).unwrap();
    let want = snapshot(&mut a);
    assert_eq!(
        ckpts.load_latest(&mut b, &tensors).unwrap(),
        Some(state(40))
    );
    assert_eq!(snapshot(&mut b), want);
    match ckpts.save(&mut a, &tensors, &state(35)) {
        Err(TrainError::CheckpointBehind {
            step: 35,
            latest: 40,
            ..
        }) => {}
        other => panic!("expected CheckpointBehind, got {other:?}"),
    }
}

#[test]
fn read_tensors_gives_the_saved_bytes_without_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_store(&dir.path().join("a"), layout(mixed_specs()));
    fill(&mut a, 5);
    let saved = snapshot(&mut a);
    let path = dir.path().join("ckpt.safetensors");
    let tensors = all_tensors(&a);
    checkpoint::save(&mut a, &tensors, &state(9), &path).unwrap();

    // Only the masters and the frozen tensors' own entries, as a model reader would.
    let (st, got) = checkpoint::read_tensors(&path, |name| {
        name.starts_with("optimizer.master.") || !name.starts_with("optimizer.")
    })
    .unwrap();
    assert_eq!(st, state(9));
    let mut expected = 0;
    for &t in &tensors {
        let spec = a.layout().tensor(t).unwrap().clone();
        for list in [ListKind::Master, ListKind::Params] {
            let Some(loc) = a.layout().location(t, list) else {
                continue;
            };
            let name = checkpoint::tensor_name(&spec.name, list).unwrap();
            let f = got
                .iter()
                .find(|f| f.name == name)
                .unwrap_or_else(|| panic!("`{name}` read"));
            assert_eq!(f.dtype, loc.dtype, "{name}");
            assert_eq!(f.shape, spec.shape, "{name}");
            assert_eq!(f.bytes, saved[&(t.0, list)], "{name}");
            expected += 1;
        }
    }
    assert_eq!(got.len(), expected, "nothing that was not asked for");
}
