//! Guards against compact Adam moments (bf16, block-wise int8) that lose more than their
//! format must, or that differ between SIMD levels: a map that is not monotone or has
//! duplicate codes, a quantizer that picks a code other than the nearest, a non-finite
//! moment hidden inside a block, an all-zero block that reads back NaN, an outlier that
//! wipes its block out beyond the map's resolution, a SIMD kernel whose codes, absmax,
//! bf16 moments or master values differ from the scalar kernel's in any bit, and a fused
//! step that strays from an f64 AdamW by more than the quantization error.

mod common;

use common::{case, check_same, scalar, Case, Rng};
use half::{bf16, f16};
use proptest::prelude::*;
use tidestore_optimizer::quant::{self, absmax_len, maps, DynamicMap, Q8_BLOCK};
use tidestore_optimizer::{AdamW, Grads, HyperParams, Mode, Moments, ParamOut, Q8Mut, StepState};

/// Half the larger gap around code `k`: the most a nearest-code rounding can be off.
fn half_gap(map: &DynamicMap, k: usize) -> f32 {
    // Below the lowest code of the signed map lies -1 (it has +1 but not -1).
    let below = if k > 0 {
        map.values[k] - map.values[k - 1]
    } else {
        2.0 * (map.values[0] + 1.0).max(0.0) * f32::from(u8::from(map.values[0] < 0.0))
    };
    let above = if k < 255 {
        map.values[k + 1] - map.values[k]
    } else {
        0.0
    };
    below.max(above) / 2.0
}

#[test]
fn maps_are_monotone_distinct_and_symmetric_where_signed() {
    let q = maps();
    for (name, map) in [("signed", &q.signed), ("unsigned", &q.unsigned)] {
        for k in 0..255 {
            assert!(
                map.values[k] < map.values[k + 1],
                "{name}: not increasing at {k}"
            );
            assert!(
                map.values[k] < map.midpoints[k] && map.midpoints[k] < map.values[k + 1],
                "{name}: midpoint {k} not between its codes"
            );
        }
        assert_eq!(map.values[255], 1.0, "{name}: top code is 1");
        // Every value is its own code; values just either side of a midpoint round to
        // the two codes it separates (the quantizer is nearest-code).
        for k in 0..256 {
            assert_eq!(
                usize::from(map.code(map.values[k])),
                k,
                "{name}: code of value {k}"
            );
        }
        for k in 0..255 {
            let t = map.midpoints[k];
            assert_eq!(
                usize::from(map.code(t)),
                k,
                "{name}: tie at midpoint {k} goes down"
            );
            let up = f32::from_bits(if t >= 0.0 {
                t.to_bits() + 1
            } else {
                t.to_bits() - 1
            });
            assert_eq!(
                usize::from(map.code(up)),
                k + 1,
                "{name}: above midpoint {k}"
            );
        }
        assert_eq!(map.code(f32::NAN), 0, "{name}: NaN goes to code 0");
        assert_eq!(map.code(-2.0), 0);
        assert_eq!(map.code(2.0), 255);
    }
    let s = &q.signed.values;
    let u = &q.unsigned.values;
    // Signed: 127 negative codes, zero, 128 positive (the 127 mirrored ones and 1.0).
    assert_eq!(s.iter().filter(|&&x| x < 0.0).count(), 127);
    assert_eq!(s[127], 0.0);
    for k in 0..127 {
        assert_eq!(-s[k], s[254 - k], "signed map symmetric at {k}");
    }
    assert_eq!(u[0], 0.0);
    assert!(u.iter().all(|&x| x >= 0.0));
    // The dynamic map's range: smallest magnitudes ~1e-7, decade by decade up to 1.
    assert!(
        s[128] > 1e-7 && s[128] < 1e-6,
        "smallest positive {}",
        s[128]
    );
    assert!(u[1] > 1e-7 && u[1] < 1e-6, "smallest positive {}", u[1]);
    // No code is further than 0.0071 (of the absmax) from the values it stands for.
    for map in [&q.signed, &q.unsigned] {
        for k in 0..256 {
            assert!(half_gap(map, k) < 0.0071, "gap at {}", map.values[k]);
        }
    }
}

