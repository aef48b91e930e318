//! Guards against eviction and prefetch decisions that move more bytes than the chunks'
//! known lifetimes allow, or that evict a chunk needed before the one they bring.
//!
//! Over random repeated access traces (several chunks per moment) and random budgets:
//! - `lifetime` moves exactly as many bytes as the independent offline Belady
//!   computation, decision for decision, for chunks of any sizes (schedule = the whole
//!   trace, horizon `Once`), and, for equal-sized chunks, also when it only knows one
//!   traced iteration (horizon `Cyclic`) of a trace that repeats it;
//! - `lifetime` never moves more than `lru` or `fifo`. This is checked with equal-sized
//!   chunks only: there Belady's rule is optimal (also with several chunks pinned per
//!   moment, which is Belady on the serialised trace), while with mixed sizes it is a
//!   heuristic and can lose to LRU;
//! - the prefetch planner only loads missing chunks in order of need, stays within the
//!   free bytes it creates, and never evicts a chunk whose next use is not strictly
//!   later than that of the chunk it brings, nor one needed within its look-ahead
//!   window (moments, cut short by the byte bound; checked against a naive scan);
//! - a simulated tier never holds more than its capacity, with or without prefetch;
//! - planned against a real host buffer pool (buffers split into parts by size, taken
//!   and returned at random until fragmented), every load of the plan is served by the
//!   pool once its victims are gone, and only evictable chunks are evicted.

use std::sync::Arc;

use proptest::prelude::*;
use tidestore_chunk::planner::Residency;
use tidestore_chunk::{
    offline_belady, simulate, AccessTrace, ChunkId, EvictionPolicy, Fifo, Horizon, Lifetime,
    ListKind, Lru, PoolRoom, Prefetch, PrefetchPlanner, Schedule, SimReport,
};

fn chunk(i: usize) -> ChunkId {
    // Spread ids over lists and indices so the dense packing is exercised.
    ChunkId::new(ListKind::ALL[i % 5], (i / 5) as u32)
}

/// (steps of chunk numbers, number of chunks)
fn steps_strategy(
    max_chunks: usize,
    max_steps: usize,
) -> impl Strategy<Value = (Vec<Vec<usize>>, usize)> {
    (2..max_chunks).prop_flat_map(move |n| {
        (
            prop::collection::vec(prop::collection::vec(0..n, 1..4), 1..max_steps),
            Just(n),
        )
    })
}

fn make_trace(steps: &[Vec<usize>], sizes: &[u64]) -> AccessTrace {
    let n = sizes.len();
    let mut chunk_bytes = vec![0; chunk(n).dense() + 1];
    for (i, &s) in sizes.iter().enumerate() {
        chunk_bytes[chunk(i).dense()] = s;
    }
    AccessTrace::new(
        steps
            .iter()
            .map(|g| g.iter().map(|&i| chunk(i)).collect())
            .collect(),
        chunk_bytes,
    )
}

