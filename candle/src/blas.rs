//! Matrix products on the CPU through OpenBLAS's `cblas_sgemm`, loaded at run time.
//!
//! candle's CPU matmul is the `gemm` crate's. `cargo bench --bench bench_main --
//! matmul` measures both on the shapes of a 0.51B LLaMA's blocks: in one run on a 2-core
//! AMD Zen 3 VM (AVX2), candle 87-113 GFLOP/s, OpenBLAS 108-144 (1.0-1.5x per shape).
//! The decoder's products (every projection, forward and backward, and the head) go
//! through [`matmul`], and so do attention's batched products: with OpenBLAS there, it
//! calls `cblas_sgemm`; without it, candle's matmul, unchanged.
//!
//! The library is opened once, at first use, from `TIDESTORE_BLAS` when it is set (a
//! file name or path of a CBLAS library; `off` keeps candle's matmul), else from
//! `libopenblas.so.0` / `libopenblas.so` (Debian's `libopenblas0-serial`,
//! `-pthread` or `-openmp`), then oneMKL's `libmkl_rt` (`pip install mkl` puts it in
//! the environment's `lib/`, off the loader's path: name it in `TIDESTORE_BLAS`). No
//! build needs either: a machine without them computes with candle's gemm, and
//! [`backend`] says which one ran (oneMKL with its version).
//!
//! Kernels: a DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels when it is loaded, from
//! the CPU's model number; a CPU newer than the build is taken for an old one (0.3.21
//! on an Emerald Rapids Xeon: "Prescott", SSE3, 33 GFLOP/s on one core against 147 with
//! its SkylakeX AVX-512 kernels). When `openblas_get_corename` names kernels narrower
//! than the CPU's vectors ([`better_core`]) and the user has not chosen with
//! `OPENBLAS_CORETYPE`, the library is closed and loaded again with that variable set
//! (OpenBLAS's documented override), and a warning says so. The variable is set while
//! the process may have other threads: Rust's own environment calls are serialised, and
//! none of tidestore's C libraries reads the environment after start-up.
//!
//! Threads: a threaded OpenBLAS (Debian's `-pthread` or `-openmp`) or oneMKL is given
//! as many threads as rayon's global pool has (`openblas_set_num_threads`,
//! `MKL_Set_Num_Threads`; a user's `OPENBLAS_NUM_THREADS` or `MKL_NUM_THREADS` is
//! kept), and then computes each product in one call with its own threads, the
//! matrices of a batch one after another. Its threads share one packed
//! copy of the weight: on a 2-core Emerald Rapids Xeon, 295-327 GFLOP/s on the 0.51B
//! LLaMA's projections against 207-290 for two bands of rows on rayon's pool, each band
//! packing all of it, and that model's fine-tuning step in RAM 8.04-8.23 s against
//! 8.67-9.06 (four alternated pairs). Its idle threads would spin for 2^28 cycles after
//! each product, on the cores candle's next operation and the store's threads need, so
//! unless `OPENBLAS_THREAD_TIMEOUT` is set it is set to 4 (2^4 cycles) before the first
//! load. A library with one thread (a serial build, or one told so) has each product cut
//! into as many bands of rows as rayon has threads, each one call, on rayon's pool.
//! Either way the work is cut by the thread count alone, so a run repeats its results
//! bit for bit.
//!
//! oneMKL is what PyTorch's x86 wheels compute with. On that Xeon it ran the 0.51B
//! step in RAM as fast as OpenBLAS's SkylakeX kernels (medians 9.57 against 9.94 s
//! over five alternated pairs, within the machine's noise), so OpenBLAS stays the
//! first choice. Its Intel OpenMP threads keep their default wait before they sleep:
//! `KMP_BLOCKTIME=0` made that step 15.2 s.
//!
//! Results differ from candle's by f32 rounding (another summation order): the tests
//! hold both to an f64 product for every transposition, offsets and band cut.

use std::ffi::{c_char, c_int, CStr};
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};

/// The environment variable that names the CBLAS library (or `off`).
pub const BLAS_ENV: &str = "TIDESTORE_BLAS";

