//! Creating, formatting and opening a swap file: the new file is reserved whole
//! (fallocate) and both metadata copies written before it is used; an existing one is
//! locked before anything is read, then restored from the valid header copy with the
//! highest generation whose map also checks out.
//!
//! Invariants: a half-made file is removed; a file-backed swap file holds its exclusive
//! lock for as long as it is open; every buffer the file will ever need (metadata pages,
//! compression scratch and image buffers) is made here, none on the I/O path.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use super::format::{
    decode_map, Header, HeaderFault, Layout, SlotEntry, HEADER_COPIES, HEADER_PAGE_BYTES,
};
use super::{SwapFile, COMPRESS_WRITE_BUFFERS};
use crate::buffer::{align_up, AlignedBuf};
use crate::compress::{self, Codec, Compression};
use crate::config::{check_writable_dir, IoConfig};
use crate::engine::Engine;
use crate::error::{IoError, Result};

impl SwapFile {
    /// Create a new swap file at `path` of `slot_count` slots of `slot_bytes` (a multiple
    /// of 4096), reserving all its space now (fallocate). Fails if `path` exists (use
    /// [`SwapFile::open`] or [`SwapFile::open_or_create`]); a missing or unwritable
    /// directory is a config error naming `nvme.dir`; a disk without room is
    /// [`IoError::NoSpace`] (the partial file is removed).
    pub fn create(
        path: &Path,
        slot_bytes: usize,
        slot_count: u32,
        cfg: &IoConfig,
        compression: Compression,
    ) -> Result<Self> {
        Layout::new(slot_bytes as u64, slot_count as u64)?;
        compression.validate()?;
        cfg.validate()?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        check_writable_dir("nvme.dir", dir)?;
        if path.exists() {
            return Err(IoError::Setup {
                what: "creating swap file (it already exists; open it instead)",
                path: path.to_path_buf(),
                source: std::io::ErrorKind::AlreadyExists.into(),
            });
        }
        let engine = Engine::open(path, cfg, true)?;
        // Held from before the header is written; failing here means another creator
        // raced us to this path, whose file it is to keep.
        let lock = crate::file::lock_exclusive(path)?;
        match SwapFile::format(
            engine,
            path.to_path_buf(),
            slot_bytes,
            slot_count,
            compression,
        ) {
            Ok(mut swap) => {
                swap.fixed_buffers = cfg.fixed_buffers;
                swap._lock = lock;
                Ok(swap)
            }
            Err(e) => {
                if let Err(rm) = std::fs::remove_file(path) {
                    tracing::warn!(path = %path.display(), error = %rm, "could not remove a half-made swap file");
                }
                Err(e)
            }
        }
    }

    /// Bytes a swap file of `slot_count` slots of `slot_bytes` occupies on disk (headers,
    /// the two copies of the chunk map and the slots), or the config error naming the
    /// key that makes the shape impossible.
    pub fn file_bytes_for(slot_bytes: usize, slot_count: u64) -> Result<u64> {
        let layout = Layout::new(slot_bytes as u64, slot_count)?;
        Ok(layout.data_offset + layout.slot_count as u64 * layout.slot_bytes)
    }

    /// Open an existing swap file, restoring its chunk map and compression setting.
    /// Bad magic, another version, damaged headers or a file shorter than the slots its
    /// header claims are [`IoError::BadHeader`].
    pub fn open(path: &Path, cfg: &IoConfig) -> Result<Self> {
        // Locked before anything is read: another process may be rewriting it.
        let lock = crate::file::lock_exclusive(path)?;
        let engine = Engine::open(path, cfg, false)?;
        let mut swap = SwapFile::open_with_engine(engine, path.to_path_buf())?;
        swap.fixed_buffers = cfg.fixed_buffers;
        swap._lock = lock;
        Ok(swap)
    }

