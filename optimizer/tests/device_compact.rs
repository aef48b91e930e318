//! Guards against compact moments (bf16, int8) stepped on the device differently from
//! the host: `HybridAdamW::step_device_slices` over a tensor inside simulated device
//! chunks, its M and V stored as bf16 or as int8 codes + absmax (the layout's places),
//! must give the bits of `AdamW::step_moments` on copies and leave every byte outside
//! the tensor as it was, with separate gradients and in place, over several staging
//! pieces; an int8 view too short for its absmax is refused naming it. On a machine with
//! a GPU the same tensors in CUDA memory are stepped by the compact kernels and must give
//! those same bits (skipped with the reason elsewhere).

mod common;

use common::Rng;
use tidestore_optimizer::half::bf16;
use tidestore_optimizer::quant::{absmax_len, maps, quantize};
use tidestore_optimizer::{
    AdamW, CpuConfig, DType, DeviceGrads, DeviceSlices, Grads, HybridAdamW, HyperParams, Mode,
    MomentForm, Moments, OptimError, ParamOut, Q8Mut, StepState,
};
use tidestore_tiers::{Device, DeviceConfig, DeviceMem, DeviceView, DeviceViewMut};

const STATE: StepState = StepState {
    step: 5,
    grad_scale: 0.5,
};

/// Elements of the tensor (odd, over two 128 Ki staging pieces) and its offset in its
/// chunks (elements; a multiple of 4 so the int8 place starts 4-aligned).
const N: usize = 300_007;
const OFF: usize = 12;
/// Chunk elements: the tensor plus room on both sides.
const CHUNK: usize = OFF + N + 41;

fn hps() -> [HyperParams; 2] {
    [
        HyperParams::default(),
        HyperParams {
            lr: 3e-3,
            weight_decay: 0.1,
            mode: Mode::AdamL2,
            ..HyperParams::default()
        },
    ]
}

#[derive(Debug, Clone, Copy)]
enum Case {
    InPlace,
    Separate,
}

/// The bytes of `n` moments `x` stored as `form` (the layout's places: int8 is the codes,
/// padding to 4 bytes, then the absmax).
fn stored(form: MomentForm, x: &[f32], signed: bool) -> Vec<u8> {
    match form {
        MomentForm::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        MomentForm::BF16 => x
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        MomentForm::Int8 => {
            let q = maps();
            let map = if signed { &q.signed } else { &q.unsigned };
            let mut codes = vec![0u8; x.len()];
            let mut absmax = vec![0f32; absmax_len(x.len())];
            quantize(map, x, &mut codes, &mut absmax);
            codes.resize(x.len().next_multiple_of(4), 0);
            codes.extend(absmax.iter().flat_map(|a| a.to_le_bytes()));
            codes
        }
    }
}

/// The chunk images: master, M, V, 16-bit parameters (or in-place gradients), separate
/// f32 gradients; the tensor's moments at byte `OFF * 4` of their chunks.
struct Images {
    p: Vec<u8>,
    m: Vec<u8>,
    v: Vec<u8>,
    p16: Vec<u8>,
    g: Vec<u8>,
    /// Bytes of one moment view of the tensor.
    moment_bytes: usize,
}

impl Images {
    fn new(form: MomentForm, seed: u64) -> Images {
        let mut rng = Rng::new(seed);
        let f32s = |rng: &mut Rng, n: usize, f: &dyn Fn(&mut Rng) -> f32| -> Vec<u8> {
            (0..n).flat_map(|_| f(rng).to_le_bytes()).collect()
        };
        let p = f32s(&mut rng, CHUNK, &|r| r.unit());
        let g = f32s(&mut rng, CHUNK, &|r| r.unit() * 0.05);
        let p16: Vec<u8> = (0..CHUNK)
            .flat_map(|_| bf16::from_f32(rng.unit() * 0.05).to_bits().to_le_bytes())
            .collect();
        let m: Vec<f32> = (0..N).map(|_| rng.unit() * 1e-2).collect();
        let v: Vec<f32> = (0..N).map(|_| rng.unit_pos() * 1e-3).collect();
        let (m, v) = (stored(form, &m, true), stored(form, &v, false));
        let moment_bytes = m.len();
        let pad = |body: Vec<u8>, rng: &mut Rng| {
            let mut c: Vec<u8> = (0..OFF * 4).map(|_| rng.next_u64() as u8).collect();
            c.extend(body);
            c.extend((0..164).map(|_| rng.next_u64() as u8));
            c
        };
        Images {
            m: pad(m, &mut rng),
            v: pad(v, &mut rng),
            p,
            p16,
            g,
            moment_bytes,
        }
    }

