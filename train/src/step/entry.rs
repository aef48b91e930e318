//! One tensor of the step loop: what a caller names ([`StepTensor`], [`GradPlace`]),
//! and where its gradient, 16-bit copy, master, M and V lie ([`Entry`], checked against
//! the layout by [`entry_of`]).

use tidestore_chunk::{ChunkId, ChunkStore, DType, Layout, ListKind, TensorId, TensorState};

use crate::error::{Result, TrainError};

/// Where a tensor's gradient is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradPlace {
    /// Written over its 16-bit parameters (the layout's mixed precision): the step reads
    /// the gradient there and writes the new 16-bit parameters over it.
    InParam16,
    /// In its own place of the `Grads` list (a layout with a gradient list: 16-bit, or
    /// fp32 for fp32 compute); the new 16-bit parameters go to its `Params` place when
    /// `write_param16`.
    InGrads {
        /// Whether to refresh the 16-bit copy of the parameters.
        write_param16: bool,
    },
}

impl GradPlace {
    /// The list the gradient is in.
    pub fn list(self) -> ListKind {
        match self {
            GradPlace::InParam16 => ListKind::Params,
            GradPlace::InGrads { .. } => ListKind::Grads,
        }
    }
}

/// A tensor the loop steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTensor {
    /// The parameter tensor (with `Master`, `Momentum` and `Variance` places).
    pub tensor: TensorId,
    /// Where its gradient is.
    pub grad: GradPlace,
}

/// Parameters per kernel call in the host pool: the piece's 16-bit gradient is staged in
/// a buffer that stays in cache, and the store's NVMe transfers are polled between
/// pieces.
pub(super) const STEP_PIECE: usize = 128 * 1024;

/// Parameters per kernel call in the host pool where no gradient is staged: pieces long
/// enough that splitting one over the optimizer's threads costs little beside it (a
/// piece of fp32 state is 28 MB, about a millisecond of memory traffic between polls).
const STEP_PIECE_UNSTAGED: usize = 1024 * 1024;

/// Where tensors are stepped (see the module doc of `step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPlace {
    /// In the pinned host pool, by the CPU kernel.
    Host,
    /// On the device: the GPU kernel, or the CPU kernel over the simulated device.
    Device,
}

/// A tensor the loop steps, as its places lie in the layout, and where it is in the
/// iteration.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) spec: StepTensor,
    pub(super) name: String,
    pub(super) len: usize,
    /// The chunk holding its gradient (its group).
    pub(super) group: ChunkId,
    pub(super) grad_dtype: DType,
    /// The 16-bit copy's dtype, when the step writes it.
    pub(super) out_dtype: Option<DType>,
    /// How its M and V are stored (F32, BF16 or Q8; see `tidestore_chunk::moments`).
    pub(super) moments: DType,
    /// Bytes of its M place (= of its V place).
    pub(super) moment_bytes: usize,
    pub(super) grad_final: bool,
    pub(super) stepped: bool,
    /// Its step of the last decision is still to be made ([`super::Overlap::Forward`]).
    pub(super) due: bool,
    /// Where it is stepped (the loop's place, or the device for a tensor of a split:
    /// `StepLoop::place_on_device`).
    pub(super) place: StepPlace,
}

impl Entry {
    /// (tensor, list) of the gradient.
    pub(super) fn grad_at(&self) -> (TensorId, ListKind) {
        (self.spec.tensor, self.spec.grad.list())
    }

    /// The gradient was used up (stepped, or the step skipped): a gradient of its own
    /// (`Grads`) becomes FREE, and once its chunk's every gradient is, the store drops
    /// the chunk unwritten — no write-back after the step, no read before the next
    /// backward overwrites it. A gradient over the 16-bit copy now holds parameters.
    /// A gradient never written this iteration (one an abandoned iteration did not
    /// reach) is FREE already and stays so.
    pub(super) fn grad_consumed(&self, store: &mut ChunkStore) -> Result<()> {
        if let GradPlace::InGrads { .. } = self.spec.grad {
            let (tensor, list) = (self.spec.tensor, ListKind::Grads);
            if !matches!(store.state(tensor, list), None | Some(TensorState::Free)) {
                store.set_state(tensor, list, TensorState::Free)?;
            }
        }
        Ok(())
    }

    /// Parameters per kernel call of its step in the host pool.
    pub(super) fn piece(&self) -> usize {
        match self.spec.grad {
            GradPlace::InParam16 => STEP_PIECE,
            GradPlace::InGrads { .. } => STEP_PIECE_UNSTAGED,
        }
    }

