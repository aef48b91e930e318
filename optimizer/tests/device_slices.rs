//! Guards against a step over one tensor inside device chunks that differs from the
//! CPU kernel, touches bytes outside the tensor, or runs on views it should refuse:
//! `HybridAdamW::step_device_slices` over views at offsets inside simulated chunks
//! (in place — the bf16/f16 gradient read from, and the new parameters written to, the
//! same bytes — and with separate gradients) gives the bits of `AdamW::step_slice` on
//! copies, for odd lengths, odd offsets and lengths across several staging pieces, at
//! every SIMD level and with 1 and 2 threads; mixed host/CUDA views, short views,
//! misaligned views, overlapping CUDA views, F32 in place and an F32 output are typed
//! errors that change nothing; CUDA views without a GPU kernel get the reason there is
//! none. On a machine with a GPU the same tensors in CUDA memory give the CPU's bits
//! (skipped with the reason elsewhere).

mod common;

use common::Rng;
use tidestore_optimizer::half::{bf16, f16};
use tidestore_optimizer::simulated::IN_PLACE_PIECE_MIN;
use tidestore_optimizer::{
    AdamW, CpuConfig, DType, DeviceGrads, DeviceSlices, Grads, GroupPlacement, HybridAdamW,
    HyperParams, Mode, MomentForm, OptimError, ParamOut, Placement, StepState,
};
use tidestore_tiers::{
    CudaSpan, CudaSpanMut, Device, DeviceConfig, DeviceMem, DeviceView, DeviceViewMut,
};

// ---------------------------------------------------------------------------------------
// Helpers.

fn host(mem: &mut DeviceMem) -> &mut [u8] {
    match mem.view_mut() {
        DeviceViewMut::Host(b) => b,
        DeviceViewMut::Cuda(_) => unreachable!("simulated device"),
    }
}

fn host_ref(mem: &DeviceMem) -> &[u8] {
    match mem.view() {
        DeviceView::Host(b) => b,
        DeviceView::Cuda(_) => unreachable!("simulated device"),
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Bits of one random value of `dtype` (gradients: small, some exactly zero).
fn grad_bits(rng: &mut Rng, dtype: DType) -> Vec<u8> {
    let x = if rng.next_u64().is_multiple_of(17) {
        0.0
    } else {
        rng.unit() * 0.05
    };
    match dtype {
        DType::F32 => x.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::Q8 => unreachable!("q8 is a moment form, not a gradient dtype"),
    }
}

/// A chunk of `elems` random elements: parameters in [-1, 1), moments (`positive`: in
/// [0, 1e-3)), or gradients of `dtype`.
fn image(rng: &mut Rng, elems: usize, kind: Fill) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems * 4);
    for _ in 0..elems {
        match kind {
            Fill::Param => out.extend(rng.unit().to_le_bytes()),
            Fill::Moment => out.extend((rng.unit() * 1e-2).to_le_bytes()),
            Fill::Second => out.extend((rng.unit_pos() * 1e-3).to_le_bytes()),
            Fill::Grad(d) => out.extend(grad_bits(rng, d)),
        }
    }
    out
}

#[derive(Clone, Copy)]
enum Fill {
    Param,
    Moment,
    Second,
    Grad(DType),
}

/// First differing byte, named, instead of a megabyte diff.
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

const STATE: StepState = StepState {
    step: 7,
    grad_scale: 0.75,
};

/// Where the 16-bit parameters and gradients are.
#[derive(Debug, Clone, Copy)]
enum Case {
    /// Gradient of this dtype in the parameter chunk, new parameters over it.
    InPlace(DType),
    /// Gradient of `g` in its own chunk; output of `out` to the parameter chunk.
    Separate { g: DType, out: Option<DType> },
}

