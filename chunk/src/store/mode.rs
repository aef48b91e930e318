//! [`Mode`]: whether the store is tracing its first iteration or following the
//! schedule that iteration yielded.

use std::sync::Arc;

use crate::tracer::{Schedule, Tracer};

pub(super) enum Mode {
    Tracing(Tracer),
    Following(Arc<Schedule>),
}
