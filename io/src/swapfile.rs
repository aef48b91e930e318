//! The swap file: one preallocated file of fixed-size chunk slots, with a stable
//! chunk→slot map, a crc32c per chunk and optional compression.
//!
//! # Layout (all offsets 4096-aligned, so the file can be used with O_DIRECT)
//! ```text
//! [0, 4096)            header copy 0   magic, version, generation, shape, map crc,
//!                                      owner's layout fingerprint, clean flag, crc
//! [4096, 8192)         header copy 1
//! [8192, +map)         map copy 0      one 32-byte entry per slot
//! [.., +map)           map copy 1
//! [data, +slots)       slot i at data_offset + i * slot_bytes (data_offset 1 MiB aligned)
//! ```
//! A map entry is `chunk u64, len_bytes u64, stored_bytes u64, crc32c u32, flags u32`
//! (little endian). `crc32c` covers the `stored_bytes` actually kept in the slot: the
//! chunk itself, or its compressed image when compression shrank it (flag bit 1).
//!
//! # What is persisted when, and what survives a crash
//! The map lives in memory and is written by [`SwapFile::flush`] (and on drop): flush
//! waits for every request in flight, `fdatasync`s the data, writes the map and header
//! into the copy *not* holding the newest generation, and syncs again. Opening picks the
//! valid copy (magic, version, header and map checksums) with the highest generation, so
//! a crash during a flush falls back to the previous flush.
//!
//! After a crash the file holds the chunks as of the last completed flush. A chunk
//! overwritten in place after that flush (the optimizer rewrites M and V every step) may
//! hold a mix of old and new bytes: its checksum no longer matches and reading it gives
//! [`IoError::Corrupt`] — never wrong bytes. Chunks written for the first time after the
//! last flush are simply absent. Slots freed by [`SwapFile::remove`] are not reused until
//! the next flush (while others are free), so a crash cannot make a removed chunk's old
//! entry point at another chunk's bytes.
//!
//! # Owner's fingerprint and the clean-close marker
//! The header also keeps an opaque 64-bit *layout fingerprint* set by the file's owner
//! ([`SwapFile::set_layout_fingerprint`]; the chunk store stores its layout's) and a
//! *clean* flag. [`SwapFile::mark_clean`] flushes and persists the flag set: it says the
//! chunks on disk are exactly what the owner last wrote. The flag is cleared on disk
//! (header written and synced) before the first change after it — a write, a removal, a
//! new fingerprint, or [`SwapFile::clear_clean`] — so a crash after that change is never
//! read back as a clean close.
//!
//! # Invariants
//! - the file never grows after creation: every slot is reserved (fallocate) up front;
//! - a chunk keeps its slot for as long as it is stored, across flushes and reopenings;
//! - every read is checked against the checksum taken when the chunk was written;
//! - a caller's buffer is never changed by a write (compression works in scratch buffers
//!   made at open);
//! - at most one request per chunk is in flight; a second one completes at once with an
//!   error;
//! - a file-backed swap file is locked (`flock`, exclusive) while it is open, so a
//!   second owner (another process sharing `nvme.dir`) gets a setup error instead of
//!   overwriting chunks under the first;
//! - checksums are taken by the engine as each request's pieces complete (see
//!   [`Engine::submit_checksummed`]), so neither a write nor the verification of a read
//!   waits for a whole-chunk checksum pass;
//! - after any failed write or sync the file is *poisoned*: every later write and flush
//!   fails with [`IoError::Poisoned`] (no retry: the kernel may have dropped the dirty
//!   pages), while chunks written before stay readable. The chunk whose write failed is
//!   dropped from the map (reading it gives [`IoError::UnknownChunk`]).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use crate::buffer::{align_up, AlignedBuf, BufferPool, ALIGN_BYTES};
use crate::compress::{self, Codec, Compression};
use crate::config::{check_writable_dir, IoConfig};
use crate::engine::{Engine, IoCompletion, IoRequest};
use crate::error::{IoError, Op, Result};

/// First bytes of every header copy.
pub const MAGIC: [u8; 8] = *b"TIDESWAP";
/// Version of the on-disk format written by this code.
pub const VERSION: u32 = 2;

const HEADER_PAGE_BYTES: usize = ALIGN_BYTES;
const HEADER_COPIES: u64 = 2;
const ENTRY_BYTES: usize = 32;
/// Slots start on a 1 MiB boundary, so large slot transfers map onto whole device
/// requests.
const DATA_ALIGN_BYTES: u64 = 1 << 20;
/// Compressed images that may be in flight at once (each a buffer of the zstd bound of a
/// slot, made at open). A compressed write waits for one to come back when all are out.
pub const COMPRESS_WRITE_BUFFERS: usize = 2;

const FLAG_USED: u32 = 1;
const FLAG_COMPRESSED: u32 = 2;
/// Tokens of requests refused at submit, kept apart from in-flight slab indices.
const REFUSED_TOKEN_BIT: u64 = 1 << 62;

/// Where everything lies in a file of `slot_count` slots of `slot_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    slot_bytes: u64,
    slot_count: u32,
    map_bytes: u64,
    data_offset: u64,
}

impl Layout {
    fn new(slot_bytes: u64, slot_count: u64) -> Result<Layout> {
        if slot_bytes == 0
            || !slot_bytes.is_multiple_of(ALIGN_BYTES as u64)
            || slot_bytes > u32::MAX as u64
        {
            return Err(IoError::config(
                "chunk.size",
                format!("{slot_bytes} bytes is not a positive multiple of 4096 below 4 GiB"),
            ));
        }
        let slot_count = u32::try_from(slot_count)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                IoError::config("nvme.size", format!("{slot_count} is outside 1..=2^32-1"))
            })?;
        let map_bytes = align_up(slot_count as usize * ENTRY_BYTES) as u64;
        let meta_end = (HEADER_COPIES * HEADER_PAGE_BYTES as u64) + HEADER_COPIES * map_bytes;
        let data_offset = meta_end.div_ceil(DATA_ALIGN_BYTES) * DATA_ALIGN_BYTES;
        let layout = Layout {
            slot_bytes,
            slot_count,
            map_bytes,
            data_offset,
        };
        if (slot_count as u64)
            .checked_mul(slot_bytes)
            .and_then(|b| b.checked_add(data_offset))
            .is_none()
        {
            return Err(IoError::config(
                "nvme.size",
                format!("{slot_count} slots of {slot_bytes} bytes overflow a file offset"),
            ));
        }
        Ok(layout)
    }

    fn header_offset(copy: u64) -> u64 {
        copy * HEADER_PAGE_BYTES as u64
    }

    fn map_offset(&self, copy: u64) -> u64 {
        HEADER_COPIES * HEADER_PAGE_BYTES as u64 + copy * self.map_bytes
    }

    fn slot_offset(&self, slot: u32) -> u64 {
        self.data_offset + slot as u64 * self.slot_bytes
    }

    fn file_bytes(&self) -> u64 {
        self.data_offset + self.slot_count as u64 * self.slot_bytes
    }
}

/// One decoded header copy.
#[derive(Debug, Clone, Copy)]
struct Header {
    generation: u64,
    layout: Layout,
    compression: Compression,
    map_crc: u32,
    /// The owner's layout fingerprint, if one was set.
    fingerprint: Option<u64>,
    /// Closed cleanly (see the module doc).
    clean: bool,
}

// Header page field offsets.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_GENERATION: usize = 16;
const H_SLOT_BYTES: usize = 24;
const H_SLOT_COUNT: usize = 32;
const H_ENTRY_BYTES: usize = 36;
const H_MAP_BYTES: usize = 40;
const H_DATA_OFFSET: usize = 48;
const H_LEVEL: usize = 56;
const H_WORD_BYTES: usize = 60;
const H_MAP_CRC: usize = 64;
const H_FINGERPRINT: usize = 68;
const H_OWNER_FLAGS: usize = 76;
const H_CRC: usize = 80;

