//! Guards against a machine without io_uring (a container whose seccomp profile blocks
//! `io_uring_setup`, an old kernel, `kernel.io_uring_disabled`) failing to open the NVMe
//! tier: `auto` must fall back to the thread-pool engine, and asking for io_uring
//! explicitly must give a typed error, not a panic.
//!
//! The test blocks `io_uring_setup` for real with a seccomp filter installed on one
//! thread (filters apply to the installing thread and its children only).

mod common;

use tidestore_io::{BackendKind, Engine, EngineChoice, IoConfig, IoError};

/// Make `io_uring_setup` fail with ENOSYS on the calling thread. Returns false when the
/// kernel refuses the filter.
fn block_io_uring_on_this_thread() -> bool {
    let nr = libc::SYS_io_uring_setup as u32;
    let mut filter = [
        // Load the syscall number (offset 0 of struct seccomp_data).
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: nr,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    common::install_seccomp_filter(&mut filter)
}

fn cfg(engine: EngineChoice) -> IoConfig {
    IoConfig {
        engine,
        ..IoConfig::default()
    }
}

#[test]
fn auto_falls_back_to_threads_when_io_uring_is_blocked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    let outcome = std::thread::spawn(move || {
        if !block_io_uring_on_this_thread() {
            return None;
        }
        let auto = Engine::open(&path, &cfg(EngineChoice::Auto), true).map(|e| e.kind());
        let forced = Engine::open(&path, &cfg(EngineChoice::IoUring), true).map(|e| e.kind());
        Some((auto, forced))
    })
    .join()
    .unwrap();
    let Some((auto, forced)) = outcome else {
        println!("skipped: the kernel refused a seccomp filter");
        return;
    };
    assert_eq!(auto.unwrap(), BackendKind::ThreadPool);
    match forced {
        Err(IoError::Setup { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::ENOSYS)),
        other => panic!("expected a typed setup error, got {other:?}"),
    }
}

#[test]
fn auto_prefers_io_uring_where_it_works() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    match Engine::open(&path, &cfg(EngineChoice::IoUring), true) {
        Err(e) => println!("skipped: io_uring unavailable here: {e}"),
        Ok(_) => {
            let auto = Engine::open(&path, &cfg(EngineChoice::Auto), true).unwrap();
            assert_eq!(auto.kind(), BackendKind::IoUring);
        }
    }
}
