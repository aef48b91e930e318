//! Guards against layouts that lose, duplicate or overlap tensors.
//!
//! Over random registrations (random sizes, dtypes, frozen/trainable mixes, chunk
//! sizes, with and without gradient accumulation, frozen and trainable tensors packed
//! apart or together): every tensor is placed exactly once in every list it belongs to,
//! in registration order, without overlap and within its chunk; a tensor has the same
//! chunk index in every list; frozen tensors live only in Params; the byte totals add
//! up. Packed apart: no Params chunk mixes frozen and trainable tensors, every
//! trainable chunk but the last is next-fit full, so master/M/V bytes stay within the
//! trainable payload rounded up to whole chunks, and never exceed those of the shared
//! packing; with all tensors trainable, or all frozen, both packings are identical.

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
        f32_grads in any::<bool>(),
        f16 in any::<bool>(),
        separate in any::<bool>(),
    ) {
        let p16 = if f16 { DType::F16 } else { DType::BF16 };
        let f32_grads = acc && f32_grads;
        let slots_of = |s: &TensorSpec| {
            s.elements().unwrap() * s.param16_dtype(p16).size_bytes() / 2
        };
        let largest = specs.iter().map(slots_of).max().unwrap();
        let config = LayoutConfig::new(largest + slack)
            .with_grad_accumulation(acc)
            .with_fp32_grads(f32_grads)
            .with_param16_dtype(p16)
            .with_separate_frozen(separate);
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
                prop_assert_eq!(layout.chunk_used_bytes(chunk), end * config.slot_bytes(list));
            }
            for (i, s) in specs.iter().enumerate() {
                let belongs = list == ListKind::Params
                    || (s.trainable && (list != ListKind::Grads || acc));
                prop_assert_eq!(seen[i], u32::from(belongs), "tensor {} list {}", i, list);
                prop_assert_eq!(layout.location(TensorId(i as u32), list).is_some(), belongs);
            }
        }

        // Chunk indices never go back in model order: over all tensors when packed
        // together, within the frozen and within the trainable tensors when apart.
        let mut prev_index = [0u32; 2];
        for (i, s) in specs.iter().enumerate() {
            let id = TensorId(i as u32);
            prop_assert_eq!(layout.tensor_id(&s.name), Some(id));
            let p = layout.location(id, ListKind::Params).unwrap();
            let stream = usize::from(separate && s.trainable);
            prop_assert!(p.chunk.index() >= prev_index[stream]);
            prev_index[stream] = p.chunk.index();
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
                    if list != ListKind::Params {
                        prop_assert_eq!(l.slots(), l.elements);
                    }
                }
            }
            let g = layout.grad_location(id);
            prop_assert_eq!(g.is_some(), s.trainable);
            if let Some(g) = g {
                let expect = if acc { ListKind::Grads } else { ListKind::Params };
                prop_assert_eq!(g.chunk.list(), expect);
                let dtype = if f32_grads { DType::F32 } else { p.dtype };
                prop_assert_eq!(g.dtype, dtype);
                prop_assert_eq!(g.slot_bytes, dtype.size_bytes());
            }
        }

        let grad_bytes = match (acc, f32_grads) {
            (false, _) => 0,
            (true, false) => 2,
            (true, true) => 4,
        };
        let payload: u64 = specs.iter().map(|s| {
            let e = s.elements().unwrap();
            slots_of(s) * 2 + if s.trainable { e * (12 + grad_bytes) } else { 0 }
        }).sum();
        prop_assert_eq!(layout.payload_bytes(), payload);
        prop_assert_eq!(layout.total_bytes(), layout.payload_bytes() + layout.waste_bytes());
        let trainable_chunks = layout.list_chunk_count(ListKind::Master);
        prop_assert_eq!(
            layout.total_bytes(),
            layout.list_chunk_count(ListKind::Params) * c_el * 2
                + trainable_chunks * c_el * (12 + grad_bytes)
        );
        for list in [ListKind::Momentum, ListKind::Variance] {
            prop_assert_eq!(layout.list_chunk_count(list), trainable_chunks);
        }
        if separate {
            check_apart(&layout, &specs, c_el)?;
        }

        // The other packing of the same tensors: never fewer optimizer chunks when
        // shared, and the very same layout when the tensors are all of one kind.
        let other = Layout::new(config.with_separate_frozen(!separate), specs.clone()).unwrap();
        let (apart, shared) = if separate { (&layout, &other) } else { (&other, &layout) };
        prop_assert!(
            apart.list_chunk_count(ListKind::Master)
                <= shared.list_chunk_count(ListKind::Master)
        );
        let one_kind = specs.iter().all(|s| s.trainable) || specs.iter().all(|s| !s.trainable);
        if one_kind {
            prop_assert_eq!(apart.total_bytes(), shared.total_bytes());
            for i in 0..n {
                for list in ListKind::ALL {
                    let id = TensorId(i as u32);
                    prop_assert_eq!(apart.location(id, list), shared.location(id, list));
                }
            }
        }
    }

    #[test]
    fn lora_registrations_pack_adapters_apart(
        layers in prop::collection::vec(
            (64usize..3000, prop::collection::vec(1usize..200, 0..3), any::<bool>()),
            1..40,
        ),
        slack in 0u64..6000,
        acc in any::<bool>(),
    ) {
        // A frozen base weight per layer, its small trainable adapters right after it,
        // and sometimes a frozen fp32 norm: LoRA in model order.
        let mut specs = Vec::new();
        for (l, (base, adapters, norm)) in layers.iter().enumerate() {
            specs.push(TensorSpec::new(format!("l{l}.w"), &[*base], DType::BF16, false));
            for (a, &n) in adapters.iter().enumerate() {
                let dtype = if a % 2 == 0 { DType::F32 } else { DType::BF16 };
                specs.push(TensorSpec::new(format!("l{l}.lora{a}"), &[n], dtype, true));
            }
            if *norm {
                specs.push(TensorSpec::new(format!("l{l}.norm"), &[32], DType::F32, false));
            }
        }
        let largest = layers.iter().map(|(b, _, _)| *b as u64).max().unwrap();
        let config = LayoutConfig::new(largest + slack).with_grad_accumulation(acc);
        let layout = Layout::new(config, specs.clone()).unwrap();
        check_apart(&layout, &specs, layout.chunk_elements())?;
        let shared = Layout::new(config.with_separate_frozen(false), specs.clone()).unwrap();
        for list in [ListKind::Master, ListKind::Momentum, ListKind::Variance] {
            prop_assert!(layout.list_bytes(list) <= shared.list_bytes(list));
            prop_assert_eq!(layout.list_payload_bytes(list), shared.list_payload_bytes(list));
        }
        prop_assert_eq!(layout.payload_bytes(), shared.payload_bytes());
    }
}

