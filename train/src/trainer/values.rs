//! Values in and out of a [`Trainer`]: initial or imported weights written, a parameter
//! handed out for compute, its master copy viewed in place, its gradient and its Adam
//! moments (decoded from their stored form: the one decoder of bf16 and int8 moments)
//! read back.

use tidestore_chunk::{typed, DType, Guard, ListKind, Place, TensorId, TensorState, TensorView};
use tidestore_optimizer::Grads;
use tidestore_tiers::{DeviceKind, DeviceView};

use super::{Precision, Trainer};
use crate::error::{Result, TrainError};

/// Bytes as f32 (little endian).
pub(crate) fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; bytes.len() / 4];
    typed::decode_f32(bytes, DType::F32, &mut out);
    out
}

/// f32 as bytes (little endian).
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A moment's stored bytes as f32: fp32 as is, bf16 widened, a Q8 place (codes, padding
/// to 4 bytes, absmax per block) dequantized with the signed (M) or unsigned (V) map.
pub fn decode_moment(bytes: &[u8], dtype: DType, elements: usize, signed: bool) -> Vec<f32> {
    use tidestore_optimizer::quant;
    match dtype {
        DType::Q8 => {
            let maps = quant::maps();
            let map = if signed { &maps.signed } else { &maps.unsigned };
            let absmax = bytes_f32(&bytes[elements.next_multiple_of(4)..]);
            let blocks = quant::absmax_len(elements);
            let mut out = vec![0.0; elements];
            quant::dequantize(map, &bytes[..elements], &absmax[..blocks], &mut out);
            out
        }
        d => {
            let mut out = vec![0.0; bytes.len() / d.size_bytes() as usize];
            typed::decode_f32(bytes, d, &mut out);
            out
        }
    }
}

/// A parameter held for compute across calls ([`Trainer::lease`]): the store's access,
/// ended by [`Trainer::end_lease`] only.
#[derive(Debug)]
pub struct Lease {
    guard: Guard,
    index: usize,
}

impl Lease {
    /// The parameter's index.
    pub fn index(&self) -> usize {
        self.index
    }
}

/// A master copy that never moves ([`Trainer::resident_master`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    /// Address of its first fp32 element in this process.
    pub addr: usize,
    /// Elements.
    pub len: usize,
}

/// Values as a front end has them: fp32, or a framework tensor's memory as it is.
#[derive(Debug, Clone, Copy)]
pub enum Values<'a> {
    /// fp32 values.
    F32(&'a [f32]),
    /// Little-endian elements of `F32`, `BF16` or `F16`.
    Bytes {
        /// The elements.
        bytes: &'a [u8],
        /// Their dtype.
        dtype: DType,
    },
}

impl Values<'_> {
    /// How many values; an element type other than fp32 / bf16 / fp16 is refused.
    pub(crate) fn elements(&self) -> Result<usize> {
        match *self {
            Values::F32(v) => Ok(v.len()),
            Values::Bytes { bytes, dtype } => match dtype {
                DType::F32 | DType::BF16 | DType::F16 => {
                    Ok(bytes.len() / dtype.size_bytes() as usize)
                }
                other => Err(TrainError::Protocol(format!(
                    "values of dtype {other}: only F32, BF16 and F16 are taken"
                ))),
            },
        }
    }

    /// The values as the optimizer's gradient slices, where their bytes are aligned for
    /// their element type (a framework's tensors are).
    pub(crate) fn as_grads(&self) -> Option<Grads<'_>> {
        match *self {
            Values::F32(v) => Some(Grads::F32(v)),
            Values::Bytes { bytes, dtype } => crate::step::grads_of(bytes, dtype, "").ok(),
        }
    }

    /// The values widened into `dst` (as long as they are).
    pub(crate) fn widen_into(&self, dst: &mut [f32]) {
        match *self {
            Values::F32(v) => typed::copy_f32(v, dst),
            Values::Bytes { bytes, dtype } => typed::decode_f32(bytes, dtype, dst),
        }
    }
}

impl Trainer {
    /// The list compute reads a parameter from: the master copy of a trainable one in
    /// `F32`, else its 16-bit place (a frozen parameter's fp32 values live there).
    fn compute_list(&self, trainable: bool) -> ListKind {
        match (trainable, self.precision) {
            (true, Precision::F32) => ListKind::Master,
            _ => ListKind::Params,
        }
    }

