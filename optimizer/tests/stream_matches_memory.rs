//! Guards against the streaming step computing anything other than the in-memory step:
//! a group read back from NVMe, updated in slices between engine polls and written
//! behind must give the very bits `AdamW::step_groups` gives on the same arrays in
//! memory (master, M, V and the 16-bit outputs), over several steps with clipping, loss
//! scaling and an overflow skip, with the master on NVMe or in host memory, on a real file
//! and on the in-memory backend, in ascending order or during backward (descending).
//! Also: the ring never takes more buffers than the host budget pays for.

mod stream_common;

use stream_common::*;
use tidestore_io::FaultConfig;
use tidestore_optimizer::stream::{MasterPlace, Order, StreamingOptimizer};
use tidestore_optimizer::{Grads, OptimError, StepDecision};

const STEPS: u64 = 6;
const OVERFLOW_AT: Option<u64> = Some(3);

fn budget_for(ring_groups: u64, master: MasterPlace) -> u64 {
    let (ring, per_group) = StreamingOptimizer::ring_bytes_for(&groups(), &cfg(master, 1 << 40));
    let _ = ring;
    per_group as u64 * ring_groups + per_group as u64 / 2
}

fn run_against_reference(mut opt: StreamingOptimizer) {
    opt.initialize(init_master).unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    let mut r = Reference::new();
    for it in 1..=STEPS {
        let a = stream_step(&mut opt, &mut ctrl, &mut outs, it, OVERFLOW_AT).unwrap();
        let b = r.step(it, OVERFLOW_AT);
        assert_eq!(a, b, "decision at iteration {it}");
        if it == 3 {
            assert!(matches!(a, StepDecision::Skip { .. }));
        }
        assert_eq!(
            outs.bits(),
            r.outs.bits(),
            "16-bit params at iteration {it}"
        );
    }
    assert_same_state(&mut opt, &r);
    let s = opt.stats();
    assert!(s.bytes_read > 0 && s.bytes_written == s.bytes_read, "{s:?}");
}

#[test]
fn streamed_over_a_file_is_bit_identical_to_in_memory() {
    for master in [MasterPlace::Nvme, MasterPlace::Host] {
        let dir = tempfile::tempdir().unwrap();
        let swap = file_swap(dir.path(), master);
        let opt =
            StreamingOptimizer::new(cpu(), groups(), swap, cfg(master, budget_for(3, master)))
                .unwrap();
        assert_eq!(opt.ring_groups(), 3);
        run_against_reference(opt);
    }
}

#[test]
fn streamed_over_memory_backend_with_reordering_is_bit_identical() {
    let faults = FaultConfig {
        reorder: true,
        short_rate: 0.2,
        transient_rate: 0.1,
        ..FaultConfig::seeded(7)
    };
    for master in [MasterPlace::Nvme, MasterPlace::Host] {
        let swap = mem_swap(master, faults.clone());
        let opt =
            StreamingOptimizer::new(cpu(), groups(), swap, cfg(master, budget_for(4, master)))
                .unwrap();
        run_against_reference(opt);
    }
}

#[test]
fn step_during_backward_in_descending_order_matches() {
    let master = MasterPlace::Nvme;
    let swap = mem_swap(master, FaultConfig::none());
    let mut opt =
        StreamingOptimizer::new(cpu(), groups(), swap, cfg(master, budget_for(3, master))).unwrap();
    opt.initialize(init_master).unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    let mut r = Reference::new();
    for it in 1..=STEPS {
        let g = all_grads(it, ctrl.loss_scale(), OVERFLOW_AT);
        let sq: f64 = g.iter().map(|g| opt.cpu().grad_sq_norm(g.as_grads())).sum();
        let decision = ctrl.decide(sq);
        if let StepDecision::Apply { state, .. } = decision {
            let mut views = outs.views();
            let mut step = opt.begin(state, Order::Descending).unwrap();
            for i in (0..LENS.len()).rev() {
                assert_eq!(step.next_group(), Some(i));
                step.progress().unwrap();
                let o = views[i].reborrow();
                step.update_group(i, g[i].as_grads(), Some(o)).unwrap();
            }
            assert_eq!(step.next_group(), None);
            step.finish().unwrap();
        }
        assert_eq!(decision, r.step(it, OVERFLOW_AT));
        assert_eq!(outs.bits(), r.outs.bits());
    }
    assert_same_state(&mut opt, &r);
    let p = opt.placement();
    assert_eq!(p.groups.len(), LENS.len());
    assert!(p.groups.iter().all(|g| g.streamed));
}

