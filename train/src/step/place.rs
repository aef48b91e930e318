//! Where a tensor is stepped: in the host pool in place (the CPU kernel over the
//! scope's views, in pieces, the store's NVMe transfers polled between pieces), in the
//! host pool one chunk at a time through scratch copies (a pool too small for a
//! tensor's places at once), or on the device (the GPU kernel, or the CPU kernel over
//! the simulated device). Each access is released on every path by the store's scoped
//! API.

use std::ops::Range;
use std::time::Instant;

use tidestore_chunk::{ChunkStore, ListKind, Place, TensorId, TensorState};
use tidestore_optimizer::{AdamW, DeviceGrads, DeviceSlices, Grads, Placement};

use super::views::*;
use super::{Applied, Entry, GradPlace, Observer, StepLoop};
use crate::error::{Result, TrainError};

impl StepLoop {
    /// The step in place in the host pool; the gradient read from `given` where given
    /// (its place not accessed).
    pub(super) fn step_host_in_place(
        &mut self,
        store: &mut ChunkStore,
        i: usize,
        applied: Applied,
        observe: Observer<'_>,
        given: Option<Grads<'_>>,
    ) -> Result<()> {
        let e = &self.entries[i];
        let places = e.places();
        // The gradient's place comes first; a given gradient needs none.
        let places = &places[usize::from(given.is_some())..];
        let (opt, scratch) = (&self.opt, &mut self.scratch);
        let at_host: Vec<_> = places.iter().map(|&(t, l)| (t, l, Place::Host)).collect();
        let ns =
            store.with_access(&at_host, TensorState::Hold, |views, pump| -> Result<u64> {
                let mut views = host_slices(views, &e.name)?;
                let mut places = InPlace::split(&mut views, e, given.is_some())?;
                let mut ns = 0u64;
                let mut at = 0;
                while at < e.len {
                    let end = (at + e.piece()).min(e.len);
                    let started = Instant::now();
                    let staged = &mut scratch.grad[..];
                    places.step_piece(opt.cpu(), staged, e, given, &applied, at..end)?;
                    ns += started.elapsed().as_nanos() as u64;
                    // Keep the NVMe reads of the next tensors (and write-backs) moving.
                    pump.poll();
                    at = end;
                }
                Ok(ns)
            })??;
        observe(store);
        self.stats.kernel_ns += ns;
        Ok(())
    }

    /// The step one chunk in use at a time (a host pool too small for a tensor's chunks
    /// at once): gradient, M and V copied out to scratch, master updated in place, M, V
    /// and the new 16-bit parameters copied back.
    pub(super) fn step_host_copying(
        &mut self,
        store: &mut ChunkStore,
        i: usize,
        applied: Applied,
        observe: Observer<'_>,
    ) -> Result<()> {
        let e = &self.entries[i];
        let (t, len) = (e.spec.tensor, e.len);
        let s = &mut self.scratch;
        let grad_len = len * e.grad_dtype.size_bytes() as usize;
        let grad: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut s.grad[..])[..grad_len];
        copy_out(store, e.grad_at(), grad, observe)?;
        // The moments' stored bytes (at most 4 per element), in f32-aligned scratch.
        let mb = e.moment_bytes;
        let m: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut s.m[..])[..mb];
        let v: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut s.v[..])[..mb];
        copy_out(store, (t, ListKind::Momentum), m, observe)?;
        copy_out(store, (t, ListKind::Variance), v, observe)?;
        let out_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut s.out16[..len]);
        let (opt, hp, state) = (&self.opt, &applied.hp, applied.state);
        let ns =
            store.with_host_views(&[(t, ListKind::Master)], TensorState::Hold, |views| {
                let master = f32s(views[0], &e.name, "master")?;
                let grads = grads_of(grad, e.grad_dtype, &e.name)?;
                let out = match e.out_dtype {
                    Some(d) => Some(param_out(out_bytes, d, &e.name)?),
                    None => None,
                };
                let mv = moments_of((m, v), (e.moments, e.len), &e.name, 0..len)?;
                let started = Instant::now();
                opt.cpu().step_moments(state, hp, master, mv, grads, out)?;
                Ok::<_, TrainError>(started.elapsed().as_nanos() as u64)
            })??;
        observe(store);
        self.stats.kernel_ns += ns;
        copy_in(store, (t, ListKind::Momentum), m, observe)?;
        copy_in(store, (t, ListKind::Variance), v, observe)?;
        if e.out_dtype.is_some() {
            let out: &[u8] = bytemuck::cast_slice(&s.out16[..len]);
            copy_in(store, (t, ListKind::Params), out, observe)?;
        }
        Ok(())
    }

    /// The step on the device: every place accessed there and stepped where it is; the
    /// kernel has finished when the optimizer returns, before the guards are released.
    pub(super) fn step_device(
        &mut self,
        store: &mut ChunkStore,
        i: usize,
        applied: Applied,
        observe: Observer<'_>,
    ) -> Result<()> {
        let e = &self.entries[i];
        let places = e.places();
        let (opt, hp, state) = (&self.opt, &applied.hp, applied.state);
        let at_device: Vec<_> = places.iter().map(|&(t, l)| (t, l, Place::Device)).collect();
        let (ns, simulated) =
            store.with_access(&at_device, TensorState::Hold, |views, pump| {
                let mut views = views
                    .iter_mut()
                    .map(|v| device_view(v, &e.name))
                    .collect::<Result<Vec<_>>>()?;
                let v = views.pop().expect("five or four places");
                let m = views.pop().expect("five or four places");
                let master = views.pop().expect("five or four places");
                let grad = views.swap_remove(0);
                let grads = match e.spec.grad {
                    GradPlace::InParam16 => DeviceGrads::InPlace {
                        bytes: grad,
                        dtype: e.grad_dtype,
                    },
                    GradPlace::InGrads { .. } => DeviceGrads::Separate {
                        grads: read_only(grad),
                        dtype: e.grad_dtype,
                        out: views.pop().zip(e.out_dtype),
                    },
                };
                let started = Instant::now();
                let placed = opt.step_device_slices(
                    state,
                    hp,
                    DeviceSlices {
                        len: e.len,
                        master,
                        moments: state_type_of(e.moments, &e.name)?,
                        m,
                        v,
                        grads,
                    },
                )?;
                let ns = started.elapsed().as_nanos() as u64;
                pump.poll();
                if placed.placement != Placement::Gpu {
                    return Err(TrainError::Tensor {
                        tensor: e.name.clone(),
                        reason: format!(
                            "the optimizer stepped device memory on {:?}",
                            placed.placement
                        ),
                    });
                }
                Ok((ns, placed.simulated))
            })??;
        observe(store);
        self.stats.kernel_ns += ns;
        self.stats.simulated |= simulated;
        Ok(())
    }
}