/// Library names tried when [`BLAS_ENV`] is unset, in this order.
const DEFAULT_NAMES: [&str; 5] = [
    "libopenblas.so.0",
    "libopenblas.so",
    "libmkl_rt.so.3",
    "libmkl_rt.so.2",
    "libmkl_rt.so",
];

/// Below this many multiply-adds a product is one call (a band would cost more in
/// scheduling than it saves).
const SPLIT_MIN_MACS: usize = 1 << 22;

/// Fewest rows or columns in one band.
const BAND_MIN: usize = 32;

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

/// An opened CBLAS library.
struct Blas {
    /// Keeps `sgemm` valid.
    _lib: libloading::Library,
    sgemm: Sgemm,
    /// The library's name and, for OpenBLAS, its build (`openblas_get_config`).
    name: String,
    /// OpenBLAS's kernels (`openblas_get_corename`).
    core: Option<String>,
    /// Threads of the library's own that compute each product (1: it has none, and
    /// products are cut into bands on rayon's pool).
    threads: usize,
}

/// `Ok(None)`: candle's matmul (`off`, or no default library found). `Err`: the named
/// library could not be used.
static BLAS: OnceLock<std::result::Result<Option<Blas>, String>> = OnceLock::new();

fn blas() -> &'static std::result::Result<Option<Blas>, String> {
    BLAS.get_or_init(|| match std::env::var(BLAS_ENV) {
        Ok(v) if v == "off" => Ok(None),
        Ok(v) => open(&v)
            .map(Some)
            .map_err(|e| format!("{BLAS_ENV}={v}: {e}")),
        Err(_) => Ok(DEFAULT_NAMES.iter().find_map(|n| open(n).ok())),
    })
}

/// What computes the decoder's matrix products on the CPU, in words; an error when
/// [`BLAS_ENV`] names a library that cannot be opened or has no `cblas_sgemm`.
pub fn backend() -> Result<String> {
    match blas() {
        Ok(Some(b)) => Ok(b.name.clone()),
        Ok(None) => Ok("candle (gemm crate)".into()),
        Err(e) => Err(Error::Blas(e.clone())),
    }
}

fn open(name: &str) -> std::result::Result<Blas, String> {
    if std::env::var_os(TIMEOUT_ENV).is_none() {
        // Read by OpenBLAS when it starts its threads, at load; set (for this and any
        // later load) before the first.
        std::env::set_var(TIMEOUT_ENV, "4");
    }
    let first = load(name)?;
    let user_choice = std::env::var_os(CORETYPE_ENV).is_some();
    let Some(core) = first.core.clone().filter(|_| !user_choice) else {
        return Ok(first.announce());
    };
    let Some(better) = better_core(&core, VectorIsa::of_this_cpu()) else {
        return Ok(first.announce());
    };
    // OpenBLAS's DYNAMIC_ARCH builds pick their kernels once, when the library is
    // loaded, from the CPU's model number; a CPU newer than the build (0.3.21 on an
    // Emerald Rapids Xeon) falls back to the SSE3 kernels, ~4.5x slower than its
    // AVX-512 ones. `OPENBLAS_CORETYPE` (OpenBLAS's documented override) is read then,
    // so the library is closed and loaded again with it set.
    drop(first);
    // Set once, before the library reads it, and left set so that a later load (a child
    // process, another handle) picks the same kernels.
    std::env::set_var(CORETYPE_ENV, better);
    let second = load(name)?;
    if second.core.as_deref() == Some(better) {
        tracing::warn!(
            detected = %core,
            using = better,
            "blas: OpenBLAS did not recognise this CPU; loaded again with \
             {CORETYPE_ENV}={better} (set it yourself to choose the kernels)"
        );
    } else {
        tracing::warn!(
            detected = %core,
            wanted = better,
            got = second.core.as_deref().unwrap_or("?"),
            "blas: OpenBLAS did not recognise this CPU and was not unloaded to try again; \
             start the process with {CORETYPE_ENV}={better} for its vector kernels"
        );
    }
    Ok(second.announce())
}

/// OpenBLAS's override of the kernels its DYNAMIC_ARCH builds choose.
const CORETYPE_ENV: &str = "OPENBLAS_CORETYPE";