/// Owner flag: the header carries a layout fingerprint.
const OWNER_HAS_FINGERPRINT: u32 = 1;
/// Owner flag: the file was closed cleanly (see the module doc).
const OWNER_CLEAN: u32 = 2;

fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

impl Header {
    fn encode(&self, page: &mut [u8]) {
        page[..HEADER_PAGE_BYTES].fill(0);
        page[H_MAGIC..H_MAGIC + 8].copy_from_slice(&MAGIC);
        put_u32(page, H_VERSION, VERSION);
        put_u64(page, H_GENERATION, self.generation);
        put_u64(page, H_SLOT_BYTES, self.layout.slot_bytes);
        put_u32(page, H_SLOT_COUNT, self.layout.slot_count);
        put_u32(page, H_ENTRY_BYTES, ENTRY_BYTES as u32);
        put_u64(page, H_MAP_BYTES, self.layout.map_bytes);
        put_u64(page, H_DATA_OFFSET, self.layout.data_offset);
        let (level, word_bytes) = match self.compression {
            Compression::Off => (0, 0),
            Compression::Zstd { level, word_bytes } => (level, word_bytes as u32),
        };
        put_u32(page, H_LEVEL, level as u32);
        put_u32(page, H_WORD_BYTES, word_bytes);
        put_u32(page, H_MAP_CRC, self.map_crc);
        put_u64(page, H_FINGERPRINT, self.fingerprint.unwrap_or(0));
        let flags = if self.fingerprint.is_some() {
            OWNER_HAS_FINGERPRINT
        } else {
            0
        } | if self.clean { OWNER_CLEAN } else { 0 };
        put_u32(page, H_OWNER_FLAGS, flags);
        let crc = crc32c::crc32c(&page[..H_CRC]);
        put_u32(page, H_CRC, crc);
    }

    /// Decode one header page; `Err` says why it is not usable.
    fn decode(page: &[u8]) -> std::result::Result<Header, HeaderFault> {
        if page[H_MAGIC..H_MAGIC + 8] != MAGIC {
            return Err(HeaderFault::NoMagic);
        }
        let version = get_u32(page, H_VERSION);
        if version != VERSION {
            return Err(HeaderFault::Bad(format!(
                "format version {version}, this build reads version {VERSION}"
            )));
        }
        let stored = get_u32(page, H_CRC);
        let found = crc32c::crc32c(&page[..H_CRC]);
        if stored != found {
            return Err(HeaderFault::Bad(format!(
                "header checksum {found:#010x}, expected {stored:#010x}"
            )));
        }
        let bad = |what: String| HeaderFault::Bad(what);
        let layout = Layout::new(
            get_u64(page, H_SLOT_BYTES),
            get_u32(page, H_SLOT_COUNT) as u64,
        )
        .map_err(|e| bad(format!("impossible shape: {e}")))?;
        if get_u32(page, H_ENTRY_BYTES) as usize != ENTRY_BYTES
            || get_u64(page, H_MAP_BYTES) != layout.map_bytes
            || get_u64(page, H_DATA_OFFSET) != layout.data_offset
        {
            return Err(bad(
                "map size or data offset disagree with the slot shape".into()
            ));
        }
        let word_bytes = get_u32(page, H_WORD_BYTES) as usize;
        let compression = if word_bytes == 0 {
            Compression::Off
        } else {
            Compression::Zstd {
                level: get_u32(page, H_LEVEL) as i32,
                word_bytes,
            }
        };
        compression
            .validate()
            .map_err(|e| bad(format!("compression setting: {e}")))?;
        let flags = get_u32(page, H_OWNER_FLAGS);
        if flags & !(OWNER_HAS_FINGERPRINT | OWNER_CLEAN) != 0 {
            return Err(bad(format!("unknown owner flags {flags:#x}")));
        }
        Ok(Header {
            generation: get_u64(page, H_GENERATION),
            layout,
            compression,
            map_crc: get_u32(page, H_MAP_CRC),
            fingerprint: (flags & OWNER_HAS_FINGERPRINT != 0).then(|| get_u64(page, H_FINGERPRINT)),
            clean: flags & OWNER_CLEAN != 0,
        })
    }
}

enum HeaderFault {
    NoMagic,
    Bad(String),
}

/// What the file knows about one slot.
#[derive(Debug, Clone, Copy, Default)]
struct SlotEntry {
    chunk: u64,
    len_bytes: u64,
    stored_bytes: u64,
    crc: u32,
    /// Holds a chunk whose write completed.
    used: bool,
    compressed: bool,
    /// A request on this slot is in flight.
    busy: bool,
}

impl SlotEntry {
    fn encode(&self, out: &mut [u8]) {
        if !self.used {
            out[..ENTRY_BYTES].fill(0);
            return;
        }
        put_u64(out, 0, self.chunk);
        put_u64(out, 8, self.len_bytes);
        put_u64(out, 16, self.stored_bytes);
        put_u32(out, 24, self.crc);
        let flags = FLAG_USED | if self.compressed { FLAG_COMPRESSED } else { 0 };
        put_u32(out, 28, flags);
    }

    fn decode(b: &[u8]) -> SlotEntry {
        let flags = get_u32(b, 28);
        SlotEntry {
            chunk: get_u64(b, 0),
            len_bytes: get_u64(b, 8),
            stored_bytes: get_u64(b, 16),
            crc: get_u32(b, 24),
            used: flags & FLAG_USED != 0,
            compressed: flags & FLAG_COMPRESSED != 0,
            busy: false,
        }
    }
}

/// A finished swap-file request: the caller's buffer back, and what happened.
#[derive(Debug)]
pub struct SwapCompletion {
    pub chunk: u64,
    pub op: Op,
    /// `Ok` when the chunk was written (durable at the next flush), or read and verified.
    pub result: Result<()>,
    /// The buffer handed in; after a good read its first `len_bytes` are the chunk.
    pub buf: AlignedBuf,
    /// The chunk's length in bytes (0 for a read refused before its length was known).
    pub len_bytes: usize,
    token: u64,
}

/// A request handed to the engine.
#[derive(Debug)]
struct InFlight {
    /// The request's token: slab index in the low 32 bits, a sequence number above, so
    /// a token is never reused while an older completion with it may still be queued.
    token: u64,
    chunk: u64,
    slot: u32,
    op: Op,
    len_bytes: usize,
    stored_bytes: usize,
    crc: u32,
    compressed: bool,
    /// The caller's buffer while its compressed image (from `write_bufs`) is written.
    held: Option<AlignedBuf>,
}

/// A preallocated file of fixed-size chunk slots. See the module documentation.
pub struct SwapFile {
    engine: Engine,
    path: PathBuf,
    layout: Layout,
    compression: Compression,
    codec: Option<Codec>,
    /// Shuffle output before compressing, zstd output before unshuffling (slot_bytes).
    scratch: Option<AlignedBuf>,
    /// Destinations of compressed images, each of the zstd bound of a slot.
    write_bufs: Vec<AlignedBuf>,
    slots: Vec<SlotEntry>,
    /// Chunk → slot, for stored chunks and chunks whose first write is in flight.
    map: HashMap<u64, u32>,
    /// Free slots, lowest last (popped first).
    free: Vec<u32>,
    /// Slots freed since the last flush: the persisted map may still name them.
    quarantine: Vec<u32>,
    in_flight: Vec<Option<InFlight>>,
    free_tokens: Vec<u32>,
    ready: VecDeque<SwapCompletion>,
    next_refused: u64,
    /// Sequence number of the last tracked request (see `InFlight::token`).
    next_seq: u64,
    generation: u64,
    dirty: bool,
    /// The owner's layout fingerprint (persisted in the header).
    fingerprint: Option<u64>,
    /// The header on disk says clean (see the module doc): nothing changed since.
    clean: bool,
    poisoned: Option<String>,
    header_buf: Option<AlignedBuf>,
    map_buf: Option<AlignedBuf>,
    /// Whether [`SwapFile::register_pool`] may register buffers (`io.fixed_buffers`).
    fixed_buffers: bool,
    /// The exclusive lock on a file-backed swap file, held while it is open.
    _lock: Option<std::fs::File>,
}