/// One tensor of `n` elements at element `off` of chunks of `chunk` elements, stepped
/// by `hybrid` on the simulated device; every chunk's bytes must equal the image with the
/// tensor's range replaced by what `AdamW::step_slice` gives on copies.
fn check_case(who: &str, hybrid: &HybridAdamW, case: Case, hp: &HyperParams, n: usize, off: usize) {
    let label = format!("{who} {case:?} n={n} off={off} {:?}", hp.mode);
    let chunk = off + n + 37;
    let mut rng = Rng::new((n * 31 + off) as u64 ^ 0x5eed);
    let dev = Device::sim(&DeviceConfig::new(1 << 28)).unwrap();

    let (p16_dtype, g_dtype) = match case {
        Case::InPlace(d) => (Some(d), d),
        Case::Separate { g, out } => (out, g),
    };
    let img_p = image(&mut rng, chunk, Fill::Param);
    let img_m = image(&mut rng, chunk, Fill::Moment);
    let img_v = image(&mut rng, chunk, Fill::Second);
    // The 16-bit chunk: gradients in place, else stale parameters to be overwritten.
    let img_16 = image(
        &mut rng,
        chunk,
        Fill::Grad(p16_dtype.unwrap_or(DType::BF16)),
    );
    let img_g = image(&mut rng, chunk, Fill::Grad(g_dtype));

    let mut mems = Vec::new();
    for (i, img) in [&img_p, &img_m, &img_v, &img_16, &img_g].iter().enumerate() {
        let mut mem = dev.alloc(i as u64, img.len()).unwrap();
        host(&mut mem).copy_from_slice(img);
        mems.push(mem);
    }

    // The reference: step_slice on copies.
    let (mut p, mut m, mut v) = (
        f32s(&img_p[off * 4..(off + n) * 4]),
        f32s(&img_m[off * 4..(off + n) * 4]),
        f32s(&img_v[off * 4..(off + n) * 4]),
    );
    let g_src = match case {
        Case::InPlace(_) => &img_16,
        Case::Separate { .. } => &img_g,
    };
    let gs = g_dtype.size_bytes() as usize;
    let g_copy = g_src[off * gs..(off + n) * gs].to_vec();
    let g_f32 = f32s(&g_copy);
    let g_16: Vec<u16> = u16s(&g_copy);
    let g_f16: Vec<f16> = g_16.iter().map(|b| f16::from_bits(*b)).collect();
    let g_bf16: Vec<bf16> = g_16.iter().map(|b| bf16::from_bits(*b)).collect();
    let grads = match g_dtype {
        DType::F32 => Grads::F32(&g_f32),
        DType::F16 => Grads::F16(&g_f16),
        DType::BF16 => Grads::Bf16(&g_bf16),
        DType::Q8 => unreachable!("q8 is a moment form, not a gradient dtype"),
    };
    let mut o_f16 = vec![f16::ZERO; n];
    let mut o_bf16 = vec![bf16::ZERO; n];
    let out = match p16_dtype {
        None => None,
        Some(DType::F16) => Some(ParamOut::F16(&mut o_f16)),
        Some(DType::BF16) => Some(ParamOut::Bf16(&mut o_bf16)),
        Some(DType::F32 | DType::Q8) => unreachable!("outputs are 16-bit"),
    };
    hybrid
        .cpu()
        .step_slice(STATE, hp, &mut p, &mut m, &mut v, grads, out)
        .unwrap();
    let ref_16: Option<Vec<u16>> = p16_dtype.map(|d| match d {
        DType::F16 => o_f16.iter().map(|x| x.to_bits()).collect(),
        _ => o_bf16.iter().map(|x| x.to_bits()).collect(),
    });

    // The step over views inside the chunks.
    let [mp, mm, mv, m16, mg] = &mut mems[..] else {
        unreachable!()
    };
    let done = {
        let grads = match case {
            Case::InPlace(d) => DeviceGrads::InPlace {
                bytes: DeviceViewMut::Host(&mut host(m16)[off * 2..(off + n) * 2]),
                dtype: d,
            },
            Case::Separate { g, out } => DeviceGrads::Separate {
                grads: DeviceView::Host(&host_ref(mg)[off * gs..(off + n) * gs]),
                dtype: g,
                out: out.map(|d| (DeviceViewMut::Host(&mut host(m16)[off * 2..]), d)),
            },
        };
        let s = DeviceSlices {
            len: n,
            master: DeviceViewMut::Host(&mut host(mp)[off * 4..(off + n) * 4]),
            moments: MomentForm::F32,
            // A longer view than needed: only the first `n` elements may change.
            m: DeviceViewMut::Host(&mut host(mm)[off * 4..]),
            v: DeviceViewMut::Host(&mut host(mv)[off * 4..(off + n) * 4]),
            grads,
        };
        hybrid
            .step_device_slices(STATE, hp, s)
            .unwrap_or_else(|e| panic!("{label}: {e}"))
    };
    assert_eq!(
        done,
        GroupPlacement {
            group: 0,
            placement: Placement::Gpu,
            simulated: true
        },
        "{label}"
    );

    let splice = |img: &[u8], at: usize, new: &[u8]| {
        let mut w = img.to_vec();
        w[at..at + new.len()].copy_from_slice(new);
        w
    };
    assert_bytes_eq(
        &format!("{label}: master"),
        host_ref(mp),
        &splice(&img_p, off * 4, &f32_bytes(&p)),
    );
    assert_bytes_eq(
        &format!("{label}: m"),
        host_ref(mm),
        &splice(&img_m, off * 4, &f32_bytes(&m)),
    );
    assert_bytes_eq(
        &format!("{label}: v"),
        host_ref(mv),
        &splice(&img_v, off * 4, &f32_bytes(&v)),
    );
    let want_16 = match &ref_16 {
        Some(bits) => splice(&img_16, off * 2, &u16_bytes(bits)),
        None => img_16.clone(),
    };
    assert_bytes_eq(&format!("{label}: 16-bit chunk"), host_ref(m16), &want_16);
    assert_bytes_eq(&format!("{label}: grads chunk"), host_ref(mg), &img_g);
    if n > 0 {
        assert!(
            p.iter().zip(f32s(&img_p[off * 4..])).any(|(a, b)| *a != b),
            "{label}: the step changed something"
        );
    }
}

