//! Guards against chunks left pinned, and bytes lost, when a scope of accesses ends in
//! an unplanned way: an early `Err` or a panic inside the closure, or an access that
//! fails part way; and against a guard outliving its access (released by id, accessed
//! again) being honoured for views or a release of the new access.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use common::*;
use proptest::prelude::*;
use tidestore_chunk::{
    ChunkError, ChunkStore, DType, Layout, ListKind, Place, PolicyKind, TensorId, TensorState,
    TensorViewMut,
};
use tidestore_tiers::DeviceViewMut;

/// The payload of the panics these tests raise on purpose.
const PLANNED: &str = "planned panic inside a scope";

/// Keeps the default panic message for every panic but the planned ones.
fn quiet_planned_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&PLANNED) {
                default(info);
            }
        }));
    });
}

const SLOT: u64 = 16384;

/// Tensors of a few sizes, every other one trainable (so fp32 lists exist for half).
fn tensors() -> Layout {
    let t: Vec<(u64, bool)> = (0..8).map(|i| (500 + 400 * i, i % 2 == 0)).collect();
    layout(4096, &t, DType::F16)
}

/// Tight budgets: scopes move chunks between all three tiers.
fn store(dir: &tempfile::TempDir, policy: PolicyKind, async_writes: bool) -> ChunkStore {
    let cfg = config(3 * SLOT, 4 * SLOT, nvme_dir(dir, 64 * SLOT))
        .with_policy(policy)
        .with_working_set_chunks(3)
        .with_async_write_back(async_writes)
        .with_host_prefetch(if async_writes { 4 } else { 0 });
    ChunkStore::open(tensors(), cfg, sim_device(4 * SLOT)).unwrap()
}

/// Every (tensor, list) with a place.
fn places(store: &ChunkStore) -> Vec<(TensorId, ListKind)> {
    let n = store.layout().tensors().len() as u32;
    (0..n)
        .flat_map(|t| ListKind::ALL.map(|l| (TensorId(t), l)))
        .filter(|&(t, l)| store.layout().location(t, l).is_some())
        .collect()
}

fn host_bytes<'a, 'b>(v: &'a mut TensorViewMut<'b>) -> &'a mut [u8] {
    match v {
        TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => b,
        TensorViewMut::Device(DeviceViewMut::Cuda(_)) => panic!("simulated device only"),
    }
}

/// The failure: a guard whose access ended still giving views of (or releasing) the
/// tensor's next access, or a guard of one store honoured by another.
#[test]
fn a_stale_guard_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir, PolicyKind::Lru, false);
    let (t, list) = (TensorId(2), ListKind::Master);
    let old = s.access(t, list, Place::Host).unwrap();
    s.bytes_mut(&old).unwrap().fill(7);
    s.release_tensor(t, list, TensorState::Hold).unwrap();
    let stale = |r: Result<(), ChunkError>| match r {
        Err(ChunkError::StaleGuard {
            tensor, list: l, ..
        }) => assert_eq!((tensor.as_str(), l), ("t2", list)),
        other => panic!("expected StaleGuard, got {other:?}"),
    };
    stale(s.bytes(&old).map(|_| ()));
    stale(s.bytes_mut(&old).map(|_| ()));
    stale(s.view(&old).map(|_| ()));
    stale(s.view_mut(&old).map(|_| ()));
    stale(s.read_f32(&old).map(|_| ()));
    stale(s.write_f32(&old, &[0.0; 3]));
    stale(s.views_mut(&[&old]).map(|_| ()));
    s.verify().unwrap();

    // Accessed again (same tensor, same place): the old guard still names nothing.
    let new = s.access(t, list, Place::Host).unwrap();
    stale(s.bytes(&old).map(|_| ()));
    stale(s.views_mut(&[&new, &old]).map(|_| ()));
    let old_release = s.release(old, TensorState::Hold);
    stale(old_release);
    // Nothing changed: the new access holds, with the bytes written before.
    assert_eq!(s.state(t, list), Some(TensorState::Compute));
    assert!(s.bytes(&new).unwrap().iter().all(|&b| b == 7));
    s.verify().unwrap();

    // A guard of another store is stale here, even for the same tensor and access.
    let dir2 = tempfile::tempdir().unwrap();
    let mut other = store(&dir2, PolicyKind::Lru, false);
    let foreign = other.access(t, list, Place::Host).unwrap();
    stale(s.bytes(&foreign).map(|_| ()));
    stale(s.release(foreign, TensorState::Hold));
    assert_eq!(s.state(t, list), Some(TensorState::Compute));
    s.release(new, TensorState::Hold).unwrap();
    s.verify().unwrap();
}