impl std::fmt::Debug for SwapFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapFile")
            .field("path", &self.path)
            .field("slot_bytes", &self.layout.slot_bytes)
            .field("slot_count", &self.layout.slot_count)
            .field("chunks", &self.len())
            .field("compression", &self.compression)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

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
                Err(HeaderFault::NoMagic) => {
                    faults.push(format!("copy {copy}: no tidestore magic"))
                }
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
        for (copy, header) in candidates {
            let layout = header.layout;
            let need_bytes = layout.file_bytes();
            if file_bytes < need_bytes {
                return Err(bad(format!(
                    "file is {file_bytes} bytes, too small for the {} slots of {} bytes its header claims ({need_bytes} bytes)",
                    layout.slot_count, layout.slot_bytes
                )));
            }
            let map_bytes = layout.map_bytes as usize;
            let map_buf = AlignedBuf::new_zeroed(map_bytes)?;
            let (res, map_buf) = engine.read_at(layout.map_offset(copy), map_buf, map_bytes);
            let entries = res.and_then(|()| decode_map(&map_buf[..map_bytes], &header, &path));
            match entries {
                Ok(entries) => {
                    let mut swap = SwapFile::assemble(engine, path, layout, header.compression)?;
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
                    return Ok(swap);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), copy, error = %e, "swap file map copy unusable; trying the other");
                    faults.push(format!("copy {copy}: {e}"));
                }
            }
        }
        Err(bad(format!("no usable map ({})", faults.join("; "))))
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

    // ---------------------------------------------------------------- accessors

    /// The file's path (or `<memory>` for an engine-backed one).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of every slot.
    pub fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes as usize
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.layout.slot_count
    }

    /// Total size of the file (fixed at creation).
    pub fn file_bytes(&self) -> u64 {
        self.layout.file_bytes()
    }

    /// File offset of `slot`'s first byte.
    pub fn slot_offset_bytes(&self, slot: u32) -> u64 {
        self.layout.slot_offset(slot)
    }

    /// The compression setting (restored from the header on open).
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Whether `chunk` is stored (its write completed and it was not removed).
    pub fn contains(&self, chunk: u64) -> bool {
        self.entry(chunk).is_some()
    }

    /// Length in bytes of stored `chunk`.
    pub fn len_of(&self, chunk: u64) -> Option<usize> {
        self.entry(chunk).map(|(_, e)| e.len_bytes as usize)
    }

    /// Slot holding stored `chunk`.
    pub fn slot_of(&self, chunk: u64) -> Option<u32> {
        self.entry(chunk).map(|(s, _)| s)
    }

    /// Bytes `chunk` takes in its slot (less than its length when compressed).
    pub fn stored_bytes_of(&self, chunk: u64) -> Option<usize> {
        self.entry(chunk).map(|(_, e)| e.stored_bytes as usize)
    }

    /// Number of chunks stored.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|e| e.used).count()
    }

    /// Whether no chunk is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stored chunks and their slots, in slot order.
    pub fn chunks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, e)| e.used)
            .map(|(s, e)| (e.chunk, s as u32))
    }

    /// Slots free for new chunks (including ones freed since the last flush).
    pub fn free_slots(&self) -> usize {
        self.free.len() + self.quarantine.len()
    }

    /// Whether an earlier write or sync failed (writes are refused).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// Requests submitted whose completion [`SwapFile::wait`] has not returned yet.
    pub fn outstanding(&self) -> usize {
        self.in_flight.len() - self.free_tokens.len() + self.ready.len()
    }

    /// The engine underneath (backend kind, block size).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Register `pool` (the buffers chunks are read into and written from) with the
    /// engine, so requests on its buffers become io_uring `READ_FIXED` / `WRITE_FIXED`
    /// (no page pinning per request). Returns whether it took: `false` when
    /// `io.fixed_buffers` is off, on backends without fixed buffers, or when the kernel
    /// refuses (RLIMIT_MEMLOCK; logged). Buffers of other pools keep working as plain
    /// requests. Waits for every request in flight first (registration needs an idle
    /// ring); their completions stay for [`SwapFile::wait`].
    pub fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        if !self.fixed_buffers {
            return Ok(false);
        }
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.engine.register_pool(pool)
    }

    fn entry(&self, chunk: u64) -> Option<(u32, &SlotEntry)> {
        let &slot = self.map.get(&chunk)?;
        let e = &self.slots[slot as usize];
        e.used.then_some((slot, e))
    }

    // ---------------------------------------------------------------- requests

    /// Write the first `len_bytes` of `buf` as `chunk` and wait for it. The chunk keeps
    /// its slot if it is stored already, else takes a free one. `buf` comes back
    /// unchanged. Durable after the next [`SwapFile::flush`].
    pub fn write_chunk(
        &mut self,
        chunk: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        let token = self.submit_write_token(chunk, buf, len_bytes);
        let c = self.wait_for(token);
        (c.result, c.buf)
    }

    /// Read `chunk` into `buf` (at least its length rounded up to 4096), verify its
    /// checksum, and return its length.
    pub fn read_chunk(&mut self, chunk: u64, buf: AlignedBuf) -> (Result<usize>, AlignedBuf) {
        let token = self.submit_read_token(chunk, buf);
        let c = self.wait_for(token);
        (c.result.map(|()| c.len_bytes), c.buf)
    }

    /// Start writing `chunk` from the first `len_bytes` of `buf`; the compressed image is
    /// made now, the checksum by the engine as the write's pieces complete (so the write
    /// starts at once). The completion comes from [`SwapFile::wait`] or
    /// [`SwapFile::poll`]; a request refused at once (poisoned file, chunk busy, no free
    /// slot, too large) completes with its error. With compression on, this may wait for
    /// an earlier compressed write to finish when all image buffers are in flight.
    pub fn submit_write(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) {
        self.submit_write_token(chunk, buf, len_bytes);
    }

    /// Start reading `chunk` into `buf`; it is verified (and decompressed) when its
    /// completion is taken by [`SwapFile::wait`] or [`SwapFile::poll`].
    pub fn submit_read(&mut self, chunk: u64, buf: AlignedBuf) {
        self.submit_read_token(chunk, buf);
    }

    /// The next finished request, waiting for one; `None` when nothing is outstanding.
    pub fn wait(&mut self) -> Option<SwapCompletion> {
        while self.ready.is_empty() {
            let c = self.engine.wait()?;
            self.on_completion(c);
        }
        self.ready.pop_front()
    }

    /// A finished request if there is one, without waiting (also starts queued I/O).
    pub fn poll(&mut self) -> Option<SwapCompletion> {
        if self.ready.is_empty() {
            if let Some(c) = self.engine.poll() {
                self.on_completion(c);
            }
        }
        self.ready.pop_front()
    }

    /// Forget `chunk` and free its slot (reused after the next flush, or sooner when no
    /// other slot is free). Persisted at the next flush.
    pub fn remove(&mut self, chunk: u64) -> Result<()> {
        let Some(&slot) = self.map.get(&chunk) else {
            return Err(IoError::UnknownChunk { chunk });
        };
        if self.slots[slot as usize].busy {
            return Err(IoError::InvalidRequest {
                reason: format!(
                    "chunk {chunk} cannot be removed while a request on it is in flight"
                ),
            });
        }
        self.clear_clean()?;
        self.slots[slot as usize] = SlotEntry::default();
        self.map.remove(&chunk);
        self.quarantine.push(slot);
        self.dirty = true;
        Ok(())
    }

    /// Wait for every request in flight (their completions stay for
    /// [`SwapFile::wait`]), then make the data and the map durable: sync, write the map
    /// and header into the older copy, sync. A failure poisons the file.
    pub fn flush(&mut self) -> Result<()> {
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.check_not_poisoned()?;
        if !self.dirty {
            return Ok(());
        }
        self.persist_meta()
    }

    /// The owner's layout fingerprint recorded in the header, if any (see the module
    /// doc).
    pub fn layout_fingerprint(&self) -> Option<u64> {
        self.fingerprint
    }

    /// Whether the header says the file was closed cleanly and nothing changed since
    /// (see [`SwapFile::mark_clean`]).
    pub fn is_clean(&self) -> bool {
        self.clean
    }

    /// Records the owner's layout fingerprint (`None`: none). A file marked clean is
    /// first marked not clean on disk; the fingerprint itself is persisted at the next
    /// flush.
    pub fn set_layout_fingerprint(&mut self, fingerprint: Option<u64>) -> Result<()> {
        if self.fingerprint == fingerprint {
            return Ok(());
        }
        self.clear_clean()?;
        self.fingerprint = fingerprint;
        self.dirty = true;
        Ok(())
    }

    /// Flushes (see [`SwapFile::flush`]) and then persists the clean-close marker: the
    /// chunks on disk are exactly the ones written. The marker is cleared on disk before
    /// the next change. A failure poisons the file (and leaves it not clean).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.flush()?;
        if self.clean {
            return Ok(());
        }
        self.clean = true;
        let result = self.persist_meta();
        if result.is_err() {
            self.clean = false;
        }
        result
    }

    /// Clears the clean-close marker on disk (header written and synced) if it is set;
    /// every change to a clean file does this first. Waits for the requests in flight
    /// (their completions stay for [`SwapFile::wait`]). A failure poisons the file.
    pub fn clear_clean(&mut self) -> Result<()> {
        if !self.clean {
            return Ok(());
        }
        self.check_not_poisoned()?;
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.clean = false;
        self.persist_meta()
    }

    /// Syncs the data, writes the map and header of the next generation into the older
    /// copy, and syncs again; then the quarantined slots are free. A failure poisons the
    /// file. Nothing may be in flight.
    fn persist_meta(&mut self) -> Result<()> {
        let generation = self.generation + 1;
        let result = self
            .engine
            .sync_data()
            .and_then(|()| self.write_meta(generation))
            .and_then(|()| self.engine.sync_data());
        if let Err(e) = result {
            self.poison(&e);
            return Err(e);
        }
        self.generation = generation;
        self.dirty = false;
        // The persisted map no longer names the quarantined slots.
        while let Some(slot) = self.quarantine.pop() {
            self.free.push(slot);
        }
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        Ok(())
    }

    fn check_not_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(first_error) => Err(IoError::Poisoned {
                path: self.path.clone(),
                first_error: first_error.clone(),
            }),
            None => Ok(()),
        }
    }

    fn poison(&mut self, e: &IoError) {
        if self.poisoned.is_none() {
            tracing::error!(path = %self.path.display(), error = %e, "swap file poisoned: refusing further writes");
            self.poisoned = Some(e.to_string());
        }
    }

    /// Encode the map and header for `generation` and write them into copy
    /// `generation % 2` (map first: the header's checksum of the map covers a torn map).
    fn write_meta(&mut self, generation: u64) -> Result<()> {
        let copy = generation % HEADER_COPIES;
        let map_bytes = self.layout.map_bytes as usize;
        let (Some(mut map_buf), Some(mut header_buf)) =
            (self.map_buf.take(), self.header_buf.take())
        else {
            return Err(IoError::InvalidRequest {
                reason: "swap file metadata buffers are in use".into(),
            });
        };
        map_buf[..map_bytes].fill(0);
        for (slot, e) in self.slots.iter().enumerate() {
            let at = slot * ENTRY_BYTES;
            e.encode(&mut map_buf[at..at + ENTRY_BYTES]);
        }
        let header = Header {
            generation,
            layout: self.layout,
            compression: self.compression,
            map_crc: crc32c::crc32c(&map_buf[..map_bytes]),
            fingerprint: self.fingerprint,
            clean: self.clean,
        };
        header.encode(&mut header_buf);
        let (res, map_buf) = self
            .engine
            .write_at(self.layout.map_offset(copy), map_buf, map_bytes);
        self.map_buf = Some(map_buf);
        if let Err(e) = res {
            self.header_buf = Some(header_buf);
            return Err(e);
        }
        let (res, header_buf) =
            self.engine
                .write_at(Layout::header_offset(copy), header_buf, HEADER_PAGE_BYTES);
        self.header_buf = Some(header_buf);
        res
    }

    fn refuse(&mut self, chunk: u64, op: Op, buf: AlignedBuf, len_bytes: usize, e: IoError) -> u64 {
        let token = REFUSED_TOKEN_BIT | self.next_refused;
        self.next_refused = (self.next_refused + 1) % REFUSED_TOKEN_BIT;
        self.ready.push_back(SwapCompletion {
            chunk,
            op,
            result: Err(e),
            buf,
            len_bytes,
            token,
        });
        token
    }

    fn busy_error(chunk: u64) -> IoError {
        IoError::InvalidRequest {
            reason: format!("chunk {chunk} already has a request in flight"),
        }
    }

    fn submit_write_token(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) -> u64 {
        if let Err(e) = self.check_not_poisoned() {
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        }
        if len_bytes == 0 || len_bytes > buf.capacity() {
            let e = IoError::InvalidRequest {
                reason: format!(
                    "write of chunk {chunk}: {len_bytes} bytes from a buffer of {}",
                    buf.capacity()
                ),
            };
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        }
        if len_bytes as u64 > self.layout.slot_bytes {
            let e = IoError::ChunkTooLarge {
                chunk,
                len_bytes,
                slot_bytes: self.slot_bytes(),
            };
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        }
        // A clean file is marked not clean on disk before its first change.
        if let Err(e) = self.clear_clean() {
            return self.refuse(chunk, Op::Write, buf, len_bytes, e);
        }
        if let Some(&slot) = self.map.get(&chunk) {
            if self.slots[slot as usize].busy {
                return self.refuse(chunk, Op::Write, buf, len_bytes, Self::busy_error(chunk));
            }
        }
        // A compressed image needs one of the image buffers; waiting for one processes
        // other completions, which cannot make this chunk busy but may poison the file.
        let image = if self.codec.is_some() {
            let image = self.take_write_buf();
            if let Err(e) = self.check_not_poisoned() {
                if let Some(b) = image {
                    self.write_bufs.push(b);
                }
                return self.refuse(chunk, Op::Write, buf, len_bytes, e);
            }
            image
        } else {
            None
        };
        // Claim the slot.
        let (slot, is_new) = match self.map.get(&chunk) {
            Some(&slot) => (slot, false),
            None => match self.free.pop().or_else(|| self.quarantine.pop()) {
                Some(slot) => (slot, true),
                None => {
                    if let Some(b) = image {
                        self.write_bufs.push(b);
                    }
                    let e = IoError::SwapFull {
                        chunk,
                        slots: self.layout.slot_count,
                    };
                    return self.refuse(chunk, Op::Write, buf, len_bytes, e);
                }
            },
        };
        // Compress when it saves at least one 4096-byte page; otherwise store raw.
        let mut packed: Option<(AlignedBuf, usize)> = None;
        if let Some(mut image) = image {
            let codec = self.codec.as_mut();
            let scratch = self.scratch.as_mut();
            let result = match (codec, scratch) {
                (Some(codec), Some(scratch)) => {
                    codec.compress(chunk, &buf[..len_bytes], scratch, &mut image)
                }
                _ => Err(IoError::Compression {
                    chunk,
                    reason: "compression state missing".into(),
                }),
            };
            match result {
                Ok(n) if align_up(n) < align_up(len_bytes) => {
                    image[n..align_up(n)].fill(0);
                    packed = Some((image, n));
                }
                Ok(_) => self.write_bufs.push(image),
                Err(e) => {
                    self.write_bufs.push(image);
                    if is_new {
                        self.free.push(slot);
                    }
                    return self.refuse(chunk, Op::Write, buf, len_bytes, e);
                }
            }
        }
        if is_new {
            self.map.insert(chunk, slot);
        }
        self.slots[slot as usize].busy = true;
        let offset_bytes = self.layout.slot_offset(slot);
        let (state, io_buf, io_bytes) = match packed {
            Some((image, n)) => (
                InFlight {
                    token: 0,
                    chunk,
                    slot,
                    op: Op::Write,
                    len_bytes,
                    stored_bytes: n,
                    // Taken by the engine as the write's pieces complete.
                    crc: 0,
                    compressed: true,
                    held: Some(buf),
                },
                image,
                align_up(n),
            ),
            None => (
                InFlight {
                    token: 0,
                    chunk,
                    slot,
                    op: Op::Write,
                    len_bytes,
                    stored_bytes: len_bytes,
                    // Taken by the engine as the write's pieces complete.
                    crc: 0,
                    compressed: false,
                    held: None,
                },
                buf,
                align_up(len_bytes),
            ),
        };
        let stored_bytes = state.stored_bytes;
        let token = self.track(state);
        self.engine.submit_checksummed(
            IoRequest {
                op: Op::Write,
                offset_bytes,
                len_bytes: io_bytes,
                buf: io_buf,
                user_data: token,
            },
            stored_bytes,
        );
        self.engine.flush();
        token
    }

    fn submit_read_token(&mut self, chunk: u64, buf: AlignedBuf) -> u64 {
        let Some((slot, entry)) = self.entry(chunk).map(|(s, e)| (s, *e)) else {
            let busy = self
                .map
                .get(&chunk)
                .is_some_and(|&s| self.slots[s as usize].busy);
            let e = if busy {
                Self::busy_error(chunk)
            } else {
                IoError::UnknownChunk { chunk }
            };
            return self.refuse(chunk, Op::Read, buf, 0, e);
        };
        let len_bytes = entry.len_bytes as usize;
        if entry.busy {
            return self.refuse(chunk, Op::Read, buf, len_bytes, Self::busy_error(chunk));
        }
        if align_up(len_bytes) > buf.capacity() {
            let e = IoError::InvalidRequest {
                reason: format!(
                    "read of chunk {chunk} ({len_bytes} bytes) into a buffer of {}",
                    buf.capacity()
                ),
            };
            return self.refuse(chunk, Op::Read, buf, len_bytes, e);
        }
        self.slots[slot as usize].busy = true;
        let stored_bytes = entry.stored_bytes as usize;
        let token = self.track(InFlight {
            token: 0,
            chunk,
            slot,
            op: Op::Read,
            len_bytes,
            stored_bytes,
            crc: entry.crc,
            compressed: entry.compressed,
            held: None,
        });
        self.engine.submit_checksummed(
            IoRequest {
                op: Op::Read,
                offset_bytes: self.layout.slot_offset(slot),
                len_bytes: align_up(stored_bytes),
                buf,
                user_data: token,
            },
            stored_bytes,
        );
        self.engine.flush();
        token
    }

    fn track(&mut self, mut state: InFlight) -> u64 {
        // Sequence numbers stay below 2^30 so tokens never reach REFUSED_TOKEN_BIT.
        self.next_seq = self.next_seq % ((1 << 30) - 1) + 1;
        let index = match self.free_tokens.pop() {
            Some(t) => t as usize,
            None => {
                self.in_flight.push(None);
                self.in_flight.len() - 1
            }
        };
        let token = self.next_seq << 32 | index as u64;
        state.token = token;
        self.in_flight[index] = Some(state);
        token
    }

    /// An image buffer for a compressed write, waiting for in-flight requests to bring
    /// one back when all are out. `None` only if none can come back (then the chunk is
    /// stored raw).
    fn take_write_buf(&mut self) -> Option<AlignedBuf> {
        loop {
            if let Some(b) = self.write_bufs.pop() {
                return Some(b);
            }
            let c = self.engine.wait()?;
            self.on_completion(c);
        }
    }

    /// Wait for the request `token` (a refused one is already in `ready`).
    fn wait_for(&mut self, token: u64) -> SwapCompletion {
        loop {
            if let Some(pos) = self.ready.iter().position(|c| c.token == token) {
                if let Some(c) = self.ready.remove(pos) {
                    return c;
                }
            }
            // Invariant: a request we submitted completes exactly once (the engine's
            // contract), so while ours is not in `ready` the engine has it outstanding.
            let c = self
                .engine
                .wait()
                .expect("engine holds the request being waited for");
            self.on_completion(c);
        }
    }

    /// Turn an engine completion into a swap completion: update the map after a write,
    /// verify (and decompress) after a read.
    fn on_completion(&mut self, c: IoCompletion) {
        let token = c.user_data;
        let index = (token & u64::from(u32::MAX)) as usize;
        let Some(state) = self
            .in_flight
            .get_mut(index)
            .and_then(|s| s.take_if(|s| s.token == token))
        else {
            tracing::error!(token, "completion for an unknown swap request ignored");
            return;
        };
        self.free_tokens.push(index as u32);
        let slot = state.slot as usize;
        self.slots[slot].busy = false;
        let completion = match state.op {
            Op::Write => {
                // The checksum of the bytes written, taken by the engine as they went out
                // (computed here only if the engine did not, which it always does).
                let crc = c.crc32c.unwrap_or_else(|| {
                    if c.result.is_ok() {
                        crc32c::crc32c(&c.buf[..state.stored_bytes])
                    } else {
                        0
                    }
                });
                let buf = match state.held {
                    Some(caller) => {
                        self.write_bufs.push(c.buf);
                        caller
                    }
                    None => c.buf,
                };
                match c.result {
                    Ok(()) => {
                        self.slots[slot] = SlotEntry {
                            chunk: state.chunk,
                            len_bytes: state.len_bytes as u64,
                            stored_bytes: state.stored_bytes as u64,
                            crc,
                            used: true,
                            compressed: state.compressed,
                            busy: false,
                        };
                        self.dirty = true;
                        SwapCompletion {
                            chunk: state.chunk,
                            op: Op::Write,
                            result: Ok(()),
                            buf,
                            len_bytes: state.len_bytes,
                            token,
                        }
                    }
                    Err(e) => {
                        self.poison(&e);
                        // The slot's bytes are undefined now: drop the chunk and never
                        // hand the slot out again in this session (flush is refused).
                        self.slots[slot] = SlotEntry::default();
                        self.map.remove(&state.chunk);
                        self.quarantine.push(state.slot);
                        self.dirty = true;
                        SwapCompletion {
                            chunk: state.chunk,
                            op: Op::Write,
                            result: Err(e),
                            buf,
                            len_bytes: state.len_bytes,
                            token,
                        }
                    }
                }
            }
            Op::Read => {
                let mut buf = c.buf;
                let found = c.crc32c;
                let result = c
                    .result
                    .and_then(|()| self.verify_read(&state, found, &mut buf));
                SwapCompletion {
                    chunk: state.chunk,
                    op: Op::Read,
                    result,
                    buf,
                    len_bytes: state.len_bytes,
                    token,
                }
            }
        };
        self.ready.push_back(completion);
    }

    /// Check a read chunk against its checksum (`found`: the engine's checksum of the
    /// bytes read, taken as they arrived), then decompress it if it is compressed.
    fn verify_read(
        &mut self,
        state: &InFlight,
        found: Option<u32>,
        buf: &mut AlignedBuf,
    ) -> Result<()> {
        let found = found.unwrap_or_else(|| crc32c::crc32c(&buf[..state.stored_bytes]));
        if found != state.crc {
            tracing::warn!(
                chunk = state.chunk,
                slot = state.slot,
                "swap file chunk failed its checksum"
            );
            return Err(IoError::Corrupt {
                chunk: state.chunk,
                slot: state.slot,
                expected: state.crc,
                found,
            });
        }
        if !state.compressed {
            return Ok(());
        }
        let (Some(codec), Some(scratch)) = (self.codec.as_mut(), self.scratch.as_mut()) else {
            return Err(IoError::Compression {
                chunk: state.chunk,
                reason: "chunk is compressed but the file has no codec".into(),
            });
        };
        codec.decompress_shuffled(
            state.chunk,
            &buf[..state.stored_bytes],
            scratch,
            state.len_bytes,
        )?;
        compress::unshuffle(
            &scratch[..state.len_bytes],
            &mut buf[..state.len_bytes],
            codec.word_bytes(),
        );
        Ok(())
    }
}

