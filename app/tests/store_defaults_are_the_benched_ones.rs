//! Guards against the library's store defaults drifting from what `tidestore bench`
//! measures: a user who opens a `ChunkStore` without tuning it must get the prefetch
//! look-aheads and the asynchronous write-backs the benchmark numbers were taken with.

use tidestore::chunk::config::{DEFAULT_HOST_PREFETCH_LOOKAHEAD, DEFAULT_PREFETCH_LOOKAHEAD};
use tidestore::chunk::{NvmeSource, PolicyKind, StoreConfig};
use tidestore::config::EvictionName;
use tidestore::PolicySection;

#[test]
fn store_config_defaults_equal_the_bench_defaults() {
    let bench = PolicySection::default();
    let store = StoreConfig::new(
        1 << 20,
        1 << 20,
        NvmeSource::Dir {
            dir: std::env::temp_dir(),
            bytes: 1 << 20,
            io: tidestore::io::IoConfig::default(),
        },
    );
    assert_eq!(bench.prefetch_lookahead, DEFAULT_PREFETCH_LOOKAHEAD);
    assert_eq!(
        bench.host_prefetch_lookahead,
        DEFAULT_HOST_PREFETCH_LOOKAHEAD
    );
    assert_eq!(store.prefetch_lookahead, bench.prefetch_lookahead);
    assert_eq!(store.host_prefetch_lookahead, bench.host_prefetch_lookahead);
    assert!(
        store.async_write_back,
        "the bench runs with asynchronous write-backs (src/session.rs)"
    );
    assert_eq!(bench.eviction, EvictionName::Lifetime);
    assert_eq!(store.policy, PolicyKind::Lifetime);
    assert!(
        !store.adopt,
        "a store adopts an existing swap file only when asked"
    );
}