    /// What a correct step leaves: the CPU kernel over copies of the tensor's ranges.
    fn expected(&self, form: MomentForm, case: Case, hp: &HyperParams) -> Images {
        let mut e = Images {
            p: self.p.clone(),
            m: self.m.clone(),
            v: self.v.clone(),
            p16: self.p16.clone(),
            g: self.g.clone(),
            moment_bytes: self.moment_bytes,
        };
        let mut master: Vec<f32> = floats(&e.p[OFF * 4..(OFF + N) * 4]);
        let mb = OFF * 4..OFF * 4 + self.moment_bytes;
        let (mut mbytes, mut vbytes) = (e.m[mb.clone()].to_vec(), e.v[mb.clone()].to_vec());
        let grads_f32 = floats(&e.g[OFF * 4..(OFF + N) * 4]);
        let grads16: Vec<bf16> = e.p16[OFF * 2..(OFF + N) * 2]
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let mut out = vec![bf16::ZERO; N];
        let opt = AdamW::new(CpuConfig {
            threads: 1,
            ..CpuConfig::default()
        })
        .unwrap();
        let grads = match case {
            Case::InPlace => Grads::Bf16(&grads16),
            Case::Separate => Grads::F32(&grads_f32),
        };
        let mut mf = floats(&mbytes);
        let mut vf = floats(&vbytes);
        let mut m16 = halves(&mbytes);
        let mut v16 = halves(&vbytes);
        let moments = match form {
            MomentForm::F32 => Moments::F32 {
                m: &mut mf,
                v: &mut vf,
            },
            MomentForm::BF16 => Moments::Bf16 {
                m: &mut m16,
                v: &mut v16,
            },
            MomentForm::Int8 => {
                let (mc, ma) = mbytes.split_at_mut(N.next_multiple_of(4));
                let (vc, va) = vbytes.split_at_mut(N.next_multiple_of(4));
                let (ma, va) = (floats(ma), floats(va));
                let (mut ma, mut va) = (ma, va);
                opt.step_moments(
                    STATE,
                    hp,
                    &mut master,
                    Moments::Int8 {
                        m: Q8Mut {
                            codes: &mut mc[..N],
                            absmax: &mut ma,
                        },
                        v: Q8Mut {
                            codes: &mut vc[..N],
                            absmax: &mut va,
                        },
                    },
                    grads,
                    Some(ParamOut::Bf16(&mut out)),
                )
                .unwrap();
                let at = N.next_multiple_of(4);
                mbytes[at..].copy_from_slice(&bytes_of(&ma));
                vbytes[at..].copy_from_slice(&bytes_of(&va));
                e.finish(&master, &mbytes, &vbytes, &out);
                return e;
            }
        };
        opt.step_moments(
            STATE,
            hp,
            &mut master,
            moments,
            grads,
            Some(ParamOut::Bf16(&mut out)),
        )
        .unwrap();
        match form {
            MomentForm::F32 => {
                mbytes = bytes_of(&mf);
                vbytes = bytes_of(&vf);
            }
            MomentForm::BF16 => {
                mbytes = m16.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
                vbytes = v16.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            }
            MomentForm::Int8 => unreachable!("returned above"),
        }
        e.finish(&master, &mbytes, &vbytes, &out);
        e
    }

    fn finish(&mut self, master: &[f32], m: &[u8], v: &[u8], out: &[bf16]) {
        self.p[OFF * 4..(OFF + N) * 4].copy_from_slice(&bytes_of(master));
        let mb = OFF * 4..OFF * 4 + self.moment_bytes;
        self.m[mb.clone()].copy_from_slice(m);
        self.v[mb].copy_from_slice(v);
        let o: Vec<u8> = out.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        self.p16[OFF * 2..(OFF + N) * 2].copy_from_slice(&o);
    }