/// Decode and check a map copy read from disk: its checksum, and every used entry's
/// sanity (lengths within the slot, one slot per chunk).
fn decode_map(map: &[u8], header: &Header, path: &Path) -> Result<Vec<(u32, SlotEntry)>> {
    let bad = |reason: String| IoError::BadHeader {
        path: path.to_path_buf(),
        reason,
    };
    let found = crc32c::crc32c(map);
    if found != header.map_crc {
        return Err(bad(format!(
            "map checksum {found:#010x}, expected {:#010x}",
            header.map_crc
        )));
    }
    let slot_bytes = header.layout.slot_bytes;
    let mut entries = Vec::new();
    let mut seen = HashMap::new();
    for slot in 0..header.layout.slot_count {
        let at = slot as usize * ENTRY_BYTES;
        let entry = SlotEntry::decode(&map[at..at + ENTRY_BYTES]);
        if !entry.used {
            continue;
        }
        let sane = entry.len_bytes > 0
            && entry.len_bytes <= slot_bytes
            && entry.stored_bytes <= align_up(entry.len_bytes as usize) as u64
            && (entry.compressed || entry.stored_bytes == entry.len_bytes)
            && (!entry.compressed || header.compression.is_on());
        if !sane {
            return Err(bad(format!(
                "map entry of slot {slot} (chunk {}) is impossible",
                entry.chunk
            )));
        }
        if let Some(other) = seen.insert(entry.chunk, slot) {
            return Err(bad(format!(
                "chunk {} is in slots {other} and {slot}",
                entry.chunk
            )));
        }
        entries.push((slot, entry));
    }
    Ok(entries)
}

