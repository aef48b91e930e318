use super::*;

/// The failure: a fingerprint that misses a change of where bytes are (so another
/// model's chunks are adopted), or one that moves between builds (so a clean file
/// is refused after an upgrade that changed nothing).
#[test]
fn the_fingerprint_sees_every_change_of_place_and_is_stable() {
    let base = |chunk: u64, name: &str, n: usize, dtype: DType, trainable: bool| {
        Layout::new(
            LayoutConfig::new(chunk),
            [
                TensorSpec::new("a", &[64, 32], DType::F32, true),
                TensorSpec::new(name, &[n], dtype, trainable),
            ],
        )
        .unwrap()
        .fingerprint()
    };
    let fp = base(4096, "b", 100, DType::F16, true);
    assert_eq!(fp, base(4096, "b", 100, DType::F16, true));
    for (what, other) in [
        ("chunk size", base(8192, "b", 100, DType::F16, true)),
        ("name", base(4096, "c", 100, DType::F16, true)),
        ("shape", base(4096, "b", 101, DType::F16, true)),
        ("dtype", base(4096, "b", 100, DType::BF16, true)),
        ("trainable", base(4096, "b", 100, DType::F16, false)),
    ] {
        assert_ne!(fp, other, "a change of {what} kept the fingerprint");
    }
    let accum = Layout::new(
        LayoutConfig::new(4096).with_grad_accumulation(true),
        [
            TensorSpec::new("a", &[64, 32], DType::F32, true),
            TensorSpec::new("b", &[100], DType::F16, true),
        ],
    )
    .unwrap();
    assert_ne!(fp, accum.fingerprint(), "gradient accumulation");
    // Pinned: the same layout hashes the same in every build.
    assert_eq!(fp, GOLDEN_FINGERPRINT, "{fp:#018x}");
}

const GOLDEN_FINGERPRINT: u64 = 0xdab0_3e0b_f036_ab3e;

fn t(name: &str, n: usize, dtype: DType, trainable: bool) -> TensorSpec {
    TensorSpec::new(name, &[n], dtype, trainable)
}

#[test]
fn next_fit_and_mirrored_lists() {
    // Shared packing: frozen and trainable tensors in the same open chunk.
    let layout = Layout::new(
        LayoutConfig::new(100).with_separate_frozen(false),
        [
            t("a", 60, DType::F16, true),
            t("b", 30, DType::F16, false),
            t("c", 20, DType::F16, true), // does not fit 90 + 20 -> chunk 1
            t("d", 80, DType::F16, true),
        ],
    )
    .unwrap();
    assert_eq!(layout.chunks_per_list(), 2);
    let c = layout.location(TensorId(2), ListKind::Params).unwrap();
    assert_eq!((c.chunk.index(), c.offset_elements), (1, 0));
    let d = layout.location(TensorId(3), ListKind::Master).unwrap();
    assert_eq!((d.chunk.index(), d.offset_elements), (1, 20));
    assert_eq!(d.offset_bytes(), 80);
    assert!(layout.location(TensorId(1), ListKind::Master).is_none());
    assert_eq!(
        layout.chunk_tensors(ChunkId::new(ListKind::Master, 0)),
        &[TensorId(0)]
    );
    // No accumulation: the grad reuses the param space.
    assert_eq!(
        layout.grad_location(TensorId(0)),
        layout.location(TensorId(0), ListKind::Params)
    );
    assert!(layout.grad_location(TensorId(1)).is_none());
    assert_eq!(layout.list_chunk_count(ListKind::Grads), 0);
    // Bytes: 2 param chunks of 200 B, 2 x 3 fp32 chunks of 400 B.
    assert_eq!(layout.total_bytes(), 2 * 200 + 6 * 400);
    let payload = (60 + 30 + 20 + 80) * 2 + (60 + 20 + 80) * 12;
    assert_eq!(layout.payload_bytes(), payload);
    assert_eq!(layout.waste_bytes(), 2800 - payload);
}

