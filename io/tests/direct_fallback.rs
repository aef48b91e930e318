//! Guards against a filesystem that refuses O_DIRECT (some FUSE, overlay and older tmpfs
//! mounts answer EINVAL) making the NVMe tier unusable: the swap file must fall back to
//! buffered I/O, log it, and still round-trip chunks byte-exact.
//!
//! The refusal is made real with a seccomp filter, on one thread, that answers EINVAL to
//! every `openat` asking for O_DIRECT.

mod common;

use tidestore_io::compress::Compression;
use tidestore_io::{AlignedBuf, IoConfig, SwapFile};

/// Make `openat(…, O_DIRECT)` fail with EINVAL on the calling thread. Returns false when
/// the kernel refuses the filter.
fn refuse_o_direct_on_this_thread() -> bool {
    let ld = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let jeq = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    let and = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    let o_direct = libc::O_DIRECT as u32;
    let mut filter = [
        // seccomp_data: nr at 0, args[2] (the open flags, low word) at 16 + 2 * 8.
        libc::sock_filter {
            code: ld,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: jeq,
            jt: 0,
            jf: 4,
            k: libc::SYS_openat as u32,
        },
        libc::sock_filter {
            code: ld,
            jt: 0,
            jf: 0,
            k: 32,
        },
        libc::sock_filter {
            code: and,
            jt: 0,
            jf: 0,
            k: o_direct,
        },
        libc::sock_filter {
            code: jeq,
            jt: 0,
            jf: 1,
            k: o_direct,
        },
        libc::sock_filter {
            code: ret,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EINVAL as u32,
        },
        libc::sock_filter {
            code: ret,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    common::install_seccomp_filter(&mut filter)
}

#[test]
fn swap_file_falls_back_to_buffered_io_where_o_direct_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let outcome = std::thread::spawn(move || {
        if !refuse_o_direct_on_this_thread() {
            return None;
        }
        let cfg = IoConfig::default();
        let mut swap = SwapFile::create(&path, 64 << 10, 4, &cfg, Compression::Off)
            .expect("buffered fallback");
        let direct = swap.engine().aligned_only();
        let mut buf = AlignedBuf::new_zeroed(64 << 10).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let (res, buf) = swap.write_chunk(3, buf, 50_000);
        res.unwrap();
        let expect = buf[..50_000].to_vec();
        swap.flush().unwrap();
        drop(swap);
        let mut swap = SwapFile::open(&path, &cfg).expect("reopen, buffered");
        let (res, back) = swap.read_chunk(3, AlignedBuf::new_zeroed(64 << 10).unwrap());
        Some((direct, res.unwrap(), back[..50_000] == expect[..]))
    })
    .join()
    .unwrap();
    let Some((direct, len, same)) = outcome else {
        println!("skipped: the kernel refused a seccomp filter");
        return;
    };
    assert!(
        !direct,
        "O_DIRECT was refused, so the engine must run buffered"
    );
    assert_eq!(len, 50_000);
    assert!(same, "chunk read back byte-exact through buffered I/O");
}