    fn all(&self) -> [&Vec<u8>; 5] {
        [&self.p, &self.m, &self.v, &self.p16, &self.g]
    }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn halves(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

fn bytes_of(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} of {} (got {:#04x}, want {:#04x})",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// The tensor's views inside the five chunks (`master`, `m`, `v`, 16-bit, gradient).
fn slices<'a>(
    form: MomentForm,
    case: Case,
    mems: &'a mut [DeviceMem],
    moment_bytes: usize,
) -> DeviceSlices<'a> {
    let [mp, mm, mv, m16, mg] = mems else {
        unreachable!("five chunks")
    };
    let cut = |mem: &'a mut DeviceMem, at: usize, len: usize| match mem.view_mut() {
        DeviceViewMut::Host(b) => DeviceViewMut::Host(&mut b[at..at + len]),
        DeviceViewMut::Cuda(span) => DeviceViewMut::Cuda(
            span.get(at..at + len)
                .expect("the tensor lies in its chunk"),
        ),
    };
    let p16 = cut(m16, OFF * 2, N * 2);
    let grads = match case {
        Case::InPlace => DeviceGrads::InPlace {
            bytes: p16,
            dtype: DType::BF16,
        },
        Case::Separate => DeviceGrads::Separate {
            grads: match cut(mg, OFF * 4, N * 4) {
                DeviceViewMut::Host(b) => DeviceView::Host(b),
                DeviceViewMut::Cuda(s) => DeviceView::Cuda(s.into_span()),
            },
            dtype: DType::F32,
            out: Some((p16, DType::BF16)),
        },
    };
    DeviceSlices {
        len: N,
        master: cut(mp, OFF * 4, N * 4),
        moments: form,
        m: cut(mm, OFF * 4, moment_bytes),
        v: cut(mv, OFF * 4, moment_bytes),
        grads,
    }
}

fn hybrid() -> HybridAdamW {
    HybridAdamW::new(
        AdamW::new(CpuConfig {
            threads: 2,
            block_params: 4096,
            ..CpuConfig::default()
        })
        .unwrap(),
        0,
    )
}

#[test]
fn simulated_device_steps_compact_moments_with_the_cpu_bits() {
    let hybrid = hybrid();
    let sim = Device::sim(&DeviceConfig::new(1 << 28)).unwrap();
    for form in MomentForm::ALL {
        for case in [Case::InPlace, Case::Separate] {
            for hp in &hps() {
                let label = format!("{form} {case:?} {:?}", hp.mode);
                let img = Images::new(form, 17);
                let want = img.expected(form, case, hp);
                let mut mems: Vec<DeviceMem> = img
                    .all()
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let mut mem = sim.alloc(i as u64, b.len()).unwrap();
                        match mem.view_mut() {
                            DeviceViewMut::Host(h) => h.copy_from_slice(b),
                            DeviceViewMut::Cuda(_) => unreachable!("simulated"),
                        }
                        mem
                    })
                    .collect();
                let s = slices(form, case, &mut mems, img.moment_bytes);
                let done = hybrid.step_device_slices(STATE, hp, s).unwrap();
                assert!(done.simulated, "{label}");
                for (k, (mem, w)) in mems.iter().zip(want.all()).enumerate() {
                    match mem.view() {
                        DeviceView::Host(b) => assert_bytes_eq(&format!("{label} chunk {k}"), b, w),
                        DeviceView::Cuda(_) => unreachable!("simulated"),
                    }
                }
            }
        }
    }
}

#[test]
fn int8_view_without_room_for_its_absmax_is_refused() {
    let hybrid = hybrid();
    let sim = Device::sim(&DeviceConfig::new(1 << 28)).unwrap();
    let img = Images::new(MomentForm::Int8, 3);
    let mut mems: Vec<DeviceMem> = img
        .all()
        .iter()
        .enumerate()
        .map(|(i, b)| sim.alloc(i as u64, b.len()).unwrap())
        .collect();
    // Codes only: the absmax would lie past the view.
    let s = slices(MomentForm::Int8, Case::Separate, &mut mems, N);
    match hybrid.step_device_slices(STATE, &HyperParams::default(), s) {
        Err(OptimError::DeviceView { view, reason }) => {
            assert_eq!(view, "m");
            assert!(reason.contains("int8 moments"), "{reason}");
        }
        other => panic!("expected a refusal naming m, got {other:?}"),
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::common::gpu::{cuda_or_skip, download, upload};

    /// The compact GPU kernels against the CPU kernel, bit for bit, every byte of the
    /// chunks compared (nothing outside the tensor touched).
    #[test]
    fn cuda_compact_moments_give_the_cpu_bits() {
        let hybrid = hybrid();
        let Some(mut dev) = cuda_or_skip(&hybrid) else {
            return;
        };
        for form in [MomentForm::BF16, MomentForm::Int8] {
            for case in [Case::InPlace, Case::Separate] {
                for hp in &hps() {
                    let label = format!("GPU {form} {case:?} {:?}", hp.mode);
                    let img = Images::new(form, 29);
                    let want = img.expected(form, case, hp);
                    let mut mems: Vec<DeviceMem> = img
                        .all()
                        .iter()
                        .enumerate()
                        .map(|(i, b)| upload(&mut dev, i as u64, b))
                        .collect();
                    let s = slices(form, case, &mut mems, img.moment_bytes);
                    let done = hybrid
                        .step_device_slices(STATE, hp, s)
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert!(!done.simulated, "{label}");
                    for (k, (mem, w)) in mems.into_iter().zip(want.all()).enumerate() {
                        let (_, got) = download(&mut dev, mem);
                        assert_bytes_eq(&format!("{label} chunk {k}"), &got, w);
                    }
                }
            }
        }
    }
}
