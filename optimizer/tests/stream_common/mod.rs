//! Shared helpers of the streaming-step tests: groups, swap files (in memory with faults,
//! or on disk), deterministic gradients, and an uninterrupted in-memory reference run.

#![allow(dead_code)]

use std::path::Path;

use tidestore_io::{Compression, Engine, FaultConfig, IoConfig, MemoryBackend, SwapFile};
use tidestore_optimizer::half::{bf16, f16};
use tidestore_optimizer::stream::{GroupSpec, MasterPlace, StreamConfig, StreamingOptimizer};
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HyperParams, LossScalerConfig, Mode, ParamGroup, ParamOut,
    StepController, StepDecision,
};

/// Group sizes: uneven, not multiples of 16 or 1024, so tails and padding are exercised.
pub const LENS: [usize; 7] = [40_000, 65_536, 12_345, 70_001, 3, 50_000, 33_333];

pub fn groups() -> Vec<GroupSpec> {
    LENS.iter()
        .enumerate()
        .map(|(i, &len)| GroupSpec {
            len,
            hp: HyperParams {
                lr: 1e-3 * (1.0 + i as f32 * 0.1),
                weight_decay: if i % 2 == 0 { 0.01 } else { 0.0 },
                mode: if i == 3 { Mode::AdamL2 } else { Mode::AdamW },
                ..HyperParams::default()
            },
        })
        .collect()
}

pub fn cpu() -> AdamW {
    AdamW::new(CpuConfig {
        threads: 2,
        ..CpuConfig::default()
    })
    .unwrap()
}

pub fn controller() -> StepController {
    StepController::new(
        Some(1.0),
        Some(LossScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            ..LossScalerConfig::default()
        }),
    )
    .unwrap()
}

pub fn cfg(master: MasterPlace, budget: u64) -> StreamConfig {
    StreamConfig {
        host_budget_bytes: budget,
        master,
        read_ahead_max: 0,
        poll_params: 10_000,
    }
}

/// A swap file over the in-memory backend with `faults`.
pub fn mem_swap(master: MasterPlace, faults: FaultConfig) -> SwapFile {
    let (slot_bytes, slots) = StreamingOptimizer::swap_shape(&groups(), master);
    let cap = SwapFile::file_bytes_for(slot_bytes, u64::from(slots)).unwrap();
    let engine = Engine::new(
        Box::new(MemoryBackend::new(cap, 16, faults)),
        64 << 10,
        true,
    )
    .unwrap();
    SwapFile::with_engine(engine, slot_bytes, slots, Compression::Off).unwrap()
}

/// A swap file on disk in `dir`.
pub fn file_swap(dir: &Path, master: MasterPlace) -> SwapFile {
    let (slot_bytes, slots) = StreamingOptimizer::swap_shape(&groups(), master);
    SwapFile::create(
        &dir.join("opt.swap"),
        slot_bytes,
        slots,
        &IoConfig::default(),
        Compression::Off,
    )
    .unwrap()
}

pub fn init_master(group: usize, p: &mut [f32]) {
    for (j, x) in p.iter_mut().enumerate() {
        *x = hash_unit(0xA5A5, group as u64, j as u64) * 0.5;
    }
}

