//! Helpers shared by the io crate's integration tests.

/// Install `filter` as a seccomp program on the calling thread (filters apply to the
/// installing thread and the threads it spawns). Returns false when the kernel refuses.
pub fn install_seccomp_filter(filter: &mut [libc::sock_filter]) -> bool {
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: plain prctl calls; `prog` and `filter` outlive the call, which copies them.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return false;
        }
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const libc::sock_fprog,
        ) == 0
    }
}
