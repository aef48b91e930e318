//! The checks of `tidestore_candle::blas::matmul`, the decoder's matrix products
//! through OpenBLAS, run by `blas.rs` (the library's own threads, where it has them)
//! and `blas_bands.rs` (one thread: products cut into bands on rayon's pool): for every
//! transposition of either operand, operands that start inside a larger tensor (an
//! offset, a leading dimension past the row), and products cut into uneven bands, it
//! must equal an f64 reference to f32 rounding, as candle's matmul does, and so must
//! batches of products (attention's); where `cblas_sgemm` does not apply (a tracked
//! graph, a broadcast operand, a 4-D batch) it must be candle's matmul, bit for bit.
//!
//! Without OpenBLAS on the machine (`libopenblas.so.0`; Debian's `libopenblas0`) the
//! OpenBLAS comparisons are skipped, saying so: they would compare candle with itself.
//! CI installs it.

use candle_core::{Device, Tensor, Var};
use tidestore_candle::blas;

/// `true` when a CBLAS library computes the products; prints why not otherwise.
pub fn blas_present() -> bool {
    let backend = blas::backend().expect("the default library search never errs");
    if backend.starts_with("candle") {
        println!(
            "SKIPPED: no OpenBLAS here (libopenblas.so.0; `apt-get install libopenblas0`): \
             products are candle's ({backend})"
        );
        return false;
    }
    println!("products through {backend}");
    true
}

/// A `(rows, cols)` tensor of values from a fixed sequence (no two rows alike).
fn filled(rows: usize, cols: usize, seed: u32) -> Tensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

/// Checks `c = a · b` against an f64 product: each element within 1e-5 of the sum of
/// its terms' magnitudes (f32 rounding of a k-term sum, whatever the order).
fn assert_product(a: &Tensor, b: &Tensor, c: &Tensor, what: &str) {
    let (a, b, c) = (rows(a), rows(b), rows(c));
    assert_eq!(c.len(), a.len(), "{what}: rows");
    for (i, row) in c.iter().enumerate() {
        assert_eq!(row.len(), b[0].len(), "{what}: columns");
        for (j, &got) in row.iter().enumerate() {
            let (mut sum, mut mag) = (0f64, 0f64);
            for (p, brow) in b.iter().enumerate() {
                let term = f64::from(a[i][p]) * f64::from(brow[j]);
                sum += term;
                mag += term.abs();
            }
            let err = (f64::from(got) - sum).abs();
            assert!(
                err <= 1e-5 * mag.max(1e-30),
                "{what}: c[{i}][{j}] = {got}, f64 gives {sum} (error {err:e}, scale {mag:e})"
            );
        }
    }
}

/// `(m, k)` as itself or as the transpose of a stored `(k, m)`.
fn operand(rows: usize, cols: usize, transposed: bool, seed: u32) -> Tensor {
    if transposed {
        filled(cols, rows, seed).t().unwrap()
    } else {
        filled(rows, cols, seed)
    }
}

/// Every (`a` transposed, `b` transposed) pair.
const TRANSPOSITIONS: [(bool, bool); 4] =
    [(false, false), (false, true), (true, false), (true, true)];

/// A pool of three threads: where the library computes with one thread, products past
/// the split size are cut into three uneven bands, and a batch of two is smaller than
/// the pool.
fn three_threads() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap()
}

pub fn every_transposition_equals_the_f64_product() {
    if !blas_present() {
        return;
    }
    // One call (small), and a product cut into bands of rows.
    let pool = three_threads();
    for (m, k, n) in [(37, 29, 53), (301, 67, 257)] {
        for (ta, tb) in TRANSPOSITIONS {
            let a = operand(m, k, ta, 1);
            let b = operand(k, n, tb, 2);
            let c = pool.install(|| blas::matmul(&a, &b)).unwrap();
            assert_eq!(c.dims(), [m, n]);
            let what = format!("({m}x{k})·({k}x{n}), a transposed {ta}, b transposed {tb}");
            assert_product(&a, &b, &c, &what);
            // candle's own product is held to the same bound.
            assert_product(&a, &b, &a.matmul(&b).unwrap(), &format!("candle {what}"));
        }
    }
}

pub fn operands_inside_larger_tensors() {
    if !blas_present() {
        return;
    }
    // Rows 3.. and columns 2.. of larger tensors: an offset and a leading dimension
    // longer than the row, plain and transposed.
    let big_a = filled(90, 80, 3);
    let big_b = filled(70, 100, 4);
    let a = big_a.narrow(0, 3, 64).unwrap().narrow(1, 2, 61).unwrap();
    let b = big_b.narrow(0, 5, 61).unwrap().narrow(1, 7, 83).unwrap();
    assert_product(
        &a,
        &b,
        &blas::matmul(&a, &b).unwrap(),
        "offset a · offset b",
    );
    let bt = big_b
        .narrow(0, 1, 66)
        .unwrap()
        .narrow(1, 9, 61)
        .unwrap()
        .t()
        .unwrap();
    assert_product(
        &a,
        &bt,
        &blas::matmul(&a, &bt).unwrap(),
        "offset a · offset bᵀ",
    );
}