#[test]
fn frozen_f32_stays_f32_in_two_slots_and_trainable_f32_is_cast() {
    let layout = Layout::new(
        LayoutConfig::new(64).with_param16_dtype(DType::F16),
        [
            t("norm", 10, DType::F32, false),
            t("w", 10, DType::F32, true),
        ],
    )
    .unwrap();
    let norm = layout.location(TensorId(0), ListKind::Params).unwrap();
    assert_eq!(
        (norm.dtype, norm.slots(), norm.bytes()),
        (DType::F32, 20, 40)
    );
    // Packed apart from the frozen norm: its own chunk.
    let w = layout.location(TensorId(1), ListKind::Params).unwrap();
    assert_eq!(
        (w.chunk.index(), w.dtype, w.offset_elements, w.slots()),
        (1, DType::F16, 0, 10)
    );
    let m = layout.location(TensorId(1), ListKind::Master).unwrap();
    assert_eq!((m.dtype, m.offset_elements), (DType::F32, 0));
    // Shared packing: after the norm's 20 slots.
    let shared = Layout::new(
        layout.config().with_separate_frozen(false),
        layout.tensors().to_vec(),
    )
    .unwrap();
    let w = shared.location(TensorId(1), ListKind::Params).unwrap();
    assert_eq!((w.chunk.index(), w.offset_elements), (0, 20));
    let m = shared.location(TensorId(1), ListKind::Master).unwrap();
    assert_eq!((m.chunk.index(), m.offset_elements), (0, 0));
}

#[test]
fn grad_accumulation_adds_a_list() {
    let layout = Layout::new(
        LayoutConfig::new(64).with_grad_accumulation(true),
        [
            t("a", 10, DType::BF16, false),
            t("b", 10, DType::BF16, true),
        ],
    )
    .unwrap();
    let g = layout.grad_location(TensorId(1)).unwrap();
    assert_eq!(g.chunk.list(), ListKind::Grads);
    assert_eq!((g.offset_elements, g.dtype), (0, DType::BF16));
    assert_eq!(layout.lists().len(), 5);
}

#[test]
fn fp32_grads_take_one_four_byte_slot_per_element() {
    let specs = [
        t("frozen", 10, DType::F32, false),
        t("w", 24, DType::F32, true),
        t("b", 8, DType::F32, true),
    ];
    let config = LayoutConfig::new(64)
        .with_grad_accumulation(true)
        .with_fp32_grads(true);
    let layout = Layout::new(config, specs).unwrap();
    let g = layout.grad_location(TensorId(2)).unwrap();
    assert_eq!(g.chunk.list(), ListKind::Grads);
    // After `w`'s 24 elements: one slot each, as in Master.
    assert_eq!(
        (g.offset_elements, g.dtype, g.slot_bytes),
        (24, DType::F32, 4)
    );
    assert_eq!(layout.chunk_bytes(ListKind::Grads), 64 * 4);
    assert_eq!(layout.chunk_used_bytes(g.chunk), 32 * 4);
    let master = layout.location(TensorId(2), ListKind::Master).unwrap();
    assert_eq!(g.chunk.index(), master.chunk.index());
    // Without a gradient list there is nowhere to put them.
    let e = Layout::new(LayoutConfig::new(64).with_fp32_grads(true), []).unwrap_err();
    assert!(matches!(e, ChunkError::Fp32GradsWithoutGradList), "{e:?}");
}

#[test]
fn lora_base_chunks_have_no_optimizer_chunks() {
    let mut specs: Vec<_> = (0..4)
        .map(|i| t(&format!("base{i}"), 50, DType::BF16, false))
        .collect();
    specs.push(t("lora_a", 8, DType::BF16, true));
    let layout = Layout::new(LayoutConfig::new(100), specs).unwrap();
    assert_eq!(layout.list_chunk_count(ListKind::Params), 3);
    assert_eq!(layout.list_chunk_count(ListKind::Master), 1);
    assert!(!layout.chunk_exists(ChunkId::new(ListKind::Variance, 0)));
    assert!(layout.chunk_exists(ChunkId::new(ListKind::Variance, 2)));
}

