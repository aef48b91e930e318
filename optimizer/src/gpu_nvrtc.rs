//! NVRTC for every tidestore kernel: CUDA C to a cubin for one GPU architecture (what is
//! loaded), or to PTX (the fallback, and what `ptxas` checks in CI).
//!
//! Why a cubin: a driver refuses PTX written by an NVRTC newer than itself
//! (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), while a cubin for the device's own `sm_XY` is
//! machine code any driver of the same major version loads. cudarc's `compile_ptx*` only
//! returns PTX, so the cubin path calls NVRTC's C API here (`nvrtcGetCUBIN`).
//!
//! Invariants:
//! - no NVRTC call before `cudarc::nvrtc::sys::is_culib_present()` said the library loads
//!   (cudarc panics otherwise): [`nvrtc_available`] is asked first by every entry point;
//! - every program created is destroyed exactly once ([`Program`]'s `Drop`);
//! - every kernel is built with the same options ([`BASE_OPTIONS`]): no FMA contraction,
//!   no flush to zero, IEEE division and square root — the roundings that give the CPU's
//!   bits.

use std::ffi::{c_char, c_int, CStr, CString};

use cudarc::nvrtc::{result, sys};

use crate::error::{OptimError, Result};

/// The options every tidestore kernel is compiled with.
pub const BASE_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// Whether libnvrtc can be loaded (the kernels can be compiled, GPU or not).
#[cfg(not(feature = "cuda-linked"))]
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to `dlopen` libnvrtc under its known names; its initialisers run
    // as in any CUDA program; no memory of ours is touched.
    unsafe { sys::is_culib_present() }
}

/// Whether libnvrtc is loaded: with `cuda-linked` cudarc links it, so a process that runs
/// has it (the dynamic loader would not have started the binary without libnvrtc.so).
#[cfg(feature = "cuda-linked")]
pub fn nvrtc_available() -> bool {
    true
}

fn nvrtc_err(op: &'static str, reason: impl std::fmt::Display) -> OptimError {
    OptimError::Cuda {
        op,
        reason: reason.to_string(),
    }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(nvrtc_err(
            "nvrtc",
            "libnvrtc not found (install nvidia-cuda-nvrtc-cu12, see .ci/cuda-env.sh, and put \
             its lib dir on LD_LIBRARY_PATH)",
        ))
    }
}

/// The version of the libnvrtc loaded, as `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: libnvrtc is loadable (checked above); both pointers are to live `c_int`s.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcVersion", format!("{e:?}")))?;
    Ok((major, minor))
}

/// The loaded NVRTC's version as text (`12.4`), or why it is unknown; for logs and reports.
pub fn nvrtc_version_text() -> String {
    match nvrtc_version() {
        Ok((major, minor)) => format!("{major}.{minor}"),
        Err(e) => format!("unknown ({e})"),
    }
}

/// One NVRTC program, destroyed when dropped.
struct Program {
    prog: sys::nvrtcProgram,
    /// NVRTC keeps pointers to the source and name until the program is destroyed.
    _src: CString,
    _name: CString,
}

impl Program {
    fn new(source: &str, file: &str) -> Result<Self> {
        require_nvrtc()?;
        let src = CString::new(source).map_err(|e| nvrtc_err("nvrtc source", e))?;
        let name = CString::new(file).map_err(|e| nvrtc_err("nvrtc source name", e))?;
        let prog = result::create_program(&src, Some(&name))
            .map_err(|e| nvrtc_err("nvrtcCreateProgram", format!("{file}: {e:?}")))?;
        Ok(Program {
            prog,
            _src: src,
            _name: name,
        })
    }

    fn compile(&self, file: &str, options: &[String]) -> Result<()> {
        // SAFETY: `prog` is live (created in `new`, destroyed only in `drop`).
        let compiled = unsafe { result::compile_program(self.prog, options) };
        compiled.map_err(|e| {
            nvrtc_err(
                "nvrtc compile",
                format!("{file} ({}): {e:?}\n{}", options.join(" "), self.log()),
            )
        })
    }

