//! The swap file's on-disk format: where everything lies ([`Layout`]), the header page
//! ([`Header`], with the owner's fingerprint and the clean flag) and the 32-byte map
//! entries ([`SlotEntry`]), each with its encoder and a decoder that checks what it
//! reads. All integers are little endian.
//!
//! Invariants: every offset is 4096-aligned and slots start on a 1 MiB boundary; a
//! header decodes only with the right magic, version and checksum and a shape
//! [`Layout::new`] accepts; a map decodes only with the checksum its header names and
//! entries that fit their slot, one slot per chunk.

use std::collections::HashMap;
use std::path::Path;

use crate::buffer::{align_up, ALIGN_BYTES};
use crate::compress::Compression;
use crate::error::{IoError, Result};

/// First bytes of every header copy.
pub const MAGIC: [u8; 8] = *b"TIDESWAP";
/// Version of the on-disk format written by this code.
pub const VERSION: u32 = 2;

pub(super) const HEADER_PAGE_BYTES: usize = ALIGN_BYTES;
pub(super) const HEADER_COPIES: u64 = 2;
pub(super) const ENTRY_BYTES: usize = 32;
/// Slots start on a 1 MiB boundary, so large slot transfers map onto whole device
/// requests.
pub(super) const DATA_ALIGN_BYTES: u64 = 1 << 20;

const FLAG_USED: u32 = 1;
const FLAG_COMPRESSED: u32 = 2;

/// Where everything lies in a file of `slot_count` slots of `slot_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) slot_bytes: u64,
    pub(super) slot_count: u32,
    pub(super) map_bytes: u64,
    pub(super) data_offset: u64,
}

impl Layout {
    pub(super) fn new(slot_bytes: u64, slot_count: u64) -> Result<Layout> {
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

    pub(super) fn header_offset(copy: u64) -> u64 {
        copy * HEADER_PAGE_BYTES as u64
    }

    pub(super) fn map_offset(&self, copy: u64) -> u64 {
        HEADER_COPIES * HEADER_PAGE_BYTES as u64 + copy * self.map_bytes
    }

    pub(super) fn slot_offset(&self, slot: u32) -> u64 {
        self.data_offset + slot as u64 * self.slot_bytes
    }

    pub(super) fn file_bytes(&self) -> u64 {
        self.data_offset + self.slot_count as u64 * self.slot_bytes
    }
}

/// One decoded header copy.
#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    pub(super) generation: u64,
    pub(super) layout: Layout,
    pub(super) compression: Compression,
    pub(super) map_crc: u32,
    /// The owner's layout fingerprint, if one was set.
    pub(super) fingerprint: Option<u64>,
    /// Closed cleanly (see the module doc).
    pub(super) clean: bool,
}

// Header page field offsets.
const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 8;
pub(super) const H_GENERATION: usize = 16;
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
    pub(super) fn encode(&self, page: &mut [u8]) {
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
    pub(super) fn decode(page: &[u8]) -> std::result::Result<Header, HeaderFault> {
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

pub(super) enum HeaderFault {
    NoMagic,
    Bad(String),
}

/// What the file knows about one slot.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SlotEntry {
    pub(super) chunk: u64,
    pub(super) len_bytes: u64,
    pub(super) stored_bytes: u64,
    pub(super) crc: u32,
    /// Holds a chunk whose write completed.
    pub(super) used: bool,
    pub(super) compressed: bool,
    /// A request on this slot is in flight.
    pub(super) busy: bool,
}

impl SlotEntry {
    pub(super) fn encode(&self, out: &mut [u8]) {
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

    pub(super) fn decode(b: &[u8]) -> SlotEntry {
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

/// Decode and check a map copy read from disk: its checksum, and every used entry's
/// sanity (lengths within the slot, one slot per chunk).
pub(super) fn decode_map(
    map: &[u8],
    header: &Header,
    path: &Path,
) -> Result<Vec<(u32, SlotEntry)>> {
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
