//! A tier's eviction policy, with an LRU kept up to date beside it: the LRU chooses while
//! the main policy cannot (`lifetime` without a valid schedule: warm-up, after a
//! divergence). Both see every insert, access and eviction, so either can take over at
//! any moment; a victim is always one of the candidates offered.

use crate::id::ChunkId;
use crate::policy::{EvictionPolicy, Lru};

/// A tier's policy plus an LRU kept up to date beside it, used while the main policy
/// cannot be (`lifetime` without a valid schedule: warm-up, after a divergence).
pub(crate) struct Policies {
    main: Box<dyn EvictionPolicy + Send>,
    lru: Lru,
    pub(super) use_main: bool,
}

impl Policies {
    pub(crate) fn new(main: Box<dyn EvictionPolicy + Send>, use_main: bool) -> Self {
        Policies {
            main,
            lru: Lru::new(),
            use_main,
        }
    }

    pub(crate) fn set_main(&mut self, main: Box<dyn EvictionPolicy + Send>) {
        self.main = main;
    }

    pub(super) fn on_insert(&mut self, c: ChunkId, m: u64) {
        self.main.on_insert(c, m);
        self.lru.on_insert(c, m);
    }

    pub(crate) fn on_access(&mut self, c: ChunkId, m: u64) {
        self.main.on_access(c, m);
        self.lru.on_access(c, m);
    }

    pub(super) fn on_evict(&mut self, c: ChunkId, m: u64) {
        self.main.on_evict(c, m);
        self.lru.on_evict(c, m);
    }

    pub(super) fn choose(&mut self, candidates: &[ChunkId], m: u64) -> Option<ChunkId> {
        let v = if self.use_main {
            self.main.choose_victim(candidates, m)
        } else {
            self.lru.choose_victim(candidates, m)
        };
        v.filter(|v| candidates.contains(v))
    }
}