fn hybrids(block_params: usize) -> Vec<(String, HybridAdamW)> {
    common::optimizers(block_params)
        .into_iter()
        .map(|(level, threads, opt)| {
            (
                format!("{level:?}/{threads}t"),
                HybridAdamW::cpu_only(opt, OptimError::NotCompiledWithCuda),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Bits on the simulated device.

#[test]
fn in_place_gives_the_bits_of_step_slice_on_a_copy() {
    // Lengths: empty, one, odd below a SIMD width, odd, and across 2 and 3 staging
    // pieces with an odd tail. Offsets: the chunk's start, and odd element offsets (f32
    // 12 bytes in, 16-bit 6 bytes in: neither 32- nor 64-byte aligned).
    let lens = [
        0,
        1,
        15,
        4_099,
        IN_PLACE_PIECE_MIN + 1,
        2 * IN_PLACE_PIECE_MIN + 4_099,
    ];
    for (name, hybrid) in hybrids(1024) {
        for dtype in [DType::BF16, DType::F16] {
            for hp in &hps() {
                for &n in &lens {
                    for off in [0, 3, 1_029] {
                        // The big lengths once per optimizer and dtype: they are slow in
                        // debug builds and add nothing at more offsets.
                        if n > IN_PLACE_PIECE_MIN && (off != 3 || hp.mode != Mode::AdamW) {
                            continue;
                        }
                        check_case(&name, &hybrid, Case::InPlace(dtype), hp, n, off);
                    }
                }
            }
        }
    }
}

#[test]
fn separate_grads_give_the_bits_of_step_slice() {
    let cases = [
        Case::Separate {
            g: DType::BF16,
            out: Some(DType::BF16),
        },
        Case::Separate {
            g: DType::F16,
            out: Some(DType::F16),
        },
        Case::Separate {
            g: DType::F32,
            out: Some(DType::BF16),
        },
        Case::Separate {
            g: DType::BF16,
            out: Some(DType::F16),
        },
        Case::Separate {
            g: DType::F16,
            out: None,
        },
    ];
    for (name, hybrid) in hybrids(1024) {
        for case in cases {
            for hp in &hps() {
                for n in [1, 15, 4_099, IN_PLACE_PIECE_MIN + 33] {
                    for off in [0, 5] {
                        check_case(&name, &hybrid, case, hp, n, off);
                    }
                }
            }
        }
    }
}

/// A thread pool wider than one staging piece's blocks: the piece grows so every thread
/// gets work, and the bits stay the same.
#[test]
fn in_place_with_a_large_pool_block_gives_the_same_bits() {
    let opt = AdamW::new(CpuConfig {
        threads: 2,
        block_params: IN_PLACE_PIECE_MIN,
        simd: None,
    })
    .unwrap();
    let hybrid = HybridAdamW::cpu_only(opt, OptimError::NotCompiledWithCuda);
    check_case(
        "2 threads, blocks of a piece",
        &hybrid,
        Case::InPlace(DType::BF16),
        &HyperParams::default(),
        3 * IN_PLACE_PIECE_MIN + 7,
        3,
    );
}

// ---------------------------------------------------------------------------------------
// Refusals.

/// Chunks of the simulated device for the refusal tests (bytes: `n` elements and some).
struct Sim {
    mems: Vec<DeviceMem>,
    before: Vec<Vec<u8>>,
}

impl Sim {
    fn new(n: usize) -> Self {
        let dev = Device::sim(&DeviceConfig::new(1 << 24)).unwrap();
        let mut rng = Rng::new(n as u64);
        let mut mems = Vec::new();
        let mut before = Vec::new();
        for (i, fill) in [
            Fill::Param,
            Fill::Moment,
            Fill::Second,
            Fill::Grad(DType::F32),
        ]
        .into_iter()
        .enumerate()
        {
            let img = image(&mut rng, n + 64, fill);
            let mut mem = dev.alloc(i as u64, img.len()).unwrap();
            host(&mut mem).copy_from_slice(&img);
            mems.push(mem);
            before.push(img);
        }
        Sim { mems, before }
    }

    fn unchanged(&self, what: &str) {
        for (mem, img) in self.mems.iter().zip(&self.before) {
            assert_bytes_eq(what, host_ref(mem), img);
        }
    }
}

fn hybrid1() -> HybridAdamW {
    HybridAdamW::new(
        AdamW::new(CpuConfig {
            threads: 1,
            ..CpuConfig::default()
        })
        .unwrap(),
        0,
    )
}

/// The error is [`OptimError::DeviceView`] naming `view`, its reason containing `says`.
fn refused(e: OptimError, view: &str, says: &str) {
    match e {
        OptimError::DeviceView { view: v, reason } if v == view && reason.contains(says) => {}
        other => panic!("expected DeviceView {{ {view}, \"..{says}..\" }}, got {other:?}"),
    }
}

#[test]
fn host_views_that_are_wrong_are_refused_and_change_nothing() {
    let n = 1_001;
    let hybrid = hybrid1();
    let hp = HyperParams::default();
    let mut sim = Sim::new(n);
    let step = |sim: &mut Sim, spec: DeviceSlicesSpec| {
        let [a, b, c, d] = &mut sim.mems[..] else {
            unreachable!()
        };
        let s = spec.build(n, host(a), host(b), host(c), host(d));
        hybrid.step_device_slices(STATE, &hp, s)
    };

    // Short views: each named, with how many elements it has.
    for (which, name) in [(0, "master"), (1, "m"), (2, "v"), (3, "bytes")] {
        let r = step(
            &mut sim,
            DeviceSlicesSpec {
                short: Some(which),
                ..DeviceSlicesSpec::default()
            },
        );
        assert_eq!(
            r,
            Err(OptimError::LengthMismatch {
                slice: name,
                len: n - 1,
                reference: "len",
                expected: n
            })
        );
    }
    // Separate: short gradients (f32: half as many as the 2n bytes hold) and output.
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            separate: Some((DType::F32, Some(DType::BF16))),
            short: Some(3),
            ..DeviceSlicesSpec::default()
        },
    );
    assert_eq!(
        r,
        Err(OptimError::LengthMismatch {
            slice: "grads",
            len: (2 * n - 2) / 4,
            reference: "len",
            expected: n
        })
    );
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            separate: Some((DType::BF16, Some(DType::BF16))),
            short: Some(4),
            ..DeviceSlicesSpec::default()
        },
    );
    assert!(
        matches!(r, Err(OptimError::LengthMismatch { slice: "out", .. })),
        "{r:?}"
    );

    // Misaligned: f32 two bytes in, 16-bit one byte in.
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            shift_bytes: Some((1, 2)),
            ..DeviceSlicesSpec::default()
        },
    );
    refused(r.unwrap_err(), "m", "starts 2 bytes");
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            shift_bytes: Some((3, 1)),
            ..DeviceSlicesSpec::default()
        },
    );
    refused(r.unwrap_err(), "bytes", "starts 1 bytes");

    // F32 in place; F32 output.
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            in_place_dtype: DType::F32,
            ..DeviceSlicesSpec::default()
        },
    );
    refused(r.unwrap_err(), "bytes", "F32 in place");
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            separate: Some((DType::BF16, Some(DType::F32))),
            ..DeviceSlicesSpec::default()
        },
    );
    refused(r.unwrap_err(), "out", "is F32");

    // Mixed: a CUDA view among host views (caught before anything is touched, even where
    // a GPU exists: the pointer is never used).
    let r = step(
        &mut sim,
        DeviceSlicesSpec {
            cuda_v: true,
            ..DeviceSlicesSpec::default()
        },
    );
    refused(r.unwrap_err(), "v", "is CUDA memory");

    sim.unchanged("after refused steps");

    // And a good call on the same chunks does step (so the refusals were not vacuous).
    let r = step(&mut sim, DeviceSlicesSpec::default());
    assert!(r.unwrap().simulated);
    assert_ne!(host_ref(&sim.mems[0])[..4 * n], sim.before[0][..4 * n]);
}

