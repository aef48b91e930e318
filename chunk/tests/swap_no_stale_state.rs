//! Guards against a store taking bytes it did not write as state: chunks left in a swap
//! file by an earlier store (same layout, even closed cleanly) read back as the new
//! store's contents, or a crashed or foreign file adopted as if it were clean.

mod common;

use common::*;
use tidestore_chunk::{
    AdoptRefusal, ChunkError, ChunkStore, DType, Layout, LayoutConfig, ListKind, Place, TensorId,
    TensorSpec, TensorState,
};

const SLOT: u64 = 8192;
const TENSORS: u32 = 6;

/// Six trainable f16 tensors, one per chunk (Params chunks of 4096 bytes, fp32 lists
/// of 8192).
fn six() -> Layout {
    let tensors: Vec<(u64, bool)> = (0..TENSORS).map(|_| (2048, true)).collect();
    layout(2048, &tensors, DType::F16)
}

/// A small host pool, so most chunks live on NVMe between uses.
fn open(dir: &tempfile::TempDir, layout: Layout, adopt: bool) -> Result<ChunkStore, ChunkError> {
    let cfg = config(2 * SLOT, 3 * SLOT, nvme_dir(dir, 64 * SLOT)).with_adopt(adopt);
    ChunkStore::open(layout, cfg, sim_device(4 * SLOT))
}

const LISTS: [ListKind; 3] = [ListKind::Params, ListKind::Master, ListKind::Momentum];

/// Writes `pattern(seed + ...)` into every (tensor, list) in `which`, half of them
/// through the device (so the newest copy is a device copy), and returns what it wrote.
fn fill(store: &mut ChunkStore, seed: u64, which: &[u32]) -> Vec<((u32, ListKind), Vec<u8>)> {
    let mut wrote = Vec::new();
    for &t in which {
        for list in LISTS {
            let len = store.layout().location(TensorId(t), list).unwrap().bytes() as usize;
            let data = pattern(seed + u64::from(t) * 10 + list as u64, len);
            if t % 2 == 0 {
                let g = store.access(TensorId(t), list, Place::Device).unwrap();
                store.bytes_mut(&g).unwrap().copy_from_slice(&data);
                store.release(g, TensorState::Hold).unwrap();
            } else {
                store.write(TensorId(t), list, &data).unwrap();
            }
            store.verify().unwrap();
            wrote.push(((t, list), data));
        }
    }
    wrote
}

fn read_all(store: &mut ChunkStore) -> Vec<((u32, ListKind), Vec<u8>)> {
    let mut out = Vec::new();
    for t in 0..TENSORS {
        for list in LISTS {
            out.push(((t, list), store.read(TensorId(t), list).unwrap()));
            store.verify().unwrap();
        }
    }
    out
}

fn expect(written: &[((u32, ListKind), Vec<u8>)], got: &[((u32, ListKind), Vec<u8>)], who: &str) {
    for ((key, bytes), (key2, got)) in written.iter().zip(got) {
        assert_eq!(key, key2);
        assert!(bytes == got, "{who}: tensor {} in {} differs", key.0, key.1);
    }
}

/// The failure: a second store in the same swap directory reading the first one's
/// chunks (the same layout, closed cleanly: the most tempting case) as its own.
#[test]
fn two_fresh_stores_in_one_swap_dir_see_only_their_own_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = open(&dir, six(), false).unwrap();
    let all: Vec<u32> = (0..TENSORS).collect();
    let wrote = fill(&mut first, 1000, &all);
    let got = read_all(&mut first);
    expect(&wrote, &got, "first store");
    first.close().unwrap();

    let mut second = open(&dir, six(), false).unwrap();
    second.verify().unwrap();
    // Nothing of the first store is there: every chunk reads as zeros.
    for ((t, list), bytes) in read_all(&mut second) {
        assert!(
            bytes.iter().all(|&b| b == 0),
            "second store sees bytes it never wrote in tensor {t}, {list}"
        );
    }
    // What it writes (two tensors) it reads back; the rest stays zeros.
    let mine = fill(&mut second, 5000, &[1, 4]);
    // Push everything through NVMe and back.
    second.evict_device_all().unwrap();
    second.verify().unwrap();
    for ((t, list), bytes) in read_all(&mut second) {
        match mine.iter().find(|(k, _)| *k == (t, list)) {
            Some((_, want)) => assert!(bytes == *want, "tensor {t} {list} lost"),
            None => assert!(
                bytes.iter().all(|&b| b == 0),
                "tensor {t} {list} not written by the second store reads non-zero"
            ),
        }
    }
    drop(second);
}

