//! Guards against layouts that lose, duplicate or overlap tensors.
//!
//! Over random registrations (random sizes, dtypes, frozen/trainable mixes, chunk
//! sizes, with and without gradient accumulation): every tensor is placed exactly once
//! in every list it belongs to, in registration order, without overlap and within its
//! chunk; a tensor has the same chunk index in every list; frozen tensors live only in
//! Param16; the byte totals add up.

use proptest::prelude::*;
use tidestore_chunk::{DType, Layout, LayoutConfig, ListKind, TensorId, TensorSpec};

fn specs_strategy() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec((1usize..3000, 0usize..3, any::<bool>(), 1usize..4), 1..60).prop_map(
        |v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (n, d, trainable, rows))| {
                    TensorSpec::new(format!("t{i}"), &[rows, n], DType::ALL[d], trainable)
                })
                .collect()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_tensor_placed_once_without_overlap(
        specs in specs_strategy(),
        slack in 0u64..20_000,
        acc in any::<bool>(),
        f16 in any::<bool>(),
    ) {
        let p16 = if f16 { DType::F16 } else { DType::BF16 };
        let slots_of = |s: &TensorSpec| {
            s.elements().unwrap() * s.param16_dtype(p16).size_bytes() / 2
        };
        let largest = specs.iter().map(slots_of).max().unwrap();
        let config = LayoutConfig::new(largest + slack)
            .with_grad_accumulation(acc)
            .with_param16_dtype(p16);
        let layout = Layout::new(config, specs.clone()).unwrap();
        let n = specs.len();
        let c_el = layout.chunk_elements();

        for list in ListKind::ALL {
            let mut seen = vec![0u32; n];
            for chunk in layout.chunks(list) {
                prop_assert_eq!(chunk.list(), list);
                let mut end = 0u64;
                let mut last_id = None;
                for &id in layout.chunk_tensors(chunk) {
                    seen[id.index()] += 1;
                    let loc = layout.location(id, list).unwrap();
                    prop_assert_eq!(loc.chunk, chunk);
                    // In order, no overlap, within the chunk.
                    prop_assert!(loc.offset_elements >= end);
                    prop_assert!(last_id.is_none_or(|l: TensorId| l < id));
                    end = loc.end_elements();
                    prop_assert!(end <= c_el);
                    last_id = Some(id);
                }
                prop_assert_eq!(layout.chunk_used_bytes(chunk), end * list.slot_bytes());
            }
            for (i, s) in specs.iter().enumerate() {
                let belongs = list == ListKind::Param16
                    || (s.trainable && (list != ListKind::GradF16 || acc));
                prop_assert_eq!(seen[i], u32::from(belongs), "tensor {} list {}", i, list);
                prop_assert_eq!(layout.location(TensorId(i as u32), list).is_some(), belongs);
            }
        }

        let mut prev_index = 0;
        for (i, s) in specs.iter().enumerate() {
            let id = TensorId(i as u32);
            prop_assert_eq!(layout.tensor_id(&s.name), Some(id));
            let p = layout.location(id, ListKind::Param16).unwrap();
            prop_assert!(p.chunk.index() >= prev_index);
            prev_index = p.chunk.index();
            prop_assert_eq!(p.elements, s.elements().unwrap());
            let expect_dtype = match (s.dtype, s.trainable) {
                (DType::F32, true) => p16,
                (d, _) => d,
            };
            prop_assert_eq!(p.dtype, expect_dtype);
            prop_assert_eq!(p.slots(), slots_of(s));
            for list in ListKind::ALL {
                if let Some(l) = layout.location(id, list) {
                    prop_assert_eq!(l.chunk.index(), p.chunk.index());
                    prop_assert!(layout.chunk_exists(l.chunk));
                    if list != ListKind::Param16 {
                        prop_assert_eq!(l.slots(), l.elements);
                    }
                }
            }
            let g = layout.grad_location(id);
            prop_assert_eq!(g.is_some(), s.trainable);
            if let Some(g) = g {
                let expect = if acc { ListKind::GradF16 } else { ListKind::Param16 };
                prop_assert_eq!(g.chunk.list(), expect);
                prop_assert_eq!(g.dtype, p.dtype);
            }
        }

        let payload: u64 = specs.iter().map(|s| {
            let e = s.elements().unwrap();
            slots_of(s) * 2 + if s.trainable { e * (12 + if acc { 2 } else { 0 }) } else { 0 }
        }).sum();
        prop_assert_eq!(layout.payload_bytes(), payload);
        prop_assert_eq!(layout.total_bytes(), layout.payload_bytes() + layout.waste_bytes());
        let trainable_chunks = layout.list_chunk_count(ListKind::MasterF32);
        prop_assert_eq!(
            layout.total_bytes(),
            layout.list_chunk_count(ListKind::Param16) * c_el * 2
                + trainable_chunks * c_el * (12 + if acc { 2 } else { 0 })
        );
    }
}
