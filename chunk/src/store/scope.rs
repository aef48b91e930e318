//! Scoped access: several tensors accessed at once, their views handed to a closure,
//! and every one released on every path — return, error of the closure's own, a failed
//! access or view part way, a panic (released, then resumed).
//!
//! Invariant: no path out of a scope leaves a tensor it accessed in COMPUTE.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::error::ChunkError;
use crate::id::{ListKind, TensorId};
use crate::mover::IoPump;
use crate::state::TensorState;
use crate::Result;

use super::{ChunkStore, Guard, Place, TensorViewMut};

impl ChunkStore {
    /// Accesses every `(tensor, list, place)` of `tensors` in order, runs `f` on
    /// writable views of them all (in that order, wherever they are, as
    /// [`ChunkStore::tensor_views_mut_with_io`] gives them) with an [`IoPump`], and
    /// releases every one to `to` on every path: when `f` returns (whatever it returns,
    /// an `Err` of its own included), when an access or the views fail part way (the
    /// tensors accessed so far are released), and when `f` panics (every tensor is
    /// released, then the panic goes on). Every chunk counts as changed where it is
    /// accessed. Accesses and releases are moments of the trace, as with
    /// [`ChunkStore::access`] / [`ChunkStore::release`].
    ///
    /// Errors: `to` not a state COMPUTE may go to (nothing is accessed); the first
    /// access or view error; a release error (a broken invariant; `f`'s result is then
    /// dropped).
    pub fn with_access<R>(
        &mut self,
        tensors: &[(TensorId, ListKind, Place)],
        to: TensorState,
        f: impl FnOnce(&mut [TensorViewMut<'_>], &mut IoPump<'_>) -> R,
    ) -> Result<R> {
        let guards = self.access_all(tensors, to)?;
        let outcome = {
            let refs: Vec<&Guard> = guards.iter().collect();
            self.tensor_views_mut_with_io(&refs)
                .map(|(mut views, mut pump)| {
                    catch_unwind(AssertUnwindSafe(|| f(&mut views, &mut pump)))
                })
        };
        self.end_scope(guards, to, outcome)
    }

    /// As [`ChunkStore::with_access`], for tensors accessed in the host pool, with their
    /// bytes as plain slices (in the order of `tensors`).
    pub fn with_host_views<R>(
        &mut self,
        tensors: &[(TensorId, ListKind)],
        to: TensorState,
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R> {
        let at_host: Vec<(TensorId, ListKind, Place)> =
            tensors.iter().map(|&(t, l)| (t, l, Place::Host)).collect();
        let guards = self.access_all(&at_host, to)?;
        let outcome = {
            let refs: Vec<&Guard> = guards.iter().collect();
            self.views_mut(&refs)
                .map(|mut views| catch_unwind(AssertUnwindSafe(|| f(&mut views))))
        };
        self.end_scope(guards, to, outcome)
    }

    /// Accesses every tensor of a scope, releasing (to `to`) the ones accessed before an
    /// access that fails. `to` is checked first.
    fn access_all(
        &mut self,
        tensors: &[(TensorId, ListKind, Place)],
        to: TensorState,
    ) -> Result<Vec<Guard>> {
        if let Some(&(tensor, list, _)) = tensors.first() {
            if to == TensorState::Compute || !TensorState::Compute.can_become(to) {
                return Err(ChunkError::IllegalTransition {
                    tensor: self.name(tensor),
                    chunk: self.location(tensor, list)?.chunk,
                    from: TensorState::Compute,
                    to,
                });
            }
        }
        let mut guards = Vec::with_capacity(tensors.len());
        for &(tensor, list, place) in tensors {
            match self.access(tensor, list, place) {
                Ok(g) => guards.push(g),
                Err(e) => {
                    if let Err(r) = self.release_all(guards, to) {
                        tracing::error!(error = %r, "chunk store: releasing a scope after a failed access");
                    }
                    return Err(e);
                }
            }
        }
        Ok(guards)
    }

    /// Releases every guard of a scope (all of them, whatever fails), returning the
    /// first error.
    fn release_all(&mut self, guards: Vec<Guard>, to: TensorState) -> Result<()> {
        let mut first = Ok(());
        for g in guards {
            if let Err(e) = self.release(g, to) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Ends a scope: releases its guards, then returns `f`'s result, the views' error,
    /// or resumes `f`'s panic.
    fn end_scope<R>(
        &mut self,
        guards: Vec<Guard>,
        to: TensorState,
        outcome: Result<std::thread::Result<R>>,
    ) -> Result<R> {
        let released = self.release_all(guards, to);
        match outcome {
            Ok(Ok(r)) => released.map(|()| r),
            Ok(Err(panic)) => {
                if let Err(e) = released {
                    tracing::error!(error = %e, "chunk store: releasing a scope after a panic");
                }
                resume_unwind(panic)
            }
            Err(e) => {
                if let Err(r) = released {
                    tracing::error!(error = %r, "chunk store: releasing a scope after a view error");
                }
                Err(e)
            }
        }
    }
}