/// How the refusal test builds its slices over the four chunks (master, m, v, 16-bit).
#[derive(Clone, Copy)]
struct DeviceSlicesSpec {
    /// Which view (0 master, 1 m, 2 v, 3 bytes/grads, 4 out) is one element short.
    short: Option<usize>,
    /// Which view starts this many bytes late.
    shift_bytes: Option<(usize, usize)>,
    in_place_dtype: DType,
    /// Separate gradients (dtype, output dtype) instead of in place: the gradient in the
    /// 16-bit chunk's first half, the output in its second.
    separate: Option<(DType, Option<DType>)>,
    /// `v` as a (made-up) CUDA pointer.
    cuda_v: bool,
}

impl Default for DeviceSlicesSpec {
    fn default() -> Self {
        DeviceSlicesSpec {
            short: None,
            shift_bytes: None,
            in_place_dtype: DType::BF16,
            separate: None,
            cuda_v: false,
        }
    }
}

impl DeviceSlicesSpec {
    fn build<'a>(
        &self,
        n: usize,
        p: &'a mut [u8],
        m: &'a mut [u8],
        v: &'a mut [u8],
        b16: &'a mut [u8],
    ) -> DeviceSlices<'a> {
        let cut = |i: usize, buf: &'a mut [u8], elem: usize| -> &'a mut [u8] {
            let at = match self.shift_bytes {
                Some((j, s)) if j == i => s,
                _ => 0,
            };
            let len = if self.short == Some(i) {
                (n - 1) * elem
            } else {
                n * elem
            };
            &mut buf[at..at + len]
        };
        let master = DeviceViewMut::Host(cut(0, p, 4));
        let m = DeviceViewMut::Host(cut(1, m, 4));
        let v = if self.cuda_v {
            fake(0, 0, 4 * n)
        } else {
            DeviceViewMut::Host(cut(2, v, 4))
        };
        let grads = match self.separate {
            None => DeviceGrads::InPlace {
                bytes: DeviceViewMut::Host(cut(3, b16, 2)),
                dtype: self.in_place_dtype,
            },
            Some((g, out)) => {
                let (gb, ob) = b16.split_at_mut(2 * n + 32);
                DeviceGrads::Separate {
                    grads: DeviceView::Host(cut(3, gb, 2)),
                    dtype: g,
                    out: out.map(|d| (DeviceViewMut::Host(cut(4, ob, 2)), d)),
                }
            }
        };
        DeviceSlices {
            len: n,
            master,
            moments: MomentForm::F32,
            m,
            v,
            grads,
        }
    }
}

