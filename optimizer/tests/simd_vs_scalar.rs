//! Guards against SIMD kernels that disagree with the portable one: a changed operation
//! order, a missing fusion, a wrong tail or block split, a lane shuffled by a pack.
//!
//! Claim tested: for random lengths (tails that are not multiples of 8 or 16, several
//! blocks), random hyper-parameters, random values (with infinities, NaNs, zeros and
//! subnormals mixed in) and every gradient / output dtype, every SIMD level and thread
//! count gives fp32 master, M and V **bit-identical** to the scalar level with one
//! thread — all levels evaluate the same f32 operations in the same order with the same
//! fused multiply-adds, and `sqrt` / division are correctly rounded (here any NaN equals
//! any NaN; that every step NaN is the canonical one, at every level, is
//! `nan_policy.rs`). 16-bit outputs equal `half`'s conversion of the
//! final master value bit for bit. The f64 gradient norm agrees within 1e-12 relative
//! (lanes sum in a different order); finiteness, accumulation and casts agree exactly.

mod common;

use common::{case, check_same, scalar, Case, Rng};
use half::{bf16, f16};
use proptest::prelude::*;
use tidestore_optimizer::{AdamW, CpuConfig, Grads, ParamOut, NORM_STREAMS};

fn value(rng: &mut Rng, scale: f32, specials: bool) -> f32 {
    if specials && rng.next_u64().is_multiple_of(16) {
        const S: [f32; 9] = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            1e-40,
            -3e-39,
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        return S[(rng.next_u64() % S.len() as u64) as usize];
    }
    // Magnitudes over many binades.
    let e = (rng.next_u64() % 12) as i32 - 6;
    rng.unit() * scale * 2f32.powi(e)
}

struct Arrays {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g32: Vec<f32>,
    g16: Vec<f16>,
    gb16: Vec<bf16>,
    of16: Vec<f16>,
    ob16: Vec<bf16>,
}

impl Arrays {
    fn new(c: &Case) -> Self {
        let mut rng = Rng::new(c.seed);
        let n = c.len;
        let p: Vec<f32> = (0..n).map(|_| value(&mut rng, 1.0, c.specials)).collect();
        let m: Vec<f32> = (0..n).map(|_| value(&mut rng, 1e-2, c.specials)).collect();
        let v: Vec<f32> = (0..n)
            .map(|_| value(&mut rng, 1e-4, c.specials).abs())
            .collect();
        let g32: Vec<f32> = (0..n).map(|_| value(&mut rng, 1e-1, c.specials)).collect();
        Arrays {
            g16: g32.iter().map(|&x| f16::from_f32(x)).collect(),
            gb16: g32.iter().map(|&x| bf16::from_f32(x)).collect(),
            of16: vec![f16::ZERO; n],
            ob16: vec![bf16::ZERO; n],
            p,
            m,
            v,
            g32,
        }
    }

