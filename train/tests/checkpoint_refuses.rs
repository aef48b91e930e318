//! Guards against a damaged or foreign checkpoint being taken as state: a flipped byte,
//! a file cut short, a header that does not parse or is not ours, a tensor missing or of
//! another shape or dtype. Each is refused with a typed error naming the file and the
//! tensor, before a single byte of the store is changed.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tidestore_chunk::{ChunkStore, DType, TensorSpec};
use tidestore_train::{checkpoint, TrainError};

/// A checkpoint of the mixed model, saved from a store of its own.
fn saved(dir: &Path) -> PathBuf {
    let mut a = open_store(&dir.join("a"), layout(mixed_specs()));
    fill(&mut a, 11);
    let path = dir.join("ckpt.safetensors");
    let tensors = all_tensors(&a);
    checkpoint::save(&mut a, &tensors, &state(3), &path).unwrap();
    path
}

/// Loads `file` into a filled store of `specs` and checks the store kept every byte;
/// returns the error.
fn refused(dir: &Path, specs: Vec<TensorSpec>, file: &Path) -> TrainError {
    let mut b: ChunkStore = open_store(&dir.join("b"), layout(specs));
    fill(&mut b, 22);
    let before = snapshot(&mut b);
    let tensors = all_tensors(&b);
    let err = checkpoint::load(&mut b, &tensors, file).expect_err("a bad checkpoint loaded");
    assert_eq!(
        snapshot(&mut b),
        before,
        "a refused checkpoint changed the store"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&file.display().to_string()),
        "names the file: {msg}"
    );
    err
}

/// A copy of `path` changed by `f`.
fn corrupt(path: &Path, name: &str, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    let out = path.with_file_name(name);
    std::fs::write(&out, bytes).unwrap();
    out
}

/// Where tensor `name`'s bytes are in the file.
fn data_range(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let (a, b) = meta.info(name).unwrap().data_offsets;
    8 + n + a..8 + n + b
}

#[test]
fn a_flipped_data_byte_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    for name in [
        "layers.0.b",
        "optimizer.exp_avg_sq.head.weight",
        "norm.frozen",
    ] {
        let bad = corrupt(&good, "flipped.safetensors", |b| {
            let r = data_range(b, name);
            b[r.start + r.len() / 2] ^= 0x10;
        });
        match refused(dir.path(), mixed_specs(), &bad) {
            TrainError::CheckpointChecksum {
                tensor,
                expected,
                found,
                ..
            } => {
                assert_eq!(tensor, name);
                assert_ne!(expected, found);
            }
            other => panic!("{name}: expected a checksum error, got {other}"),
        }
    }
}

#[test]
fn read_tensors_refuses_a_flipped_byte_of_a_tensor_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    let name = "optimizer.master.head.weight";
    let bad = corrupt(&good, "flipped.safetensors", |b| {
        let r = data_range(b, name);
        b[r.start] ^= 0x01;
    });
    match checkpoint::read_tensors(&bad, |n| n == name) {
        Err(TrainError::CheckpointChecksum { path, tensor, .. }) => {
            assert_eq!(path, bad);
            assert_eq!(tensor, name);
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    // A tensor not asked for is not read, so its damage goes unseen.
    let (_, others) = checkpoint::read_tensors(&bad, |n| n == "layers.0.b").unwrap();
    assert_eq!(others.len(), 1);
}

#[test]
fn a_truncated_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    let full = std::fs::metadata(&good).unwrap().len() as usize;
    for cut in [full - 1, full / 2, 20, 4, 0] {
        let bad = corrupt(&good, "cut.safetensors", |b| b.truncate(cut));
        match refused(dir.path(), mixed_specs(), &bad) {
            TrainError::CheckpointTruncated {
                len_bytes,
                expected_bytes,
                ..
            } => {
                assert_eq!(len_bytes, cut as u64);
                assert!(expected_bytes > len_bytes);
                if cut > 100 {
                    assert_eq!(expected_bytes, full as u64, "the header's length");
                }
            }
            other => panic!("cut at {cut}: expected truncated, got {other}"),
        }
    }
}