impl Drop for SwapFile {
    /// Flush the map unless the file is poisoned; errors are logged (drop cannot return
    /// them: call [`SwapFile::flush`] to see them).
    fn drop(&mut self) {
        if self.poisoned.is_some() || !self.dirty {
            return;
        }
        if let Err(e) = self.flush() {
            tracing::error!(path = %self.path.display(), error = %e, "swap file flush on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{FaultConfig, MemoryBackend};
    use proptest::prelude::*;

    const SLOT_BYTES: usize = 64 << 10;

    fn mem_swap(slot_count: u32, compression: Compression) -> SwapFile {
        let capacity = Layout::new(SLOT_BYTES as u64, slot_count as u64)
            .unwrap()
            .file_bytes();
        let backend = MemoryBackend::new(capacity, 16, FaultConfig::none());
        let engine = Engine::new(Box::new(backend), 16 << 10, true).unwrap();
        SwapFile::with_engine(engine, SLOT_BYTES, slot_count, compression).unwrap()
    }

    fn file_cfg() -> IoConfig {
        IoConfig {
            block_bytes: 32 << 10,
            queue_depth: 8,
            ..IoConfig::default()
        }
    }

    /// `len` bytes of a deterministic pattern in a buffer of `cap` bytes.
    fn filled(seed: u64, len: usize, cap: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::new_zeroed(cap.max(len)).unwrap();
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for b in buf[..len].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
        buf
    }

    /// fp32 values with shared exponents: compresses after shuffling.
    fn floats(seed: u64, len: usize) -> AlignedBuf {
        let mut buf = filled(seed, len, len);
        for w in buf[..len].chunks_exact_mut(4) {
            let m = u32::from_le_bytes([w[0], w[1], w[2], 0]) >> 9;
            let v = 1e-3f32 * (1.0 + m as f32 / (1u32 << 15) as f32);
            w.copy_from_slice(&v.to_le_bytes());
        }
        buf
    }

    fn read_back(swap: &mut SwapFile, chunk: u64) -> Result<Vec<u8>> {
        let buf = AlignedBuf::new_zeroed(swap.slot_bytes()).unwrap();
        let (res, buf) = swap.read_chunk(chunk, buf);
        res.map(|len| buf[..len].to_vec())
    }

    #[test]
    fn layout_is_aligned_and_checked() {
        let l = Layout::new(8192, 1000).unwrap();
        assert_eq!(l.data_offset % DATA_ALIGN_BYTES, 0);
        assert_eq!(l.map_offset(1) % 4096, 0);
        assert!(l.map_offset(1) + l.map_bytes <= l.data_offset);
        assert_eq!(l.slot_offset(3), l.data_offset + 3 * 8192);
        for (bytes, count, key) in [
            (1000, 4, "chunk.size"),
            (0, 4, "chunk.size"),
            (4096, 0, "nvme.size"),
        ] {
            match Layout::new(bytes, count) {
                Err(IoError::Config { key: k, .. }) => assert_eq!(k, key),
                other => panic!("expected a config error, got {other:?}"),
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Write {
            chunk: u64,
            len: usize,
            floats: bool,
        },
        Remove {
            chunk: u64,
        },
        Flush,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0u64..12, 1usize..=SLOT_BYTES, any::<bool>())
                .prop_map(|(chunk, len, floats)| Step::Write { chunk, len, floats }),
            1 => (0u64..12).prop_map(|chunk| Step::Remove { chunk }),
            1 => Just(Step::Flush),
        ]
    }

    /// Apply `steps` to `swap` and to a model; every read must equal the model.
    fn run_model(swap: &mut SwapFile, steps: &[Step]) -> std::result::Result<(), TestCaseError> {
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        for (i, s) in steps.iter().enumerate() {
            match *s {
                Step::Write {
                    chunk,
                    len,
                    floats: f,
                } => {
                    let buf = if f {
                        floats(i as u64, align_up(len))
                    } else {
                        filled(i as u64, len, len)
                    };
                    let before = buf[..len].to_vec();
                    let full =
                        !model.contains_key(&chunk) && model.len() == swap.slot_count() as usize;
                    let (res, buf) = swap.write_chunk(chunk, buf, len);
                    prop_assert_eq!(
                        &buf[..len],
                        &before[..],
                        "write changed the caller's buffer"
                    );
                    if full {
                        let is_full = matches!(res, Err(IoError::SwapFull { .. }));
                        prop_assert!(is_full, "expected SwapFull, got {:?}", res);
                    } else {
                        prop_assert!(res.is_ok(), "write failed: {:?}", res);
                        model.insert(chunk, before);
                    }
                }
                Step::Remove { chunk } => {
                    let res = swap.remove(chunk);
                    prop_assert_eq!(res.is_ok(), model.remove(&chunk).is_some());
                }
                Step::Flush => swap.flush().unwrap(),
            }
        }
        for chunk in 0..12u64 {
            match model.get(&chunk) {
                Some(want) => {
                    prop_assert_eq!(swap.len_of(chunk), Some(want.len()));
                    let got = read_back(swap, chunk).unwrap();
                    prop_assert!(got == *want, "chunk {} differs", chunk);
                }
                None => {
                    prop_assert!(!swap.contains(chunk));
                    let unknown =
                        matches!(read_back(swap, chunk), Err(IoError::UnknownChunk { .. }));
                    prop_assert!(unknown);
                }
            }
        }
        prop_assert_eq!(swap.len(), model.len());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn random_chunks_round_trip_in_memory(
            steps in proptest::collection::vec(step(), 1..40),
            compressed in any::<bool>(),
        ) {
            let compression = if compressed { Compression::FP32 } else { Compression::Off };
            let mut swap = mem_swap(6, compression);
            run_model(&mut swap, &steps)?;
        }

        #[test]
        fn random_chunks_round_trip_in_a_file(
            steps in proptest::collection::vec(step(), 1..30),
            compressed in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let compression = if compressed { Compression::FP32 } else { Compression::Off };
            let path = dir.path().join("swap");
            let mut swap = SwapFile::create(&path, SLOT_BYTES, 6, &file_cfg(), compression).unwrap();
            run_model(&mut swap, &steps)?;
        }
    }

    #[test]
    fn reopen_finds_every_chunk_in_the_same_slot_and_the_file_does_not_grow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let mut want = HashMap::new();
        let file_bytes;
        {
            let mut swap =
                SwapFile::create(&path, SLOT_BYTES, 8, &file_cfg(), Compression::FP32).unwrap();
            for chunk in 0..6u64 {
                let len = 4096 * (chunk as usize + 1) + 17;
                let buf = if chunk % 2 == 0 {
                    floats(chunk, align_up(len))
                } else {
                    filled(chunk, len, len)
                };
                want.insert(chunk, buf[..len].to_vec());
                let (res, _) = swap.write_chunk(chunk * 100, buf, len);
                res.unwrap();
            }
            swap.flush().unwrap();
            file_bytes = std::fs::metadata(&path).unwrap().len();
            assert_eq!(file_bytes, swap.file_bytes());
        }
        let slots: Vec<(u64, u32)>;
        {
            let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
            assert_eq!(swap.compression(), Compression::FP32);
            assert_eq!(swap.len(), 6);
            for (&chunk, bytes) in &want {
                assert_eq!(read_back(&mut swap, chunk * 100).unwrap(), *bytes);
            }
            slots = swap.chunks().collect();
            // Change the set: drop one, add one, overwrite one; persisted on drop.
            swap.remove(100).unwrap();
            want.remove(&1);
            let (res, _) = swap.write_chunk(700, filled(7, 5000, 5000), 5000);
            res.unwrap();
            want.insert(7, filled(7, 5000, 5000)[..5000].to_vec());
            let (res, _) = swap.write_chunk(200, filled(9, 9000, 9000), 9000);
            res.unwrap();
            want.insert(2, filled(9, 9000, 9000)[..9000].to_vec());
        }
        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        assert_eq!(swap.len(), want.len());
        for (&chunk, bytes) in &want {
            assert_eq!(
                read_back(&mut swap, chunk * 100).unwrap(),
                *bytes,
                "chunk {chunk}"
            );
        }
        for (chunk, slot) in slots {
            if chunk != 100 {
                assert_eq!(swap.slot_of(chunk), Some(slot), "chunk {chunk} moved");
            }
        }
        drop(swap);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), file_bytes);
        // Opening with the same shape works; another shape is refused.
        SwapFile::open_or_create(&path, SLOT_BYTES, 8, &file_cfg(), Compression::FP32).unwrap();
        assert!(matches!(
            SwapFile::open_or_create(&path, SLOT_BYTES, 9, &file_cfg(), Compression::FP32),
            Err(IoError::BadHeader { .. })
        ));
    }