#[test]
fn errors_name_the_tensor() {
    let mut b = LayoutBuilder::new(LayoutConfig::new(16)).unwrap();
    b.register(t("ok", 16, DType::F16, true)).unwrap();
    let e = b.register(t("big", 17, DType::F16, true)).unwrap_err();
    assert!(
        matches!(&e, ChunkError::TensorTooLarge { tensor, needed_elements: 17, .. } if tensor == "big")
    );
    let e = b.register(t("f32big", 9, DType::F32, false)).unwrap_err();
    assert!(matches!(
        &e,
        ChunkError::TensorTooLarge {
            needed_elements: 18,
            ..
        }
    ));
    let e = b.register(t("ok", 1, DType::F16, true)).unwrap_err();
    assert!(matches!(&e, ChunkError::DuplicateTensor { tensor } if tensor == "ok"));
    let e = b
        .register(TensorSpec::new("empty", &[3, 0], DType::F16, true))
        .unwrap_err();
    assert!(e.to_string().contains("empty"));
    assert_eq!(b.len(), 1);
    assert!(LayoutBuilder::new(LayoutConfig::new(16).with_param16_dtype(DType::F32)).is_err());
    assert!(LayoutBuilder::new(LayoutConfig::new(0)).is_err());
}

#[test]
fn frozen_and_trainable_packed_apart() {
    // The same tensors as above, packed apart (the default): a and c share the
    // trainable chunk 0, b opens the frozen chunk 1, d opens trainable chunk 2.
    let layout = Layout::new(
        LayoutConfig::new(100),
        [
            t("a", 60, DType::F16, true),
            t("b", 30, DType::F16, false),
            t("c", 20, DType::F16, true),
            t("d", 80, DType::F16, true),
        ],
    )
    .unwrap();
    assert_eq!(layout.chunks_per_list(), 3);
    let at = |i: u32| {
        let l = layout.location(TensorId(i), ListKind::Params).unwrap();
        (l.chunk.index(), l.offset_elements)
    };
    assert_eq!(
        [at(0), at(1), at(2), at(3)],
        [(0, 0), (1, 0), (0, 60), (2, 0)]
    );
    let c = layout.location(TensorId(2), ListKind::Master).unwrap();
    assert_eq!((c.chunk.index(), c.offset_elements), (0, 60));
    assert!(!layout.chunk_exists(ChunkId::new(ListKind::Master, 1)));
    assert_eq!(layout.list_chunk_count(ListKind::Master), 2);
    assert_eq!(
        layout.chunk_tensors(ChunkId::new(ListKind::Momentum, 0)),
        &[TensorId(0), TensorId(2)]
    );
    assert_eq!(
        layout.grad_location(TensorId(2)),
        layout.location(TensorId(2), ListKind::Params)
    );
    // Bytes: 3 param chunks of 200 B, 2 x 3 fp32 chunks of 400 B.
    assert_eq!(layout.total_bytes(), 3 * 200 + 6 * 400);
}

#[test]
fn chunks_are_allocated_and_moved_as_their_used_prefix() {
    // 16Ki-element chunks: a 64 KiB master chunk holding one 1000-element adapter
    // is one page, a full 16-bit chunk stays whole, a list's last chunk is cut.
    let specs = vec![
        t("base0", 16 * 1024, DType::BF16, false),
        t("base1", 5000, DType::BF16, false),
        t("lora", 1000, DType::BF16, true),
    ];
    let layout = Layout::new(LayoutConfig::new(16 * 1024), specs).unwrap();
    let dense = layout.dense_chunk_bytes();
    let size = |c: ChunkId| dense[c.dense()];
    let p16: Vec<ChunkId> = layout.chunks(ListKind::Params).collect();
    assert_eq!(size(p16[0]), 32 * 1024, "a full chunk is whole");
    assert_eq!(size(p16[1]), 12 * 1024, "10000 B used, rounded to pages");
    assert_eq!(size(p16[2]), 4096, "2000 B of adapter");
    for list in [ListKind::Master, ListKind::Momentum, ListKind::Variance] {
        let c = layout.chunks(list).next().unwrap();
        assert_eq!(layout.chunk_bytes(list), 64 * 1024);
        assert_eq!(size(c), 4096, "{list:?}: 4000 B of fp32 state");
    }
    // A chunk size that is not a page multiple never rounds past the chunk.
    let odd = Layout::new(
        LayoutConfig::new(1001),
        vec![t("a", 1000, DType::BF16, true)],
    )
    .unwrap();
    let c = odd.chunks(ListKind::Master).next().unwrap();
    assert_eq!(odd.dense_chunk_bytes()[c.dense()], 4004);
}