    /// Open the file at `path` if it exists, else create it. An existing file must have
    /// the shape and compression asked for, otherwise it is [`IoError::BadHeader`] (the
    /// file is left as it is: delete it to change its shape).
    pub fn open_or_create(
        path: &Path,
        slot_bytes: usize,
        slot_count: u32,
        cfg: &IoConfig,
        compression: Compression,
    ) -> Result<Self> {
        if !path.exists() {
            return SwapFile::create(path, slot_bytes, slot_count, cfg, compression);
        }
        let swap = SwapFile::open(path, cfg)?;
        if swap.slot_bytes() != slot_bytes
            || swap.slot_count() != slot_count
            || swap.compression != compression
        {
            return Err(IoError::BadHeader {
                path: path.to_path_buf(),
                reason: format!(
                    "holds {} slots of {} bytes with {:?}, the config asks for {slot_count} slots of {slot_bytes} bytes with {compression:?}",
                    swap.slot_count(),
                    swap.slot_bytes(),
                    swap.compression
                ),
            });
        }
        Ok(swap)
    }

    /// Format a new swap file over an engine built by the caller (for instance on the
    /// in-memory fault-injecting backend). Errors name the file as `<memory>` etc.
    pub fn with_engine(
        engine: Engine,
        slot_bytes: usize,
        slot_count: u32,
        compression: Compression,
    ) -> Result<Self> {
        let path = PathBuf::from(format!("<{}>", engine.kind()));
        SwapFile::format(engine, path, slot_bytes, slot_count, compression)
    }

    /// Open a swap file already formatted on the device behind `engine`; `path` only
    /// names it in errors.
    pub fn open_with_engine(mut engine: Engine, path: PathBuf) -> Result<Self> {
        let bad = |reason: String| IoError::BadHeader {
            path: path.clone(),
            reason,
        };
        let file_bytes = engine.len_bytes()?;
        let (candidates, mut faults) = read_headers(&mut engine, &path, file_bytes)?;
        for (copy, header) in candidates {
            let layout = header.layout;
            let need_bytes = layout.file_bytes();
            if file_bytes < need_bytes {
                return Err(bad(format!(
                    "file is {file_bytes} bytes, too small for the {} slots of {} bytes its header claims ({need_bytes} bytes)",
                    layout.slot_count, layout.slot_bytes
                )));
            }
            match read_map(&mut engine, copy, &header, &path) {
                Ok(entries) => return SwapFile::restore(engine, path, copy, &header, entries),
                Err(e) => {
                    tracing::warn!(path = %path.display(), copy, error = %e, "swap file map copy unusable; trying the other");
                    faults.push(format!("copy {copy}: {e}"));
                }
            }
        }
        Err(bad(format!("no usable map ({})", faults.join("; "))))
    }

    /// The in-memory state of an opened file: `header`'s shape and owner's fields, and
    /// the map `entries` read from its copy `copy`.
    fn restore(
        engine: Engine,
        path: PathBuf,
        copy: u64,
        header: &Header,
        entries: Vec<(u32, SlotEntry)>,
    ) -> Result<Self> {
        let mut swap = SwapFile::assemble(engine, path, header.layout, header.compression)?;
        swap.generation = header.generation;
        swap.fingerprint = header.fingerprint;
        swap.clean = header.clean;
        for (slot, entry) in entries {
            swap.map.insert(entry.chunk, slot);
            swap.slots[slot as usize] = entry;
        }
        let slots = &swap.slots;
        swap.free.retain(|&s| !slots[s as usize].used);
        tracing::debug!(path = %swap.path.display(), copy, generation = swap.generation, chunks = swap.len(), "swap file opened");
        Ok(swap)
    }

    fn format(
        mut engine: Engine,
        path: PathBuf,
        slot_bytes: usize,
        slot_count: u32,
        compression: Compression,
    ) -> Result<Self> {
        let layout = Layout::new(slot_bytes as u64, slot_count as u64)?;
        compression.validate()?;
        engine.allocate(layout.file_bytes())?;
        let mut swap = SwapFile::assemble(engine, path, layout, compression)?;
        // Both copies valid from the start: generation 0 in copy 0, 1 in copy 1.
        swap.write_meta(0)?;
        swap.write_meta(1)?;
        swap.engine.sync_data()?;
        swap.generation = 1;
        swap.dirty = false;
        tracing::debug!(path = %swap.path.display(), slot_bytes, slot_count, ?compression, "swap file created");
        Ok(swap)
    }

