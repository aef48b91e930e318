//! What a store makes of a swap file that already holds chunks: no stale state.
//!
//! A store never takes bytes it did not write in this run as state unless told to
//! ([`crate::StoreConfig::adopt`]). Not adopting, every chunk the file holds is dropped
//! and the file records the new layout's fingerprint ([`crate::Layout::fingerprint`]),
//! so every chunk reads as zeros until written. Adopting, the file must record this
//! layout's fingerprint and carry the clean-close marker that only
//! [`crate::ChunkStore::close`] writes (after every chunk is on NVMe and synced); the
//! marker is then cleared on disk before anything else changes, so a crash later in this
//! run is never taken as a clean close. Every refusal is
//! [`ChunkError::AdoptRefused`], before the file is changed.

use std::path::Path;

use tidestore_io::compress::Compression;
use tidestore_io::swapfile::SwapFile;
use tidestore_io::{IoConfig, IoError};
use tidestore_tiers::{NvmeTier, TierError, TierKind};

use crate::error::{AdoptRefusal, ChunkError};
use crate::id::ChunkId;
use crate::store::SWAP_FILE_NAME;
use crate::Result;

fn refused(path: &Path, reason: AdoptRefusal) -> ChunkError {
    ChunkError::AdoptRefused {
        path: path.display().to_string(),
        reason,
    }
}

fn swap_error(op: &'static str, e: IoError) -> ChunkError {
    ChunkError::tier(op, None, TierError::io(TierKind::Nvme, None, e))
}

/// Refuses adoption of a file recording `file_fingerprint` and `clean` by a layout of
/// `fingerprint`, naming the first reason.
fn check_adoptable(
    path: &Path,
    file_fingerprint: Option<u64>,
    clean: bool,
    fingerprint: u64,
) -> Result<()> {
    match file_fingerprint {
        None => Err(refused(path, AdoptRefusal::NoFingerprint)),
        Some(f) if f != fingerprint => Err(refused(
            path,
            AdoptRefusal::OtherLayout {
                file_fingerprint: f,
                layout_fingerprint: fingerprint,
            },
        )),
        Some(_) if !clean => Err(refused(path, AdoptRefusal::NotClosedCleanly)),
        Some(_) => Ok(()),
    }
}

/// Opens the store's own swap file in `dir` with `slots` slots of `slot_bytes` (no
/// compression). `adopt_fingerprint` `Some`: adoption is asked for, so the file must
/// exist, qualify (see the module doc) and have this shape. `None`: a file of another
/// shape, or one that is not a usable swap file, is removed and made again (the name is
/// the store's own); its chunks are dropped later by [`prepare_swap_file`].
pub(crate) fn open_swap_dir(
    dir: &Path,
    slot_bytes: usize,
    slots: u32,
    io: &IoConfig,
    adopt_fingerprint: Option<u64>,
) -> Result<NvmeTier> {
    let path = dir.join(SWAP_FILE_NAME);
    let create = || {
        NvmeTier::open_or_create(&path, slot_bytes, slots, io, Compression::Off)
            .map_err(|e| ChunkError::tier("opening the swap file", None, e))
    };
    if !path.exists() {
        if adopt_fingerprint.is_some() {
            return Err(refused(&path, AdoptRefusal::NoSwapFile));
        }
        return create();
    }
    let why_remade = match SwapFile::open(&path, io) {
        Ok(file) => match reuse(file, &path, slot_bytes, slots, adopt_fingerprint)? {
            Ok(nvme) => return Ok(nvme),
            Err(why) => why,
        },
        Err(IoError::BadHeader { reason, .. }) if adopt_fingerprint.is_none() => reason,
        Err(e) => return Err(swap_error("opening the swap file", e)),
    };
    tracing::info!(
        path = %path.display(),
        was = %why_remade,
        "chunk store: swap file of another shape or format; making it again"
    );
    std::fs::remove_file(&path).map_err(|e| {
        swap_error(
            "removing a swap file of another shape",
            IoError::Setup {
                what: "removing a swap file of another shape",
                path: path.clone(),
                source: e,
            },
        )
    })?;
    create()
}