#[test]
fn ring_never_exceeds_the_host_budget() {
    for master in [MasterPlace::Nvme, MasterPlace::Host] {
        for ring in [2u64, 3, 5] {
            let budget = budget_for(ring, master);
            let swap = mem_swap(master, FaultConfig::none());
            let opt = StreamingOptimizer::new(cpu(), groups(), swap, cfg(master, budget)).unwrap();
            let pool = opt.ring().clone();
            assert!((pool.count() * pool.buf_bytes()) as u64 <= budget);
            assert_eq!(
                pool.count(),
                ring as usize * if master == MasterPlace::Nvme { 3 } else { 2 }
            );
            // Fewer ring slots than groups: the pipeline must recycle.
            assert!((ring as usize) < LENS.len());
            run_against_reference(opt);
        }
    }
    // The peak is counted: a ring of 2 with 7 groups uses all its buffers at some point.
    let swap = mem_swap(MasterPlace::Nvme, FaultConfig::none());
    let mut opt = StreamingOptimizer::new(
        cpu(),
        groups(),
        swap,
        cfg(MasterPlace::Nvme, budget_for(2, MasterPlace::Nvme)),
    )
    .unwrap();
    opt.initialize(init_master).unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    stream_step(&mut opt, &mut ctrl, &mut outs, 1, None).unwrap();
    let s = opt.stats();
    assert!(s.buffers_in_use_peak <= opt.ring().count(), "{s:?}");
    assert!(s.buffers_in_use_peak >= 4, "{s:?}");
    assert_eq!(
        opt.ring().available(),
        opt.ring().count(),
        "every buffer back after the step"
    );
}

#[test]
fn a_budget_below_two_groups_is_refused() {
    let swap = mem_swap(MasterPlace::Nvme, FaultConfig::none());
    let budget = budget_for(1, MasterPlace::Nvme);
    let e =
        StreamingOptimizer::new(cpu(), groups(), swap, cfg(MasterPlace::Nvme, budget)).unwrap_err();
    assert!(matches!(e, OptimError::Stream { .. }), "{e}");
    assert!(e.to_string().contains("too small"), "{e}");
}

#[test]
fn misuse_is_a_typed_error_and_an_abandoned_step_poisons() {
    let swap = mem_swap(MasterPlace::Nvme, FaultConfig::none());
    let mut opt = StreamingOptimizer::new(
        cpu(),
        groups(),
        swap,
        cfg(MasterPlace::Nvme, budget_for(3, MasterPlace::Nvme)),
    )
    .unwrap();
    let mut ctrl = controller();
    let mut outs = Outs::new();
    // Not initialized.
    assert!(matches!(
        stream_step(&mut opt, &mut ctrl, &mut outs, 1, None),
        Err(OptimError::Stream { .. })
    ));
    opt.initialize(init_master).unwrap();
    let g = all_grads(1, 1.0, None);
    let state = tidestore_optimizer::StepState::new(1);
    {
        let mut step = opt.begin(state, Order::Ascending).unwrap();
        // Out of order: refused, nothing changed.
        let e = step.update_group(2, g[2].as_grads(), None).unwrap_err();
        assert!(matches!(e, OptimError::Stream { .. }), "{e}");
        // Wrong length: refused.
        let e = step
            .update_group(0, Grads::F32(&[0.0; 5]), None)
            .unwrap_err();
        assert!(matches!(e, OptimError::LengthMismatch { .. }), "{e}");
    }
    // Dropped before updating anything: not poisoned.
    assert!(!opt.is_poisoned());
    // Wrong step number.
    assert!(matches!(
        opt.begin(tidestore_optimizer::StepState::new(5), Order::Ascending),
        Err(OptimError::InvalidParam { name: "step", .. })
    ));
    {
        let mut step = opt.begin(state, Order::Ascending).unwrap();
        step.update_group(0, g[0].as_grads(), None).unwrap();
        // dropped midway
    }
    assert!(opt.is_poisoned());
    let e = stream_step(&mut opt, &mut ctrl, &mut outs, 1, None).unwrap_err();
    assert!(matches!(e, OptimError::Poisoned { .. }), "{e}");
    assert!(e.to_string().contains("abandoned"), "{e}");
}
