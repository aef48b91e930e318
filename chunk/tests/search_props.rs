//! Guards against a chunk-size search that misses the least-waste size or returns an
//! unaligned one.
//!
//! Over random registrations and I/O block sizes: the pruned search's choice is aligned
//! to 4096 and the block size in every list, fits the largest tensor, is no worse than
//! any candidate it considered, wastes exactly as little as an exhaustive scan of every
//! aligned size in the range, and the layout built with it reports the same waste.

use proptest::prelude::*;
use tidestore_chunk::search::search_chunk_size_exhaustive;
use tidestore_chunk::{
    search_chunk_size, DType, Layout, LayoutConfig, ListKind, SearchConfig, TensorSpec,
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn pruned_search_equals_exhaustive_and_is_aligned(
        tensors in prop::collection::vec((1usize..40_000, 0usize..3, any::<bool>()), 1..40),
        block_pow in 9u32..15,
        odd_block in any::<bool>(),
        acc in any::<bool>(),
        cap_factor in 1u64..5,
    ) {
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .enumerate()
            .map(|(i, &(n, d, t))| TensorSpec::new(format!("t{i}"), &[n], DType::ALL[d], t))
            .collect();
        let block = if odd_block { 3 << block_pow } else { 1 << block_pow };
        let layout_cfg = LayoutConfig::new(1).with_grad_accumulation(acc);
        let cfg = SearchConfig::new(block).with_cap_factor(cap_factor).with_candidates();
        let r = search_chunk_size(&specs, &layout_cfg, &cfg).unwrap();
        let full = search_chunk_size_exhaustive(&specs, &layout_cfg, &cfg).unwrap();

        let chosen = r.chosen;
        for list in ListKind::ALL {
            let bytes = chosen.chunk_elements * list.slot_bytes();
            prop_assert_eq!(bytes % 4096, 0);
            prop_assert_eq!(bytes % block, 0);
        }
        prop_assert!(chosen.chunk_elements >= r.min_elements && chosen.chunk_elements <= r.max_elements);
        prop_assert_eq!(r.candidates.len(), r.candidates_considered);
        for c in &r.candidates {
            prop_assert!(chosen.waste_bytes <= c.waste_bytes);
            prop_assert_eq!(c.chunk_bytes % r.align_bytes, 0);
        }
        prop_assert_eq!(chosen.waste_bytes, full.chosen.waste_bytes);
        prop_assert_eq!(chosen.chunk_elements, full.chosen.chunk_elements);
        prop_assert!(r.candidates_considered <= full.candidates_considered);

        let layout = Layout::new(layout_cfg.clone_with(chosen.chunk_elements), specs).unwrap();
        prop_assert_eq!(layout.waste_bytes(), chosen.waste_bytes);
        prop_assert_eq!(layout.total_bytes(), chosen.allocated_bytes);
        prop_assert_eq!(layout.payload_bytes(), r.payload_bytes);
    }
}

trait CloneWith {
    fn clone_with(&self, chunk_elements: u64) -> LayoutConfig;
}

impl CloneWith for LayoutConfig {
    fn clone_with(&self, chunk_elements: u64) -> LayoutConfig {
        LayoutConfig {
            chunk_elements,
            ..*self
        }
    }
}