    /// The dtype compute reads parameter `i` in ([`Trainer::fetch_view`],
    /// [`Trainer::lease_view`]): bf16 for a trainable parameter in `Bf16`, f32 otherwise.
    pub fn compute_dtype(&self, i: usize) -> Result<DType> {
        let trainable = self.entry(i)?.spec.trainable;
        Ok(match (trainable, self.precision) {
            (true, Precision::Bf16) => DType::BF16,
            _ => DType::F32,
        })
    }

    /// Writes parameter `i`'s values (untraced: not a moment of the iteration): the
    /// master copy (and the bf16 copy in `Bf16`) of a trainable parameter, the fp32
    /// tensor itself of a frozen one.
    pub fn set_values(&mut self, i: usize, values: &[f32]) -> Result<()> {
        self.complete_step()?;
        let e = self.entry(i)?;
        if values.len() != e.spec.elements() {
            return Err(TrainError::Tensor {
                tensor: e.spec.name.clone(),
                reason: format!(
                    "{} values for shape {:?} ({} elements)",
                    values.len(),
                    e.spec.shape,
                    e.spec.elements()
                ),
            });
        }
        let (id, trainable) = (e.id, e.spec.trainable);
        if !trainable {
            return Ok(self.store.write(id, ListKind::Params, &f32_bytes(values))?);
        }
        self.store.write(id, ListKind::Master, &f32_bytes(values))?;
        if self.precision == Precision::Bf16 {
            let mut b = vec![0u8; values.len() * 2];
            typed::encode_f32(values, DType::BF16, &mut b);
            self.store.write(id, ListKind::Params, &b)?;
        }
        Ok(())
    }

    /// Parameter `i` for compute: its values as f32, read where compute reads them
    /// (see [`Trainer::open`]) and released at once to `to` — `HoldAfterFwd` in forward,
    /// `HoldAfterBwd` in backward's recompute. A traced moment of the iteration.
    pub fn fetch(&mut self, i: usize, to: TensorState) -> Result<Vec<f32>> {
        self.step_deferred(i)?;
        let e = self.entry(i)?;
        let (id, list) = (e.id, self.compute_list(e.spec.trainable));
        let g = self.store.access(id, list, self.compute_place)?;
        let values = self.store.read_f32(&g);
        self.store.release(g, to)?;
        self.checked_len(i, values?)
    }

    /// As [`Trainer::fetch`], handing `f` a view of the stored elements and their
    /// dtype instead (bf16 for a trainable parameter in `Bf16`, f32 otherwise) while
    /// the tensor is accessed: host bytes, or on a GPU whose memory compute reads (see
    /// [`Trainer::set_compute_on_device`]) a device pointer. For a front end that
    /// converts on its own device: no f32 vector is made in host memory, and from the
    /// device tier nothing crosses the host at all.
    pub fn fetch_view<R>(
        &mut self,
        i: usize,
        to: TensorState,
        f: impl FnOnce(TensorView<'_>, DType) -> R,
    ) -> Result<R> {
        let lease = self.lease(i)?;
        let out = self.lease_view(&lease).map(|(v, dtype)| f(v, dtype));
        self.end_lease(lease, to)?;
        out
    }

    /// Parameter `i` accessed where compute reads it (as [`Trainer::fetch_view`]) and
    /// kept so until [`Trainer::end_lease`]: for a front end whose framework tensors view
    /// the store's memory across calls (the Python engine binds a module's weights before
    /// its forward and lets them go after it). While leased the tensor's chunk stays
    /// where it is, so the bytes [`Trainer::lease_view`] gives keep their address. A
    /// traced moment of the iteration, as every access.
    pub fn lease(&mut self, i: usize) -> Result<Lease> {
        self.step_deferred(i)?;
        let e = self.entry(i)?;
        let (id, list) = (e.id, self.compute_list(e.spec.trainable));
        let guard = self.store.access(id, list, self.compute_place)?;
        Ok(Lease { guard, index: i })
    }

    /// The leased parameter's stored elements and their dtype (bf16 for a trainable
    /// parameter in `Bf16`, f32 otherwise): host bytes, or a device view on a GPU whose
    /// memory compute reads. A view of another size than the spec's shape is an error
    /// naming the tensor.
    pub fn lease_view(&self, lease: &Lease) -> Result<(TensorView<'_>, DType)> {
        let spec = &self.entry(lease.index)?.spec;
        let dtype = lease.guard.dtype();
        let v = self.store.view(&lease.guard)?;
        if view_len(&v) as u64 != spec.elements() as u64 * dtype.size_bytes() {
            return Err(TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: format!(
                    "the store holds a different size than shape {:?}",
                    spec.shape
                ),
            });
        }
        Ok((v, dtype))
    }