    #[test]
    fn a_file_written_by_one_engine_reads_back_through_another() {
        use crate::config::EngineChoice;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let threads = IoConfig {
            engine: EngineChoice::ThreadPool,
            ..file_cfg()
        };
        {
            let mut swap =
                SwapFile::create(&path, SLOT_BYTES, 4, &threads, Compression::BF16).unwrap();
            assert_eq!(swap.engine().kind(), crate::BackendKind::ThreadPool);
            for chunk in 0..4u64 {
                let (res, _) = swap.write_chunk(
                    chunk,
                    floats(chunk, SLOT_BYTES),
                    SLOT_BYTES - 4096 * chunk as usize,
                );
                res.unwrap();
            }
        }
        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        for chunk in 0..4u64 {
            let len = SLOT_BYTES - 4096 * chunk as usize;
            assert_eq!(
                read_back(&mut swap, chunk).unwrap(),
                floats(chunk, SLOT_BYTES)[..len].to_vec()
            );
        }
    }

    #[test]
    fn a_flipped_byte_in_the_file_is_corrupt_on_read() {
        use std::os::unix::fs::FileExt;
        for compression in [Compression::Off, Compression::FP32] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("swap");
            let (slot, offset) = {
                let mut swap =
                    SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), compression).unwrap();
                let (res, _) = swap.write_chunk(1, floats(1, 20_000), 20_000);
                res.unwrap();
                let (res, _) = swap.write_chunk(42, floats(2, 30_000), 30_000);
                res.unwrap();
                swap.flush().unwrap();
                let slot = swap.slot_of(42).unwrap();
                (slot, swap.slot_offset_bytes(slot))
            };
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.write_all_at(b"garbage", offset + 100).unwrap();
            f.sync_all().unwrap();
            drop(f);
            let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
            match read_back(&mut swap, 42) {
                Err(IoError::Corrupt {
                    chunk: 42,
                    slot: s,
                    expected,
                    found,
                }) => {
                    assert_eq!(s, slot);
                    assert_ne!(expected, found);
                }
                other => panic!("expected Corrupt, got {other:?}"),
            }
            assert_eq!(
                read_back(&mut swap, 1).unwrap(),
                floats(1, 20_000)[..20_000].to_vec()
            );
        }
    }

    fn bad_header_reason(r: Result<SwapFile>) -> String {
        match r {
            Err(IoError::BadHeader { reason, .. }) => reason,
            other => panic!("expected BadHeader, got {other:?}"),
        }
    }

    #[test]
    fn files_that_are_not_ours_or_too_small_are_bad_headers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        drop(SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap());
        let full_bytes = std::fs::metadata(&path).unwrap().len();

        // Too small for the slots its header claims.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(full_bytes - SLOT_BYTES as u64).unwrap();
        let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
        assert!(reason.contains("too small"), "{reason}");

        // Too small for a header at all.
        f.set_len(100).unwrap();
        let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
        assert!(reason.contains("too small"), "{reason}");

        // Not ours.
        let other = dir.path().join("other");
        std::fs::write(&other, vec![7u8; 3 << 20]).unwrap();
        let reason = bad_header_reason(SwapFile::open(&other, &file_cfg()));
        assert!(reason.contains("magic"), "{reason}");

        // Another version in both copies.
        use std::os::unix::fs::FileExt;
        drop(f);
        std::fs::remove_file(&path).unwrap();
        drop(SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap());
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        for copy in 0..2u64 {
            f.write_all_at(&99u32.to_le_bytes(), copy * 4096 + H_VERSION as u64)
                .unwrap();
        }
        let reason = bad_header_reason(SwapFile::open(&path, &file_cfg()));
        assert!(reason.contains("version 99"), "{reason}");
    }

    /// The newest valid header on disk, read past the lock (as a crashed process
    /// leaves it).
    fn header_on_disk(path: &Path) -> Header {
        let bytes = std::fs::read(path).unwrap();
        (0..HEADER_COPIES as usize)
            .filter_map(|c| Header::decode(&bytes[c * HEADER_PAGE_BYTES..]).ok())
            .max_by_key(|h| h.generation)
            .unwrap()
    }

    /// Guards against a crash after a clean close being taken as clean: the marker must
    /// be off on disk before the first change reaches the file, flushed or not.
    #[test]
    fn the_clean_marker_is_cleared_on_disk_before_the_first_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let mut swap =
            SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap();
        assert_eq!(swap.layout_fingerprint(), None);
        assert!(!swap.is_clean());
        swap.set_layout_fingerprint(Some(0xfeed)).unwrap();
        let (res, _) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
        res.unwrap();
        swap.mark_clean().unwrap();
        let h = header_on_disk(&path);
        assert!(h.clean);
        assert_eq!(h.fingerprint, Some(0xfeed));
        drop(swap);

        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        assert!(swap.is_clean());
        assert_eq!(swap.layout_fingerprint(), Some(0xfeed));
        // Reads change nothing.
        assert_eq!(
            read_back(&mut swap, 1).unwrap(),
            filled(1, 4096, 4096)[..].to_vec()
        );
        assert!(header_on_disk(&path).clean);
        // A write, not flushed: the header on disk already says not clean.
        let (res, _) = swap.write_chunk(2, filled(2, 4096, 4096), 4096);
        res.unwrap();
        assert!(!swap.is_clean());
        assert!(!header_on_disk(&path).clean);
        swap.mark_clean().unwrap();
        // A removal and a new fingerprint clear it too.
        swap.remove(2).unwrap();
        assert!(!header_on_disk(&path).clean);
        swap.mark_clean().unwrap();
        swap.set_layout_fingerprint(Some(7)).unwrap();
        assert!(!header_on_disk(&path).clean);
        drop(swap);
        let swap = SwapFile::open(&path, &file_cfg()).unwrap();
        assert!(!swap.is_clean());
        assert_eq!(swap.layout_fingerprint(), Some(7));
    }

    #[test]
    fn a_torn_newest_header_falls_back_to_the_previous_flush() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let mut swap =
            SwapFile::create(&path, SLOT_BYTES, 4, &file_cfg(), Compression::Off).unwrap();
        let (res, _) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
        res.unwrap();
        swap.flush().unwrap(); // generation 2, copy 0
        let (res, _) = swap.write_chunk(2, filled(2, 4096, 4096), 4096);
        res.unwrap();
        swap.flush().unwrap(); // generation 3, copy 1
        drop(swap);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xff; 8], 4096 + H_GENERATION as u64 - 4)
            .unwrap();
        drop(f);
        let mut swap = SwapFile::open(&path, &file_cfg()).unwrap();
        assert!(swap.contains(1));
        assert!(!swap.contains(2), "chunk 2 was only in the torn copy");
        assert_eq!(
            read_back(&mut swap, 1).unwrap(),
            filled(1, 4096, 4096)[..4096].to_vec()
        );
    }

    #[test]
    fn creating_needs_a_writable_directory_and_a_new_path() {
        let missing = Path::new("/nonexistent/tidestore/swap");
        match SwapFile::create(missing, SLOT_BYTES, 4, &file_cfg(), Compression::Off) {
            Err(IoError::Config { key, reason }) => {
                assert_eq!(key, "nvme.dir");
                assert!(reason.contains("/nonexistent/tidestore"), "{reason}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        drop(SwapFile::create(&path, SLOT_BYTES, 2, &file_cfg(), Compression::Off).unwrap());
        assert!(matches!(
            SwapFile::create(&path, SLOT_BYTES, 2, &file_cfg(), Compression::Off),
            Err(IoError::Setup { .. })
        ));
        assert!(matches!(
            SwapFile::create(
                &dir.path().join("x"),
                5000,
                2,
                &file_cfg(),
                Compression::Off
            ),
            Err(IoError::Config {
                key: "chunk.size",
                ..
            })
        ));
    }

    #[test]
    fn a_device_too_small_for_the_slots_is_no_space() {
        let backend = MemoryBackend::new(2 << 20, 8, FaultConfig::none());
        let engine = Engine::new(Box::new(backend), 16 << 10, true).unwrap();
        assert!(matches!(
            SwapFile::with_engine(engine, 1 << 20, 4, Compression::Off),
            Err(IoError::NoSpace { .. })
        ));
    }

    #[test]
    fn bad_requests_get_typed_errors() {
        let mut swap = mem_swap(2, Compression::Off);
        let (res, buf) = swap.write_chunk(1, filled(1, 8192, SLOT_BYTES * 2), SLOT_BYTES + 1);
        assert!(matches!(res, Err(IoError::ChunkTooLarge { chunk: 1, .. })));
        let (res, buf) = swap.write_chunk(1, buf, 0);
        assert!(matches!(res, Err(IoError::InvalidRequest { .. })));
        let (res, buf) = swap.read_chunk(9, buf);
        assert!(matches!(res, Err(IoError::UnknownChunk { chunk: 9 })));
        let (res, buf) = swap.write_chunk(1, buf, 100);
        res.unwrap();
        let (res, buf) = swap.write_chunk(2, buf, 100);
        res.unwrap();
        let (res, buf) = swap.write_chunk(3, buf, 100);
        assert!(matches!(res, Err(IoError::SwapFull { chunk: 3, slots: 2 })));
        let (res, _) = swap.read_chunk(1, AlignedBuf::new_zeroed(100).unwrap());
        assert_eq!(res.unwrap(), 100);
        // A removed chunk's slot is reused when nothing else is free.
        swap.remove(2).unwrap();
        assert!(matches!(
            swap.remove(2),
            Err(IoError::UnknownChunk { chunk: 2 })
        ));
        let (res, _) = swap.write_chunk(3, buf, 100);
        res.unwrap();
        assert_eq!(swap.free_slots(), 0);
    }

    #[test]
    fn removed_slots_wait_for_a_flush_while_others_are_free() {
        let mut swap = mem_swap(3, Compression::Off);
        let (res, buf) = swap.write_chunk(1, filled(1, 4096, 4096), 4096);
        res.unwrap();
        let slot = swap.slot_of(1).unwrap();
        swap.remove(1).unwrap();
        let (res, buf) = swap.write_chunk(2, buf, 4096);
        res.unwrap();
        assert_ne!(swap.slot_of(2), Some(slot));
        swap.flush().unwrap();
        swap.remove(2).unwrap();
        let (res, _) = swap.write_chunk(3, buf, 4096);
        res.unwrap();
        assert_eq!(
            swap.slot_of(3),
            Some(slot),
            "lowest free slot after the flush"
        );
    }

    #[test]
    fn async_requests_overlap_and_one_per_chunk_is_in_flight() {
        let mut swap = mem_swap(8, Compression::FP32);
        for chunk in 0..8u64 {
            let len = 10_000 + chunk as usize * 3000;
            swap.submit_write(chunk, floats(chunk, align_up(len)), len);
        }
        // A second request on a chunk whose write is in flight (the last one: earlier
        // ones may have finished while waiting for an image buffer) is refused at once.
        swap.submit_read(7, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
        let mut writes = 0;
        let mut refused = 0;
        while let Some(c) = swap.wait() {
            match c.op {
                Op::Write => {
                    c.result.unwrap();
                    assert_eq!(
                        &c.buf[..c.len_bytes],
                        &floats(c.chunk, align_up(c.len_bytes))[..c.len_bytes]
                    );
                    writes += 1;
                }
                Op::Read => {
                    assert!(
                        matches!(c.result, Err(IoError::InvalidRequest { .. })),
                        "{:?}",
                        c.result
                    );
                    refused += 1;
                }
            }
        }
        assert_eq!((writes, refused), (8, 1));
        assert_eq!(swap.outstanding(), 0);
        for chunk in 0..8u64 {
            swap.submit_read(chunk, AlignedBuf::new_zeroed(SLOT_BYTES).unwrap());
        }
        let mut reads = 0;
        while let Some(c) = swap.poll().or_else(|| swap.wait()) {
            c.result.unwrap();
            let len = 10_000 + c.chunk as usize * 3000;
            assert_eq!(c.len_bytes, len);
            assert_eq!(&c.buf[..len], &floats(c.chunk, align_up(len))[..len]);
            reads += 1;
        }
        assert_eq!(reads, 8);
    }

    #[test]
    fn compression_shrinks_structured_data_and_stores_noise_raw() {
        let mut swap = mem_swap(4, Compression::FP32);
        let len = SLOT_BYTES - 100;
        let (res, _) = swap.write_chunk(1, floats(1, SLOT_BYTES), len);
        res.unwrap();
        let stored = swap.stored_bytes_of(1).unwrap();
        assert!(stored < len * 85 / 100, "stored {stored} of {len}");
        let (res, _) = swap.write_chunk(2, filled(2, len, SLOT_BYTES), len);
        res.unwrap();
        assert_eq!(swap.stored_bytes_of(2), Some(len), "noise is stored raw");
        assert_eq!(
            read_back(&mut swap, 1).unwrap(),
            floats(1, SLOT_BYTES)[..len].to_vec()
        );
        assert_eq!(
            read_back(&mut swap, 2).unwrap(),
            filled(2, len, SLOT_BYTES)[..len].to_vec()
        );
    }
}
