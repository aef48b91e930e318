//! Guards against the host tier growing past its budget or blocking without bound: the
//! pool is fixed at start-up, exhaustion is a typed error, buffers dropped anywhere come
//! back, and the peak is tracked.

use std::time::Duration;

use tidestore_tiers::{Device, DeviceConfig, HostTier, TierError, TierKind};

fn dev() -> Device {
    Device::sim(&DeviceConfig::new(1 << 20)).unwrap()
}

#[test]
fn pool_is_sized_by_budget_and_exhaustion_is_typed() {
    let host = HostTier::new(3 * 8192 + 4095, 5000, &dev()).unwrap();
    assert_eq!(host.buf_bytes(), 8192);
    assert_eq!(host.buffers(), 3);
    assert_eq!(host.budget().capacity_bytes(), 3 * 8192);
    let a = host.try_take(1, 5000).unwrap();
    let b = host.try_take(2, 5000).unwrap();
    let c = host.try_take(3, 5000).unwrap();
    match host.try_take(4, 5000) {
        Err(TierError::HostPoolExhausted {
            chunk: 4,
            buffers: 3,
            buf_bytes: 8192,
        }) => {}
        other => panic!("expected HostPoolExhausted, got {other:?}"),
    }
    assert!(matches!(
        host.take_timeout(5, 5000, Duration::from_millis(10)),
        Err(TierError::HostPoolExhausted { .. })
    ));
    assert_eq!(host.used_bytes(), 3 * 8192);
    host.give_back(a);
    drop(b); // dropping anywhere returns it too
    assert_eq!(host.used_bytes(), 8192);
    assert_eq!(host.budget().peak_bytes(), 3 * 8192);
    host.reset_peak();
    assert_eq!(host.budget().peak_bytes(), 8192);
    drop(c);
    assert_eq!(host.available(), 3);
}

#[test]
fn budget_below_one_chunk_is_refused() {
    match HostTier::new(4096, 5000, &dev()) {
        Err(TierError::BudgetTooSmall {
            tier: TierKind::Host,
            capacity_bytes: 4096,
            chunk_bytes: 8192,
        }) => {}
        other => panic!("expected BudgetTooSmall, got {other:?}"),
    }
    assert!(matches!(
        HostTier::new(1 << 20, 0, &dev()),
        Err(TierError::Config { .. })
    ));
}

#[test]
fn buffers_are_aligned_and_distinct() {
    let host = HostTier::new(4 * 4096, 4096, &dev()).unwrap();
    let bufs: Vec<_> = (0..4).map(|i| host.try_take(i, 4096).unwrap()).collect();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        for other in &bufs[i + 1..] {
            assert_ne!(b.as_ptr(), other.as_ptr());
        }
    }
}

#[test]
fn smaller_chunks_take_parts_of_a_buffer_and_are_counted_by_them() {
    // Buffers of 64 KiB (the largest chunk); chunks of a quarter of that share one.
    let host = HostTier::new(2 * 65536, 65536, &dev()).unwrap();
    assert_eq!(host.held_bytes(65536), Some(65536));
    assert_eq!(host.held_bytes(16000), Some(16384));
    assert_eq!(host.held_bytes(65537), None);
    let quarters: Vec<_> = (0..4).map(|i| host.try_take(i, 16000).unwrap()).collect();
    assert_eq!(host.used_bytes(), 65536);
    assert_eq!(host.available(), 1);
    let whole = host.try_take(9, 65536).unwrap();
    assert!(matches!(
        host.try_take(10, 16000),
        Err(TierError::HostPoolExhausted { chunk: 10, .. })
    ));
    drop(whole);
    let mut quarters = quarters;
    quarters.pop();
    assert_eq!(host.used_bytes(), 3 * 16384);
    // The freed part serves the next chunk of that size; a whole chunk takes the other
    // buffer.
    let again = host.try_take(11, 16000).unwrap();
    assert_eq!(host.available(), 1);
    drop((again, quarters));
    assert_eq!(host.used_bytes(), 0);
    assert_eq!(host.budget().peak_bytes(), 2 * 65536);
}
