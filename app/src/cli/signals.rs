//! SIGINT and SIGTERM: the scratch paths of the run ([`crate::scratch`]: swap
//! directories, `io-bench`'s file, checkpoint and export temporaries) are removed, what
//! was removed is said on stderr, and the process exits with 128 + the signal (130 for
//! Ctrl-C, 143 for SIGTERM), as a shell reports a process the signal killed, through
//! `_exit`: the C libraries' destructors do not run under threads still using them.
//!
//! The handler itself only writes the signal's number into a pipe (`write` is
//! async-signal-safe); a thread blocked on the pipe's other end does the rest, in
//! ordinary code. Checkpoints and exports are renamed into place whole, so a signal at
//! any moment leaves each either complete or absent; an interrupted run keeps the
//! checkpoints it completed. Child processes (fio) get the default dispositions back at
//! `exec`. A signal ignored when the process starts (a background job of a shell
//! without job control, `nohup`) stays ignored.

use std::io::Write;
use std::sync::atomic::{AtomicI32, Ordering};

/// The pipe's write end, for the handler (-1 until installed).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

#[allow(unsafe_code)]
extern "C" fn on_signal(sig: libc::c_int) {
    let fd = PIPE_WRITE.load(Ordering::Relaxed);
    let byte = sig as u8;
    // SAFETY: `write` is async-signal-safe; `byte` lives across the call and the length
    // is 1. A failed write (a full pipe: a second signal before the first is handled)
    // loses nothing, the first one ends the process.
    unsafe {
        libc::write(fd, std::ptr::addr_of!(byte).cast(), 1);
    }
}

/// Installs the handler for SIGINT and SIGTERM and starts the thread that cleans up.
/// Failing to install is logged: the run goes on, uncleaned on a signal as before.
#[allow(unsafe_code)]
pub fn install() {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for `pipe2` to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(),
            "no signal pipe: an interrupted run may leave scratch files");
        return;
    }
    let [read_fd, write_fd] = fds;
    PIPE_WRITE.store(write_fd, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("tidestore-signals".into())
        .spawn(move || wait_and_clean(read_fd));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no signal thread: an interrupted run may leave scratch files");
        return;
    }
    for sig in [libc::SIGINT, libc::SIGTERM] {
        if ignored(sig) {
            // A background job of a shell without job control, `nohup`: whoever started
            // the process asked for the signal to be ignored, and it stays so.
            continue;
        }
        // SAFETY: a zeroed `sigaction` is a valid starting value; the handler is an
        // `extern "C" fn(c_int)` that only calls `write` (async-signal-safe); the mask
        // is emptied by `sigemptyset` before use.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if installed != 0 {
            tracing::warn!(sig, error = %std::io::Error::last_os_error(),
                "cannot handle the signal: an interrupted run may leave scratch files");
        }
    }
}

/// Whether `sig` is ignored (`SIG_IGN`, inherited from the parent).
#[allow(unsafe_code)]
fn ignored(sig: libc::c_int) -> bool {
    // SAFETY: a zeroed `sigaction` is valid for `sigaction` to fill; a null new action
    // only queries the current one.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// Waits for a signal's number on the pipe, then removes the scratch paths and exits.
#[allow(unsafe_code)]
fn wait_and_clean(read_fd: libc::c_int) {
    let mut byte = 0u8;
    loop {
        // SAFETY: `byte` is a valid one-byte buffer for the duration of the call.
        let n = unsafe { libc::read(read_fd, std::ptr::addr_of_mut!(byte).cast(), 1) };
        if n == 1 {
            break;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return;
    }
    let sig = libc::c_int::from(byte);
    let name = if sig == libc::SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    };
    // A checkpoint or export being written is finished first (and no other begun), so
    // that no temporary of it appears after the clean-up.
    crate::scratch::close_writes();
    let removed = crate::scratch::remove_registered();
    let list: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
    let _ = writeln!(
        std::io::stderr(),
        "\ninterrupted by {name}: stopped; removed {}; completed checkpoints are kept",
        if list.is_empty() {
            "no scratch files".to_string()
        } else {
            list.join(", ")
        }
    );
    let _ = std::io::stdout().flush();
    // `_exit`, not `exit`: other threads are still running (a matrix product on
    // OpenBLAS's threads, the store's I/O), and `exit` would run the C libraries'
    // destructors under them (OpenBLAS frees the buffers its threads are using).
    // SAFETY: `_exit` ends the process at once; nothing after it runs.
    unsafe { libc::_exit(128 + sig) }
}