    /// Build the in-memory state (every slot free) and every buffer it will ever need.
    fn assemble(
        engine: Engine,
        path: PathBuf,
        layout: Layout,
        compression: Compression,
    ) -> Result<Self> {
        let slot_count = layout.slot_count as usize;
        let slot_bytes = layout.slot_bytes as usize;
        let (codec, scratch, write_bufs) = match compression {
            Compression::Off => (None, None, Vec::new()),
            Compression::Zstd { level, word_bytes } => {
                let codec = Codec::new(level, word_bytes)?;
                let scratch = AlignedBuf::new_zeroed(slot_bytes)?;
                let image_bytes = align_up(compress::compress_bound(slot_bytes));
                let mut bufs = Vec::with_capacity(COMPRESS_WRITE_BUFFERS);
                for _ in 0..COMPRESS_WRITE_BUFFERS {
                    bufs.push(AlignedBuf::new_zeroed(image_bytes)?);
                }
                (Some(codec), Some(scratch), bufs)
            }
        };
        let in_flight_max = slot_count.min(1024);
        Ok(SwapFile {
            engine,
            path,
            layout,
            compression,
            codec,
            scratch,
            write_bufs,
            slots: vec![SlotEntry::default(); slot_count],
            map: HashMap::with_capacity(slot_count),
            free: (0..layout.slot_count).rev().collect(),
            quarantine: Vec::with_capacity(slot_count),
            in_flight: Vec::with_capacity(in_flight_max),
            free_tokens: Vec::with_capacity(in_flight_max),
            ready: VecDeque::with_capacity(in_flight_max),
            next_refused: 0,
            next_seq: 0,
            generation: 0,
            dirty: false,
            fingerprint: None,
            clean: false,
            poisoned: None,
            header_buf: Some(AlignedBuf::new_zeroed(HEADER_PAGE_BYTES)?),
            map_buf: Some(AlignedBuf::new_zeroed(layout.map_bytes as usize)?),
            fixed_buffers: true,
            _lock: None,
        })
    }
}

/// The usable header copies (copy index, header), newest first, and why the others
/// are not usable.
type HeaderCopies = (Vec<(u64, Header)>, Vec<String>);

/// Reads both header pages and decodes them: the usable copies, newest first, and why
/// the others are not. No usable copy, or a file too small for the header pages, is
/// [`IoError::BadHeader`].
fn read_headers(engine: &mut Engine, path: &Path, file_bytes: u64) -> Result<HeaderCopies> {
    let bad = |reason: String| IoError::BadHeader {
        path: path.to_path_buf(),
        reason,
    };
    let pages_bytes = HEADER_COPIES as usize * HEADER_PAGE_BYTES;
    if file_bytes < pages_bytes as u64 {
        return Err(bad(format!(
            "file is {file_bytes} bytes, too small for its two {HEADER_PAGE_BYTES}-byte header pages"
        )));
    }
    let pages = AlignedBuf::new_zeroed(pages_bytes)?;
    let (res, pages) = engine.read_at(0, pages, pages_bytes);
    res?;
    let mut candidates = Vec::with_capacity(HEADER_COPIES as usize);
    let mut faults = Vec::new();
    for copy in 0..HEADER_COPIES as usize {
        let page = &pages[copy * HEADER_PAGE_BYTES..(copy + 1) * HEADER_PAGE_BYTES];
        match Header::decode(page) {
            Ok(h) => candidates.push((copy as u64, h)),
            Err(HeaderFault::NoMagic) => faults.push(format!("copy {copy}: no tidestore magic")),
            Err(HeaderFault::Bad(why)) => faults.push(format!("copy {copy}: {why}")),
        }
    }
    if candidates.is_empty() {
        return Err(bad(format!(
            "not a usable tidestore swap file ({})",
            faults.join("; ")
        )));
    }
    candidates.sort_by_key(|(_, h)| std::cmp::Reverse(h.generation));
    Ok((candidates, faults))
}

/// Reads map copy `copy` and decodes it against `header`.
fn read_map(
    engine: &mut Engine,
    copy: u64,
    header: &Header,
    path: &Path,
) -> Result<Vec<(u32, SlotEntry)>> {
    let layout = header.layout;
    let map_bytes = layout.map_bytes as usize;
    let map_buf = AlignedBuf::new_zeroed(map_bytes)?;
    let (res, map_buf) = engine.read_at(layout.map_offset(copy), map_buf, map_bytes);
    res.and_then(|()| decode_map(&map_buf[..map_bytes], header, path))
}
