//! `tidestore_candle::blas::matmul` with OpenBLAS told to use one thread of its own
//! (`OPENBLAS_NUM_THREADS=1`, read when this process first opens it): each product is
//! cut into bands of rows on rayon's pool (see `blas_checks` for what each check holds).
//! Its own binary, so that the variable is set before the library is opened.

mod blas_checks;

use tidestore_candle::blas;

#[test]
fn products_cut_into_bands_on_rayons_pool() {
    std::env::set_var("OPENBLAS_NUM_THREADS", "1");
    if !blas_checks::blas_present() {
        return;
    }
    assert_eq!(
        blas::library_threads_in_use(),
        Some(1),
        "OpenBLAS kept threads of its own though the user asked for one"
    );
    blas_checks::every_transposition_equals_the_f64_product();
    blas_checks::operands_inside_larger_tensors();
    blas_checks::where_sgemm_does_not_apply_the_product_is_candles();
    blas_checks::batches_equal_the_f64_product();
    blas_checks::a_lent_matrix_multiplies_as_its_tensor_does();
}