/// A change made to a file's bytes.
type Edit = Box<dyn FnOnce(&mut Vec<u8>)>;

#[test]
fn a_bad_header_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    let find = |b: &[u8], s: &str| {
        b.windows(s.len())
            .position(|w| w == s.as_bytes())
            .unwrap_or_else(|| panic!("{s} not in the header"))
    };
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "not json",
            Box::new(|b: &mut Vec<u8>| b[8] = b'x'),
            "safetensors",
        ),
        (
            "foreign format",
            Box::new(move |b: &mut Vec<u8>| {
                let at = find(b, "tidestore.checkpoint.v1");
                b[at + 22] = b'9';
            }),
            "format",
        ),
        (
            "crc not hex",
            Box::new(move |b: &mut Vec<u8>| {
                let at = find(b, "\"crc32c.layers.0.b\":\"0x");
                b[at + 23..at + 31].copy_from_slice(b"zzzzzzzz");
            }),
            "crc32c.layers.0.b",
        ),
        (
            "crc missing",
            Box::new(move |b: &mut Vec<u8>| {
                let at = find(b, "\"crc32c.layers.0.b\"");
                b[at + 1] = b'C';
            }),
            "crc32c.layers.0.b",
        ),
        (
            "step not a number",
            Box::new(move |b: &mut Vec<u8>| {
                let at = find(b, "\"step\":\"3\"");
                b[at + 8] = b'x';
            }),
            "step",
        ),
        (
            "trailing bytes",
            Box::new(|b: &mut Vec<u8>| b.extend_from_slice(&[0; 16])),
            "safetensors",
        ),
    ];
    for (what, f, needle) in cases {
        let bad = corrupt(&good, "bad-header.safetensors", f);
        match refused(dir.path(), mixed_specs(), &bad) {
            TrainError::CheckpointMalformed { reason, .. } => {
                assert!(reason.contains(needle), "{what}: {reason}")
            }
            other => panic!("{what}: expected malformed, got {other}"),
        }
    }
}

#[test]
fn a_wrong_shape_or_dtype_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    let with = |name: &str, f: &dyn Fn(&mut TensorSpec)| {
        let mut specs = mixed_specs();
        specs.iter_mut().filter(|s| s.name == name).for_each(f);
        specs
    };
    let shape = with("head.weight", &|s| s.shape = vec![256, 2]);
    match refused(dir.path(), shape, &good) {
        TrainError::CheckpointMismatch {
            tensor,
            expected,
            found,
            ..
        } => {
            assert!(tensor.ends_with("head.weight"), "{tensor}");
            assert!(expected.contains("[256, 2]") && found.contains("[2, 256]"));
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
    let dtype = with("rope.frozen", &|s| s.dtype = DType::BF16);
    match refused(dir.path(), dtype, &good) {
        TrainError::CheckpointMismatch { tensor, found, .. } => {
            assert_eq!(tensor, "rope.frozen");
            assert!(found.contains("F16"), "{found}");
        }
        other => panic!("expected a dtype mismatch, got {other}"),
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = saved(dir.path());
    let mut extra = mixed_specs();
    extra.push(TensorSpec::new("lora.a", &[64], DType::BF16, true));
    match refused(dir.path(), extra, &good) {
        TrainError::CheckpointMissingTensor { tensor, .. } => {
            assert!(tensor.ends_with("lora.a"), "{tensor}")
        }
        other => panic!("expected a missing tensor, got {other}"),
    }
    // A tensor frozen when saved has no optimizer state to load as trainable.
    let mut thawed = mixed_specs();
    thawed[4].trainable = true;
    match refused(dir.path(), thawed, &good) {
        TrainError::CheckpointMissingTensor { tensor, .. } => {
            assert_eq!(tensor, "optimizer.master.rope.frozen")
        }
        other => panic!("expected a missing tensor, got {other}"),
    }
}

#[test]
fn a_missing_file_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    match refused(
        dir.path(),
        mixed_specs(),
        &dir.path().join("nope.safetensors"),
    ) {
        TrainError::Io { op, .. } => assert_eq!(op, "opening"),
        other => panic!("expected an I/O error, got {other}"),
    }
}
