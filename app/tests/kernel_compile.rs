//! Guards against a GPU kernel of the workspace that does not compile or spills
//! registers, on machines without a GPU: the optimizer's AdamW source and the bench's
//! kernels are compiled to PTX with NVRTC (libnvrtc only) and, when `ptxas` is on PATH,
//! assembled for sm_86, sm_89 and sm_90 with `-v`; registers and spills are printed per kernel
//! and any spill fails the test. Without the `cuda` feature or without libnvrtc the
//! test prints why it skipped and passes — except where `TIDESTORE_REQUIRE_KERNEL_TOOLS`
//! is set (CI sets it after installing both with `.ci/cuda-env.sh`): there a missing tool
//! fails the test, so CI never passes without having compiled every kernel.
//!
//! It also guards against a kernel image a GPU's driver would refuse: what a GPU loads is
//! a cubin NVRTC writes for the device's own architecture (PTX from an NVRTC newer than
//! the driver is refused), so every kernel source must compile to a cubin for sm_86,
//! sm_89 and sm_90 — a CUDA ELF whose header names that architecture.

/// Skip with the reason, or fail where the environment promises the tools.
fn missing(reason: String) {
    if std::env::var_os("TIDESTORE_REQUIRE_KERNEL_TOOLS").is_some() {
        panic!("TIDESTORE_REQUIRE_KERNEL_TOOLS is set but {reason}");
    }
    println!("skipped: {reason}");
}

/// Kernel sources: (name, PTX for compute_86, entry points it must define).
#[cfg(feature = "cuda")]
fn sources() -> Vec<(&'static str, String, Vec<String>)> {
    let adamw = tidestore::optimizer::gpu::compile_ptx(Some("compute_86"))
        .expect("NVRTC compiles the optimizer's AdamW kernels");
    let mut adamw_entries = Vec::new();
    for mode in ["adamw", "l2"] {
        for g in ["f32", "f16", "bf16"] {
            for out in ["none", "f16", "bf16"] {
                adamw_entries.push(format!("adamw_{g}_{out}_{mode}"));
            }
        }
    }
    let bench = tidestore_app::gpu::compile_ptx(Some("compute_86"))
        .expect("NVRTC compiles the bench's kernels");
    let bench_entries = tidestore_app::gpu::KERNEL_NAMES
        .iter()
        .map(|s| s.to_string())
        .collect();
    let compact = tidestore::optimizer::gpu::compile_compact_ptx(Some("compute_86"))
        .expect("NVRTC compiles the compact-moment AdamW kernels");
    // The compact program holds the AdamW kernels it is appended to, then its own.
    let mut compact_entries = adamw_entries.clone();
    compact_entries.extend(tidestore::optimizer::cuda_source::compact_kernel_names());
    vec![
        ("adamw", adamw, adamw_entries),
        ("adamw_compact", compact, compact_entries),
        ("bench", bench, bench_entries),
    ]
}

#[test]
fn every_kernel_compiles_to_ptx_and_assembles_without_spills() {
    #[cfg(not(feature = "cuda"))]
    missing("the test was built without the `cuda` feature".into());
    #[cfg(feature = "cuda")]
    compile_and_assemble();
}

#[test]
fn every_kernel_compiles_to_a_cubin_for_each_target_architecture() {
    #[cfg(not(feature = "cuda"))]
    missing("the test was built without the `cuda` feature".into());
    #[cfg(feature = "cuda")]
    compile_cubins();
}

#[cfg(feature = "cuda")]
fn compile_cubins() {
    use tidestore::optimizer::gpu::{cubin_sm, nvrtc_version_text};
    if !tidestore_app::gpu::nvrtc_available() {
        missing(format!(
            "libnvrtc not found: LD_LIBRARY_PATH={}",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        ));
        return;
    }
    let nvrtc = nvrtc_version_text();
    println!("NVRTC {nvrtc}");
    if let Ok(pinned) = std::env::var("TIDESTORE_NVRTC_PINNED") {
        // .ci/cuda-env.sh pins e.g. 12.4.127: the library loaded must be that release.
        let want: String = pinned.split('.').take(2).collect::<Vec<_>>().join(".");
        assert_eq!(
            nvrtc, want,
            "the NVRTC loaded is not the one .ci/cuda-env.sh pins"
        );
    }
    for cc in [(8, 6), (8, 9), (9, 0)] {
        let sm = (cc.0 * 10 + cc.1) as u32;
        let images = [
            (
                "adamw",
                tidestore::optimizer::gpu::compile_cubin(cc).expect("NVRTC writes the AdamW cubin"),
            ),
            (
                "bench",
                tidestore_app::gpu::compile_cubin(cc).expect("NVRTC writes the bench cubin"),
            ),
        ];
        for (name, image) in &images {
            assert_eq!(&image[..4], b"\x7fELF", "{name} sm_{sm}: not an ELF image");
            let got = cubin_sm(image).unwrap_or_else(|e| panic!("{name} sm_{sm}: {e}"));
            println!(
                "{name}: cubin sm_{sm}, {} bytes, ELF e_flags arch sm_{got}",
                image.len()
            );
            assert_eq!(got, sm, "{name}: the cubin is for sm_{got}, not sm_{sm}");
        }
    }
}

#[cfg(feature = "cuda")]
fn compile_and_assemble() {
    if !tidestore_app::gpu::nvrtc_available() {
        missing(format!(
            "libnvrtc not found: LD_LIBRARY_PATH={}",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        ));
        return;
    }
    let sources = sources();
    for (name, ptx, entries) in &sources {
        let count = ptx.matches(".entry").count();
        println!("{name}: PTX {} bytes, {count} kernels", ptx.len());
        assert_eq!(count, entries.len(), "{name}: kernel count");
        for e in entries {
            assert!(
                ptx.contains(&format!(".entry {e}(")),
                "{name}: kernel {e} missing from the PTX"
            );
        }
    }

    let ptxas = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    });
    let Some(ptxas) = ptxas else {
        missing("ptxas not found on PATH: PTX compiled, assembly not checked".into());
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, ptx, _) in &sources {
        let src = dir.path().join(format!("{name}.ptx"));
        std::fs::write(&src, ptx).expect("write PTX");
        for sm in ["sm_86", "sm_89", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={sm}"))
                .arg("-v")
                .arg(&src)
                .arg("-o")
                .arg(dir.path().join(format!("{name}.{sm}.cubin")))
                .output()
                .expect("ptxas runs");
            let log = String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "ptxas {name} {sm} failed:\n{log}");
            let mut spills = 0u64;
            let mut current = String::new();
            for line in log.lines() {
                if let Some(i) = line.find("Compiling entry function '") {
                    current = line[i + 26..].split('\'').next().unwrap_or("").to_string();
                }
                // "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                for part in line.split(',') {
                    let words: Vec<&str> = part.split_whitespace().collect();
                    if words.len() == 4 && words[1] == "bytes" && words[2] == "spill" {
                        let n = words[0].parse::<u64>().unwrap_or(u64::MAX);
                        if n > 0 {
                            println!("{sm} {current}: {}", line.trim());
                        }
                        spills = spills.saturating_add(n);
                    }
                }
                if line.contains("Used") && line.contains("registers") {
                    println!(
                        "{sm} {current}: {}",
                        line.trim().trim_start_matches("ptxas info    : ")
                    );
                }
            }
            assert_eq!(spills, 0, "{name} {sm}: register spills:\n{log}");
        }
    }
}