/// The host views of an in-place step, by role.
struct InPlace<'a> {
    /// The gradient's place (empty for a given gradient).
    grad: &'a mut [u8],
    /// The 16-bit copy's place, when the step writes it apart from the gradient.
    out: Option<&'a mut [u8]>,
    master: &'a mut [f32],
    m: &'a mut [u8],
    v: &'a mut [u8],
}

impl<'a> InPlace<'a> {
    /// `views` of `e.places()` (without the gradient's when `given`) by role.
    fn split(views: &'a mut [&mut [u8]], e: &Entry, given: bool) -> Result<Self> {
        let (grad, rest): (&mut [u8], _) = if given {
            (&mut [], views)
        } else {
            let (g, rest) = views.split_first_mut().expect("four places or five");
            (&mut **g, rest)
        };
        let (out, rest) = match e.spec.grad {
            GradPlace::InGrads {
                write_param16: true,
            } => {
                let (o, r) = rest.split_first_mut().expect("five places");
                (Some(&mut **o), r)
            }
            _ => (None, rest),
        };
        let [master, m, v] = rest else {
            unreachable!("master, M and V follow the gradient places")
        };
        Ok(InPlace {
            grad,
            out,
            master: f32s(master, &e.name, "master")?,
            m,
            v,
        })
    }

    /// Steps elements `piece` of `e` (with `given`, its gradient read there). A 16-bit
    /// gradient that shares its bytes with the new parameters is staged in `staged` (a
    /// cache-sized buffer) first.
    fn step_piece(
        &mut self,
        cpu: &AdamW,
        staged: &mut [u32],
        e: &Entry,
        given: Option<Grads<'_>>,
        applied: &Applied,
        piece: Range<usize>,
    ) -> Result<()> {
        let (at, end) = (piece.start, piece.end);
        let Applied { state, hp } = *applied;
        let master = &mut self.master[at..end];
        let mv = moments_of((self.m, self.v), (e.moments, e.len), &e.name, piece)?;
        if matches!(e.spec.grad, GradPlace::InParam16) {
            let n = end - at;
            let staged: &mut [u8] = bytemuck::cast_slice_mut(staged);
            staged[..2 * n].copy_from_slice(&self.grad[2 * at..2 * end]);
            let grads = grads_of(&staged[..2 * n], e.grad_dtype, &e.name)?;
            let out = param_out(&mut self.grad[2 * at..2 * end], e.grad_dtype, &e.name)?;
            return Ok(cpu.step_moments(state, &hp, master, mv, grads, Some(out))?);
        }
        let w = e.grad_dtype.size_bytes() as usize;
        let grads = match given {
            Some(g) => g.split_at(end).0.split_at(at).1,
            None => grads_of(&self.grad[w * at..w * end], e.grad_dtype, &e.name)?,
        };
        let out = match (&mut self.out, e.out_dtype) {
            (Some(o), Some(d)) => Some(param_out(&mut o[2 * at..2 * end], d, &e.name)?),
            _ => None,
        };
        Ok(cpu.step_moments(state, &hp, master, mv, grads, out)?)
    }
}

/// Copies the place's bytes out to `dst` (one access).
fn copy_out(
    store: &mut ChunkStore,
    (t, l): (TensorId, ListKind),
    dst: &mut [u8],
    observe: Observer<'_>,
) -> Result<()> {
    store.with_host_views(&[(t, l)], TensorState::Hold, |v| dst.copy_from_slice(v[0]))?;
    observe(store);
    Ok(())
}

/// Copies `src` into the place (one access).
fn copy_in(
    store: &mut ChunkStore,
    (t, l): (TensorId, ListKind),
    src: &[u8],
    observe: Observer<'_>,
) -> Result<()> {
    store.with_host_views(&[(t, l)], TensorState::Hold, |v| v[0].copy_from_slice(src))?;
    observe(store);
    Ok(())
}