/// Every element read back within half the gap around its code, times the absmax (plus
/// the f32 rounding of the product).
fn check_roundtrip(map: &DynamicMap, x: &[f32]) -> Result<(), TestCaseError> {
    let mut codes = vec![0u8; x.len()];
    let mut absmax = vec![0f32; absmax_len(x.len())];
    quant::quantize(map, x, &mut codes, &mut absmax);
    let mut back = vec![0f32; x.len()];
    quant::dequantize(map, &codes, &absmax, &mut back);
    for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
        let am = absmax[i / Q8_BLOCK];
        let bound = (half_gap(map, usize::from(codes[i])) + 1e-6) * am + 1e-37;
        prop_assert!(
            (a - b).abs() <= bound,
            "[{}] {} -> {} (absmax {}, bound {})",
            i,
            a,
            b,
            am,
            bound
        );
        let true_max = x[i / Q8_BLOCK * Q8_BLOCK..((i / Q8_BLOCK + 1) * Q8_BLOCK).min(x.len())]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        let want = if true_max == 0.0 {
            0.0
        } else {
            true_max.max(f32::MIN_POSITIVE)
        };
        prop_assert_eq!(am, want);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn quantize_dequantize_within_half_a_gap(seed in any::<u64>(), n in 1usize..1500, e in -30i32..30) {
        let mut rng = Rng::new(seed);
        let scale = 2f32.powi(e);
        let m: Vec<f32> = (0..n).map(|_| rng.unit() * scale * 2f32.powi((rng.next_u64() % 20) as i32 - 10)).collect();
        check_roundtrip(&maps().signed, &m)?;
        let v: Vec<f32> = m.iter().map(|x| x * x).collect();
        check_roundtrip(&maps().unsigned, &v)?;
    }
}

#[test]
fn non_finite_block_reads_back_nan_and_others_are_untouched() {
    let map = &maps().signed;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x: Vec<f32> = (0..600).map(|i| (i as f32 - 300.0) * 1e-3).collect();
        x[300] = bad;
        let mut codes = vec![0u8; 600];
        let mut absmax = vec![0f32; 3];
        quant::quantize(map, &x, &mut codes, &mut absmax);
        assert!(absmax[1].is_nan(), "{bad}: block 1 absmax NaN");
        let mut back = vec![0f32; 600];
        quant::dequantize(map, &codes, &absmax, &mut back);
        assert!(
            back[256..512].iter().all(|v| v.is_nan()),
            "{bad}: whole block NaN"
        );
        assert!(back[..256]
            .iter()
            .chain(&back[512..])
            .all(|v| v.is_finite()));
    }
}

