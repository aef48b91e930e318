//! Guards against chunk moves that allocate: device memory for chunks must come from the
//! slab made when the device opened — no `cuMemAlloc`/`cuMemFree` (or, simulated, no
//! fresh zeroed buffer) per move — and the slab must never hold more than the budget.
//!
//! Claim tested, on the simulated device (which runs the slab allocator the GPU runs):
//! over random sequences of allocations (chunk sizes from a few classes, none a multiple
//! of the 2 MiB granularity, some not of a page), copies both ways (which also check the
//! bytes), frees and tidal capacity changes,
//! - the budget is never exceeded, and the slab's blocks are exactly the live leases;
//! - every chunk's memory lies inside the slab, disjoint from every other chunk's;
//! - an allocation is served outside the slab (an overflow) only when the slab had the
//!   bytes free but no run long enough (fragmentation), and with one chunk size there is
//!   never one: then nothing at all is allocated after start-up;
//! - the slab's invariants hold after every step (`verify_slab`).

use proptest::prelude::*;
use tidestore_io::{align_up, AlignedBuf};
use tidestore_tiers::{Device, DeviceConfig, DeviceMem, DeviceView, TierError};

const PAGE: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    /// Allocate a chunk of size class `class` (and fill it through a copy).
    Alloc { class: usize },
    /// Free the `which`-th live chunk.
    Free { which: prop::sample::Index },
    /// Copy the `which`-th live chunk to the host and back, checking its bytes.
    RoundTrip { which: prop::sample::Index },
    /// Move the budget's capacity to `pages` pages.
    Capacity { pages: u64 },
}

fn op(classes: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..classes).prop_map(|class| Op::Alloc { class }),
        3 => any::<prop::sample::Index>().prop_map(|which| Op::Free { which }),
        2 => any::<prop::sample::Index>().prop_map(|which| Op::RoundTrip { which }),
        1 => (0u64..64).prop_map(|pages| Op::Capacity { pages }),
    ]
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(31)) as u8)
        .collect()
}

fn host_of(view: &DeviceView<'_>) -> (u64, usize) {
    match view {
        DeviceView::Host(b) => (b.as_ptr() as u64, b.len()),
        DeviceView::Cuda(s) => (s.ptr(), s.len_bytes()),
    }
}

struct Live {
    mem: DeviceMem,
    len: usize,
    seed: u64,
}

fn copy(dev: &mut Device, live: Live, to_host_first: bool) -> Live {
    let Live { mem, len, seed } = live;
    let mut host = AlignedBuf::new_zeroed(len).unwrap();
    let mem = if to_host_first {
        mem
    } else {
        host[..len].copy_from_slice(&pattern(seed, len));
        let id = dev.copy_to_device(seed, host, mem, len);
        let c = dev.wait_copy_id(id).unwrap();
        c.result.unwrap();
        host = c.host;
        host.fill(0);
        c.mem
    };
    let id = dev.copy_to_host(seed, mem, host, len);
    let c = dev.wait_copy_id(id).unwrap();
    c.result.unwrap();
    assert_eq!(
        &c.host[..len],
        &pattern(seed, len)[..],
        "chunk {seed} bytes"
    );
    Live {
        mem: c.mem,
        len,
        seed,
    }
}

fn run(classes: &[usize], budget_pages: u64, ops: Vec<Op>) -> Result<u64, TestCaseError> {
    let mut cfg = DeviceConfig::new(budget_pages * PAGE);
    cfg.sim_total_bytes = Some(64 * PAGE);
    cfg.sim_alloc_granularity_bytes = 2 << 20;
    let mut dev = Device::sim(&cfg).unwrap();
    let (base, slab) = (dev.slab_base_addr(), dev.slab_bytes());
    let mut live: Vec<Live> = Vec::new();
    for (n, op) in ops.into_iter().enumerate() {
        match op {
            Op::Alloc { class } => {
                let len = classes[class];
                let before = dev.slab_stats();
                match dev.alloc(n as u64, len) {
                    Ok(mem) => {
                        let after = dev.slab_stats();
                        let block = align_up(len) as u64;
                        if after.overflow_allocs > before.overflow_allocs {
                            prop_assert!(
                                before.largest_free_bytes < block,
                                "an overflow while a free run held the block"
                            );
                        } else {
                            prop_assert_eq!(after.used_bytes, before.used_bytes + block);
                        }
                        let l = copy(
                            &mut dev,
                            Live {
                                mem,
                                len,
                                seed: n as u64,
                            },
                            false,
                        );
                        live.push(l);
                    }
                    Err(TierError::OverBudget { .. } | TierError::DeviceOutOfMemory { .. }) => {}
                    Err(e) => prop_assert!(false, "unexpected {}", e),
                }
            }
            Op::Free { which } => {
                if !live.is_empty() {
                    drop(live.swap_remove(which.index(live.len())));
                }
            }
            Op::RoundTrip { which } => {
                if !live.is_empty() {
                    let i = which.index(live.len());
                    let l = live.swap_remove(i);
                    live.push(copy(&mut dev, l, true));
                }
            }
            Op::Capacity { pages } => {
                let _ = dev.set_budget_capacity(pages * PAGE);
            }
        }
        let b = dev.budget();
        let s = dev.slab_stats();
        prop_assert!(b.used_bytes() <= b.capacity_bytes());
        prop_assert!(b.capacity_bytes() <= slab);
        prop_assert!(s.used_bytes <= slab);
        prop_assert_eq!(s.used_bytes + s.overflow_live_bytes, b.used_bytes());
        dev.verify_slab().map_err(TestCaseError::fail)?;
        // Every chunk in the slab lies inside it, and no two overlap.
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|l| host_of(&l.mem.view()))
            .filter(|&(addr, _)| addr >= base && addr < base + slab)
            .map(|(addr, len)| (addr, addr + len as u64))
            .collect();
        let outside = live.len() - spans.len();
        prop_assert_eq!(
            outside > 0,
            s.overflow_live_bytes > 0,
            "chunks outside the slab are exactly the overflows"
        );
        spans.sort_unstable();
        for w in spans.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "chunks overlap in the slab");
        }
        for &(_, end) in &spans {
            prop_assert!(end <= base + slab);
        }
    }
    Ok(dev.slab_stats().overflow_allocs)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn chunks_of_several_sizes_live_in_the_slab_within_budget(
        budget_pages in 8u64..64,
        ops in prop::collection::vec(op(3), 1..120),
    ) {
        // Three classes, as a store's chunk lists (16-bit params, fp32 master/moments, a
        // short last chunk): none a multiple of the granularity, one not of a page.
        run(&[2 * 4096, 4 * 4096, 4096 + 1000], budget_pages, ops)?;
    }

    #[test]
    fn chunks_of_one_size_never_allocate_after_start_up(
        budget_pages in 4u64..64,
        ops in prop::collection::vec(op(1), 1..120),
    ) {
        let overflows = run(&[3 * 4096 - 7], budget_pages, ops)?;
        prop_assert_eq!(overflows, 0, "an allocation outside the slab");
    }
}
