//! Optional chunk compression: a byte shuffle of fixed-size words, then zstd.
//!
//! Training state is arrays of fp32 or bf16 numbers. Their mantissa bytes are close to
//! random, but their sign/exponent bytes repeat a handful of values. Shuffling puts byte
//! `k` of every word together (all low mantissa bytes, then the next, …, then all the
//! exponent bytes), so zstd sees long runs of near-identical exponent bytes instead of
//! one every fourth byte. A low zstd level (1–3) keeps it fast.
//!
//! Invariants:
//! - [`unshuffle`] inverts [`shuffle`] for every length and word size; a tail shorter
//!   than one word is copied as it is, last;
//! - a [`Codec`] holds its zstd contexts for its whole life; compressing and decompressing
//!   allocate nothing (the caller passes the scratch and destination buffers);
//! - every failure is an [`IoError::Compression`] naming the chunk.

use crate::error::{IoError, Result};

/// Word sizes the shuffle accepts (1 means no shuffle).
pub const WORD_BYTES_ALLOWED: [usize; 4] = [1, 2, 4, 8];

/// Whether and how the chunks of a swap file are compressed. Off by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Chunks are stored as they are.
    #[default]
    Off,
    /// Byte-shuffle words of `word_bytes` (4 for fp32, 2 for bf16/fp16), then zstd at
    /// `level` (1–3 recommended; 0 is zstd's default, 3).
    Zstd { level: i32, word_bytes: usize },
}

impl Compression {
    /// zstd level 1 over shuffled fp32 words: the setting for master params, M and V.
    pub const FP32: Compression = Compression::Zstd {
        level: 1,
        word_bytes: 4,
    };
    /// zstd level 1 over shuffled 16-bit words (bf16 / fp16).
    pub const BF16: Compression = Compression::Zstd {
        level: 1,
        word_bytes: 2,
    };

    /// Check the level and word size; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if let Compression::Zstd { level, word_bytes } = *self {
            if !WORD_BYTES_ALLOWED.contains(&word_bytes) {
                return Err(IoError::config(
                    "nvme.compression.word_bytes",
                    format!("{word_bytes} is not one of {WORD_BYTES_ALLOWED:?}"),
                ));
            }
            let range = zstd::compression_level_range();
            if !range.contains(&level) {
                return Err(IoError::config(
                    "nvme.compression.level",
                    format!("{level} is outside zstd's {range:?}"),
                ));
            }
        }
        Ok(())
    }

    /// Whether chunks are compressed.
    pub fn is_on(&self) -> bool {
        matches!(self, Compression::Zstd { .. })
    }
}

/// Largest compressed size of `len_bytes` of input (zstd's bound): the size a destination
/// buffer needs so that compression never fails for lack of room.
pub fn compress_bound(len_bytes: usize) -> usize {
    zstd::zstd_safe::compress_bound(len_bytes)
}

/// The part of [`shuffle`] and [`unshuffle`] that is the same both ways: copies the tail
/// (`src.len() % word_bytes` bytes) unchanged and returns the whole words of `src`, the
/// matching bytes of `dst` and `n`, the number of words.
///
/// # Panics
/// If `dst` is shorter than `src` or `word_bytes` is 0 (caller bugs, not data errors).
fn copy_tail<'s, 'd>(
    src: &'s [u8],
    dst: &'d mut [u8],
    word_bytes: usize,
) -> (&'s [u8], &'d mut [u8], usize) {
    assert!(word_bytes > 0, "word_bytes must be positive");
    let dst = &mut dst[..src.len()];
    let n = src.len() / word_bytes;
    let body_bytes = n * word_bytes;
    let (body, tail) = dst.split_at_mut(body_bytes);
    tail.copy_from_slice(&src[body_bytes..]);
    (&src[..body_bytes], body, n)
}

/// Put byte `k` of every `word_bytes`-byte word of `src` together, for `k` in order:
/// `dst[k * n + i] = src[i * word_bytes + k]` with `n = src.len() / word_bytes`. The tail
/// (`src.len() % word_bytes` bytes) is copied to the end unchanged.
///
/// # Panics
/// If `dst` is shorter than `src` or `word_bytes` is 0 (caller bugs, not data errors).
pub fn shuffle(src: &[u8], dst: &mut [u8], word_bytes: usize) {
    let (src, body, n) = copy_tail(src, dst, word_bytes);
    match word_bytes {
        1 => body.copy_from_slice(src),
        2 => {
            let (d0, d1) = body.split_at_mut(n);
            for ((w, a), b) in src.chunks_exact(2).zip(d0).zip(d1) {
                *a = w[0];
                *b = w[1];
            }
        }
        4 => {
            let (d0, rest) = body.split_at_mut(n);
            let (d1, rest) = rest.split_at_mut(n);
            let (d2, d3) = rest.split_at_mut(n);
            for ((((w, a), b), c), d) in src.chunks_exact(4).zip(d0).zip(d1).zip(d2).zip(d3) {
                *a = w[0];
                *b = w[1];
                *c = w[2];
                *d = w[3];
            }
        }
        _ => {
            for (k, plane) in body.chunks_exact_mut(n.max(1)).enumerate().take(word_bytes) {
                for (out, w) in plane.iter_mut().zip(src.chunks_exact(word_bytes)) {
                    *out = w[k];
                }
            }
        }
    }
}

