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

/// A threaded OpenBLAS or oneMKL is given rayon's threads (a serial one keeps its one),
/// unless the user chose with `OPENBLAS_NUM_THREADS` or `MKL_NUM_THREADS`.
#[test]
fn a_threaded_library_gets_rayons_threads() {
    if !blas_checks::blas_present() {
        return;
    }
    for var in ["OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"] {
        if let Some(v) = std::env::var_os(var) {
            println!("SKIPPED: {var}={v:?} was set before the test: the user's choice");
            return;
        }
    }
    let threads = blas::library_threads_in_use().expect("a library is open");
    let pool = std::thread::spawn(rayon::current_num_threads)
        .join()
        .unwrap();
    println!("the library computes with {threads} thread(s); rayon's pool has {pool}");
    assert!(
        threads == pool || threads == 1,
        "the library runs {threads} threads beside rayon's {pool}"
    );
}

/// The library `TIDESTORE_BLAS` names is the one that computes, and the report names
/// it (`.ci/run` runs this file once more with oneMKL from PyPI named there).
#[test]
fn the_library_tidestore_blas_names_computes() {
    let Some(named) = std::env::var_os(blas::BLAS_ENV).filter(|v| v != "off") else {
        println!(
            "SKIPPED: {} is not set: the default search is tested above",
            blas::BLAS_ENV
        );
        return;
    };
    let named = named.to_string_lossy().into_owned();
    let backend = blas::backend().expect("the named library opens");
    println!("{named}: {backend}");
    assert!(backend.contains(&named), "{backend} does not name {named}");
    if named.contains("mkl") {
        assert!(
            backend.contains("Math Kernel Library"),
            "no oneMKL version in {backend}"
        );
        assert_eq!(blas::openblas_core(), None, "oneMKL has no OpenBLAS core");
        if std::env::var_os("MKL_NUM_THREADS").is_none() {
            // Its own pool, sized to rayon's: not bands on rayon's pool, each calling
            // into oneMKL's own threads as well.
            let pool = std::thread::spawn(rayon::current_num_threads)
                .join()
                .unwrap();
            assert_eq!(blas::library_threads_in_use(), Some(pool));
        }
    }
}