/// The failure: a scope that returns early, fails an access part way or panics
/// leaving its tensors in COMPUTE (chunks pinned for good), or losing what it wrote.
#[test]
fn scopes_release_on_return_error_and_panic() {
    quiet_planned_panics();
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir, PolicyKind::Lifetime, true);
    let a = (TensorId(0), ListKind::Master);
    let b = (TensorId(2), ListKind::Momentum);
    let c = (TensorId(4), ListKind::Params);

    // Normal return, with a value.
    let n = s
        .with_host_views(&[a, b], TensorState::Hold, |views| {
            views[0].fill(1);
            views[1].fill(2);
            views.len()
        })
        .unwrap();
    assert_eq!(n, 2);
    s.verify().unwrap();

    // The closure's own error: released, the error handed back inside Ok.
    let r: Result<Result<(), String>, ChunkError> =
        s.with_host_views(&[a], TensorState::HoldAfterFwd, |views| {
            views[0].fill(3);
            Err("early".to_string())
        });
    assert_eq!(r.unwrap(), Err("early".to_string()));
    assert_eq!(s.state(a.0, a.1), Some(TensorState::HoldAfterFwd));
    s.verify().unwrap();

    // A panic: released, bytes written before it kept, the panic propagated.
    let caught = catch_unwind(AssertUnwindSafe(|| {
        s.with_access(
            &[(c.0, c.1, Place::Device), (b.0, b.1, Place::Host)],
            TensorState::Hold,
            |views, io| {
                io.poll();
                host_bytes(&mut views[0]).fill(9);
                std::panic::panic_any(PLANNED);
            },
        )
    }));
    assert_eq!(
        caught.unwrap_err().downcast_ref::<&str>(),
        Some(&PLANNED),
        "the closure's panic goes on"
    );
    s.verify().unwrap();
    for (t, l) in [a, b, c] {
        assert_ne!(s.state(t, l), Some(TensorState::Compute));
    }

    // An access failing part way (the same tensor twice): the first is released.
    let err = s
        .with_host_views(&[a, b, a], TensorState::Hold, |_| ())
        .unwrap_err();
    assert!(matches!(err, ChunkError::IllegalTransition { .. }), "{err}");
    s.verify().unwrap();
    // A state COMPUTE cannot go to: nothing accessed.
    let err = s
        .with_host_views(&[a], TensorState::Free, |_| ())
        .unwrap_err();
    assert!(matches!(err, ChunkError::IllegalTransition { .. }), "{err}");
    s.verify().unwrap();

    s.evict_device_all().unwrap();
    assert!(s.read(a.0, a.1).unwrap().iter().all(|&x| x == 3));
    assert!(s.read(b.0, b.1).unwrap().iter().all(|&x| x == 2));
    assert!(s.read(c.0, c.1).unwrap().iter().all(|&x| x == 9));
    s.verify().unwrap();
}

#[derive(Debug, Clone)]
enum End {
    Return,
    Fail,
    Panic,
}

#[derive(Debug, Clone)]
struct Scope {
    /// Indices into the places (wrapped), with where each is accessed.
    tensors: Vec<(usize, bool)>,
    write: bool,
    host_views: bool,
    end: End,
    to_fwd: bool,
}

fn scope() -> impl Strategy<Value = Scope> {
    (
        prop::collection::vec((0usize..64, any::<bool>()), 1..4),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(End::Return), Just(End::Fail), Just(End::Panic)],
        any::<bool>(),
    )
        .prop_map(|(tensors, write, host_views, end, to_fwd)| Scope {
            tensors,
            write,
            host_views,
            end,
            to_fwd,
        })
}