#[test]
fn all_zero_block_reads_back_zero() {
    for map in [&maps().signed, &maps().unsigned] {
        let x = vec![0f32; 300];
        let mut codes = vec![0u8; 300];
        let mut absmax = vec![1f32; 2];
        quant::quantize(map, &x, &mut codes, &mut absmax);
        assert_eq!(absmax, vec![0.0, 0.0]);
        let mut back = vec![1f32; 300];
        quant::dequantize(map, &codes, &absmax, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn one_huge_outlier_keeps_itself_and_bounds_the_rest() {
    let map = &maps().signed;
    let mut rng = Rng::new(7);
    let mut x: Vec<f32> = (0..256).map(|_| rng.unit() * 1e-3).collect();
    x[17] = 1e4;
    x[200] = -9e3;
    let mut codes = vec![0u8; 256];
    let mut absmax = vec![0f32; 1];
    quant::quantize(map, &x, &mut codes, &mut absmax);
    let mut back = vec![0f32; 256];
    quant::dequantize(map, &codes, &absmax, &mut back);
    assert_eq!(back[17], 1e4, "the outlier is the absmax, code 1.0 exactly");
    assert!((back[200] + 9e3).abs() / 9e3 < 0.01);
    // The rest (1e-7 of the absmax) fall in the map's smallest decade or to zero.
    for i in (0..256).filter(|&i| i != 17 && i != 200) {
        assert!(
            (back[i] - x[i]).abs() <= 1e4 * 1e-6,
            "[{i}] {} -> {}",
            x[i],
            back[i]
        );
    }
}

// ---- the fused step ----

fn value(rng: &mut Rng, scale: f32, specials: bool) -> f32 {
    if specials && rng.next_u64().is_multiple_of(64) {
        const S: [f32; 6] = [f32::INFINITY, f32::NAN, 0.0, -0.0, 1e-40, f32::MAX];
        return S[(rng.next_u64() % S.len() as u64) as usize];
    }
    let e = (rng.next_u64() % 12) as i32 - 6;
    rng.unit() * scale * 2f32.powi(e)
}

#[derive(Clone)]
struct Arrays {
    p: Vec<f32>,
    mb: Vec<bf16>,
    vb: Vec<bf16>,
    mc: Vec<u8>,
    ma: Vec<f32>,
    vc: Vec<u8>,
    va: Vec<f32>,
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
        let mut mc = vec![0u8; n];
        let mut ma = vec![0f32; absmax_len(n)];
        let mut vc = vec![0u8; n];
        let mut va = vec![0f32; absmax_len(n)];
        quant::quantize(&maps().signed, &m, &mut mc, &mut ma);
        quant::quantize(&maps().unsigned, &v, &mut vc, &mut va);
        Arrays {
            mb: m.iter().map(|&x| bf16::from_f32(x)).collect(),
            vb: v.iter().map(|&x| bf16::from_f32(x)).collect(),
            mc,
            ma,
            vc,
            va,
            g16: g32.iter().map(|&x| f16::from_f32(x)).collect(),
            gb16: g32.iter().map(|&x| bf16::from_f32(x)).collect(),
            of16: vec![f16::ZERO; n],
            ob16: vec![bf16::ZERO; n],
            p,
            g32,
        }
    }

    fn step(&mut self, opt: &AdamW, c: &Case, int8: bool) {
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
        let mv = if int8 {
            Moments::Int8 {
                m: Q8Mut {
                    codes: &mut self.mc,
                    absmax: &mut self.ma,
                },
                v: Q8Mut {
                    codes: &mut self.vc,
                    absmax: &mut self.va,
                },
            }
        } else {
            Moments::Bf16 {
                m: &mut self.mb,
                v: &mut self.vb,
            }
        };
        opt.step_moments(c.state, &c.hp, &mut self.p, mv, grads, out)
            .unwrap();
    }
}

fn bits16(a: &[bf16]) -> Vec<u16> {
    a.iter().map(|x| x.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Every SIMD level and thread count equals the scalar kernel bit for bit: master,
    /// codes, absmax, bf16 moments, 16-bit output (NaN payloads excepted).
    #[test]
    fn compact_step_bit_identical_to_scalar(c in case(1300, &[16, 256, 512, 1 << 16])) {
        for int8 in [false, true] {
            let mut want = Arrays::new(&c);
            want.step(&scalar(), &c, int8);
            for (level, threads, opt) in common::optimizers(c.block) {
                let mut got = Arrays::new(&c);
                got.step(&opt, &c, int8);
                let label = format!("{level:?} x{threads} int8={int8}");
                check_same(&got.p, &want.p, &format!("{label} master"))?;
                if int8 {
                    prop_assert_eq!(&got.mc, &want.mc, "{} m codes", label);
                    prop_assert_eq!(&got.vc, &want.vc, "{} v codes", label);
                    check_same(&got.ma, &want.ma, &format!("{label} m absmax"))?;
                    check_same(&got.va, &want.va, &format!("{label} v absmax"))?;
                } else {
                    let (gm, wm) = (bits16(&got.mb), bits16(&want.mb));
                    for i in 0..c.len {
                        prop_assert!(gm[i] == wm[i] || (got.mb[i].is_nan() && want.mb[i].is_nan()), "{} m[{}]", label, i);
                        prop_assert!(got.vb[i].to_bits() == want.vb[i].to_bits() || (got.vb[i].is_nan() && want.vb[i].is_nan()), "{} v[{}]", label, i);
                    }
                }
                for i in 0..c.len {
                    match c.okind {
                        1 => prop_assert_eq!(got.of16[i].to_bits(), f16::from_f32(got.p[i]).to_bits(), "{} f16 out {}", label, i),
                        2 => prop_assert_eq!(got.ob16[i].to_bits(), bf16::from_f32(got.p[i]).to_bits(), "{} bf16 out {}", label, i),
                        _ => {}
                    }
                }
            }
        }
    }

    /// One fused step against f64 AdamW from the same (dequantized) moments: master
    /// within f32 rounding, the stored moments within the format's error.
    #[test]
    fn compact_step_matches_f64_adamw(c in case(1300, &[16, 256, 512, 1 << 16]).prop_filter("finite", |c| !c.specials)) {
        for int8 in [false, true] {
            let a0 = Arrays::new(&c);
            let mut a = a0.clone();
            a.step(&scalar(), &c, int8);
            let n = c.len;
            let (mut m0, mut v0) = (vec![0f32; n], vec![0f32; n]);
            let (mut m1, mut v1) = (vec![0f32; n], vec![0f32; n]);
            if int8 {
                quant::dequantize(&maps().signed, &a0.mc, &a0.ma, &mut m0);
                quant::dequantize(&maps().unsigned, &a0.vc, &a0.va, &mut v0);
                quant::dequantize(&maps().signed, &a.mc, &a.ma, &mut m1);
                quant::dequantize(&maps().unsigned, &a.vc, &a.va, &mut v1);
            } else {
                m0 = a0.mb.iter().map(|x| x.to_f32()).collect();
                v0 = a0.vb.iter().map(|x| x.to_f32()).collect();
                m1 = a.mb.iter().map(|x| x.to_f32()).collect();
                v1 = a.vb.iter().map(|x| x.to_f32()).collect();
            }
            let h = &c.hp;
            let (b1, b2) = (f64::from(h.beta1), f64::from(h.beta2));
            let t = c.state.step as i32;
            let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
            let mut ref_m = vec![0f64; n];
            let mut ref_v = vec![0f64; n];
            let mut scale_m = vec![0f64; n];
            let mut scale_v = vec![0f64; n];
            for i in 0..n {
                let g32 = match c.gkind { 0 => a0.g32[i], 1 => a0.g16[i].to_f32(), _ => a0.gb16[i].to_f32() };
                let p = f64::from(a0.p[i]);
                let mut g = f64::from(g32) * f64::from(c.state.grad_scale);
                if h.mode == Mode::AdamL2 { g += f64::from(h.weight_decay) * p; }
                let m = b1 * f64::from(m0[i]) + (1.0 - b1) * g;
                let v = b2 * f64::from(v0[i]) + (1.0 - b2) * g * g;
                ref_m[i] = m;
                ref_v[i] = v;
                // Magnitudes the f32 sums cancel from (the format's error is relative to them).
                scale_m[i] = b1 * f64::from(m0[i]).abs() + (1.0 - b1) * g.abs();
                scale_v[i] = b2 * f64::from(v0[i]) + (1.0 - b2) * g * g;
                let upd = f64::from(h.lr) / bc1 * m / ((v / bc2).sqrt() + f64::from(h.eps));
                let p1 = if h.mode == Mode::AdamW { p - f64::from(h.lr) * f64::from(h.weight_decay) * p - upd } else { p - upd };
                // The f32 kernel's M is exact only to a few ulps of the terms it sums
                // (the gradient's own terms too, under L2): when they cancel, the update
                // carries that error relative to the small M.
                let g_terms = f64::from(g32).abs() * f64::from(c.state.grad_scale)
                    + if h.mode == Mode::AdamL2 { f64::from(h.weight_decay) * p.abs() } else { 0.0 };
                let m_err = 4.0 * f64::from(f32::EPSILON) * (b1 * f64::from(m0[i]).abs() + (1.0 - b1) * g_terms);
                let tol = 1e-5 * (p.abs() + upd.abs()) + upd.abs() * m_err / m.abs().max(m_err) + 1e-30;
                prop_assert!((f64::from(a.p[i]) - p1).abs() <= tol, "int8={} p[{}]: {} vs {}", int8, i, a.p[i], p1);
            }
            for i in 0..n {
                let (em, ev) = if int8 {
                    let blk = i / Q8_BLOCK;
                    let (am, av) = (f64::from(a.ma[blk]), f64::from(a.va[blk]));
                    // The largest half gap of either map (near 1) times the absmax.
                    (0.0072 * am + 1e-6 * scale_m[i], 0.0072 * av + 1e-6 * scale_v[i])
                } else {
                    (scale_m[i] * (1.0 / 256.0 + 1e-6) + 1e-38, scale_v[i] * (1.0 / 256.0 + 1e-6) + 1e-38)
                };
                prop_assert!((f64::from(m1[i]) - ref_m[i]).abs() <= em, "int8={} m[{}] {} vs {}", int8, i, m1[i], ref_m[i]);
                prop_assert!((f64::from(v1[i]) - ref_v[i]).abs() <= ev, "int8={} v[{}] {} vs {}", int8, i, v1[i], ref_v[i]);
            }
        }
    }
}

/// With beta1 = beta2 = 0 the new M is the gradient itself, so the kernel's quantizer
/// is seen directly: at every level, codes of values at and just above every midpoint
/// equal [`DynamicMap::code`].
#[test]
fn kernel_quantizer_equals_the_map_at_every_level() {
    let map = &maps().signed;
    let mut g = Vec::new();
    for k in 0..255 {
        let t = map.midpoints[k];
        let up = f32::from_bits(if t >= 0.0 {
            t.to_bits() + 1
        } else {
            t.to_bits() - 1
        });
        g.extend([t, up, map.values[k]]);
    }
    g.push(1.0); // absmax of every block is ~1
    while g.len() % Q8_BLOCK != 0 {
        g.push(1.0);
    }
    // Put 1.0 in each block so the absmax is exactly 1 and x * r == x.
    for b in 0..g.len() / Q8_BLOCK {
        g[b * Q8_BLOCK] = 1.0;
    }
    let n = g.len();
    let hp = HyperParams {
        lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 1e-8,
        weight_decay: 0.0,
        mode: Mode::AdamW,
    };
    let state = StepState {
        step: 1,
        grad_scale: 1.0,
    };
    for (level, threads, opt) in common::optimizers(256) {
        let mut p = vec![0f32; n];
        let (mut mc, mut vc) = (vec![0u8; n], vec![0u8; n]);
        let (mut ma, mut va) = (vec![0f32; n / Q8_BLOCK], vec![0f32; n / Q8_BLOCK]);
        opt.step_moments(
            state,
            &hp,
            &mut p,
            Moments::Int8 {
                m: Q8Mut {
                    codes: &mut mc,
                    absmax: &mut ma,
                },
                v: Q8Mut {
                    codes: &mut vc,
                    absmax: &mut va,
                },
            },
            Grads::F32(&g),
            None,
        )
        .unwrap();
        assert!(ma.iter().all(|&a| a == 1.0));
        for i in 0..n {
            assert_eq!(
                mc[i],
                map.code(g[i]),
                "{level:?} x{threads}: code of {:e}",
                g[i]
            );
        }
    }
}
