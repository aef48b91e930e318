//! Guards the choice of OpenBLAS's kernels (`tidestore_candle::blas`): a DYNAMIC_ARCH
//! OpenBLAS older than the CPU detects it as an old one and falls back to SSE3 kernels
//! (0.3.21 on an Emerald Rapids Xeon: "Prescott", ~4.5x slower than its AVX-512 ones),
//! so the library is loaded again with `OPENBLAS_CORETYPE` naming kernels of the CPU's
//! vector width. Its own binary: the check needs the first load of the process, before
//! any other test has opened the library.

use tidestore_candle::blas::{self, better_core, VectorIsa};

#[test]
fn openblas_runs_kernels_of_this_cpus_vector_width() {
    if let Some(v) = std::env::var_os("OPENBLAS_CORETYPE") {
        println!("SKIPPED: OPENBLAS_CORETYPE={v:?} was set before the test: the user's choice");
        return;
    }
    let backend = blas::backend().expect("the default library search never errs");
    let Some(core) = blas::openblas_core() else {
        println!("SKIPPED: no OpenBLAS here ({backend}): candle's gemm computes the products");
        return;
    };
    let cpu = VectorIsa::of_this_cpu();
    println!("{backend}: kernels {core} on a CPU with {cpu:?}");
    assert_eq!(
        better_core(&core, cpu),
        None,
        "OpenBLAS runs its {core} kernels on a CPU with {cpu:?}"
    );
}

#[test]
fn an_old_core_on_a_newer_cpu_is_replaced_and_nothing_else_is() {
    use VectorIsa::*;
    assert_eq!(better_core("Prescott", Avx512), Some("SkylakeX"));
    assert_eq!(better_core("Nehalem", Avx2), Some("Haswell"));
    assert_eq!(better_core("Haswell", Avx512), Some("SkylakeX"));
    assert_eq!(better_core("ZEN", Avx512), Some("SkylakeX"));
    // Kernels as wide as the CPU's, or wider by the library's own judgement, stay.
    for (core, cpu) in [
        ("SkylakeX", Avx512),
        ("Cooperlake", Avx512),
        ("SapphireRapids", Avx512),
        ("Zen", Avx2),
        ("Haswell", Avx2),
        ("Prescott", Older),
        ("Sandybridge", Older),
    ] {
        assert_eq!(better_core(core, cpu), None, "{core} on {cpu:?}");
    }
    // A name this code does not know (a newer OpenBLAS's) is trusted.
    assert_eq!(better_core("Zen5", Avx512), None);
}
