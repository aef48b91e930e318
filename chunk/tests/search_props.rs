//! Guards against a chunk-size search that misses the least-waste size or returns an
//! unaligned one.
//!
//! Over random registrations (frozen/trainable mixes, and LoRA-shaped ones: frozen base
//! weights with small trainable adapters between them), I/O block sizes, and frozen
//! and trainable tensors packed apart or together: the pruned search's choice is
//! aligned to 4096 and the block size in every list, fits the largest tensor, is no
//! worse than any candidate it considered, wastes exactly as little as an exhaustive
//! scan of every aligned size in the range, and the layout built with it reports the
//! same waste (so the search evaluates the packing the layout produces).

use proptest::prelude::*;
use tidestore_chunk::search::search_chunk_size_exhaustive;
use tidestore_chunk::{
    search_chunk_size, DType, Layout, LayoutConfig, ListKind, SearchConfig, TensorSpec,
};

/// Random tensors, each frozen or trainable at random.
fn mixed_strategy() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec((1usize..40_000, 0usize..3, any::<bool>()), 1..40).prop_map(|v| {
        v.iter()
            .enumerate()
            .map(|(i, &(n, d, t))| TensorSpec::new(format!("t{i}"), &[n], DType::ALL[d], t))
            .collect()
    })
}

/// Frozen 16-bit base weights, each followed by 0-2 small trainable adapters (fp32 or
/// bf16) and sometimes a frozen fp32 norm.
fn lora_strategy() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec(
        (
            1usize..40_000,
            prop::collection::vec((1usize..3000, any::<bool>()), 0..3),
            any::<bool>(),
        ),
        1..30,
    )
    .prop_map(|layers| {
        let mut specs = Vec::new();
        for (l, (base, adapters, norm)) in layers.into_iter().enumerate() {
            specs.push(TensorSpec::new(
                format!("l{l}.w"),
                &[base],
                DType::BF16,
                false,
            ));
            for (a, (n, f32)) in adapters.into_iter().enumerate() {
                let dtype = if f32 { DType::F32 } else { DType::BF16 };
                specs.push(TensorSpec::new(format!("l{l}.lora{a}"), &[n], dtype, true));
            }
            if norm {
                specs.push(TensorSpec::new(
                    format!("l{l}.norm"),
                    &[64],
                    DType::F32,
                    false,
                ));
            }
        }
        specs
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn pruned_search_equals_exhaustive_and_is_aligned(
        specs in prop_oneof![mixed_strategy(), lora_strategy()],
        block_pow in 9u32..15,
        odd_block in any::<bool>(),
        acc in any::<bool>(),
        f32_grads in any::<bool>(),
        separate in any::<bool>(),
        cap_factor in 1u64..5,
        resident in prop_oneof![Just(0u64), 1u64..8],
    ) {
        let block = if odd_block { 3 << block_pow } else { 1 << block_pow };
        let layout_cfg = LayoutConfig::new(1)
            .with_grad_accumulation(acc)
            .with_fp32_grads(acc && f32_grads)
            .with_separate_frozen(separate);
        let cfg = SearchConfig::new(block)
            .with_cap_factor(cap_factor)
            .with_resident_chunks(resident)
            .with_candidates();
        let r = search_chunk_size(&specs, &layout_cfg, &cfg).unwrap();
        let full = search_chunk_size_exhaustive(&specs, &layout_cfg, &cfg).unwrap();

        let chosen = r.chosen;
        for list in ListKind::ALL {
            let bytes = chosen.chunk_elements * layout_cfg.slot_bytes(list);
            prop_assert_eq!(bytes % 4096, 0);
            prop_assert_eq!(bytes % block, 0);
        }
        prop_assert!(chosen.chunk_elements >= r.min_elements && chosen.chunk_elements <= r.max_elements);
        prop_assert_eq!(r.candidates.len(), r.candidates_considered);
        for c in &r.candidates {
            prop_assert!(chosen.cost_bytes <= c.cost_bytes);
            prop_assert_eq!(c.cost_bytes, c.waste_bytes + resident * c.largest_chunk_bytes);
            prop_assert_eq!(c.chunk_bytes % r.align_bytes, 0);
        }
        if resident == 0 {
            prop_assert_eq!(chosen.cost_bytes, chosen.waste_bytes);
        }
        prop_assert_eq!(chosen.cost_bytes, full.chosen.cost_bytes);
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