fn hash_unit(a: u64, b: u64, c: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ c;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^= x >> 33;
    ((x >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

/// Gradients of one group at one iteration, in the dtype the group uses.
pub enum GradBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl GradBuf {
    pub fn as_grads(&self) -> Grads<'_> {
        match self {
            GradBuf::F32(g) => Grads::F32(g),
            GradBuf::F16(g) => Grads::F16(g),
            GradBuf::Bf16(g) => Grads::Bf16(g),
        }
    }
}

/// Gradients of `group` at iteration `it` (loss-scaled by `scale`); group 0 gets an inf
/// at iteration `overflow_at` to exercise the skip.
pub fn grads(it: u64, group: usize, len: usize, scale: f32, overflow_at: Option<u64>) -> GradBuf {
    let vals = (0..len).map(|j| hash_unit(it, group as u64, j as u64) * 0.1 * scale);
    let mut g = match group % 3 {
        0 => GradBuf::F32(vals.collect()),
        1 => GradBuf::F16(vals.map(f16::from_f32).collect()),
        _ => GradBuf::Bf16(vals.map(bf16::from_f32).collect()),
    };
    if overflow_at == Some(it) && group == 0 {
        if let GradBuf::F32(v) = &mut g {
            v[len / 2] = f32::INFINITY;
        }
    }
    g
}

pub fn all_grads(it: u64, scale: f32, overflow_at: Option<u64>) -> Vec<GradBuf> {
    LENS.iter()
        .enumerate()
        .map(|(i, &len)| grads(it, i, len, scale, overflow_at))
        .collect()
}

/// 16-bit parameter outputs: bf16 for even groups, f16 for odd ones.
pub struct Outs {
    pub bf: Vec<Vec<bf16>>,
    pub hf: Vec<Vec<f16>>,
}

impl Outs {
    pub fn new() -> Self {
        Outs {
            bf: LENS.iter().map(|&l| vec![bf16::ZERO; l]).collect(),
            hf: LENS.iter().map(|&l| vec![f16::ZERO; l]).collect(),
        }
    }

    pub fn views(&mut self) -> Vec<ParamOut<'_>> {
        self.bf
            .iter_mut()
            .zip(self.hf.iter_mut())
            .enumerate()
            .map(|(i, (b, h))| {
                if i % 2 == 0 {
                    ParamOut::Bf16(b)
                } else {
                    ParamOut::F16(h)
                }
            })
            .collect()
    }

    /// The bits of the output each group writes.
    pub fn bits(&self) -> Vec<Vec<u16>> {
        (0..LENS.len())
            .map(|i| {
                if i % 2 == 0 {
                    self.bf[i].iter().map(|x| x.to_bits()).collect()
                } else {
                    self.hf[i].iter().map(|x| x.to_bits()).collect()
                }
            })
            .collect()
    }
}

/// The uninterrupted run, fully in memory.
pub struct Reference {
    pub cpu: AdamW,
    pub ctrl: StepController,
    pub master: Vec<Vec<f32>>,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub outs: Outs,
}

impl Reference {
    pub fn new() -> Self {
        let master = LENS
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let mut p = vec![0.0; l];
                init_master(i, &mut p);
                p
            })
            .collect();
        Reference {
            cpu: cpu(),
            ctrl: controller(),
            master,
            m: LENS.iter().map(|&l| vec![0.0; l]).collect(),
            v: LENS.iter().map(|&l| vec![0.0; l]).collect(),
            outs: Outs::new(),
        }
    }

    pub fn step(&mut self, it: u64, overflow_at: Option<u64>) -> StepDecision {
        let g = all_grads(it, self.ctrl.loss_scale(), overflow_at);
        let specs = groups();
        let mut outs = self.outs.views();
        let mut pg: Vec<ParamGroup<'_>> = self
            .master
            .iter_mut()
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
            .zip(outs.drain(..))
            .enumerate()
            .map(|(i, (((p, m), v), o))| ParamGroup {
                hp: specs[i].hp,
                master: p,
                m,
                v,
                grads: g[i].as_grads(),
                out: Some(o),
            })
            .collect();
        self.cpu.step_groups(&mut self.ctrl, &mut pg).unwrap()
    }
}

/// One full streamed step at iteration `it`.
pub fn stream_step(
    opt: &mut StreamingOptimizer,
    ctrl: &mut StepController,
    outs: &mut Outs,
    it: u64,
    overflow_at: Option<u64>,
) -> tidestore_optimizer::Result<StepDecision> {
    let g = all_grads(it, ctrl.loss_scale(), overflow_at);
    let views: Vec<Grads<'_>> = g.iter().map(GradBuf::as_grads).collect();
    let mut o = outs.views();
    opt.step(ctrl, &views, &mut o)
}

/// Asserts the optimizer's state equals the reference's, bit for bit.
pub fn assert_same_state(opt: &mut StreamingOptimizer, r: &Reference) {
    for (i, &len) in LENS.iter().enumerate() {
        let (mut p, mut m, mut v) = (vec![0.0f32; len], vec![0.0f32; len], vec![0.0f32; len]);
        opt.read_group(i, &mut p, &mut m, &mut v).unwrap();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p), bits(&r.master[i]), "master of group {i}");
        assert_eq!(bits(&m), bits(&r.m[i]), "M of group {i}");
        assert_eq!(bits(&v), bits(&r.v[i]), "V of group {i}");
    }
    assert_eq!(opt.step_count(), r.ctrl.step());
}
