//! The chunk-size search: the element count that costs the fewest bytes.
//!
//! # What it minimises
//! Two costs, both in bytes, added:
//! - **Waste**, over the whole state: bytes allocated that no tensor occupies.
//! - **The working set the size forces** ([`SearchConfig::resident_chunks`]): a chunk
//!   is the unit of every move, so a store must hold some number of whole chunks at
//!   once whatever its budget (a host step holds a tensor's gradient, master, M and V
//!   chunks and loads into one more buffer). Those bytes are the floor of the budget,
//!   and every byte of budget they take is a byte the look-ahead cannot use: with
//!   chunks of ~700 MB and a 4 GiB host pool, the step holds five of its six buffers
//!   and nothing can stream beside it. The term is `resident_chunks` times the largest
//!   chunk's bytes.
//!
//! With `resident_chunks = 0` (the default) the search minimises waste alone, the
//! choice of a store that is sized to hold everything. A streaming trainer passes its
//! working set, and the search then prefers the smaller of two sizes unless the larger
//! saves more waste than it costs in budget.
//!
//! Waste is counted over every list the layout will allocate (Params, and master, M,
//! V, grad for chunk groups that hold trainable tensors): allocated bytes minus the
//! bytes tensors occupy. The search evaluates exactly the packing the layout will
//! produce under the given [`LayoutConfig`], frozen and trainable tensors packed apart
//! or together ([`LayoutConfig::separate_frozen`]). Candidates are chunk sizes whose
//! byte sizes are multiples of `lcm(4096, io_block_bytes)` in every list (the Params
//! list has 2-byte slots, so the element step is half that alignment), from the largest
//! tensor (rounded up) to a cap (`cap_factor` x the largest tensor, or
//! [`SearchConfig::max_chunk_elements`]).
//!
//! Why few candidates suffice. The layout packs each *stream* of tensors next-fit into
//! its own open chunk: the frozen tensors and the trainable tensors, each in model order
//! (or all tensors as one stream when they are not packed apart). Next-fit packing at
//! size `C` only compares `C` with sums of tensors consecutive within one stream ("run
//! sums"). Between two consecutive run sums the packing, and so every chunk count, is
//! the same, while allocated bytes grow with `C`. So on each such interval the smallest
//! aligned size is the best, and the optimum over the whole aligned grid is among
//! `{round_up(lo)} ∪ {round_up(S) : S run sum in (lo, hi]}`. Run sums above the cap are
//! never enumerated, so a LLaMA-70B-sized registration (~700 tensors, cap 4x the
//! embedding) yields a few thousand candidates, each packed in O(tensors). When the run
//! sums outnumber the grid points, the grid itself is used. Either way the result
//! equals an exhaustive scan of the grid ([`search_chunk_size_exhaustive`]; checked by
//! `tests/search_props.rs`).
//!
//! Ties go to the smaller chunk (finer-grained moves).

use crate::error::ChunkError;
use crate::id::ListKind;
use crate::layout::{
    allocated_bytes, pack_counts, pack_streams, LayoutConfig, PackItem, TensorSpec,
};
use crate::Result;

/// The byte alignment every chunk of every list must have at least.
pub const PAGE_BYTES: u64 = 4096;

/// What the search may choose from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchConfig {
    /// The I/O block size; every chunk's byte size is a multiple of it and of 4096.
    pub io_block_bytes: u64,
    /// The cap as a multiple of the largest tensor (default 4).
    pub cap_factor: u64,
    /// An absolute cap in elements; with `cap_factor` the smaller one applies. A cap
    /// below the largest tensor is an error naming that tensor.
    pub max_chunk_elements: Option<u64>,
    /// Whether [`SearchReport::candidates`] lists every candidate evaluated.
    pub keep_candidates: bool,
    /// Chunks the store must hold at once (see the module doc); each costs the largest
    /// chunk's bytes. 0: waste alone decides.
    pub resident_chunks: u64,
}

impl SearchConfig {
    /// A search for `io_block_bytes`, cap 4x the largest tensor.
    pub fn new(io_block_bytes: u64) -> Self {
        SearchConfig {
            io_block_bytes,
            cap_factor: 4,
            max_chunk_elements: None,
            keep_candidates: false,
            resident_chunks: 0,
        }
    }

    /// With an absolute cap in elements.
    pub fn with_max_chunk_elements(mut self, max: u64) -> Self {
        self.max_chunk_elements = Some(max);
        self
    }

    /// With another cap factor (at least 1).
    pub fn with_cap_factor(mut self, factor: u64) -> Self {
        self.cap_factor = factor;
        self
    }

