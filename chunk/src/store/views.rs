//! Views of accessed tensors: read-only and writable, one at a time or several at once
//! (cut from their chunks without overlapping), as host bytes or device views, and the
//! typed `f32` reads and writes over them.
//!
//! Invariants: a view is given only through a current guard; a writable view marks its
//! chunk changed where the guard is (its copies on the other tiers are dropped) before
//! any byte can change; views given together never overlap.

use tidestore_tiers::{CudaSpanMut, DeviceKind, DeviceView, DeviceViewMut};

use crate::error::ChunkError;
use crate::mover::IoPump;
use crate::Result;

use super::{ChunkStore, Guard, Place};
use crate::mover::Slot;

/// A read-only view of an accessed tensor.
#[derive(Debug)]
pub enum TensorView<'a> {
    /// Its bytes in the host pool.
    Host(&'a [u8]),
    /// Its bytes on the device (host bytes in the simulation, a pointer on a GPU).
    Device(DeviceView<'a>),
}

/// A writable view of an accessed tensor.
#[derive(Debug)]
pub enum TensorViewMut<'a> {
    /// Its bytes in the host pool.
    Host(&'a mut [u8]),
    /// Its bytes on the device.
    Device(DeviceViewMut<'a>),
}

/// What is left of one chunk's bytes while views are cut from it.
enum Region<'a> {
    /// Host-addressable bytes (`true`: the simulated device).
    Host(&'a mut [u8], bool),
    /// GPU memory (`None` only while a view is being cut from it).
    Cuda(Option<CudaSpanMut<'a>>),
}

impl ChunkStore {
    fn lost(&self, g: &Guard) -> ChunkError {
        ChunkError::BadView {
            tensor: self.name(g.tensor),
            reason: "its chunk is not resident (store bug)",
        }
    }

    /// A read-only view of an accessed tensor.
    pub fn view(&self, g: &Guard) -> Result<TensorView<'_>> {
        self.check_guard(g)?;
        let range = g.offset_bytes..g.offset_bytes + g.len_bytes;
        match g.place {
            Place::Host => {
                let buf = self.mover.host_copy(g.chunk).ok_or_else(|| self.lost(g))?;
                Ok(TensorView::Host(&buf[range]))
            }
            Place::Device => {
                let mem = self
                    .mover
                    .device_copy(g.chunk)
                    .ok_or_else(|| self.lost(g))?;
                Ok(TensorView::Device(match mem.view() {
                    DeviceView::Host(bytes) => DeviceView::Host(&bytes[range]),
                    DeviceView::Cuda(span) => {
                        DeviceView::Cuda(span.get(range).ok_or_else(|| self.lost(g))?)
                    }
                }))
            }
        }
    }

    /// A writable view of an accessed tensor. The chunk counts as changed where the
    /// guard is: its copies on the other tiers are dropped (and written back from here
    /// when it is evicted).
    pub fn view_mut(&mut self, g: &Guard) -> Result<TensorViewMut<'_>> {
        self.check_guard(g)?;
        let c = g.chunk;
        self.mover.mark_changed(c, g.place, self.demand());
        let lost = self.lost(g);
        let range = g.offset_bytes..g.offset_bytes + g.len_bytes;
        match g.place {
            Place::Host => {
                let buf = self.mover.host_copy_mut(c).ok_or(lost)?;
                Ok(TensorViewMut::Host(&mut buf[range]))
            }
            Place::Device => {
                let mem = self.mover.device_copy_mut(c).ok_or(lost.clone())?;
                Ok(TensorViewMut::Device(match mem.view_mut() {
                    DeviceViewMut::Host(bytes) => DeviceViewMut::Host(&mut bytes[range]),
                    DeviceViewMut::Cuda(span) => DeviceViewMut::Cuda(span.get(range).ok_or(lost)?),
                }))
            }
        }
    }

    /// Writable views of several accessed tensors at once, in the order of `guards`
    /// (in different chunks or in one, on either tier where host-addressable). Every
    /// chunk counts as changed where its guard is (see [`ChunkStore::view_mut`]).
    /// Errors: [`ChunkError::OverlappingViews`] when two guards' bytes overlap (the
    /// same tensor twice included), [`ChunkError::StaleGuard`] for a guard no longer in
    /// use, [`ChunkError::BadView`] for GPU memory.
    pub fn views_mut(&mut self, guards: &[&Guard]) -> Result<Vec<&mut [u8]>> {
        self.views_mut_with_io(guards).map(|(views, _)| views)
    }

    /// As [`ChunkStore::views_mut`], with an [`IoPump`] to keep the store's NVMe
    /// transfers (prefetches, write-backs) moving while the views are in use: poll it
    /// between pieces of work.
    pub fn views_mut_with_io(&mut self, guards: &[&Guard]) -> Result<(Vec<&mut [u8]>, IoPump<'_>)> {
        for g in guards {
            self.check_guard(g)?;
            if g.place == Place::Device && self.mover.device().kind() == DeviceKind::Cuda {
                return Err(self.not_addressable(g));
            }
        }
        let lost = self.lost_any(guards);
        let (views, pump) = self.tensor_views_mut_with_io(guards)?;
        let bytes = views
            .into_iter()
            .map(|v| match v {
                TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => Ok(b),
                TensorViewMut::Device(DeviceViewMut::Cuda(_)) => Err(lost.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((bytes, pump))
    }

    /// Writable views of several accessed tensors at once, wherever they are: host
    /// bytes for the host pool and the simulated device, device pointers on a GPU (for
    /// kernels), in the order of `guards`, with an [`IoPump`] as in
    /// [`ChunkStore::views_mut_with_io`]. Every chunk counts as changed where its guard
    /// is. Errors: [`ChunkError::OverlappingViews`] when two guards' bytes overlap,
    /// [`ChunkError::StaleGuard`] for a guard no longer in use.
    pub fn tensor_views_mut_with_io(
        &mut self,
        guards: &[&Guard],
    ) -> Result<(Vec<TensorViewMut<'_>>, IoPump<'_>)> {
        for g in guards {
            self.check_guard(g)?;
        }
        let order = self.disjoint_order(guards)?;
        let lost = self.lost_any(guards);
        for g in guards {
            self.mover.mark_changed(g.chunk, g.place, self.demand());
        }
        let (slots, pump) = self.mover.pump_parts();
        let views = cut_views(slots, guards, &order, lost)?;
        Ok((views, pump))
    }

    /// The guards' indices sorted by (chunk, offset); guards whose bytes overlap are
    /// [`ChunkError::OverlappingViews`].
    fn disjoint_order(&self, guards: &[&Guard]) -> Result<Vec<usize>> {
        // Sorted by (chunk, offset): overlaps are between neighbours.
        let mut order: Vec<usize> = (0..guards.len()).collect();
        order.sort_by_key(|&i| (guards[i].chunk.dense(), guards[i].offset_bytes));
        for w in order.windows(2) {
            let (a, b) = (guards[w[0]], guards[w[1]]);
            if a.chunk == b.chunk && a.offset_bytes + a.len_bytes > b.offset_bytes {
                return Err(ChunkError::OverlappingViews {
                    first: self.name(a.tensor),
                    second: self.name(b.tensor),
                    chunk: a.chunk,
                });
            }
        }
        Ok(order)
    }

    fn lost_any(&self, guards: &[&Guard]) -> ChunkError {
        ChunkError::BadView {
            tensor: guards
                .first()
                .map_or_else(String::new, |g| self.name(g.tensor)),
            reason: "its chunk is not resident (store bug)",
        }
    }

    /// The accessed tensor's bytes where they are host-addressable (the host pool, or
    /// the simulated device); [`ChunkError::BadView`] for GPU memory.
    pub fn bytes(&self, g: &Guard) -> Result<&[u8]> {
        match self.view(g)? {
            TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => Ok(b),
            TensorView::Device(DeviceView::Cuda(_)) => Err(self.not_addressable(g)),
        }
    }

    /// Writable host-addressable bytes (see [`ChunkStore::bytes`] and
    /// [`ChunkStore::view_mut`]).
    pub fn bytes_mut(&mut self, g: &Guard) -> Result<&mut [u8]> {
        let err = self.not_addressable(g);
        match self.view_mut(g)? {
            TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => Ok(b),
            TensorViewMut::Device(DeviceViewMut::Cuda(_)) => Err(err),
        }
    }

    fn not_addressable(&self, g: &Guard) -> ChunkError {
        ChunkError::BadView {
            tensor: self.name(g.tensor),
            reason: "GPU memory is not host-addressable; use the device view",
        }
    }

    /// The accessed tensor's elements as `f32` (converted from f16/bf16).
    pub fn read_f32(&self, g: &Guard) -> Result<Vec<f32>> {
        Ok(crate::typed::decode_f32_vec(self.bytes(g)?, g.dtype))
    }

    /// Writes `values` into the accessed tensor (converted to its dtype).
    pub fn write_f32(&mut self, g: &Guard, values: &[f32]) -> Result<()> {
        self.check_guard(g)?;
        let expected = g.len_bytes as u64;
        let got = values.len() as u64 * g.dtype.size_bytes();
        if expected != got {
            return Err(ChunkError::LengthMismatch {
                tensor: self.name(g.tensor),
                expected_bytes: expected,
                got_bytes: got,
            });
        }
        let dtype = g.dtype;
        let bytes = self.bytes_mut(g)?;
        crate::typed::encode_f32(values, dtype, bytes);
        Ok(())
    }
}

/// Cuts the guards' views out of their chunks' copies in `slots` (`order`: the guards
/// sorted by chunk and offset, disjoint), returned in the order of `guards`; `lost` when
/// a chunk has no copy where its guard is.
fn cut_views<'a>(
    slots: &'a mut [Slot],
    guards: &[&Guard],
    order: &[usize],
    lost: ChunkError,
) -> Result<Vec<TensorViewMut<'a>>> {
    let mut out: Vec<Option<TensorViewMut<'a>>> = (0..guards.len()).map(|_| None).collect();
    let mut k = 0;
    for (d, slot) in slots.iter_mut().enumerate() {
        if k == order.len() {
            break;
        }
        let first = guards[order[k]];
        if first.chunk.dense() != d {
            continue;
        }
        // A chunk's guards all name one place (a chunk is accessed where it is).
        let mut rest: Region<'_> = match first.place {
            Place::Host => match slot.host_mut() {
                Some(buf) => Region::Host(buf, false),
                None => return Err(lost),
            },
            Place::Device => match slot.dev_mut().map(|m| m.view_mut()) {
                Some(DeviceViewMut::Host(bytes)) => Region::Host(bytes, true),
                Some(DeviceViewMut::Cuda(span)) => Region::Cuda(Some(span)),
                None => return Err(lost),
            },
        };
        let mut consumed = 0;
        while k < order.len() && guards[order[k]].chunk.dense() == d {
            let i = order[k];
            let g = guards[i];
            if g.place != first.place {
                return Err(lost);
            }
            let skip = g.offset_bytes - consumed;
            match &mut rest {
                Region::Host(bytes, on_device) => {
                    if skip + g.len_bytes > bytes.len() {
                        return Err(lost);
                    }
                    let (_, tail) = std::mem::take(bytes).split_at_mut(skip);
                    let (view, tail) = tail.split_at_mut(g.len_bytes);
                    out[i] = Some(if *on_device {
                        TensorViewMut::Device(DeviceViewMut::Host(view))
                    } else {
                        TensorViewMut::Host(view)
                    });
                    *bytes = tail;
                }
                Region::Cuda(span) => {
                    let (view, tail) = span
                        .take()
                        .and_then(|s| s.split_at(skip))
                        .and_then(|(_, tail)| tail.split_at(g.len_bytes))
                        .ok_or(lost.clone())?;
                    out[i] = Some(TensorViewMut::Device(DeviceViewMut::Cuda(view)));
                    *span = Some(tail);
                }
            }
            consumed = g.offset_bytes + g.len_bytes;
            k += 1;
        }
    }
    out.into_iter().collect::<Option<Vec<_>>>().ok_or(lost)
}