/// The properties of a layout packed apart, for `specs` registered with `c_el` slots
/// per chunk.
fn check_apart(layout: &Layout, specs: &[TensorSpec], c_el: u64) -> Result<(), TestCaseError> {
    // No Params chunk mixes frozen and trainable tensors; the optimizer lists exist
    // exactly for the trainable groups, and hold the same tensors as their Params
    // chunk, as densely (a trainable tensor has one slot per element there).
    let mut trainable_groups = Vec::new();
    for chunk in layout.chunks(ListKind::Params) {
        let tensors = layout.chunk_tensors(chunk);
        prop_assert!(!tensors.is_empty());
        let trainable = specs[tensors[0].index()].trainable;
        for id in tensors {
            prop_assert_eq!(specs[id.index()].trainable, trainable, "chunk {}", chunk);
        }
        let master = chunk.in_list(ListKind::Master);
        prop_assert_eq!(layout.chunk_exists(master), trainable);
        if trainable {
            prop_assert_eq!(layout.chunk_tensors(master), tensors);
            prop_assert_eq!(
                layout.chunk_used_bytes(master),
                2 * layout.chunk_used_bytes(chunk)
            );
            trainable_groups.push(chunk);
        }
    }
    // Next-fit: every trainable chunk but the last is too full for the first tensor of
    // the next one.
    for pair in trainable_groups.windows(2) {
        let fill = layout.chunk_used_bytes(pair[0]) / 2;
        let first = layout.chunk_tensors(pair[1])[0];
        let next = layout.location(first, ListKind::Params).unwrap().slots();
        prop_assert!(fill + next > c_el, "{} then {}", pair[0], pair[1]);
    }
    // So with P trainable elements and s the largest trainable tensor, every trainable
    // chunk but the last holds at least C - s + 1 of them, and the master/M/V chunks are
    // at most ceil(P / (C - s + 1)): the trainable payload rounded up to whole chunks
    // (of C elements when the tensors are small next to a chunk) plus the partly filled
    // last one, and no more. (Next-fit cannot promise ceil(P / C) + 1 in general:
    // tensors of C/2 + 1 elements take a chunk each.)
    let trainable: Vec<u64> = specs
        .iter()
        .filter(|s| s.trainable)
        .map(|s| s.elements().unwrap())
        .collect();
    let p: u64 = trainable.iter().sum();
    let s = trainable.iter().copied().max().unwrap_or(0);
    let k = layout.list_chunk_count(ListKind::Master);
    prop_assert_eq!(k, trainable_groups.len() as u64);
    if p == 0 {
        prop_assert_eq!(k, 0);
    } else {
        let bound = p.div_ceil(c_el - s + 1);
        prop_assert!(
            k <= bound,
            "{} chunks for {} elements (largest {})",
            k,
            p,
            s
        );
        prop_assert!(k >= p.div_ceil(c_el));
        for list in [ListKind::Master, ListKind::Momentum, ListKind::Variance] {
            prop_assert_eq!(layout.list_payload_bytes(list), p * 4);
            prop_assert!(layout.list_bytes(list) <= bound * c_el * 4);
        }
    }
    Ok(())
}