    /// Weighing `n` resident chunks against waste (see the module doc).
    pub fn with_resident_chunks(mut self, n: u64) -> Self {
        self.resident_chunks = n;
        self
    }

    /// Recording every candidate in the report.
    pub fn with_candidates(mut self) -> Self {
        self.keep_candidates = true;
        self
    }
}

/// One chunk size and what it costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Chunk size in element slots.
    pub chunk_elements: u64,
    /// Bytes of one Params chunk (fp32 chunks are twice that).
    pub chunk_bytes: u64,
    /// Chunk indices (Params chunks).
    pub chunks: u64,
    /// Bytes allocated over every list.
    pub allocated_bytes: u64,
    /// Allocated bytes no tensor occupies.
    pub waste_bytes: u64,
    /// `waste_bytes / allocated_bytes`.
    pub waste_fraction: f64,
    /// Bytes of the largest chunk of any list (an fp32 chunk where tensors train).
    pub largest_chunk_bytes: u64,
    /// What the search minimises: `waste_bytes` plus
    /// [`SearchConfig::resident_chunks`] times `largest_chunk_bytes`.
    pub cost_bytes: u64,
}

/// The search's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchReport {
    /// The size with the least cost (the smaller one on ties).
    pub chosen: Candidate,
    /// Every candidate evaluated, ascending, when [`SearchConfig::keep_candidates`].
    pub candidates: Vec<Candidate>,
    /// How many candidates were evaluated.
    pub candidates_considered: usize,
    /// The byte alignment of every Params chunk: `lcm(4096, io_block_bytes)`.
    pub align_bytes: u64,
    /// The element step between aligned sizes.
    pub step_elements: u64,
    /// The smallest aligned size (fits the largest tensor).
    pub min_elements: u64,
    /// The largest aligned size considered.
    pub max_elements: u64,
    /// Bytes tensors occupy over every list (the same for every candidate).
    pub payload_bytes: u64,
}