/// The failure: a clean close that loses the newest bytes (a device-only or host-only
/// copy never written back), so a resumed store adopts stale chunks.
#[test]
fn adoption_after_a_clean_close_gives_back_the_exact_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = open(&dir, six(), false).unwrap();
    let all: Vec<u32> = (0..TENSORS).collect();
    let mut wrote = fill(&mut first, 1, &all);
    // A second version of a few, whose newest copies stay on the device and the host.
    let newer = fill(&mut first, 77, &[0, 3]);
    for (k, v) in newer {
        wrote.iter_mut().find(|(k2, _)| *k2 == k).unwrap().1 = v;
    }
    first.close().unwrap();

    let mut second = open(&dir, six(), true).unwrap();
    second.verify().unwrap();
    let got = read_all(&mut second);
    expect(&wrote, &got, "adopted store");
    second.close().unwrap();

    // Adopting again after a clean close of the adopting store works too.
    let mut third = open(&dir, six(), true).unwrap();
    let got = read_all(&mut third);
    expect(&wrote, &got, "adopted twice");
}

/// The failure: a store that crashed (or was dropped without `close`) adopted as if its
/// file were consistent — including one that adopted cleanly and then changed chunks.
#[test]
fn adoption_after_drop_without_close_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = open(&dir, six(), false).unwrap();
    fill(&mut first, 1, &[0, 1, 2]);
    drop(first);
    match open(&dir, six(), true) {
        Err(ChunkError::AdoptRefused {
            reason: AdoptRefusal::NotClosedCleanly,
            ..
        }) => {}
        other => panic!("expected a refusal (not closed cleanly), got {other:?}"),
    }

    // Clean close, adopted, changed, dropped: refused again.
    let mut store = open(&dir, six(), false).unwrap();
    fill(&mut store, 2, &[0, 1, 2]);
    store.close().unwrap();
    let mut adopted = open(&dir, six(), true).unwrap();
    fill(&mut adopted, 3, &[1]);
    adopted.evict_device_all().unwrap();
    drop(adopted);
    let err = open(&dir, six(), true).unwrap_err();
    assert!(
        matches!(
            err,
            ChunkError::AdoptRefused {
                reason: AdoptRefusal::NotClosedCleanly,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("not closed cleanly"), "{err}");

    // Even an adopting store that changed nothing is not clean once dropped: the
    // marker is cleared when it opens.
    let store = open(&dir, six(), false).unwrap();
    store.close().unwrap();
    drop(open(&dir, six(), true).unwrap());
    assert!(open(&dir, six(), true).is_err());
}

/// The failure: chunks of another model (other names, shapes or chunk size) adopted
/// because they fit the slots, or a file without a fingerprint taken on trust.
#[test]
fn adoption_with_another_layout_is_refused_naming_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    // No swap file at all.
    match open(&dir, six(), true) {
        Err(ChunkError::AdoptRefused {
            reason: AdoptRefusal::NoSwapFile,
            ..
        }) => {}
        other => panic!("expected a refusal (no swap file), got {other:?}"),
    }

    let mut first = open(&dir, six(), false).unwrap();
    fill(&mut first, 1, &[0, 1]);
    first.close().unwrap();
    // Same sizes, one tensor renamed: another layout.
    let other = Layout::new(
        LayoutConfig::new(2048),
        (0..TENSORS).map(|i| {
            let name = if i == 3 {
                "renamed".to_string()
            } else {
                format!("t{i}")
            };
            TensorSpec::new(name, &[2048], DType::F16, true)
        }),
    )
    .unwrap();
    let (file_fp, layout_fp) = (six().fingerprint(), other.fingerprint());
    assert_ne!(file_fp, layout_fp);
    let err = open(&dir, other, true).unwrap_err();
    match &err {
        ChunkError::AdoptRefused {
            reason:
                AdoptRefusal::OtherLayout {
                    file_fingerprint,
                    layout_fingerprint,
                },
            ..
        } => assert_eq!(
            (*file_fingerprint, *layout_fingerprint),
            (file_fp, layout_fp)
        ),
        other => panic!("expected a refusal (another layout), got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&format!("{file_fp:#018x}")), "{msg}");
    assert!(msg.contains(&format!("{layout_fp:#018x}")), "{msg}");
    assert!(msg.contains("another layout"), "{msg}");
    // The refusal changed nothing: the right layout still adopts.
    let mut again = open(&dir, six(), true).unwrap();
    again.verify().unwrap();
    assert_ne!(
        again.read(TensorId(0), ListKind::Params).unwrap(),
        vec![0; 4096]
    );
    drop(again);

    // A file no chunk store ever fingerprinted.
    let bare = tempfile::tempdir().unwrap();
    let path = bare.path().join(tidestore_chunk::SWAP_FILE_NAME);
    drop(
        tidestore_io::swapfile::SwapFile::create(
            &path,
            SLOT as usize,
            64,
            &io_cfg(),
            tidestore_io::compress::Compression::Off,
        )
        .unwrap(),
    );
    match open(&bare, six(), true) {
        Err(ChunkError::AdoptRefused {
            reason: AdoptRefusal::NoFingerprint,
            ..
        }) => {}
        other => panic!("expected a refusal (no fingerprint), got {other:?}"),
    }
}