fn run(scopes: Vec<Scope>, policy: usize, async_writes: bool) -> Result<(), TestCaseError> {
    quiet_planned_panics();
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(&dir, PolicyKind::ALL[policy], async_writes);
    let places = places(&s);
    let mut model: std::collections::HashMap<(TensorId, ListKind), Vec<u8>> = places
        .iter()
        .map(|&(t, l)| {
            (
                (t, l),
                vec![0; s.layout().location(t, l).unwrap().bytes() as usize],
            )
        })
        .collect();
    let mut version = 0u64;
    for (i, sc) in scopes.iter().enumerate() {
        let picked: Vec<(TensorId, ListKind, Place)> = sc
            .tensors
            .iter()
            .map(|&(k, host)| {
                let (t, l) = places[k % places.len()];
                (
                    t,
                    l,
                    if host || sc.host_views {
                        Place::Host
                    } else {
                        Place::Device
                    },
                )
            })
            .collect();
        let to = if sc.to_fwd {
            TensorState::HoldAfterFwd
        } else {
            TensorState::Hold
        };
        // What the closure sees and writes; checked against the model afterwards.
        let mut seen: Vec<Vec<u8>> = Vec::new();
        let fresh: Vec<Vec<u8>> = picked
            .iter()
            .map(|&(t, l, _)| {
                version += 1;
                pattern(version, model[&(t, l)].len())
            })
            .collect();
        let mut wrote = false;
        let body = |views: &mut [&mut [u8]], seen: &mut Vec<Vec<u8>>, wrote: &mut bool| {
            for (v, new) in views.iter_mut().zip(&fresh) {
                seen.push(v.to_vec());
                if sc.write {
                    v.copy_from_slice(new);
                }
            }
            *wrote = sc.write;
            match sc.end {
                End::Return => Ok(()),
                End::Fail => Err("closure failed"),
                End::Panic => std::panic::panic_any(PLANNED),
            }
        };
        let caught = catch_unwind(AssertUnwindSafe(|| {
            if sc.host_views {
                let pairs: Vec<(TensorId, ListKind)> =
                    picked.iter().map(|&(t, l, _)| (t, l)).collect();
                s.with_host_views(&pairs, to, |views| body(views, &mut seen, &mut wrote))
            } else {
                s.with_access(&picked, to, |views, io| {
                    io.poll();
                    let mut bytes: Vec<&mut [u8]> = views.iter_mut().map(host_bytes).collect();
                    body(&mut bytes, &mut seen, &mut wrote)
                })
            }
        }));
        match (&caught, &sc.end) {
            (Err(_), End::Panic) | (Ok(Ok(Err(_))), End::Fail) | (Ok(Ok(Ok(()))), End::Return) => {}
            // An access the scope cannot make (the same tensor twice, a chunk in use on
            // the other tier): refused before the closure ran.
            (
                Ok(Err(ChunkError::IllegalTransition { .. } | ChunkError::PinnedElsewhere { .. })),
                _,
            ) => prop_assert!(seen.is_empty()),
            (other, end) => {
                return Err(TestCaseError::fail(format!(
                    "scope {i} ending {end:?} gave {:?}",
                    other.as_ref().map(|r| r.as_ref().map(|_| ()))
                )))
            }
        }
        for ((&(t, l, _), before), new) in picked.iter().zip(&seen).zip(&fresh) {
            prop_assert!(
                before == &model[&(t, l)],
                "scope {i}: {t} {l} read stale bytes"
            );
            if wrote {
                model.insert((t, l), new.clone());
            }
        }
        s.verify()
            .map_err(|e| TestCaseError::fail(format!("after scope {i}: {e}")))?;
        for &(t, l) in &places {
            prop_assert_ne!(
                s.state(t, l),
                Some(TensorState::Compute),
                "{} {} left in COMPUTE",
                t,
                l
            );
        }
        if i % 5 == 4 {
            let _ = s.end_iteration();
            s.verify()
                .map_err(|e| TestCaseError::fail(format!("end of iteration: {e}")))?;
        }
    }
    // No chunk pinned: every tensor can be accessed on either tier.
    for &(t, l) in &places {
        for place in [Place::Device, Place::Host] {
            let g = s.access(t, l, place).unwrap();
            s.release(g, TensorState::Hold).unwrap();
        }
    }
    s.sync().unwrap();
    s.verify()
        .map_err(|e| TestCaseError::fail(format!("at the end: {e}")))?;
    for &(t, l) in &places {
        prop_assert!(
            s.read(t, l).unwrap() == model[&(t, l)],
            "{} {} changed",
            t,
            l
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// The failure: any mix of returns, errors and panics inside scopes leaving a chunk
    /// pinned, a tensor in COMPUTE, the store's invariants broken or bytes changed.
    #[test]
    fn random_scopes_that_return_fail_or_panic_leave_nothing_pinned(
        scopes in prop::collection::vec(scope(), 1..40),
        policy in 0usize..3,
        async_writes in any::<bool>(),
    ) {
        run(scopes, policy, async_writes)?;
    }
}