/// The swap file found at `path` as the NVMe tier (`Ok`) when it has the shape asked
/// for, else what it was (`Err`: it is made again); with `adopt_fingerprint`, a file
/// that cannot be adopted is refused instead.
fn reuse(
    file: SwapFile,
    path: &Path,
    slot_bytes: usize,
    slots: u32,
    adopt_fingerprint: Option<u64>,
) -> Result<std::result::Result<NvmeTier, String>> {
    if let Some(fingerprint) = adopt_fingerprint {
        check_adoptable(
            path,
            file.layout_fingerprint(),
            file.is_clean(),
            fingerprint,
        )?;
    }
    let same_shape = file.slot_bytes() == slot_bytes
        && file.slot_count() == slots
        && file.compression() == Compression::Off;
    if same_shape {
        return Ok(Ok(NvmeTier::from_swap_file(file)));
    }
    if adopt_fingerprint.is_some() {
        return Err(refused(
            path,
            AdoptRefusal::OtherShape {
                file_slot_bytes: file.slot_bytes(),
                file_slots: file.slot_count(),
                slot_bytes,
                slots,
            },
        ));
    }
    Ok(Err(format!(
        "{} slots of {} bytes with {:?}",
        file.slot_count(),
        file.slot_bytes(),
        file.compression()
    )))
}

/// Decides what the chunks `nvme` already stores are (see the module doc) and returns
/// the adopted ones. `len_bytes`: per dense chunk id, its stored length (0: no such
/// chunk). On return the file records `fingerprint` and is not marked clean on disk.
pub(crate) fn prepare_swap_file(
    nvme: &mut NvmeTier,
    len_bytes: &[u64],
    fingerprint: u64,
    adopt: bool,
) -> Result<Vec<ChunkId>> {
    let (path, stored) = nvme.with_swap_file(|f| {
        let stored: Vec<(u64, usize)> = f
            .chunks()
            .map(|(id, _)| (id, f.len_of(id).unwrap_or(0)))
            .collect();
        (f.path().to_path_buf(), stored)
    });
    let nvme_err = |op: &'static str| move |e| ChunkError::tier(op, None, e);
    if adopt {
        check_adoptable(
            &path,
            nvme.layout_fingerprint(),
            nvme.is_clean(),
            fingerprint,
        )?;
        let mut adopted = Vec::with_capacity(stored.len());
        for &(id, len) in &stored {
            let ours = usize::try_from(id)
                .ok()
                .and_then(|d| len_bytes.get(d))
                .is_some_and(|&l| l > 0 && l as usize == len);
            if !ours {
                return Err(refused(
                    &path,
                    AdoptRefusal::ForeignChunk {
                        chunk: id,
                        len_bytes: len,
                    },
                ));
            }
            adopted.push(ChunkId::from_dense(id as usize));
        }
        // Before anything else changes: a crash from here on is not a clean close.
        nvme.clear_clean()
            .map_err(nvme_err("clearing the swap file's clean marker"))?;
        tracing::info!(
            path = %path.display(),
            chunks = adopted.len(),
            "chunk store: chunks of a cleanly closed swap file of this layout adopted"
        );
        return Ok(adopted);
    }
    // The first removal (or the fingerprint) clears a clean marker on disk first.
    nvme.clear_clean()
        .map_err(nvme_err("clearing the swap file's clean marker"))?;
    for &(id, _) in &stored {
        nvme.remove(id)
            .map_err(nvme_err("emptying the swap file"))?;
    }
    nvme.set_layout_fingerprint(Some(fingerprint))
        .map_err(nvme_err("recording the layout fingerprint"))?;
    nvme.flush().map_err(nvme_err("emptying the swap file"))?;
    if !stored.is_empty() {
        tracing::info!(
            path = %path.display(),
            chunks = stored.len(),
            "chunk store: chunks an earlier run left in the swap file dropped (not adopted)"
        );
    }
    Ok(Vec::new())
}