/// How long OpenBLAS's idle threads spin before they sleep: 2^value cycles (4 to 30).
const TIMEOUT_ENV: &str = "OPENBLAS_THREAD_TIMEOUT";

/// OpenBLAS's own thread count, which a user who sets it keeps.
const THREADS_ENV: &str = "OPENBLAS_NUM_THREADS";

/// A library loaded, before it is announced.
struct Loaded {
    lib: libloading::Library,
    sgemm: Sgemm,
    /// `openblas_get_config`'s text (the build and its kernels), if it has one.
    config: Option<String>,
    /// `openblas_get_corename`'s, if it has one.
    core: Option<String>,
    name: String,
    threads: usize,
}

impl Loaded {
    fn announce(self) -> Blas {
        let mut label = match &self.config {
            Some(c) => format!("{c} ({})", self.name),
            None => self.name.clone(),
        };
        if self.threads > 1 {
            label.push_str(&format!(", {} threads of its own", self.threads));
        }
        tracing::info!(library = %label, "blas: matrix products through cblas_sgemm");
        Blas {
            _lib: self.lib,
            sgemm: self.sgemm,
            name: label,
            core: self.core,
            threads: self.threads,
        }
    }
}

fn load(name: &str) -> std::result::Result<Loaded, String> {
    // SAFETY: loading runs the library's initialisers; a CBLAS library's (OpenBLAS:
    // CPU detection, its thread pool) may run at any time in any thread.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
    // SAFETY: `Sgemm` is `cblas_sgemm`'s C signature (CBLAS reference, enums as int).
    let sgemm: Sgemm = *unsafe { lib.get::<Sgemm>(b"cblas_sgemm\0") }.map_err(|e| e.to_string())?;
    let threads = library_threads(&lib);
    Ok(Loaded {
        config: static_text(&lib, b"openblas_get_config\0").or_else(|| mkl_version(&lib)),
        core: static_text(&lib, b"openblas_get_corename\0"),
        sgemm,
        lib,
        name: name.to_owned(),
        threads,
    })
}

/// A library's own thread pool: its setter and getter (C `void set(int)`,
/// `int get(void)`) and the environment variable that, set by the user, keeps the
/// library's own choice.
struct PoolControl {
    set: &'static [u8],
    get: &'static [u8],
    env: &'static str,
}

/// OpenBLAS's pool, then oneMKL's (`libmkl_rt`, whatever threading layer it loaded).
const POOL_CONTROLS: [PoolControl; 2] = [
    PoolControl {
        set: b"openblas_set_num_threads\0",
        get: b"openblas_get_num_threads\0",
        env: THREADS_ENV,
    },
    PoolControl {
        set: b"MKL_Set_Num_Threads\0",
        get: b"MKL_Get_Max_Threads\0",
        env: MKL_THREADS_ENV,
    },
];

/// oneMKL's own thread count, which a user who sets it keeps.
const MKL_THREADS_ENV: &str = "MKL_NUM_THREADS";