    /// The places the step uses, in access order: the gradient, the 16-bit copy when
    /// written apart from it, master, M, V.
    pub(super) fn places(&self) -> Vec<(TensorId, ListKind)> {
        let t = self.spec.tensor;
        let mut p = vec![self.grad_at()];
        if let GradPlace::InGrads {
            write_param16: true,
        } = self.spec.grad
        {
            p.push((t, ListKind::Params));
        }
        p.extend([
            (t, ListKind::Master),
            (t, ListKind::Momentum),
            (t, ListKind::Variance),
        ]);
        p
    }
}

/// The entry of `spec`, checked against the layout.
pub(super) fn entry_of(layout: &Layout, spec: StepTensor) -> Result<Entry> {
    let name = layout
        .tensor(spec.tensor)
        .map_or_else(|| spec.tensor.to_string(), |s| s.name.clone());
    let missing = |what: String| TrainError::Tensor {
        tensor: name.clone(),
        reason: what,
    };
    if layout.tensor(spec.tensor).is_none() {
        return Err(missing("not registered in the store's layout".into()));
    }
    for list in [ListKind::Master, ListKind::Momentum, ListKind::Variance] {
        if layout.location(spec.tensor, list).is_none() {
            return Err(missing(format!(
                "has no {list} place: only trainable tensors are stepped"
            )));
        }
    }
    let master = layout
        .location(spec.tensor, ListKind::Master)
        .expect("checked above");
    let len = usize::try_from(master.elements)
        .map_err(|_| missing("more elements than this machine addresses".into()))?;
    let grad_list = spec.grad.list();
    let grad_loc = layout
        .location(spec.tensor, grad_list)
        .ok_or_else(|| missing(format!("has no {grad_list} place for its gradient")))?;
    let m_loc = layout
        .location(spec.tensor, ListKind::Momentum)
        .expect("checked above");
    if grad_loc.dtype == DType::Q8 {
        return Err(missing("its gradient place holds 8-bit codes".into()));
    }
    let p16 = layout.location(spec.tensor, ListKind::Params);
    let out_dtype = match spec.grad {
        GradPlace::InParam16 => {
            if grad_loc.dtype == DType::F32 {
                return Err(missing(
                    "a gradient in place of the 16-bit parameters must be 16-bit".into(),
                ));
            }
            Some(grad_loc.dtype)
        }
        GradPlace::InGrads {
            write_param16: true,
        } => match p16 {
            Some(l) if l.dtype != DType::F32 => Some(l.dtype),
            _ => return Err(missing("has no 16-bit param16 place to write".into())),
        },
        GradPlace::InGrads { .. } => None,
    };
    let moment_bytes = usize::try_from(m_loc.bytes())
        .map_err(|_| missing("more moment bytes than this machine addresses".into()))?;
    Ok(Entry {
        spec,
        name,
        len,
        group: grad_loc.chunk,
        grad_dtype: grad_loc.dtype,
        out_dtype,
        moments: m_loc.dtype,
        moment_bytes,
        grad_final: false,
        stepped: false,
        due: false,
        place: StepPlace::Host,
    })
}

/// The lists `id` has a place in, each with the dense index of its place's chunk.
pub fn tensor_chunks(
    layout: &Layout,
    id: TensorId,
) -> impl Iterator<Item = (ListKind, usize)> + '_ {
    ListKind::ALL
        .into_iter()
        .filter_map(move |l| layout.location(id, l).map(|loc| (l, loc.chunk.dense())))
}

/// `tensors` (in layout order) in runs whose places share chunks in any list: a
/// tensor joins the run before it when one of its chunks is one of the run's. Tensors
/// are laid out in the same order in every list, so tensors sharing a chunk are in one
/// run.
pub fn sharing_runs(layout: &Layout, tensors: &[TensorId]) -> Vec<Vec<TensorId>> {
    let mut runs: Vec<(Vec<TensorId>, Vec<usize>)> = Vec::new();
    for &id in tensors {
        let mine: Vec<usize> = tensor_chunks(layout, id).map(|(_, d)| d).collect();
        match runs.last_mut() {
            Some((run, seen)) if mine.iter().any(|d| seen.contains(d)) => {
                run.push(id);
                seen.extend(mine);
            }
            _ => runs.push((vec![id], mine)),
        }
    }
    runs.into_iter().map(|(run, _)| run).collect()
}
