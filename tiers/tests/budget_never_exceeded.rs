//! Guards against a tier going over its budget: random sequences of reservations,
//! releases, capacity changes (the device's tidal budget) and device allocations must
//! keep `used <= capacity` after every single step, refuse exactly what does not fit with
//! the exact numbers, and keep the peak right.

use proptest::prelude::*;
use tidestore_io::align_up;
use tidestore_tiers::{Budget, Device, DeviceConfig, SharedBudget, TierError, TierKind};

#[derive(Debug, Clone)]
enum Step {
    Reserve(u64),
    Release(u64),
    SetCapacity(u64),
    ResetPeak,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..400).prop_map(Step::Reserve),
        3 => (0u64..400).prop_map(Step::Release),
        1 => (0u64..1200).prop_map(Step::SetCapacity),
        1 => Just(Step::ResetPeak),
    ]
}

proptest! {
    #[test]
    fn budget_matches_model(capacity in 0u64..1000, steps in prop::collection::vec(step(), 1..200)) {
        let mut b = Budget::new(TierKind::Device, capacity);
        let (mut cap, mut used, mut peak) = (capacity, 0u64, 0u64);
        for s in steps {
            match s {
                Step::Reserve(n) => {
                    let r = b.try_reserve(n);
                    if used + n <= cap {
                        prop_assert!(r.is_ok());
                        used += n;
                        peak = peak.max(used);
                    } else {
                        match r {
                            Err(TierError::OverBudget { tier, needed_bytes, free_bytes, capacity_bytes }) => {
                                prop_assert_eq!(tier, TierKind::Device);
                                prop_assert_eq!(needed_bytes, n);
                                prop_assert_eq!(free_bytes, cap - used);
                                prop_assert_eq!(capacity_bytes, cap);
                            }
                            other => prop_assert!(false, "expected OverBudget, got {:?}", other),
                        }
                    }
                }
                Step::Release(n) => {
                    let r = b.release(n);
                    if n <= used {
                        prop_assert!(r.is_ok());
                        used -= n;
                    } else {
                        let refused = matches!(r, Err(TierError::ReleaseExceedsUsed { .. }));
                        prop_assert!(refused);
                    }
                }
                Step::SetCapacity(c) => {
                    prop_assert_eq!(b.excess_bytes_at(c), used.saturating_sub(c));
                    let r = b.set_capacity(c);
                    if c >= used {
                        prop_assert!(r.is_ok());
                        cap = c;
                    } else {
                        match r {
                            Err(TierError::ShrinkBelowUsed { excess_bytes, used_bytes, .. }) => {
                                prop_assert_eq!(excess_bytes, used - c);
                                prop_assert_eq!(used_bytes, used);
                            }
                            other => prop_assert!(false, "expected ShrinkBelowUsed, got {:?}", other),
                        }
                    }
                }
                Step::ResetPeak => {
                    b.reset_peak();
                    peak = used;
                }
            }
            prop_assert!(b.used_bytes() <= b.capacity_bytes());
            prop_assert_eq!(b.used_bytes(), used);
            prop_assert_eq!(b.capacity_bytes(), cap);
            prop_assert_eq!(b.peak_bytes(), peak);
            prop_assert_eq!(b.free_bytes(), cap - used);
        }
    }

    #[test]
    fn leases_release_exactly_once(capacity in 0u64..1000, ops in prop::collection::vec((any::<bool>(), 0u64..300, any::<prop::sample::Index>()), 1..150)) {
        let shared = SharedBudget::new(TierKind::Host, capacity);
        let mut live = Vec::new();
        for (take, n, which) in ops {
            if take || live.is_empty() {
                if let Ok(l) = shared.try_lease(n) {
                    live.push(l);
                }
            } else {
                drop(live.swap_remove(which.index(live.len())));
            }
            let snap = shared.snapshot();
            prop_assert!(snap.used_bytes() <= snap.capacity_bytes());
            prop_assert_eq!(snap.used_bytes(), live.iter().map(|l| l.bytes()).sum::<u64>());
        }
        drop(live);
        prop_assert_eq!(shared.snapshot().used_bytes(), 0);
    }

    /// Device allocations within a tidal budget on the simulated device.
    #[test]
    fn device_allocations_stay_in_budget(
        budget_pages in 1u64..64,
        ops in prop::collection::vec((0u8..4, 1usize..5 * 4096, any::<prop::sample::Index>(), 0u64..64), 1..80),
    ) {
        let budget_bytes = budget_pages * 4096;
        let mut cfg = DeviceConfig::new(budget_bytes);
        cfg.sim_total_bytes = Some(64 * 4096);
        let dev = Device::sim(&cfg).unwrap();
        let mut live = Vec::new();
        for (chunk, (op, bytes, which, pages)) in ops.into_iter().enumerate() {
            match op {
                0 | 1 => {
                    let before = dev.budget();
                    match dev.alloc(chunk as u64, bytes) {
                        Ok(m) => {
                            prop_assert!(before.fits(align_up(bytes) as u64));
                            live.push(m);
                        }
                        Err(TierError::OverBudget { needed_bytes, free_bytes, .. }) => {
                            prop_assert_eq!(needed_bytes, align_up(bytes) as u64);
                            prop_assert!(needed_bytes > free_bytes);
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                2 => {
                    if !live.is_empty() {
                        drop(live.swap_remove(which.index(live.len())));
                    }
                }
                _ => {
                    let cap = pages * 4096;
                    let excess = dev.excess_bytes_at(cap);
                    match dev.set_budget_capacity(cap) {
                        Ok(()) => prop_assert_eq!(excess, 0),
                        Err(TierError::ShrinkBelowUsed { excess_bytes, .. }) => prop_assert_eq!(excess_bytes, excess),
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
            }
            let b = dev.budget();
            prop_assert!(b.used_bytes() <= b.capacity_bytes());
            prop_assert_eq!(b.used_bytes(), live.iter().map(|m| align_up(m.bytes()) as u64).sum::<u64>());
            prop_assert!(b.peak_bytes() >= b.used_bytes());
        }
    }
}