    /// Ends a lease: the parameter released to `to` (`HoldAfterFwd` after forward,
    /// `HoldAfterBwd` after backward); its chunk may move again.
    pub fn end_lease(&mut self, lease: Lease, to: TensorState) -> Result<()> {
        Ok(self.store.release(lease.guard, to)?)
    }

    fn checked_len(&self, i: usize, v: Vec<f32>) -> Result<Vec<f32>> {
        let spec = &self.entries[i].spec;
        if v.len() != spec.elements() {
            return Err(TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: format!("the store holds {} values, shape {:?}", v.len(), spec.shape),
            });
        }
        Ok(v)
    }

    /// Whether compute reads parameters from the device tier's memory: on a GPU only a
    /// front end that computes on that GPU asks for it (the parameters then stay on the
    /// device, and [`Trainer::fetch_view`] hands out device pointers; [`Trainer::fetch`]
    /// cannot read them). A simulated device standing in for a GPU is read whatever is
    /// asked, one left where no GPU was found when asked (see
    /// [`Trainer::compute_reads_device`]). Set before the first step: the warm-up
    /// iteration traces the place. While a master copy is resident
    /// ([`Trainer::resident_master`]) compute stays in the host pool whatever is asked.
    pub fn set_compute_on_device(&mut self, on_device: bool) {
        if !self.resident {
            self.compute_place = self.compute_place_for(on_device);
        }
    }

    /// Whether compute reads parameters on the device tier (else in the host pool).
    pub fn compute_reads_device(&self) -> bool {
        self.compute_place == Place::Device
    }

    /// Whether the store's device tier is a CUDA GPU (else the simulation).
    pub fn device_is_gpu(&self) -> bool {
        self.store.device().kind() == DeviceKind::Cuda
    }

    /// Compute's activations take `bytes` where it runs from now on. Where compute
    /// reads the simulated device, which stands in for a GPU, they are that device's
    /// non-model memory: reported to the store, whose tide leaves them room. On a GPU
    /// the store measures what candle allocates instead, and where compute reads the
    /// host pool they are host memory: neither reports.
    pub fn hold_activations(&mut self, bytes: u64) {
        self.activation_peak_bytes = self.activation_peak_bytes.max(bytes);
        if !self.device_is_gpu() && self.compute_reads_device() {
            self.store.report_non_model_bytes(bytes);
        }
    }

    /// Where compute reads parameters, `on_device` when a front end computes on the GPU.
    /// A simulated device that stands in for a GPU (`DeviceChoice::Sim`, a caller's own
    /// store) is read as a GPU would be, so the GPU's traffic is exercised and measured on
    /// any machine. One that is only what was left without a GPU (`DeviceChoice::Auto`)
    /// is not: compute then runs on the CPU and reads where the step writes — the host
    /// pool, unless the step was asked onto the device — since both tiers are host memory
    /// and every copy between them would be the CPU's work for nothing.
    pub(super) fn compute_place_for(&self, on_device: bool) -> Place {
        match self.store.device().kind() {
            DeviceKind::Sim if on_device || self.sim_stands_in => Place::Device,
            DeviceKind::Sim => match self.step.place() {
                crate::step::StepPlace::Device => Place::Device,
                crate::step::StepPlace::Host => Place::Host,
            },
            DeviceKind::Cuda if on_device => Place::Device,
            DeviceKind::Cuda => Place::Host,
        }
    }

    /// Where trainable parameter `i`'s fp32 master copy stays for the trainer's life: for
    /// a front end whose own tensor becomes that memory (`tidestore.AdamW` binds a CPU
    /// fp32 parameter to it, so nothing is copied in or out around a step). `None`
    /// unless nothing can move it: `F32` precision, the step in the host pool, and a
    /// host pool that holds every chunk of the layout at once (nothing is evicted).
    /// From the first one on, compute reads parameters in the host pool too, so no
    /// access takes a chunk to the device tier. The memory is the store's: valid while
    /// the trainer lives, written by its steps and by [`Trainer::set_master`] /
    /// [`Trainer::load`].
    pub fn resident_master(&mut self, i: usize) -> Result<Option<Resident>> {
        let stays = self.precision == Precision::F32
            && self.step.place() == crate::step::StepPlace::Host
            && self.host_pool_holds_every_chunk();
        if !stays {
            return Ok(None);
        }
        let (addr, len) = self.with_master(i, |m| (m.as_mut_ptr() as usize, m.len()))?;
        self.resident = true;
        self.compute_place = Place::Host;
        Ok(Some(Resident { addr, len }))
    }

    /// Whether the host pool holds every chunk of the layout at once: nothing is ever
    /// evicted to NVMe, and memory a front end keeps beside the store (its gradients
    /// until the step, say) is not taken from a budget below the training state.
    pub fn host_pool_holds_every_chunk(&self) -> bool {
        let plan = self.store.capacity_plan();
        plan.host_buffers >= plan.chunks
    }

    /// Runs `f` on trainable parameter `i`'s fp32 master copy, in place in the host
    /// pool (a traced access, released to `Hold`): how a front end whose tensors live
    /// elsewhere reads the new values after a step, or writes values it changed.
    pub fn with_master<R>(&mut self, i: usize, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
        self.complete_step()?;
        let id = self.trainable_id(i)?;
        self.store
            .with_host_views(&[(id, ListKind::Master)], TensorState::Hold, |v| {
                f32_view_mut(v[0]).map(f)
            })?
    }

    /// The id of parameter `i`, refused when it is frozen (it has no master copy).
    pub(super) fn trainable_id(&self, i: usize) -> Result<TensorId> {
        let e = self.entry(i)?;
        if !e.spec.trainable {
            return Err(TrainError::Tensor {
                tensor: e.spec.name.clone(),
                reason: "frozen: it has no master copy".into(),
            });
        }
        Ok(e.id)
    }

    /// Writes `values` as trainable parameter `i`'s master copy (in place, a traced
    /// access: see [`Trainer::with_master`]).
    pub fn set_master(&mut self, i: usize, values: Values<'_>) -> Result<()> {
        self.check_values(i, &values, "values")?;
        self.with_master(i, |m| values.widen_into(m))
    }

    /// Compares `values` with trainable parameter `i`'s master copy rounded to their
    /// dtype; where they differ (the front end changed the parameter outside the
    /// optimizer) the values become the master copy. Returns whether they did.
    pub fn sync_master(&mut self, i: usize, values: Values<'_>) -> Result<bool> {
        self.check_values(i, &values, "values")?;
        self.with_master(i, |m| {
            let differs = match values {
                Values::F32(v) => v
                    .iter()
                    .zip(m.iter())
                    .any(|(a, b)| a.to_bits() != b.to_bits()),
                Values::Bytes { bytes, dtype } => {
                    let mut rounded = vec![0u8; bytes.len()];
                    typed::encode_f32(m, dtype, &mut rounded);
                    rounded != bytes
                }
            };
            if differs {
                values.widen_into(m);
            }
            differs
        })
    }

    /// Writes trainable parameter `i`'s master copy, rounded to `dtype` (nearest even),
    /// into `out` (little-endian elements).
    pub fn read_master(&mut self, i: usize, out: &mut [u8], dtype: DType) -> Result<()> {
        self.check_values(i, &Values::Bytes { bytes: out, dtype }, "output")?;
        self.complete_step()?;
        let id = self.trainable_id(i)?;
        let cpu = self.step.optimizer().cpu();
        self.store
            .with_host_views(&[(id, ListKind::Master)], TensorState::Hold, |v| {
                let m = f32_view_mut(v[0])?;
                match bytemuck::try_cast_slice_mut(out) {
                    // fp32 out: a copy, spread over the optimizer's threads.
                    Ok(dst) if dtype == DType::F32 => Ok(cpu.copy(m, dst)?),
                    _ => {
                        typed::encode_f32(m, dtype, out);
                        Ok(())
                    }
                }
            })?
    }

    /// `values` are exactly parameter `i`'s elements (`what`: values, gradient,
    /// output), or the error naming the tensor, the bytes given and the bytes expected.
    pub(super) fn check_values(&self, i: usize, values: &Values<'_>, what: &str) -> Result<()> {
        let spec = &self.entry(i)?.spec;
        let n = spec.elements();
        let (given, want, dtype) = match *values {
            Values::F32(v) => (4 * v.len(), 4 * n, DType::F32),
            Values::Bytes { bytes, dtype } => {
                values.elements()?;
                (bytes.len(), n * dtype.size_bytes() as usize, dtype)
            }
        };
        if given != want {
            return Err(TrainError::Argument {
                tensor: spec.name.clone(),
                reason: format!(
                    "{what}: {given} bytes, expected {want} ({n} elements of {dtype}, shape {:?})",
                    spec.shape
                ),
            });
        }
        Ok(())
    }

    /// Parameter `i`'s current fp32 values (the master copy of a trainable one);
    /// untraced.
    pub fn values(&mut self, i: usize) -> Result<Vec<f32>> {
        self.complete_step()?;
        let e = self.entry(i)?;
        let list = if e.spec.trainable {
            ListKind::Master
        } else {
            ListKind::Params
        };
        let id = e.id;
        Ok(bytes_f32(&self.store.read(id, list)?))
    }

    /// Trainable parameter `i`'s gradient of this iteration, between its
    /// [`Trainer::put_grad`] and the step (`F32` only: there it has an fp32 place of its
    /// own; in `Bf16` the step writes the new parameters over it). The step consumes
    /// it: after the step it is refused, as the store drops dead gradients unwritten.
    /// Untraced.
    pub fn grad_values(&mut self, i: usize) -> Result<Vec<f32>> {
        self.complete_step()?;
        let e = self.entry(i)?;
        let refuse = |reason: &str| TrainError::Tensor {
            tensor: e.spec.name.clone(),
            reason: reason.into(),
        };
        if !e.spec.trainable || self.precision != Precision::F32 {
            return Err(refuse("no gradient of its own (frozen, or bf16 precision)"));
        }
        if self.store.state(e.id, ListKind::Grads) != Some(TensorState::HoldAfterBwd) {
            return Err(refuse(
                "no gradient to read: none was put since the last step, which consumes it",
            ));
        }
        let id = e.id;
        Ok(bytes_f32(&self.store.read(id, ListKind::Grads)?))
    }

    /// Trainable parameter `i`'s Adam moments (M, V) as f32, decoded from their stored
    /// form (bf16 widened, int8 dequantized); untraced.
    pub fn moments(&mut self, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.complete_step()?;
        let e = self.entry(i)?;
        let (id, n) = (e.id, e.spec.elements());
        let dtype = self
            .store
            .layout()
            .location(id, ListKind::Momentum)
            .map_or(DType::F32, |l| l.dtype);
        let m = self.store.read(id, ListKind::Momentum)?;
        let v = self.store.read(id, ListKind::Variance)?;
        Ok((
            decode_moment(&m, dtype, n, true),
            decode_moment(&v, dtype, n, false),
        ))
    }
}

