//! Guards against NVMe requests standing still while the tier's owner computes: the
//! engine starts a request's pieces only when polled, at most the queue depth at once,
//! so without the tier's I/O pump a chunk of many pieces would advance only at the
//! owner's calls. Here the owner submits a read of 16 pieces over a queue of 2 and then
//! does not touch the tier: the pump alone must carry it to the end (one owner poll
//! moves at most one round of 2 pieces).

use std::time::{Duration, Instant};

use tidestore_io::{AlignedBuf, Compression, Engine, FaultConfig, MemoryBackend, SwapFile};
use tidestore_tiers::NvmeTier;

const BLOCK: usize = 4096;
const PIECES: usize = 16;

#[test]
fn the_pump_finishes_a_read_the_owner_never_polls() {
    let backend = MemoryBackend::new(8 << 20, 2, FaultConfig::none());
    let engine = Engine::new(Box::new(backend), BLOCK, true).expect("engine");
    let swap = SwapFile::with_engine(engine, PIECES * BLOCK, 4, Compression::Off).expect("swap");
    let mut nvme = NvmeTier::from_swap_file(swap);
    let data: Vec<u8> = (0..PIECES * BLOCK).map(|i| (i % 251) as u8).collect();
    let mut buf = AlignedBuf::new_zeroed(PIECES * BLOCK).expect("buffer");
    buf[..data.len()].copy_from_slice(&data);
    let (written, buf) = nvme.write_chunk(7, buf, data.len());
    written.expect("write");

    nvme.submit_read(7, buf);
    // The owner computes; only the pump touches the engine. A generous deadline: the
    // pump polls every 200 µs, so this takes milliseconds when it works.
    let deadline = Instant::now() + Duration::from_secs(20);
    while nvme.finished() == 0 {
        assert!(
            Instant::now() < deadline,
            "the read did not finish without the owner polling: the I/O pump is not running"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let done = nvme.poll().expect("the finished read is handed back");
    done.result.expect("read verified");
    assert_eq!(&done.buf[..data.len()], &data[..]);
    assert_eq!(nvme.outstanding(), 0);
}