pub fn where_sgemm_does_not_apply_the_product_is_candles() {
    // These hold with or without OpenBLAS: each case falls back to candle's matmul.
    let a = filled(33, 20, 5);
    let b = filled(20, 41, 6);
    let same = |x: &Tensor, y: &Tensor, what: &str| {
        let got = blas::matmul(x, y).unwrap();
        let want = x.matmul(y).unwrap();
        assert_eq!(rows(&got), rows(&want), "{what}");
        got
    };
    // A tracked graph: the product must be differentiable.
    let va = Var::from_tensor(&a).unwrap();
    let c = same(va.as_tensor(), &b, "tracked");
    let grads = c.sum_all().unwrap().backward().unwrap();
    assert!(
        grads.get(va.as_tensor()).is_some(),
        "the product kept its graph"
    );
    // A broadcast operand (row stride 0).
    let row = filled(1, 20, 7).broadcast_as((33, 20)).unwrap();
    same(&row, &b, "broadcast");
    // A 4-D batch, and a batch against one matrix (candle broadcasts neither here).
    let a4 = Tensor::stack(&[&a, &a], 0).unwrap().unsqueeze(0).unwrap();
    let b4 = Tensor::stack(&[&b, &b], 0).unwrap().unsqueeze(0).unwrap();
    let got = blas::matmul(&a4, &b4).unwrap();
    let want = a4.matmul(&b4).unwrap();
    assert_eq!(
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        "4-D"
    );
    let a3 = Tensor::stack(&[&a, &a], 0).unwrap();
    assert!(
        blas::matmul(&a3, &b).is_err() == a3.matmul(&b).is_err(),
        "3-D · 2-D"
    );
}

/// Attention's products: batches of matrices, as stored and transposed, a batch smaller
/// than the pool (each matrix in bands where the library has one thread) and larger
/// (one call per matrix).
pub fn batches_equal_the_f64_product() {
    if !blas_present() {
        return;
    }
    let pool = three_threads();
    for (batch, m, k, n) in [(2, 260, 40, 530), (5, 33, 17, 29)] {
        for (ta, tb) in TRANSPOSITIONS {
            let mats = |rows: usize, cols: usize, seed: u32| {
                let each: Vec<Tensor> = (0..batch as u32)
                    .map(|i| filled(rows, cols, seed + i))
                    .collect();
                Tensor::stack(&each, 0).unwrap()
            };
            // Transposed as attention's are: the stored batch's last two dimensions.
            let a = match ta {
                true => mats(k, m, 10).transpose(1, 2).unwrap(),
                false => mats(m, k, 10),
            };
            let b = match tb {
                true => mats(n, k, 20).transpose(1, 2).unwrap(),
                false => mats(k, n, 20),
            };
            let c = pool.install(|| blas::matmul(&a, &b)).unwrap();
            assert_eq!(c.dims(), [batch, m, n]);
            for i in 0..batch {
                let at = |t: &Tensor| t.get(i).unwrap();
                let what = format!("matrix {i} of {batch}: a transposed {ta}, b transposed {tb}");
                assert_product(&at(&a), &at(&b), &at(&c), &what);
            }
        }
    }
}

/// A matrix the store lends (a slice, not a tensor) multiplies as the same matrix in a
/// contiguous tensor does, bit for bit, with OpenBLAS or without (then candle's matmul
/// on a copy): `x · Wᵀ` as in a projection's forward, `g · W` as in its backward, `x`
/// plain and transposed, one call and in bands. A slice of the wrong length is refused.
pub fn a_lent_matrix_multiplies_as_its_tensor_does() {
    let pool = three_threads();
    for (m, out, inp) in [(37, 29, 53), (301, 257, 67)] {
        let w = filled(out, inp, 8);
        let slice = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for ta in [false, true] {
            let x = operand(m, inp, ta, 9);
            let g = operand(m, out, ta, 10);
            let fwd = pool
                .install(|| blas::matmul_slice(&x, &slice, (out, inp), true))
                .unwrap();
            let want = pool.install(|| blas::matmul(&x, &w.t().unwrap())).unwrap();
            assert_eq!(
                rows(&fwd),
                rows(&want),
                "x · Wᵀ, ({m}x{inp}), x transposed {ta}"
            );
            let back = pool
                .install(|| blas::matmul_slice(&g, &slice, (out, inp), false))
                .unwrap();
            let want = pool.install(|| blas::matmul(&g, &w)).unwrap();
            assert_eq!(
                rows(&back),
                rows(&want),
                "g · W, ({m}x{out}), g transposed {ta}"
            );
        }
        let short = &slice[1..];
        let e = blas::matmul_slice(&filled(m, inp, 9), short, (out, inp), true);
        assert!(e.is_err(), "a slice one element short was taken");
    }
}
