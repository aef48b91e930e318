//! `tidestore_candle::blas::matmul` with the library's threads as opened: a threaded
//! OpenBLAS computes each product with as many threads of its own as rayon's global
//! pool has (see `blas_checks` for what each check holds).

mod blas_checks;

use tidestore_candle::blas;

#[test]
fn every_transposition_equals_the_f64_product() {
    blas_checks::every_transposition_equals_the_f64_product();
}

#[test]
fn operands_inside_larger_tensors() {
    blas_checks::operands_inside_larger_tensors();
}

#[test]
fn where_sgemm_does_not_apply_the_product_is_candles() {
    blas_checks::where_sgemm_does_not_apply_the_product_is_candles();
}

#[test]
fn batches_equal_the_f64_product() {
    blas_checks::batches_equal_the_f64_product();
}

#[test]
fn a_lent_matrix_multiplies_as_its_tensor_does() {
    blas_checks::a_lent_matrix_multiplies_as_its_tensor_does();
}

/// A threaded OpenBLAS is given rayon's threads (a serial one keeps its one), unless
/// the user chose with `OPENBLAS_NUM_THREADS`.
#[test]
fn a_threaded_openblas_gets_rayons_threads() {
    if !blas_checks::blas_present() {
        return;
    }
    if let Some(v) = std::env::var_os("OPENBLAS_NUM_THREADS") {
        println!("SKIPPED: OPENBLAS_NUM_THREADS={v:?} was set before the test: the user's choice");
        return;
    }
    let threads = blas::library_threads_in_use().expect("a library is open");
    let pool = std::thread::spawn(rayon::current_num_threads)
        .join()
        .unwrap();
    println!("the library computes with {threads} thread(s); rayon's pool has {pool}");
    assert!(
        threads == pool || threads == 1,
        "OpenBLAS runs {threads} threads beside rayon's {pool}"
    );
}