struct Prepared {
    items: Vec<PackItem>,
    payload_bytes: u64,
    align_bytes: u64,
    step: u64,
    lo: u64,
    hi: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn prepare(specs: &[TensorSpec], layout: &LayoutConfig, config: &SearchConfig) -> Result<Prepared> {
    let block = config.io_block_bytes;
    if block == 0 {
        return Err(ChunkError::InvalidBlockSize {
            block_bytes: 0,
            reason: "must be positive",
        });
    }
    let align_bytes = (PAGE_BYTES / gcd(PAGE_BYTES, block))
        .checked_mul(block)
        .filter(|a| *a <= u64::MAX / 64)
        .ok_or(ChunkError::InvalidBlockSize {
            block_bytes: block,
            reason: "its alignment with 4096 overflows",
        })?;
    // Params slots are 2 bytes; align_bytes is a multiple of 4096, so even.
    let step = align_bytes / ListKind::Params.slot_bytes();
    if !layout.param16_dtype.is_16bit() {
        return Err(ChunkError::NotSixteenBit {
            dtype: layout.param16_dtype,
        });
    }
    let items = specs
        .iter()
        .map(|s| PackItem::of(s, layout))
        .collect::<Result<Vec<_>>>()?;
    let (largest_at, largest) = items
        .iter()
        .enumerate()
        .map(|(i, it)| (i, it.slots))
        .max_by_key(|&(i, s)| (s, std::cmp::Reverse(i)))
        .ok_or(ChunkError::NoTensors)?;
    let too_large = |chunk_elements| ChunkError::TensorTooLarge {
        tensor: specs[largest_at].name.clone(),
        needed_elements: largest,
        chunk_elements,
    };
    let lo = largest
        .div_ceil(step)
        .checked_mul(step)
        .ok_or_else(|| too_large(u64::MAX))?;
    let by_factor = largest.saturating_mul(config.cap_factor.max(1));
    let hi = match config.max_chunk_elements {
        Some(max) if max / step * step < lo => return Err(too_large(max / step * step)),
        Some(max) => max.min(by_factor),
        None => by_factor,
    };
    let hi = (hi / step * step).max(lo);
    if hi.checked_mul(4).is_none() {
        return Err(ChunkError::InvalidChunkSize {
            chunk_elements: hi,
            reason: "the chunk's byte size overflows u64",
        });
    }
    let per_trainable = layout.trainable_state_bytes();
    let payload_bytes = items
        .iter()
        .map(|it| it.slots * ListKind::Params.slot_bytes() + it.trainable_elements * per_trainable)
        .sum();
    Ok(Prepared {
        items,
        payload_bytes,
        align_bytes,
        step,
        lo,
        hi,
    })
}

fn evaluate(
    p: &Prepared,
    layout: &LayoutConfig,
    resident_chunks: u64,
    chunk_elements: u64,
) -> Candidate {
    let counts = pack_counts(&p.items, chunk_elements, layout);
    let allocated = allocated_bytes(counts, chunk_elements, layout);
    let waste = allocated - p.payload_bytes;
    let widest_slot = if counts.trainable_chunks > 0 {
        ListKind::Master.slot_bytes()
    } else {
        ListKind::Params.slot_bytes()
    };
    let largest_chunk_bytes = chunk_elements * widest_slot;
    Candidate {
        chunk_elements,
        chunk_bytes: chunk_elements * ListKind::Params.slot_bytes(),
        chunks: counts.chunks,
        allocated_bytes: allocated,
        waste_bytes: waste,
        waste_fraction: if allocated == 0 {
            0.0
        } else {
            waste as f64 / allocated as f64
        },
        largest_chunk_bytes,
        cost_bytes: waste.saturating_add(resident_chunks.saturating_mul(largest_chunk_bytes)),
    }
}

fn finish(
    p: Prepared,
    layout: &LayoutConfig,
    config: &SearchConfig,
    sizes: Vec<u64>,
) -> SearchReport {
    let mut chosen: Option<Candidate> = None;
    let mut kept = Vec::new();
    for &c in &sizes {
        let cand = evaluate(&p, layout, config.resident_chunks, c);
        if chosen.is_none_or(|best| cand.cost_bytes < best.cost_bytes) {
            chosen = Some(cand);
        }
        if config.keep_candidates {
            kept.push(cand);
        }
    }
    // `sizes` always holds `lo`, so a choice exists; fall back to it defensively.
    let chosen = chosen.unwrap_or_else(|| evaluate(&p, layout, config.resident_chunks, p.lo));
    SearchReport {
        chosen,
        candidates: kept,
        candidates_considered: sizes.len(),
        align_bytes: p.align_bytes,
        step_elements: p.step,
        min_elements: p.lo,
        max_elements: p.hi,
        payload_bytes: p.payload_bytes,
    }
}

/// Finds the aligned chunk size with the least cost for `specs` registered in order
/// under `layout` (its `chunk_elements` is ignored), evaluating only the sizes where
/// the packing changes (see the module doc).
pub fn search_chunk_size(
    specs: &[TensorSpec],
    layout: &LayoutConfig,
    config: &SearchConfig,
) -> Result<SearchReport> {
    let p = prepare(specs, layout, config)?;
    let (lo, hi, step) = (p.lo, p.hi, p.step);
    let grid_points = (hi - lo) / step + 1;
    let mut sizes = vec![lo];
    let mut use_grid = false;
    // Deduplicate whenever the list doubles past the grid; give up on pruning once the
    // distinct sizes are as many as the grid's points.
    let mut dedup_at = 2 * grid_points;
    'runs: for stream in pack_streams(&p.items, layout) {
        for start in 0..stream.len() {
            let mut sum = 0u64;
            for &slots in &stream[start..] {
                sum += slots;
                if sum > hi {
                    break;
                }
                if sum > lo {
                    sizes.push(sum.div_ceil(step) * step);
                    if sizes.len() as u64 > dedup_at {
                        sizes.sort_unstable();
                        sizes.dedup();
                        if sizes.len() as u64 >= grid_points {
                            use_grid = true;
                            break 'runs;
                        }
                        dedup_at = sizes.len() as u64 + 2 * grid_points;
                    }
                }
            }
        }
    }
    if use_grid {
        sizes = (0..grid_points).map(|k| lo + k * step).collect();
    } else {
        sizes.sort_unstable();
        sizes.dedup();
    }
    tracing::debug!(
        candidates = sizes.len(),
        grid_points,
        min_elements = lo,
        max_elements = hi,
        "chunk-size search"
    );
    let report = finish(p, layout, config, sizes);
    tracing::debug!(
        chunk_elements = report.chosen.chunk_elements,
        waste_bytes = report.chosen.waste_bytes,
        waste_fraction = report.chosen.waste_fraction,
        cost_bytes = report.chosen.cost_bytes,
        "chunk size chosen"
    );
    Ok(report)
}