/// The inverse of [`shuffle`]: `dst[i * word_bytes + k] = src[k * n + i]`, tail copied.
///
/// # Panics
/// If `dst` is shorter than `src` or `word_bytes` is 0 (caller bugs, not data errors).
pub fn unshuffle(src: &[u8], dst: &mut [u8], word_bytes: usize) {
    let (src, body, n) = copy_tail(src, dst, word_bytes);
    match word_bytes {
        1 => body.copy_from_slice(src),
        2 => {
            let (s0, s1) = src.split_at(n);
            for ((w, a), b) in body.chunks_exact_mut(2).zip(s0).zip(s1) {
                w[0] = *a;
                w[1] = *b;
            }
        }
        4 => {
            let (s0, rest) = src.split_at(n);
            let (s1, rest) = rest.split_at(n);
            let (s2, s3) = rest.split_at(n);
            for ((((w, a), b), c), d) in body.chunks_exact_mut(4).zip(s0).zip(s1).zip(s2).zip(s3) {
                w[0] = *a;
                w[1] = *b;
                w[2] = *c;
                w[3] = *d;
            }
        }
        _ => {
            for (k, plane) in src.chunks_exact(n.max(1)).enumerate().take(word_bytes) {
                for (w, b) in body.chunks_exact_mut(word_bytes).zip(plane) {
                    w[k] = *b;
                }
            }
        }
    }
}

/// Shuffle + zstd with contexts made once.
pub struct Codec {
    level: i32,
    word_bytes: usize,
    compressor: zstd::bulk::Compressor<'static>,
    decompressor: zstd::bulk::Decompressor<'static>,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec")
            .field("level", &self.level)
            .field("word_bytes", &self.word_bytes)
            .finish()
    }
}

impl Codec {
    /// Make the zstd contexts for `level` and `word_bytes` (see [`Compression::validate`]).
    pub fn new(level: i32, word_bytes: usize) -> Result<Self> {
        Compression::Zstd { level, word_bytes }.validate()?;
        let setup = |e: std::io::Error| IoError::Compression {
            chunk: u64::MAX,
            reason: format!("creating zstd context: {e}"),
        };
        let mut compressor = zstd::bulk::Compressor::new(level).map_err(setup)?;
        // The frame records the content size, so decompression can check it.
        compressor
            .set_parameter(zstd::zstd_safe::CParameter::ContentSizeFlag(true))
            .map_err(setup)?;
        let decompressor = zstd::bulk::Decompressor::new().map_err(setup)?;
        Ok(Codec {
            level,
            word_bytes,
            compressor,
            decompressor,
        })
    }

    /// The zstd level.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// The shuffle's word size.
    pub fn word_bytes(&self) -> usize {
        self.word_bytes
    }

    /// Shuffle `src` into `scratch` (at least `src.len()` bytes), compress that into `dst`
    /// and return the compressed length. `dst` of [`compress_bound`]`(src.len())` bytes
    /// always has room; a smaller one may give an error.
    pub fn compress(
        &mut self,
        chunk: u64,
        src: &[u8],
        scratch: &mut [u8],
        dst: &mut [u8],
    ) -> Result<usize> {
        if scratch.len() < src.len() {
            return Err(IoError::Compression {
                chunk,
                reason: format!(
                    "scratch of {} bytes for {} bytes of input",
                    scratch.len(),
                    src.len()
                ),
            });
        }
        let shuffled = &mut scratch[..src.len()];
        shuffle(src, shuffled, self.word_bytes);
        self.compressor
            .compress_to_buffer(shuffled, dst)
            .map_err(|e| IoError::Compression {
                chunk,
                reason: format!("zstd compression of {} bytes: {e}", src.len()),
            })
    }