/// Sizes the library's own pool (OpenBLAS's or oneMKL's) to rayon's, unless the user
/// set its variable, and returns the threads it then has: 1 for a library without a
/// pool (neither of those, or a serial build).
fn library_threads(lib: &libloading::Library) -> usize {
    type SetThreads = unsafe extern "C" fn(c_int);
    type GetThreads = unsafe extern "C" fn() -> c_int;
    let found = POOL_CONTROLS.iter().find_map(|c| {
        // SAFETY: the symbols of `POOL_CONTROLS` have these C signatures:
        // `void f(int)` and `int f(void)`.
        let (set, get) = unsafe { (lib.get::<SetThreads>(c.set), lib.get::<GetThreads>(c.get)) };
        Some((set.ok()?, get.ok()?, c.env))
    });
    let Some((set, get, env)) = found else {
        return 1;
    };
    if std::env::var_os(env).is_none() {
        // The global pool's size, asked from a thread in no pool (the library may be
        // opened inside a smaller one).
        let pool = std::thread::spawn(rayon::current_num_threads)
            .join()
            .unwrap_or(1);
        let want = c_int::try_from(pool).unwrap_or(c_int::MAX);
        // SAFETY: any positive count is valid; it only sizes the library's own pool.
        unsafe { set(want) };
    }
    // SAFETY: takes nothing, returns the pool's size.
    let n = unsafe { get() };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Threads of the opened library's own that compute each product (1 where products
/// are cut into bands on rayon's pool instead); `None` without a library.
pub fn library_threads_in_use() -> Option<usize> {
    match blas() {
        Ok(Some(b)) => Some(b.threads),
        _ => None,
    }
}

/// What `symbol`, a `char *f(void)` returning static text (OpenBLAS's
/// `openblas_get_config`, `openblas_get_corename`), returns; `None` without it.
fn static_text(lib: &libloading::Library, symbol: &[u8]) -> Option<String> {
    type GetText = unsafe extern "C" fn() -> *const c_char;
    // SAFETY: the symbols passed here have the signature `char *f(void)`.
    let f = unsafe { lib.get::<GetText>(symbol) }.ok()?;
    // SAFETY: it takes nothing and returns a static NUL-terminated string (or null).
    let ptr = unsafe { f() };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null (checked), NUL-terminated and static (OpenBLAS's contract).
    let text = unsafe { CStr::from_ptr(ptr) };
    Some(text.to_string_lossy().trim().to_owned())
}

/// oneMKL's `MKL_Get_Version_String` (e.g. "Intel(R) oneAPI Math Kernel Library
/// Version 2026.2-Product Build …"); `None` without it.
fn mkl_version(lib: &libloading::Library) -> Option<String> {
    type GetVersion = unsafe extern "C" fn(*mut c_char, c_int);
    // SAFETY: oneMKL's `void MKL_Get_Version_String(char *buf, int len)`.
    let f = unsafe { lib.get::<GetVersion>(b"MKL_Get_Version_String\0") }.ok()?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` holds more than the `len` bytes oneMKL may write.
    unsafe { f(buf.as_mut_ptr(), (buf.len() - 1) as c_int) };
    // SAFETY: its last byte is never written and stays 0: NUL-terminated.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(text.to_string_lossy().trim().to_owned())
}

/// The widest vector instructions this CPU (and its OS) runs that OpenBLAS's sgemm
/// kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum VectorIsa {
    /// Neither of the others.
    Older,
    /// AVX2 and FMA (OpenBLAS's Haswell and Zen kernels).
    Avx2,
    /// AVX-512 F, BW, DQ, VL and CD (its SkylakeX kernels).
    Avx512,
}

impl VectorIsa {
    /// This CPU's (`Older` off x86-64).
    pub fn of_this_cpu() -> VectorIsa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
                return VectorIsa::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return VectorIsa::Avx2;
            }
        }
        VectorIsa::Older
    }

    /// Of the kernels OpenBLAS names `core` (`openblas_get_corename`, lower case),
    /// `None` when unknown here.
    fn of_openblas_core(core: &str) -> Option<VectorIsa> {
        match core.to_ascii_lowercase().as_str() {
            "skylakex" | "cooperlake" | "sapphirerapids" => Some(VectorIsa::Avx512),
            "haswell" | "zen" | "excavator" => Some(VectorIsa::Avx2),
            "prescott" | "core2" | "penryn" | "dunnington" | "nehalem" | "sandybridge" | "atom"
            | "nano" | "barcelona" | "bobcat" | "bulldozer" | "piledriver" | "steamroller"
            | "opteron" | "opteron_sse3" | "katmai" | "coppermine" | "northwood" | "banias"
            | "athlon" => Some(VectorIsa::Older),
            _ => None,
        }
    }
}

/// The OpenBLAS core to load instead of `core` on a CPU with `cpu`'s instructions:
/// `Some` only when `core` is a known one whose kernels use narrower vectors than the
/// CPU has (a CPU newer than the library, detected as an old one).
pub fn better_core(core: &str, cpu: VectorIsa) -> Option<&'static str> {
    let used = VectorIsa::of_openblas_core(core)?;
    (used < cpu).then_some(match cpu {
        VectorIsa::Avx512 => "SkylakeX",
        VectorIsa::Avx2 => "Haswell",
        VectorIsa::Older => return None,
    })
}

/// The kernels the opened OpenBLAS uses (`openblas_get_corename`); `None` without
/// OpenBLAS.
pub fn openblas_core() -> Option<String> {
    match blas() {
        Ok(Some(b)) => b.core.clone(),
        _ => None,
    }
}

/// A 2-D f32 operand as CBLAS sees it (row-major storage).
#[derive(Clone, Copy)]
struct Operand {
    /// Element offset of `(0, 0)` in the storage.
    offset: usize,
    /// Stored transposed (the logical matrix's columns are storage rows).
    trans: bool,
    /// Leading dimension: elements between storage rows.
    ld: usize,
    /// Elements between the matrices of a batch (0 for one matrix).
    batch_stride: usize,
}

impl Operand {
    /// `t`'s layout (its last two dimensions; a 3-D tensor is a batch of matrices) as a
    /// row-major matrix or the transpose of one; `None` for any other striding
    /// (broadcasts, every other row, …).
    fn of(t: &Tensor) -> Option<Operand> {
        let (dims, stride) = (t.dims(), t.layout().stride());
        let r = dims.len();
        if !(2..=3).contains(&r) {
            return None;
        }
        let (rows, cols) = (dims[r - 2], dims[r - 1]);
        let (s0, s1) = (stride[r - 2], stride[r - 1]);
        let offset = t.layout().start_offset();
        let batch_stride = if r == 3 { stride[0] } else { 0 };
        let (trans, ld) = if s1 == 1 && s0 >= cols.max(1) {
            (false, s0)
        } else if s0 == 1 && s1 >= rows.max(1) {
            (true, s1)
        } else {
            return None;
        };
        Some(Operand {
            offset,
            trans,
            ld,
            batch_stride,
        })
    }

    /// Matrix `i` of the batch.
    fn batch(self, i: usize) -> Operand {
        Operand {
            offset: self.offset + i * self.batch_stride,
            ..self
        }
    }

    /// The operand from logical row `r` and column `c` on.
    fn at(self, r: usize, c: usize) -> Operand {
        let offset = if self.trans {
            self.offset + c * self.ld + r
        } else {
            self.offset + r * self.ld + c
        };
        Operand { offset, ..self }
    }

    /// One past the last storage element of the `batch` matrices of `(rows, cols)` it
    /// addresses.
    fn end(self, batch: usize, rows: usize, cols: usize) -> usize {
        let (r, c) = if self.trans {
            (cols, rows)
        } else {
            (rows, cols)
        };
        self.offset + (batch - 1) * self.batch_stride + (r - 1) * self.ld + c
    }

    fn flag(self) -> c_int {
        if self.trans {
            CBLAS_TRANS
        } else {
            CBLAS_NO_TRANS
        }
    }
}

/// `a · b` for 2-D `a` `(m, k)` and `b` `(k, n)`, or batches of them (3-D, one batch
/// size): through `cblas_sgemm` when a CBLAS library is open and both are f32 CPU
/// tensors that no autograd graph tracks (a graph needs candle's own matmul to
/// differentiate), else candle's matmul.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let Ok(Some(blas)) = blas() else {
        return Ok(a.matmul(b)?);
    };
    match product(blas, a, b)? {
        Some(c) => Ok(c),
        None => Ok(a.matmul(b)?),
    }
}

/// `(batch, m, k, n)` of a product candle's matmul would take without broadcasting.
fn sizes(a: &Tensor, b: &Tensor) -> Option<(usize, usize, usize, usize)> {
    match (a.dims(), b.dims()) {
        (&[m, k], &[k2, n]) if k == k2 => Some((1, m, k, n)),
        (&[ba, m, k], &[bb, k2, n]) if k == k2 && ba == bb => Some((ba, m, k, n)),
        _ => None,
    }
}

/// `None` where `cblas_sgemm` does not apply.
fn product(blas: &Blas, a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    let (Some(sizes), Some(ob)) = (sizes(a, b), Operand::of(b)) else {
        return Ok(None);
    };
    if b.track_op() {
        return Ok(None);
    }
    let (sb, _) = b.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(db)) = &*sb else {
        return Ok(None);
    };
    product_over(blas, a, sizes, (db, ob))
}

/// `a · b` of sizes `(batch, m, k, n)` for `b` given as the operand `ob` over `db`;
/// `None` where `cblas_sgemm` does not apply to `a` (tracked by a graph, not an f32 CPU
/// tensor, strided otherwise), to the sizes, or to `ob`'s extent.
fn product_over(
    blas: &Blas,
    a: &Tensor,
    (batch, m, k, n): (usize, usize, usize, usize),
    (db, ob): (&[f32], Operand),
) -> Result<Option<Tensor>> {
    let Some(oa) = Operand::of(a) else {
        return Ok(None);
    };
    let fits = |x: usize| c_int::try_from(x).is_ok();
    if a.track_op()
        || !a.device().is_cpu()
        || [batch, m, n, k].contains(&0)
        || ![m, n, k, oa.ld, ob.ld].into_iter().all(fits)
    {
        return Ok(None);
    }
    let (sa, _) = a.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(da)) = &*sa else {
        return Ok(None);
    };
    let Some(c) = run(blas, (batch, m, k, n), (da, oa), (db, ob)) else {
        return Ok(None);
    };
    drop(sa);
    let c = Tensor::from_vec(c, (batch * m, n), &Device::Cpu)?;
    Ok(Some(match a.rank() {
        2 => c,
        _ => c.reshape((batch, m, n))?,
    }))
}

/// `a · Wᵀ` (`transposed`) or `a · W` for a 2-D `a` and the row-major `(rows, cols)`
/// matrix `w` held outside candle (a parameter the store lends for a block, read in
/// place): the same `cblas_sgemm` calls [`matmul`] makes for `w` in a contiguous tensor
/// (so the same result, bit for bit), else candle's matmul on a tensor copied from
/// `w`.
pub fn matmul_slice(
    a: &Tensor,
    w: &[f32],
    (rows, cols): (usize, usize),
    transposed: bool,
) -> Result<Tensor> {
    if w.len() != rows * cols {
        return Err(Error::BadParam {
            name: String::new(),
            reason: format!("{} elements for a ({rows}, {cols}) matrix", w.len()),
        });
    }
    let (k, n) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let ob = Operand {
        offset: 0,
        trans: transposed,
        ld: cols,
        batch_stride: 0,
    };
    if let (Ok(Some(blas)), &[m, ka]) = (blas(), a.dims()) {
        if ka == k {
            if let Some(c) = product_over(blas, a, (1, m, k, n), (w, ob))? {
                return Ok(c);
            }
        }
    }
    let t = Tensor::from_slice(w, (rows, cols), a.device())?;
    matmul(a, &if transposed { t.t()? } else { t })
}

/// The `batch` products `(m, k) · (k, n)` of operands `oa` over `da` and `ob` over `db`,
/// row-major; `None` where an operand reaches past its slice.
fn run(
    blas: &Blas,
    (batch, m, k, n): (usize, usize, usize, usize),
    (da, oa): (&[f32], Operand),
    (db, ob): (&[f32], Operand),
) -> Option<Vec<f32>> {
    if oa.end(batch, m, k) > da.len() || ob.end(batch, k, n) > db.len() {
        return None;
    }
    // Not zeroed: with beta = 0 `cblas_sgemm` writes every element of its output
    // without reading it (CBLAS: "C need not be set on input"), and the bands and
    // matrices below cover the whole of it.
    let mut c: Vec<MaybeUninit<f32>> = Vec::with_capacity(batch * m * n);
    c.resize_with(batch * m * n, MaybeUninit::uninit);
    // A library with threads of its own computes each matrix whole (one band); else
    // each is cut into bands on rayon's pool where the batch is smaller than the pool.
    let bands = match blas.threads {
        1 => rayon::current_num_threads().div_ceil(batch),
        _ => 1,
    };
    let each = |(i, c): (usize, &mut [MaybeUninit<f32>])| {
        let (a, b) = ((da, oa.batch(i)), (db, ob.batch(i)));
        // SAFETY: matrix `i` of each operand lies inside its slice (the batch's last
        // element was checked against the slices above), and `c` is that matrix's
        // `m × n` part of the output.
        unsafe { gemm_banded(blas.sgemm, (m, n, k), a, b, c, bands) };
    };
    if blas.threads > 1 {
        // The matrices one after another, each on the library's threads.
        c.chunks_mut(m * n).enumerate().for_each(each);
    } else {
        // The matrices across the pool (a batch as large as the pool: one call each).
        for_each_piece(&mut c, m * n, each);
    }
    let mut c = std::mem::ManuallyDrop::new(c);
    // SAFETY: every element was written by `cblas_sgemm` (see above); `MaybeUninit<f32>`
    // has `f32`'s size and alignment, and the pointer, length and capacity are the
    // vector's own, whose ownership moves to the new one.
    Some(unsafe { Vec::from_raw_parts(c.as_mut_ptr().cast::<f32>(), c.len(), c.capacity()) })
}

/// `c = a · b`, cut into at most `threads` bands of rows on rayon's pool (each band reads
/// all of `b`; on a 2-core Zen 3 rows beat columns for every projection shape, the
/// weight's gradient included).
///
/// # Safety
/// `oa` is a valid `(m, k)` operand over `da` and `ob` a valid `(k, n)` one over `db`:
/// every element they address is in bounds. `c` holds `m · n` elements.
unsafe fn gemm_banded(
    sgemm: Sgemm,
    (m, n, k): (usize, usize, usize),
    (da, oa): (&[f32], Operand),
    (db, ob): (&[f32], Operand),
    c: &mut [MaybeUninit<f32>],
    threads: usize,
) {
    let bands = if m * n * k < SPLIT_MIN_MACS {
        1
    } else {
        threads.min(m / BAND_MIN).max(1)
    };
    let rows = m.div_ceil(bands);
    let band = |(i, c): (usize, &mut [MaybeUninit<f32>])| {
        let r0 = i * rows;
        let mm = c.len() / n;
        // SAFETY: `a` from row `r0` addresses `mm` of the `m` rows of `da` that the
        // caller vouches for, and `b` all of `db`'s; `c` is this band's `mm × n` rows,
        // borrowed by it alone.
        unsafe { sgemm_band(sgemm, (mm, n, k), (da, oa.at(r0, 0)), (db, ob), c) };
    };
    for_each_piece(c, rows * n, band);
}

/// `f((i, piece))` for the `i`-th `len`-element piece of `c`: on rayon's pool where
/// there are several, on this thread where `c` is one piece.
fn for_each_piece<T: Send>(c: &mut [T], len: usize, f: impl Fn((usize, &mut [T])) + Send + Sync) {
    if c.len() <= len {
        f((0, c));
    } else {
        c.par_chunks_mut(len).enumerate().for_each(f);
    }
}

/// One `cblas_sgemm` call: `c (mm, n), row-major = a · b` (every element of `c`
/// written, none read).
///
/// # Safety
/// `a` is a valid `(mm, k)` operand over `da` and `b` a valid `(k, n)` one over `db`:
/// every element they address is in bounds. `c` holds `mm · n` elements.
unsafe fn sgemm_band(
    sgemm: Sgemm,
    (mm, n, k): (usize, usize, usize),
    (da, a): (&[f32], Operand),
    (db, b): (&[f32], Operand),
    c: &mut [MaybeUninit<f32>],
) {
    debug_assert_eq!(c.len(), mm * n);
    // Every size was checked to fit a c_int.
    let dim = |x: usize| x as c_int;
    // SAFETY: the caller's contract: the reads stay inside `da` and `db`, and the
    // writes inside `c` (`mm` rows of `n`, leading dimension `n`).
    unsafe {
        sgemm(
            CBLAS_ROW_MAJOR,
            a.flag(),
            b.flag(),
            dim(mm),
            dim(n),
            dim(k),
            1.0,
            da.as_ptr().add(a.offset),
            dim(a.ld),
            db.as_ptr().add(b.offset),
            dim(b.ld),
            0.0,
            c.as_mut_ptr().cast::<f32>(),
            dim(n),
        )
    }
}
