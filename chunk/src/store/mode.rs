//! [`Mode`]: whether the store is tracing its first iteration or following the
//! schedules that iteration yielded, each held here once.

use std::sync::Arc;

use crate::tracer::{Schedule, Tracer};

pub(super) enum Mode {
    Tracing(Tracer),
    Following(Schedules),
}

/// The schedules of a traced iteration, over the same moments: every access's (what
/// the store follows, the tide and the host policy read), and the device's and the
/// host's accesses alone (what the device policy and the prefetchers read). The only
/// holder besides the `lifetime` policies, which keep their own handle on the one
/// they evict by; the mover is lent one per call where its rules need it.
#[derive(Debug, Clone)]
pub(super) struct Schedules {
    pub(super) all: Arc<Schedule>,
    pub(super) device: Arc<Schedule>,
    pub(super) host: Arc<Schedule>,
}