    fn step(&mut self, opt: &AdamW, c: &Case) {
        let grads = match c.gkind {
            0 => Grads::F32(&self.g32),
            1 => Grads::F16(&self.g16),
            _ => Grads::Bf16(&self.gb16),
        };
        let out = match c.okind {
            0 => None,
            1 => Some(ParamOut::F16(&mut self.of16)),
            _ => Some(ParamOut::Bf16(&mut self.ob16)),
        };
        opt.step_slice(
            c.state,
            &c.hp,
            &mut self.p,
            &mut self.m,
            &mut self.v,
            grads,
            out,
        )
        .unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn step_bit_identical_to_scalar(c in case(700, &[16, 48, 64, 1 << 16])) {
        let mut want = Arrays::new(&c);
        want.step(&scalar(), &c);
        for (level, threads, opt) in common::optimizers(c.block) {
            let mut got = Arrays::new(&c);
            got.step(&opt, &c);
            let label = format!("{level:?} x{threads}");
            check_same(&got.p, &want.p, &format!("{label} master"))?;
            check_same(&got.m, &want.m, &format!("{label} m"))?;
            check_same(&got.v, &want.v, &format!("{label} v"))?;
            for i in 0..c.len {
                match c.okind {
                    1 => prop_assert_eq!(got.of16[i].to_bits(), f16::from_f32(got.p[i]).to_bits(), "{} f16 out {}", label, i),
                    2 => prop_assert_eq!(got.ob16[i].to_bits(), bf16::from_f32(got.p[i]).to_bits(), "{} bf16 out {}", label, i),
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn norm_finite_accumulate_cast_agree(c in case(700, &[16, 48, 64, 1 << 16]), scale in -4f32..4.0) {
        let a = Arrays::new(&c);
        let s = scalar();
        let grads = [Grads::F32(&a.g32), Grads::F16(&a.g16), Grads::Bf16(&a.gb16)];
        for g in grads {
            let want_sq = s.grad_sq_norm(g);
            let want_finite = s.grads_finite(g);
            let mut want_acc = a.m.clone();
            s.accumulate(&mut want_acc, g, scale).unwrap();
            // Reference straight from the definition.
            let def_finite = (0..g.len()).all(|i| g.get_f32(i).unwrap().is_finite());
            prop_assert_eq!(want_finite, def_finite);
            prop_assert_eq!(want_sq.is_finite(), def_finite);
            for (level, threads, opt) in common::optimizers(c.block) {
                let sq = opt.grad_sq_norm(g);
                if want_sq.is_finite() {
                    prop_assert!((sq - want_sq).abs() <= 1e-12 * want_sq, "{:?} x{}: {} vs {}", level, threads, sq, want_sq);
                } else {
                    prop_assert!(!sq.is_finite());
                }
                prop_assert_eq!(opt.grads_finite(g), want_finite);
                let mut acc = a.m.clone();
                opt.accumulate(&mut acc, g, scale).unwrap();
                check_same(&acc, &want_acc, &format!("{level:?} x{threads} accumulate"))?;
                // Widened exactly, with the norm the widened copy has, bit for bit.
                let mut wide = vec![f32::NAN; g.len()];
                let wide_sq = opt.widen_grads(g, &mut wide).unwrap();
                for (i, w) in wide.iter().enumerate() {
                    prop_assert_eq!(w.to_bits(), g.get_f32(i).unwrap().to_bits(), "{:?} x{} widen {}", level, threads, i);
                }
                prop_assert_eq!(wide_sq.to_bits(), opt.grad_sq_norm(Grads::F32(&wide)).to_bits());
                let mut copied = vec![f32::NAN; g.len()];
                opt.copy(&wide, &mut copied).unwrap();
                check_same(&copied, &wide, &format!("{level:?} x{threads} copy"))?;
            }
        }
        for (level, threads, opt) in common::optimizers(c.block) {
            let mut o16 = vec![f16::ZERO; c.len];
            let mut ob = vec![bf16::ZERO; c.len];
            opt.cast_params(&a.p, ParamOut::F16(&mut o16)).unwrap();
            opt.cast_params(&a.p, ParamOut::Bf16(&mut ob)).unwrap();
            for i in 0..c.len {
                prop_assert_eq!(o16[i].to_bits(), f16::from_f32(a.p[i]).to_bits(), "{:?} x{} f16 {}", level, threads, a.p[i]);
                prop_assert_eq!(ob[i].to_bits(), bf16::from_f32(a.p[i]).to_bits(), "{:?} x{} bf16 {}", level, threads, a.p[i]);
            }
        }
    }
}

/// The norm and the step do not depend on the number of threads (fixed split tree).
#[test]
fn thread_count_does_not_change_bits() {
    let mut rng = Rng::new(3);
    let n = 100_003;
    let g: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let one = AdamW::new(CpuConfig {
        threads: 1,
        block_params: 1024,
        simd: None,
    })
    .unwrap();
    let two = AdamW::new(CpuConfig {
        threads: 2,
        block_params: 1024,
        simd: None,
    })
    .unwrap();
    assert_eq!(
        one.grad_sq_norm(Grads::F32(&g)).to_bits(),
        two.grad_sq_norm(Grads::F32(&g)).to_bits()
    );
}

/// The norm reads several blocks at once (`NORM_STREAMS` streams): each block's sum and
/// the order they are added in stay those of the block-at-a-time pass that widening
/// takes, bit for bit, at every SIMD level, thread count and dtype, with whole groups of
/// blocks, a group cut short and a last block cut short; and within the scalar
/// reference's rounding of the definition.
#[test]
fn the_norm_read_blocks_at_a_time_adds_as_one_block_at_a_time() {
    let block = 1024;
    let mut rng = Rng::new(11);
    for n in [
        block * NORM_STREAMS * 3,
        block * NORM_STREAMS * 3 + 517,
        block * (NORM_STREAMS + 2),
        block * NORM_STREAMS - 1,
        block,
    ] {
        let g32: Vec<f32> = (0..n).map(|_| rng.unit() * 3.0).collect();
        let g16: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
        let gb16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
        for g in [Grads::F32(&g32), Grads::F16(&g16), Grads::Bf16(&gb16)] {
            let exact: f64 = (0..n)
                .map(|i| f64::from(g.get_f32(i).unwrap()).powi(2))
                .sum();
            for (level, threads, opt) in common::optimizers(block) {
                let mut wide = vec![0f32; n];
                let blockwise = opt.widen_grads(g, &mut wide).unwrap();
                let sq = opt.grad_sq_norm(g);
                assert_eq!(
                    sq.to_bits(),
                    blockwise.to_bits(),
                    "{level:?} x{threads}, {n}"
                );
                assert!(
                    (sq - exact).abs() <= 1e-12 * exact,
                    "{level:?}: {sq} vs {exact}"
                );
            }
        }
    }
}

/// An f32 gradient widened into a destination at every alignment (the streaming copy's
/// scalar head and tail around its aligned stores) lands exactly, with its norm.
#[test]
fn widened_f32_lands_exactly_at_every_alignment() {
    let g: Vec<f32> = (0..1100).map(|i| (i as f32 - 550.0) * 0.37).collect();
    let mut buf = vec![0f32; 1100 + 16];
    for (level, threads, opt) in common::optimizers(64) {
        for offset in 0..16 {
            for len in [0, 1, 7, 15, 16, 17, 31, 33, 64, 100, 1000, 1100] {
                buf.fill(f32::NAN);
                let dst = &mut buf[offset..offset + len];
                let sq = opt.widen_grads(Grads::F32(&g[..len]), dst).unwrap();
                assert!(
                    dst.iter().zip(&g).all(|(d, s)| d.to_bits() == s.to_bits()),
                    "{level:?} x{threads}: offset {offset}, {len} elements"
                );
                assert_eq!(
                    sq.to_bits(),
                    opt.grad_sq_norm(Grads::F32(&g[..len])).to_bits()
                );
                // Nothing written outside the destination.
                assert!(buf[..offset].iter().all(|x| x.is_nan()));
                assert!(buf[offset + len..].iter().all(|x| x.is_nan()));
            }
        }
    }
}