/// Made-up CUDA spans, 1 MiB apart, 256-aligned: never launched on, since each call
/// below is refused by a check that runs before the GPU is touched.
fn fake(i: u64, off: u64, len_bytes: usize) -> DeviceViewMut<'static> {
    // SAFETY: test-only and never dereferenced: every step given these spans is refused
    // by the view checks (or for want of a GPU kernel) before any launch.
    DeviceViewMut::Cuda(unsafe { CudaSpanMut::from_raw((1 << 40) + (i << 20) + off, len_bytes) })
}

fn fake_slices(n: usize, f: impl Fn(usize) -> (u64, u64, usize)) -> DeviceSlices<'static> {
    let mk = |i: usize| {
        let (base, off, len) = f(i);
        fake(base, off, len)
    };
    DeviceSlices {
        len: n,
        master: mk(0),
        moments: MomentForm::F32,
        m: mk(1),
        v: mk(2),
        grads: DeviceGrads::InPlace {
            bytes: mk(3),
            dtype: DType::BF16,
        },
    }
}

#[test]
fn cuda_views_that_are_wrong_are_refused_before_any_launch() {
    let n = 4_097;
    let hybrid = hybrid1();
    let hp = HyperParams::default();
    let elem = |i: usize| if i == 3 { 2 } else { 4 };
    let ok = |i: usize| (i as u64, 0, n * elem(i));

    // Short.
    let s = fake_slices(n, |i| if i == 2 { (2, 0, 4 * n - 1) } else { ok(i) });
    assert_eq!(
        hybrid.step_device_slices(STATE, &hp, s),
        Err(OptimError::LengthMismatch {
            slice: "v",
            len: n - 1,
            reference: "len",
            expected: n
        })
    );
    // Misaligned.
    let s = fake_slices(n, |i| if i == 0 { (0, 6, 4 * n) } else { ok(i) });
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "master",
        "starts 2 bytes",
    );
    // Overlapping: m starts 4 elements before the end of master.
    let s = fake_slices(n, |i| {
        if i == 1 {
            (0, 4 * (n as u64 - 4), 4 * n)
        } else {
            ok(i)
        }
    });
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "m",
        "by 16 bytes",
    );
    // Overlapping: the in-place bytes inside v.
    let s = fake_slices(n, |i| if i == 3 { (2, 100, 2 * n) } else { ok(i) });
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "bytes",
        &format!("by {} bytes", 2 * n),
    );
    // Separate gradients and output may not share bytes (only in place may).
    let s = DeviceSlices {
        len: n,
        master: fake(0, 0, 4 * n),
        moments: MomentForm::F32,
        m: fake(1, 0, 4 * n),
        v: fake(2, 0, 4 * n),
        grads: DeviceGrads::Separate {
            // SAFETY: as `fake`: refused before any launch.
            grads: DeviceView::Cuda(unsafe { CudaSpan::from_raw((1 << 40) + (3 << 20), 2 * n) }),
            dtype: DType::BF16,
            out: Some((fake(3, 0, 2 * n), DType::BF16)),
        },
    };
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "out",
        &format!("by {} bytes", 2 * n),
    );
    // F32 in place.
    let mut s = fake_slices(n, ok);
    s.grads = DeviceGrads::InPlace {
        bytes: fake(3, 0, 4 * n),
        dtype: DType::F32,
    };
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "bytes",
        "F32 in place",
    );
    // Mixed: a host view among CUDA views.
    let mut host_m = vec![0u8; 4 * n];
    let mut s = fake_slices(n, ok);
    s.m = DeviceViewMut::Host(&mut host_m);
    refused(
        hybrid.step_device_slices(STATE, &hp, s).unwrap_err(),
        "m",
        "is host (simulated) memory",
    );
    assert!(host_m.iter().all(|b| *b == 0));

    // Views that pass every check: without a GPU kernel, the reason there is none. With
    // one, these made-up pointers must not reach it.
    match hybrid.gpu_status() {
        Err(why) => {
            if !cfg!(feature = "cuda") {
                assert_eq!(why, OptimError::NotCompiledWithCuda);
            }
            let s = fake_slices(n, ok);
            assert_eq!(hybrid.step_device_slices(STATE, &hp, s), Err(why));
        }
        Ok(()) => println!(
            "skipped (this part only): a GPU kernel is ready, made-up pointers must not reach it"
        ),
    }
}

