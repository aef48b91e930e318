//! Guards against two owners writing one swap file at once (two benchmark runs sharing
//! `nvme.dir`, say): each would overwrite the other's slots, and every later read of the
//! overwritten chunks would fail its checksum. A swap file is locked (`flock`, exclusive)
//! while it is open: a second open or create is a typed setup error, and the file opens
//! again once the first owner has closed it.

use tidestore_io::compress::Compression;
use tidestore_io::{AlignedBuf, IoConfig, IoError, SwapFile};

const SLOT: usize = 64 * 1024;

fn cfg() -> IoConfig {
    IoConfig {
        block_bytes: 16 * 1024,
        ..IoConfig::default()
    }
}

#[test]
fn an_open_swap_file_cannot_be_opened_twice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut first = SwapFile::create(&path, SLOT, 4, &cfg(), Compression::Off).unwrap();
    let mut buf = AlignedBuf::new_zeroed(SLOT).unwrap();
    buf.fill(0x5a);
    let (r, _) = first.write_chunk(7, buf, SLOT);
    r.unwrap();

    for second in [
        SwapFile::open(&path, &cfg()),
        SwapFile::open_or_create(&path, SLOT, 4, &cfg(), Compression::Off),
    ] {
        match second {
            Err(IoError::Setup { source, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EWOULDBLOCK), "{source}")
            }
            other => panic!("a second owner of an open swap file: {other:?}"),
        }
    }

    // The first owner is unaffected, and once it closes the file opens again.
    let (r, buf) = first.read_chunk(7, AlignedBuf::new_zeroed(SLOT).unwrap());
    assert_eq!(r.unwrap(), SLOT);
    assert!(buf.iter().all(|&b| b == 0x5a));
    drop(first);
    let mut again = SwapFile::open(&path, &cfg()).unwrap();
    let (r, buf) = again.read_chunk(7, AlignedBuf::new_zeroed(SLOT).unwrap());
    assert_eq!(r.unwrap(), SLOT);
    assert!(buf.iter().all(|&b| b == 0x5a));
}