/// The store's fp32 bytes as f32 (chunk places are 4-byte aligned).
pub(crate) fn f32_view_mut(bytes: &mut [u8]) -> Result<&mut [f32]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| TrainError::Protocol(format!("an fp32 place in the store is misaligned: {e}")))
}

/// Bytes a view spans.
fn view_len(v: &TensorView<'_>) -> usize {
    match v {
        TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => b.len(),
        TensorView::Device(DeviceView::Cuda(span)) => span.len_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bit_values_round_trip_through_f32() {
        for dtype in [DType::BF16, DType::F16] {
            let values = [0.0f32, 1.5, -2.25, 1e-3, 65000.0];
            let mut bits = vec![0u8; values.len() * 2];
            typed::encode_f32(&values, dtype, &mut bits);
            let mut wide = vec![0.0f32; values.len()];
            Values::Bytes {
                bytes: &bits,
                dtype,
            }
            .widen_into(&mut wide);
            let mut again = vec![0u8; bits.len()];
            typed::encode_f32(&wide, dtype, &mut again);
            assert_eq!(bits, again, "{dtype}");
        }
    }

    #[test]
    fn only_float_elements_are_taken() {
        let bytes = [0u8; 8];
        assert_eq!(
            Values::Bytes {
                bytes: &bytes,
                dtype: DType::BF16
            }
            .elements()
            .unwrap(),
            4
        );
        assert!(Values::Bytes {
            bytes: &bytes,
            dtype: DType::Q8
        }
        .elements()
        .is_err());
    }
}