/// The largest bytes one moment needs, and all chunks' bytes.
fn bounds(trace: &AccessTrace) -> (u64, u64) {
    let group_max = trace
        .steps
        .iter()
        .map(|g| {
            let mut g = g.clone();
            g.sort();
            g.dedup();
            g.iter().map(|c| trace.chunk_bytes[c.dense()]).sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    (group_max, trace.chunk_bytes.iter().sum())
}

fn capacity(trace: &AccessTrace, frac: f64) -> u64 {
    let (lo, hi) = bounds(trace);
    lo + ((hi.saturating_sub(lo)) as f64 * frac) as u64
}

fn run(trace: &AccessTrace, cap: u64, p: &mut dyn EvictionPolicy) -> SimReport {
    let r = simulate(trace, cap, p, None).unwrap();
    assert!(r.peak_resident_bytes <= cap);
    r
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn lifetime_equals_offline_belady_any_sizes(
        (steps, n) in steps_strategy(14, 120),
        sizes in prop::collection::vec(1u64..6, 14),
        frac in 0.0f64..1.0,
    ) {
        let trace = make_trace(&steps, &sizes[..n].iter().map(|s| s * 1000).collect::<Vec<_>>());
        let cap = capacity(&trace, frac);
        let schedule = Arc::new(trace.schedule());
        let life = run(&trace, cap, &mut Lifetime::new(schedule, Horizon::Once));
        let opt = offline_belady(&trace, cap).unwrap();
        prop_assert_eq!(life, opt);
    }

    #[test]
    fn equal_sizes_lifetime_is_belady_and_beats_lru_fifo(
        (steps, n) in steps_strategy(14, 60),
        iterations in 1usize..5,
        frac in 0.0f64..1.0,
    ) {
        let iteration = make_trace(&steps, &vec![4096; n]);
        let trace = iteration.repeat(iterations);
        let cap = capacity(&trace, frac);
        let opt = offline_belady(&trace, cap).unwrap();
        // Knowing only one iteration, read cyclically.
        let cyclic = run(&trace, cap, &mut Lifetime::new(Arc::new(iteration.schedule()), Horizon::Cyclic));
        prop_assert_eq!(cyclic.bytes_in, opt.bytes_in);
        prop_assert_eq!(cyclic.bytes_out, opt.bytes_out);
        let life = run(&trace, cap, &mut Lifetime::new(Arc::new(trace.schedule()), Horizon::Once));
        prop_assert_eq!(life, opt);
        let lru = run(&trace, cap, &mut Lru::new());
        let fifo = run(&trace, cap, &mut Fifo::new());
        prop_assert!(life.bytes_moved() <= lru.bytes_moved(), "{life:?} {lru:?}");
        prop_assert!(life.bytes_moved() <= fifo.bytes_moved(), "{life:?} {fifo:?}");
    }

    #[test]
    fn prefetch_plan_never_evicts_a_chunk_needed_sooner(
        (steps, n) in steps_strategy(14, 50),
        sizes in prop::collection::vec(1u64..6, 14),
        resident_mask in prop::collection::vec(any::<bool>(), 14),
        evictable_mask in prop::collection::vec(any::<bool>(), 14),
        free in 0u64..12,
        now_raw in 0u64..200,
        lookahead in 0u32..30,
        cyclic in any::<bool>(),
        bytes_max in prop_oneof![Just(u64::MAX), 0u64..30],
    ) {
        let trace = make_trace(&steps, &sizes[..n]);
        let schedule = trace.schedule();
        let len = schedule.len() as u64;
        let horizon = if cyclic { Horizon::Cyclic } else { Horizon::Once };
        let now = if cyclic { now_raw } else { now_raw % len };
        let mut resident = vec![false; trace.chunk_bytes.len()];
        let mut evictable = Vec::new();
        for i in 0..n {
            if resident_mask[i] {
                resident[chunk(i).dense()] = true;
                if evictable_mask[i] {
                    evictable.push(chunk(i));
                }
            }
        }
        let planner = PrefetchPlanner::new(lookahead, horizon).with_lookahead_bytes_max(bytes_max);
        let plan = planner.plan(&schedule, now, Residency {
            resident: &resident,
            evictable: &evictable,
            chunk_bytes: &trace.chunk_bytes,
            free_bytes: free,
            pool: None,
        }).unwrap();

        // Naive next use at or after `from`.
        let used = |c: ChunkId, m: u64| trace.steps[(m % len) as usize].contains(&c);
        let naive_next = |c: ChunkId, from: u64| -> u64 {
            let end = if cyclic { from + 2 * len } else { len };
            (from..end).find(|&m| used(c, m)).unwrap_or(u64::MAX)
        };
        let mut budget = free as i64;
        let mut loaded = Vec::new();
        let mut evicted = Vec::new();
        let mut last_need = 0;
        // The window's distinct chunks, in order of need, within the byte bound.
        // The window ends at the moment whose chunk passes the byte bound.
        let mut in_bound: Vec<ChunkId> = Vec::new();
        let mut window_end = now + lookahead as u64;
        let mut acc = 0u64;
        'scan: for m in now + 1..=now + lookahead as u64 {
            if !cyclic && m >= len { break; }
            for &c in trace.steps[(m % len) as usize].iter() {
                if in_bound.contains(&c) { continue; }
                acc += trace.chunk_bytes[c.dense()];
                if acc > bytes_max { window_end = m; break 'scan; }
                in_bound.push(c);
            }
        }
        for step in &plan {
            prop_assert!(in_bound.contains(&step.chunk));
            prop_assert!(!resident[step.chunk.dense()]);
            prop_assert!(!loaded.contains(&step.chunk));
            prop_assert_eq!(naive_next(step.chunk, now + 1), step.needed_at);
            prop_assert!(step.needed_at <= now + lookahead as u64);
            prop_assert!(step.needed_at >= last_need);
            last_need = step.needed_at;
            for &v in &step.evict {
                prop_assert!(evictable.contains(&v));
                prop_assert!(!evicted.contains(&v));
                prop_assert!(naive_next(v, now + 1) > window_end);
                prop_assert!(naive_next(v, now + 1) > step.needed_at,
                    "evicts {} (next {}) for {} (needed {})", v, naive_next(v, now + 1), step.chunk, step.needed_at);
                budget += trace.chunk_bytes[v.dense()] as i64;
                evicted.push(v);
            }
            budget -= trace.chunk_bytes[step.chunk.dense()] as i64;
            prop_assert!(budget >= 0);
            loaded.push(step.chunk);
        }
        // Order of need: every missing chunk needed before the last planned one's
        // moment is planned too.
        for m in now + 1..last_need {
            if !cyclic && m >= len { break; }
            for &c in trace.steps[(m % len) as usize].iter() {
                prop_assert!(resident[c.dense()] || loaded.contains(&c));
            }
        }
    }

    #[test]
    fn a_pool_plan_is_served_by_the_pool(
        (steps, n) in steps_strategy(16, 40),
        kinds in prop::collection::vec(0usize..5, 16),
        buffers in 2usize..7,
        order in prop::collection::vec(0usize..16, 0..40),
        returned in prop::collection::vec(any::<bool>(), 40),
        evictable_mask in prop::collection::vec(any::<bool>(), 16),
        lookahead in 1u32..40,
    ) {
        const BUF: u64 = 64 * 1024;
        // Whole buffers, halves, thirds, quarters and small parts.
        let lens: Vec<u64> = kinds[..n]
            .iter()
            .map(|&k| [BUF, BUF / 2, BUF / 3 - 5000, BUF / 4, 5000][k])
            .collect();
        let pool = tidestore_io::BufferPool::new(BUF as usize, buffers).unwrap();
        let class = |len: u64| pool.take_class_for(len as usize).unwrap();
        // Fragment the pool: take for chunks in a random order, give some back.
        let mut held: std::collections::HashMap<usize, tidestore_io::AlignedBuf> =
            Default::default();
        for (k, &i) in order.iter().enumerate() {
            let i = i % n;
            if held.contains_key(&i) {
                continue;
            }
            if let Some(buf) = pool.try_take_bytes(lens[i] as usize) {
                held.insert(i, buf);
            }
            if returned[k] {
                let back = order[(k * 7) % order.len()] % n;
                held.remove(&back);
            }
        }
        let trace = make_trace(&steps, &lens.iter().map(|&l| class(l).1 as u64).collect::<Vec<_>>());
        let schedule = trace.schedule();
        let mut resident = vec![false; trace.chunk_bytes.len()];
        let mut evictable = Vec::new();
        let mut room = PoolRoom {
            buf_bytes: BUF,
            whole: pool.available() as u64,
            ..PoolRoom::default()
        };
        for &len in &lens {
            let (per, held_bytes) = class(len);
            if per > 1 {
                room.parts.insert(held_bytes as u64, (u64::from(per), 0));
            }
        }
        for (index, per, part, free) in pool.splits() {
            room.splits.insert(index, (part as u64, u64::from(per), u64::from(per) - free as u64));
        }
        for (&i, buf) in &held {
            resident[chunk(i).dense()] = true;
            if evictable_mask[i] {
                evictable.push(chunk(i));
            }
            if class(lens[i]).0 > 1 {
                room.buffer_of.insert(chunk(i), buf.fixed_index().unwrap().1);
            }
        }
        let plan = PrefetchPlanner::new(lookahead, Horizon::Once)
            .plan(&schedule, 0, Residency {
                resident: &resident,
                evictable: &evictable,
                chunk_bytes: &trace.chunk_bytes,
                free_bytes: 0,
                pool: Some(&room),
            })
            .unwrap();
        let index = |c: ChunkId| (0..n).find(|&i| chunk(i) == c).unwrap();
        for step in &plan {
            for &v in &step.evict {
                prop_assert!(evictable.contains(&v));
                prop_assert!(held.remove(&index(v)).is_some(), "{} evicted twice", v);
            }
            let i = index(step.chunk);
            let buf = pool.try_take_bytes(lens[i] as usize);
            prop_assert!(buf.is_some(), "the pool refuses {} ({} bytes), planned after {:?}", step.chunk, lens[i], step.evict);
            held.insert(i, buf.unwrap());
        }
    }

    #[test]
    fn simulated_tier_never_exceeds_capacity_with_prefetch(
        (steps, n) in steps_strategy(12, 60),
        sizes in prop::collection::vec(1u64..6, 12),
        iterations in 1usize..4,
        frac in 0.0f64..1.0,
        lookahead in 0u32..12,
    ) {
        let iteration = make_trace(&steps, &sizes[..n]);
        let trace = iteration.repeat(iterations);
        let cap = capacity(&trace, frac);
        let schedule = Arc::new(iteration.schedule());
        let prefetch = Prefetch { schedule: &schedule, planner: PrefetchPlanner::new(lookahead, Horizon::Cyclic) };
        let policies: Vec<Box<dyn EvictionPolicy>> = vec![
            Box::new(Lifetime::new(schedule.clone(), Horizon::Cyclic)),
            Box::new(Lru::new()),
            Box::new(Fifo::new()),
        ];
        for mut p in policies {
            let r = simulate(&trace, cap, p.as_mut(), Some(prefetch)).unwrap();
            prop_assert!(r.peak_resident_bytes <= cap);
            prop_assert_eq!(r.bytes_in, r.demand_bytes_in + r.prefetch_bytes_in);
            prop_assert!(r.bytes_out <= r.bytes_in);
        }
    }
}

#[test]
fn schedule_from_a_trace_matches_its_steps() {
    let trace = make_trace(&[vec![0, 1], vec![1], vec![2, 0]], &[1, 1, 1]);
    let s: Schedule = trace.schedule();
    assert_eq!(s.uses(chunk(0)), &[0, 2]);
    assert_eq!(s.uses(chunk(1)), &[0, 1]);
}