#[test]
fn lora_adapters_get_full_optimizer_chunks() {
    // A frozen base of 8 x 50 with a trainable adapter of 10 after every base
    // tensor. Shared packing puts an adapter in every group: 5 groups with fp32
    // chunks. Apart, the 80 adapter elements fill one trainable chunk.
    let mut specs = Vec::new();
    for i in 0..8 {
        specs.push(t(&format!("base{i}"), 50, DType::BF16, false));
        specs.push(t(&format!("lora{i}"), 10, DType::BF16, true));
    }
    let shared = Layout::new(
        LayoutConfig::new(100).with_separate_frozen(false),
        specs.clone(),
    )
    .unwrap();
    assert_eq!(shared.list_chunk_count(ListKind::Params), 8);
    assert_eq!(shared.list_chunk_count(ListKind::Master), 8);
    let apart = Layout::new(LayoutConfig::new(100), specs).unwrap();
    assert_eq!(apart.list_chunk_count(ListKind::Params), 5);
    assert_eq!(apart.list_chunk_count(ListKind::Master), 1);
    let m = apart.chunks(ListKind::Master).next().unwrap();
    assert_eq!(m.index(), 1);
    assert_eq!(apart.chunk_used_bytes(m), 80 * 4);
    assert_eq!(apart.chunk_tensors(m).len(), 8);
    assert_eq!(
        apart.chunk_tensors(m.in_list(ListKind::Params)),
        apart.chunk_tensors(m)
    );
}

#[test]
fn all_trainable_or_all_frozen_pack_the_same_either_way() {
    for trainable in [false, true] {
        let specs: Vec<_> = [60, 30, 20, 80, 100, 1, 99]
            .iter()
            .enumerate()
            .map(|(i, &n)| t(&format!("t{i}"), n, DType::F16, trainable))
            .collect();
        let a = Layout::new(LayoutConfig::new(100), specs.clone()).unwrap();
        let b = Layout::new(LayoutConfig::new(100).with_separate_frozen(false), specs).unwrap();
        for i in 0..7 {
            for list in ListKind::ALL {
                assert_eq!(a.location(TensorId(i), list), b.location(TensorId(i), list));
            }
        }
        assert_eq!(a.total_bytes(), b.total_bytes());
    }
}

#[test]
fn pack_counts_agree_with_layout() {
    let specs = vec![
        t("a", 60, DType::F16, false),
        t("b", 50, DType::F16, false),
        t("c", 40, DType::F16, true),
        t("d", 30, DType::F16, false),
        t("e", 70, DType::F16, true),
    ];
    for separate in [true, false] {
        let cfg = LayoutConfig::new(100).with_separate_frozen(separate);
        let items: Vec<_> = specs
            .iter()
            .map(|s| PackItem::of(s, &cfg).unwrap())
            .collect();
        let counts = pack_counts(&items, 100, &cfg);
        let layout = Layout::new(cfg, specs.clone()).unwrap();
        assert_eq!(counts.chunks, layout.list_chunk_count(ListKind::Params));
        assert_eq!(
            counts.trainable_chunks,
            layout.list_chunk_count(ListKind::Master)
        );
        assert_eq!(allocated_bytes(counts, 100, &cfg), layout.total_bytes());
        assert_eq!(
            pack_streams(&items, &cfg).len(),
            if separate { 2 } else { 1 }
        );
    }
}
