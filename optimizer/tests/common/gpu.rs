//! Shared helpers of the GPU tests: a CUDA device tier or a printed reason to skip, and
//! chunk images copied to and from it.

use tidestore_io::AlignedBuf;
use tidestore_optimizer::HybridAdamW;
use tidestore_tiers::{Device, DeviceConfig, DeviceMem};

/// A CUDA device tier of 256 MiB when `hybrid` has its GPU kernels and a GPU is here;
/// otherwise `None`, having printed why the test skips.
pub fn cuda_or_skip(hybrid: &HybridAdamW) -> Option<Device> {
    if let Err(e) = hybrid.gpu_status() {
        println!("skipped: no GPU kernel: {e}");
        return None;
    }
    match Device::cuda(&DeviceConfig::new(1 << 28)) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: no CUDA device tier: {e}");
            None
        }
    }
}

/// `img` in fresh device memory of `chunk`.
pub fn upload(dev: &mut Device, chunk: u64, img: &[u8]) -> DeviceMem {
    let mem = dev.alloc(chunk, img.len()).unwrap();
    let mut buf = AlignedBuf::new_zeroed(img.len()).unwrap();
    buf[..img.len()].copy_from_slice(img);
    let id = dev.copy_to_device(chunk, buf, mem, img.len());
    let done = dev.wait_copy_id(id).expect("the copy completes");
    done.result.unwrap();
    done.mem
}

/// Every byte of `mem`, and the memory back.
pub fn download(dev: &mut Device, mem: DeviceMem) -> (DeviceMem, Vec<u8>) {
    let len = mem.bytes();
    let buf = AlignedBuf::new_zeroed(len).unwrap();
    let id = dev.copy_to_host(mem.chunk(), mem, buf, len);
    let done = dev.wait_copy_id(id).expect("the copy completes");
    done.result.unwrap();
    (done.mem, done.host[..len].to_vec())
}
