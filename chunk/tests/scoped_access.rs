//! Guards against chunks left pinned, and bytes lost, when a scope of accesses ends in
//! an unplanned way: an early `Err` or a panic inside the closure, or an access that
//! fails part way; and against a guard outliving its access (released by id, accessed
//! again) being honoured for views or a release of the new access.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use common::*;
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
    let (t, list) = (TensorId(2), ListKind::MasterF32);
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
    let a = (TensorId(0), ListKind::MasterF32);
    let b = (TensorId(2), ListKind::MomentumF32);
    let c = (TensorId(4), ListKind::Param16);

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