    fn log(&self) -> String {
        // SAFETY: `prog` is live; the log is a NUL-terminated string NVRTC wrote into the
        // vector it sized.
        match unsafe { result::get_program_log(self.prog) } {
            Ok(raw) if !raw.is_empty() => {
                // SAFETY: NVRTC's log is NUL-terminated within `raw`.
                unsafe { CStr::from_ptr(raw.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            }
            Ok(_) => String::new(),
            Err(e) => format!("(no log: {e:?})"),
        }
    }

    fn ptx(&self) -> Result<String> {
        // SAFETY: `prog` is live and was compiled.
        let raw = unsafe { result::get_ptx(self.prog) }
            .map_err(|e| nvrtc_err("nvrtcGetPTX", format!("{e:?}")))?;
        let bytes: Vec<u8> = raw
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8(bytes).map_err(|e| nvrtc_err("nvrtcGetPTX", e))
    }

    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: `prog` is live and was compiled; `size` is a live `usize`.
        unsafe { sys::nvrtcGetCUBINSize(self.prog, &mut size) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", format!("{e:?}")))?;
        if size == 0 {
            return Err(nvrtc_err(
                "nvrtcGetCUBIN",
                "no cubin (was the program compiled for a virtual compute_XY architecture?)",
            ));
        }
        let mut out = vec![0u8; size];
        // SAFETY: `out` has the `size` bytes NVRTC said the cubin needs.
        unsafe { sys::nvrtcGetCUBIN(self.prog, out.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetCUBIN", format!("{e:?}")))?;
        Ok(out)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by `create_program` and is destroyed only here.
        if let Err(e) = unsafe { result::destroy_program(self.prog) } {
            tracing::warn!(error = ?e, "nvrtcDestroyProgram failed");
        }
    }
}

fn options_for(arch: String, extra: &[String]) -> Vec<String> {
    let mut options: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.extend(extra.iter().cloned());
    options
}

/// Compiles `source` (called `file` in messages) to PTX for the virtual architecture
/// `arch` (e.g. `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_ptx(source: &str, file: &str, arch: &str, extra: &[String]) -> Result<String> {
    let prog = Program::new(source, file)?;
    prog.compile(file, &options_for(arch.into(), extra))?;
    prog.ptx()
}

/// Compiles `source` to a cubin for the real architecture `sm_{major}{minor}`: machine
/// code for that GPU, which its driver loads whatever its version. Needs libnvrtc only.
pub fn compile_cubin(
    source: &str,
    file: &str,
    (major, minor): (i32, i32),
    extra: &[String],
) -> Result<Vec<u8>> {
    let prog = Program::new(source, file)?;
    prog.compile(file, &options_for(format!("sm_{major}{minor}"), extra))?;
    prog.cubin()
}

/// A kernel image ready for `cuModuleLoadData`, and how it was made.
#[derive(Debug)]
pub enum KernelImage {
    /// Machine code for the device's architecture (the normal case).
    Cubin(Vec<u8>),
    /// PTX for the driver to compile (when NVRTC cannot write a cubin for the device).
    Ptx(String),
}

impl KernelImage {
    /// `cubin sm_86` or `ptx compute_86`, for logs.
    pub fn describe(&self, (major, minor): (i32, i32)) -> String {
        match self {
            KernelImage::Cubin(_) => format!("cubin sm_{major}{minor}"),
            KernelImage::Ptx(_) => format!("ptx compute_{major}{minor}"),
        }
    }

    /// For `CudaContext::load_module`.
    pub fn into_module_image(self) -> cudarc::nvrtc::Ptx {
        match self {
            KernelImage::Cubin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes),
            KernelImage::Ptx(src) => cudarc::nvrtc::Ptx::from_src(src),
        }
    }
}

/// The image to load on a GPU of compute capability `cc`: a cubin for it, or, when NVRTC
/// cannot write one (an architecture newer than this NVRTC), PTX, with the reason logged.
pub fn build_for_device(source: &str, file: &str, cc: (i32, i32)) -> Result<KernelImage> {
    match compile_cubin(source, file, cc, &[]) {
        Ok(bytes) => Ok(KernelImage::Cubin(bytes)),
        Err(cubin_err) => {
            tracing::warn!(
                file,
                arch = %format!("sm_{}{}", cc.0, cc.1),
                nvrtc = %nvrtc_version_text(),
                error = %cubin_err,
                "NVRTC cannot write a cubin for this GPU; falling back to PTX, which the driver \
                 accepts only if it is at least as new as NVRTC"
            );
            let arch = format!("compute_{}{}", cc.0, cc.1);
            compile_ptx(source, file, &arch, &[])
                .map(KernelImage::Ptx)
                .map_err(|ptx_err| {
                    nvrtc_err(
                        "nvrtc compile",
                        format!("cubin: {cubin_err}; PTX fallback: {ptx_err}"),
                    )
                })
        }
    }
}

/// The SM architecture a cubin was built for, from its ELF header, or why it is not one.
/// CUDA cubins are 64-bit little-endian ELF with `e_machine` EM_CUDA (190); the
/// architecture is in `e_flags`: bits 0..8 in the older ABI (`EI_ABIVERSION` < 8), bits
/// 8..16 in the newer one.
pub fn cubin_sm(image: &[u8]) -> std::result::Result<u32, String> {
    if image.len() < 64 || &image[..4] != b"\x7fELF" {
        return Err("not an ELF image".into());
    }
    if image[4] != 2 || image[5] != 1 {
        return Err("not a 64-bit little-endian ELF".into());
    }
    let e_machine = u16::from_le_bytes([image[18], image[19]]);
    if e_machine != 190 {
        return Err(format!("e_machine {e_machine}, not EM_CUDA (190)"));
    }
    let e_flags = u32::from_le_bytes([image[48], image[49], image[50], image[51]]);
    let abi_version = image[8];
    Ok(if abi_version >= 8 {
        (e_flags >> 8) & 0xff
    } else {
        e_flags & 0xff
    })
}