    /// Decompress `src` into `scratch` and unshuffle it into `dst`, which must be exactly
    /// the original length: a frame that decodes to any other length is an error.
    pub fn decompress(
        &mut self,
        chunk: u64,
        src: &[u8],
        scratch: &mut [u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let len_bytes = dst.len();
        self.decompress_shuffled(chunk, src, scratch, len_bytes)?;
        unshuffle(&scratch[..len_bytes], dst, self.word_bytes);
        Ok(())
    }

    /// Only the zstd half of [`Codec::decompress`]: decode `src` into the first
    /// `len_bytes` of `dst`, still shuffled (undo with [`unshuffle`] and
    /// [`Codec::word_bytes`]). A frame of any other decoded length is an error.
    pub fn decompress_shuffled(
        &mut self,
        chunk: u64,
        src: &[u8],
        dst: &mut [u8],
        len_bytes: usize,
    ) -> Result<()> {
        if dst.len() < len_bytes {
            return Err(IoError::Compression {
                chunk,
                reason: format!(
                    "destination of {} bytes for {len_bytes} bytes of output",
                    dst.len()
                ),
            });
        }
        // One byte of room past the expected length (where there is one) turns "too long"
        // into a visible length mismatch instead of an error about the buffer.
        let room = (len_bytes + 1).min(dst.len());
        let got = self
            .decompressor
            .decompress_to_buffer(src, &mut dst[..room])
            .map_err(|e| IoError::Compression {
                chunk,
                reason: format!("zstd decompression of {} bytes: {e}", src.len()),
            })?;
        if got != len_bytes {
            return Err(IoError::Compression {
                chunk,
                reason: format!("decompressed to {got} bytes, expected {len_bytes}"),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn unshuffle_inverts_shuffle(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            word_index in 0usize..4,
        ) {
            let word_bytes = WORD_BYTES_ALLOWED[word_index];
            let mut shuffled = vec![0u8; data.len()];
            let mut back = vec![0u8; data.len()];
            shuffle(&data, &mut shuffled, word_bytes);
            unshuffle(&shuffled, &mut back, word_bytes);
            prop_assert_eq!(&back, &data);
        }

        #[test]
        fn codec_round_trips(
            data in proptest::collection::vec(any::<u8>(), 1..5000),
            word_index in 0usize..4,
            level in 1i32..4,
        ) {
            let word_bytes = WORD_BYTES_ALLOWED[word_index];
            let mut codec = Codec::new(level, word_bytes).unwrap();
            let mut scratch = vec![0u8; data.len()];
            let mut packed = vec![0u8; compress_bound(data.len())];
            let n = codec.compress(7, &data, &mut scratch, &mut packed).unwrap();
            let mut back = vec![0u8; data.len()];
            codec.decompress(7, &packed[..n], &mut scratch, &mut back).unwrap();
            prop_assert_eq!(&back, &data);
        }
    }

    #[test]
    fn shuffle_groups_byte_planes() {
        let src = [0u8, 1, 2, 3, 10, 11, 12, 13, 99];
        let mut dst = [0u8; 9];
        shuffle(&src, &mut dst, 4);
        assert_eq!(dst, [0, 10, 1, 11, 2, 12, 3, 13, 99]);
        let mut dst2 = [0u8; 9];
        shuffle(&src, &mut dst2, 2);
        assert_eq!(dst2, [0, 2, 10, 12, 1, 3, 11, 13, 99]);
    }

    #[test]
    fn structured_floats_shrink_and_shuffle_helps() {
        // Small values around 1e-3 with random low mantissa bits: exponents repeat.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut data = Vec::with_capacity(1 << 20);
        for _ in 0..(1 << 18) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let x = 1e-3f32 * (1.0 + (state >> 40) as f32 / (1u64 << 24) as f32);
            data.extend_from_slice(&x.to_le_bytes());
        }
        let mut scratch = vec![0u8; data.len()];
        let mut packed = vec![0u8; compress_bound(data.len())];
        let mut shuffled = Codec::new(1, 4).unwrap();
        let n_shuffled = shuffled
            .compress(1, &data, &mut scratch, &mut packed)
            .unwrap();
        let mut plain = Codec::new(1, 1).unwrap();
        let n_plain = plain.compress(1, &data, &mut scratch, &mut packed).unwrap();
        assert!(
            n_shuffled < data.len() * 9 / 10,
            "{n_shuffled} of {}",
            data.len()
        );
        assert!(
            n_shuffled < n_plain,
            "shuffled {n_shuffled} vs plain {n_plain}"
        );
    }

    #[test]
    fn wrong_length_and_garbage_are_typed_errors() {
        let data = vec![5u8; 8192];
        let mut codec = Codec::new(1, 4).unwrap();
        let mut scratch = vec![0u8; 16384];
        let mut packed = vec![0u8; compress_bound(data.len())];
        let n = codec.compress(3, &data, &mut scratch, &mut packed).unwrap();
        let mut short = vec![0u8; 4096];
        assert!(matches!(
            codec.decompress(3, &packed[..n], &mut scratch, &mut short),
            Err(IoError::Compression { chunk: 3, .. })
        ));
        let mut long = vec![0u8; 12288];
        assert!(matches!(
            codec.decompress(3, &packed[..n], &mut scratch, &mut long),
            Err(IoError::Compression { chunk: 3, .. })
        ));
        let mut out = vec![0u8; 8192];
        assert!(matches!(
            codec.decompress(3, &[1, 2, 3, 4, 5, 6, 7, 8], &mut scratch, &mut out),
            Err(IoError::Compression { chunk: 3, .. })
        ));
    }

    #[test]
    fn bad_settings_name_the_key() {
        let key = |c: Compression| match c.validate() {
            Err(IoError::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        };
        assert_eq!(
            key(Compression::Zstd {
                level: 1,
                word_bytes: 3
            }),
            "nvme.compression.word_bytes"
        );
        assert_eq!(
            key(Compression::Zstd {
                level: 99,
                word_bytes: 4
            }),
            "nvme.compression.level"
        );
        Compression::FP32.validate().unwrap();
        Compression::Off.validate().unwrap();
    }
}