/// The same search over every aligned size in the range: a slow reference for tests
/// and for checking [`search_chunk_size`].
pub fn search_chunk_size_exhaustive(
    specs: &[TensorSpec],
    layout: &LayoutConfig,
    config: &SearchConfig,
) -> Result<SearchReport> {
    let p = prepare(specs, layout, config)?;
    let sizes = (0..=(p.hi - p.lo) / p.step)
        .map(|k| p.lo + k * p.step)
        .collect();
    Ok(finish(p, layout, config, sizes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::layout::Layout;

    fn specs(sizes: &[usize]) -> Vec<TensorSpec> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec::new(format!("t{i}"), &[n], DType::F16, i % 3 != 2))
            .collect()
    }

    #[test]
    fn aligned_and_agrees_with_layout() {
        let s = specs(&[5000, 3000, 2048, 9000, 100, 4000]);
        let cfg = LayoutConfig::new(1);
        let r = search_chunk_size(&s, &cfg, &SearchConfig::new(4096).with_candidates()).unwrap();
        assert_eq!(r.align_bytes, 4096);
        assert_eq!(r.chosen.chunk_bytes % 4096, 0);
        assert!(r.chosen.chunk_elements >= 9000);
        assert!(r
            .candidates
            .iter()
            .all(|c| c.waste_bytes >= r.chosen.waste_bytes));
        let layout = Layout::new(LayoutConfig::new(r.chosen.chunk_elements), s).unwrap();
        assert_eq!(layout.waste_bytes(), r.chosen.waste_bytes);
        assert_eq!(layout.total_bytes(), r.chosen.allocated_bytes);
    }

    #[test]
    fn resident_chunks_trade_waste_for_a_smaller_working_set() {
        // Frozen 5000 + 3000 slots: at 6144 (the smallest aligned size) they take two
        // chunks (waste 8576 B, largest chunk 12288 B); at 8192 one (384 B, 16384 B).
        let s: Vec<_> = [5000, 3000]
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec::new(format!("t{i}"), &[n], DType::F16, false))
            .collect();
        let cfg = LayoutConfig::new(1);
        let waste_only = search_chunk_size(&s, &cfg, &SearchConfig::new(4096)).unwrap();
        assert_eq!(waste_only.chosen.chunk_elements, 8192);
        assert_eq!(waste_only.chosen.waste_bytes, 384);
        let one = search_chunk_size(&s, &cfg, &SearchConfig::new(4096).with_resident_chunks(1));
        assert_eq!(
            one.unwrap().chosen.chunk_elements,
            8192,
            "8576 + 12288 > 384 + 16384"
        );
        let three = SearchConfig::new(4096)
            .with_resident_chunks(3)
            .with_candidates();
        let r = search_chunk_size(&s, &cfg, &three).unwrap();
        assert_eq!(
            r.chosen.chunk_elements, 6144,
            "8576 + 3 * 12288 < 384 + 3 * 16384"
        );
        assert_eq!(r.chosen.cost_bytes, 8576 + 3 * 12288);
        assert!(r
            .candidates
            .iter()
            .all(|c| c.cost_bytes >= r.chosen.cost_bytes));
        let full = search_chunk_size_exhaustive(&s, &cfg, &three).unwrap();
        assert_eq!(full.chosen, r.chosen);
    }

    #[test]
    fn io_block_alignment_is_lcm() {
        let s = specs(&[10]);
        let r = search_chunk_size(&s, &LayoutConfig::new(1), &SearchConfig::new(3 * 4096)).unwrap();
        assert_eq!(r.align_bytes, 3 * 4096);
        assert_eq!(r.chosen.chunk_elements, 3 * 2048);
        let r = search_chunk_size(&s, &LayoutConfig::new(1), &SearchConfig::new(512)).unwrap();
        assert_eq!(r.align_bytes, 4096);
        let r = search_chunk_size(&s, &LayoutConfig::new(1), &SearchConfig::new(1 << 20)).unwrap();
        assert_eq!(r.chosen.chunk_bytes, 1 << 20);
    }

    #[test]
    fn errors() {
        let cfg = LayoutConfig::new(1);
        assert_eq!(
            search_chunk_size(&[], &cfg, &SearchConfig::new(4096)).unwrap_err(),
            ChunkError::NoTensors
        );
        assert!(search_chunk_size(&specs(&[1]), &cfg, &SearchConfig::new(0)).is_err());
        let e = search_chunk_size(
            &specs(&[10, 5000]),
            &cfg,
            &SearchConfig::new(4096).with_max_chunk_elements(4096),
        )
        .unwrap_err();
        assert!(matches!(e, ChunkError::TensorTooLarge { tensor, .. } if tensor == "t1"));
    }

    #[test]
    fn grid_fallback_matches_exhaustive() {
        // Many run sums over a 4-point grid: the search scans the grid instead.
        let sizes: Vec<usize> = (0..200).map(|i| 1000 + (i * 7919) % 2001).collect();
        let s = specs(&sizes);
        let cfg = LayoutConfig::new(1);
        let search = SearchConfig::new(4096);
        let r = search_chunk_size(&s, &cfg, &search).unwrap();
        let x = search_chunk_size_exhaustive(&s, &cfg, &search).unwrap();
        assert_eq!(r.candidates_considered, x.candidates_considered);
        assert_eq!(r.chosen, x.chosen);
    }

    #[test]
    fn llama70b_sized_registration_is_quick_and_exact() {
        // 80 layers of LLaMA-2-70B (GQA) plus embedding and head: 723 tensors.
        let (h, f, kv, vocab) = (8192usize, 28672usize, 1024usize, 32000usize);
        let mut s = vec![TensorSpec::new("embed", &[vocab, h], DType::BF16, true)];
        for l in 0..80 {
            for (n, shape) in [
                ("ln1", vec![h]),
                ("q", vec![h, h]),
                ("k", vec![kv, h]),
                ("v", vec![kv, h]),
                ("o", vec![h, h]),
                ("ln2", vec![h]),
                ("gate", vec![f, h]),
                ("up", vec![f, h]),
                ("down", vec![h, f]),
            ] {
                s.push(TensorSpec::new(
                    format!("l{l}.{n}"),
                    &shape,
                    DType::BF16,
                    true,
                ));
            }
        }
        s.push(TensorSpec::new("norm", &[h], DType::BF16, true));
        s.push(TensorSpec::new("head", &[vocab, h], DType::BF16, true));
        let cfg = LayoutConfig::new(1);
        let start = std::time::Instant::now();
        let r = search_chunk_size(&s, &cfg, &SearchConfig::new(1 << 20)).unwrap();
        let elapsed = start.elapsed();
        assert!(
            r.candidates_considered < 20_000,
            "{}",
            r.candidates_considered
        );
        assert!(r.chosen.waste_fraction < 0.05, "{:?}", r.chosen);
        assert!(elapsed.as_secs() < 30, "{elapsed:?}");
        let x = search_chunk_size_exhaustive(&s, &cfg, &SearchConfig::new(1 << 20)).unwrap();
        assert_eq!(r.chosen, x.chosen);
    }

    #[test]
    fn lora_registration_searches_the_separate_packing() {
        // A frozen 16-layer base with rank-16 q/v adapters after each projection.
        let (h, f, r) = (2048usize, 5632usize, 16usize);
        let mut s = vec![TensorSpec::new("embed", &[32000, h], DType::BF16, false)];
        for l in 0..16 {
            for (n, shape, lora) in [
                ("q", [h, h], true),
                ("k", [h / 4, h], false),
                ("v", [h / 4, h], true),
                ("o", [h, h], false),
                ("up", [f, h], false),
                ("down", [h, f], false),
            ] {
                s.push(TensorSpec::new(
                    format!("l{l}.{n}"),
                    &shape,
                    DType::BF16,
                    false,
                ));
                if lora {
                    s.push(TensorSpec::new(
                        format!("l{l}.{n}.a"),
                        &[r, h],
                        DType::F32,
                        true,
                    ));
                    s.push(TensorSpec::new(
                        format!("l{l}.{n}.b"),
                        &[shape[0], r],
                        DType::F32,
                        true,
                    ));
                }
            }
        }
        let search = SearchConfig::new(1 << 20);
        for separate in [true, false] {
            let cfg = LayoutConfig::new(1).with_separate_frozen(separate);
            let got = search_chunk_size(&s, &cfg, &search).unwrap();
            let x = search_chunk_size_exhaustive(&s, &cfg, &search).unwrap();
            assert_eq!(got.chosen, x.chosen);
            let layout = Layout::new(
                LayoutConfig {
                    chunk_elements: got.chosen.chunk_elements,
                    ..cfg
                },
                s.clone(),
            )
            .unwrap();
            assert_eq!(layout.total_bytes(), got.chosen.allocated_bytes);
            assert_eq!(layout.waste_bytes(), got.chosen.waste_bytes);
            let master = layout.list_chunk_count(ListKind::Master);
            if separate {
                // 16 x 4 adapters, 1.7M elements: one chunk.
                assert_eq!(master, 1);
            } else {
                assert!(master > 1, "{master}");
            }
        }
    }
}