// ---------------------------------------------------------------------------------------
// A real GPU.

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::common::gpu::{cuda_or_skip, download, upload};

    /// The view of `mem`'s bytes `[at, at + len)`, a tensor inside its chunk.
    fn view(mem: &mut DeviceMem, at: usize, len: usize, is_gpu: bool) -> DeviceViewMut<'_> {
        match mem.view_mut() {
            DeviceViewMut::Cuda(span) => {
                assert!(is_gpu);
                DeviceViewMut::Cuda(
                    span.get(at..at + len)
                        .expect("the tensor lies in its chunk"),
                )
            }
            DeviceViewMut::Host(b) => {
                assert!(!is_gpu);
                DeviceViewMut::Host(&mut b[at..at + len])
            }
        }
    }

    #[test]
    fn cuda_slices_give_the_cpu_bits() {
        let hybrid = hybrid1();
        let Some(mut dev) = cuda_or_skip(&hybrid) else {
            return;
        };
        let (n, off) = (300_007, 3);
        let chunk = off + n + 37;
        for case in [
            Case::InPlace(DType::BF16),
            Case::InPlace(DType::F16),
            Case::Separate {
                g: DType::F32,
                out: Some(DType::BF16),
            },
        ] {
            for hp in &hps() {
                let label = format!("{case:?} {:?}", hp.mode);
                let mut rng = Rng::new(99);
                let g_dtype = match case {
                    Case::InPlace(d) => d,
                    Case::Separate { g, .. } => g,
                };
                let img_p = image(&mut rng, chunk, Fill::Param);
                let img_m = image(&mut rng, chunk, Fill::Moment);
                let img_v = image(&mut rng, chunk, Fill::Second);
                let img_16 = image(&mut rng, chunk, Fill::Grad(DType::BF16));
                let img_g = image(&mut rng, chunk, Fill::Grad(g_dtype));
                let imgs = [&img_p, &img_m, &img_v, &img_16, &img_g];

                // The CPU's bits: the same call on the simulated device.
                let sim = Device::sim(&DeviceConfig::new(1 << 28)).unwrap();
                let mut cpu_mems: Vec<DeviceMem> = imgs
                    .iter()
                    .enumerate()
                    .map(|(i, img)| {
                        let mut mem = sim.alloc(i as u64, img.len()).unwrap();
                        host(&mut mem).copy_from_slice(img);
                        mem
                    })
                    .collect();
                let mut gpu_mems: Vec<DeviceMem> = imgs
                    .iter()
                    .enumerate()
                    .map(|(i, img)| upload(&mut dev, i as u64, img))
                    .collect();

                for (mems, is_gpu) in [(&mut cpu_mems, false), (&mut gpu_mems, true)] {
                    let [mp, mm, mv, m16, mg] = &mut mems[..] else {
                        unreachable!()
                    };
                    let gs = g_dtype.size_bytes() as usize;
                    let grads = match case {
                        Case::InPlace(d) => DeviceGrads::InPlace {
                            bytes: view(m16, off * 2, n * 2, is_gpu),
                            dtype: d,
                        },
                        Case::Separate { g, out } => {
                            let gview = match view(mg, off * gs, n * gs, is_gpu) {
                                DeviceViewMut::Host(b) => DeviceView::Host(b),
                                DeviceViewMut::Cuda(span) => DeviceView::Cuda(span.into_span()),
                            };
                            DeviceGrads::Separate {
                                grads: gview,
                                dtype: g,
                                out: out.map(|d| (view(m16, off * 2, n * 2, is_gpu), d)),
                            }
                        }
                    };
                    let s = DeviceSlices {
                        len: n,
                        master: view(mp, off * 4, n * 4, is_gpu),
                        moments: MomentForm::F32,
                        m: view(mm, off * 4, n * 4, is_gpu),
                        v: view(mv, off * 4, n * 4, is_gpu),
                        grads,
                    };
                    let done = hybrid
                        .step_device_slices(STATE, hp, s)
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(done.simulated, !is_gpu, "{label}");
                }
                for (i, (cpu_mem, gpu_mem)) in cpu_mems.iter().zip(gpu_mems).enumerate() {
                    let (_, got) = download(&mut dev, gpu_mem);
                    assert_bytes_eq(
                        &format!("{label}: chunk {i} GPU vs CPU"),
                        &got,
                        host_ref(cpu_mem),
                    );
                }
            }
        }
    }
}
