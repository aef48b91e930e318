//! The NCCL engine: this process as a rank of an NCCL communicator on its own GPU, through
//! cudarc's binding (loaded at run time, as the rest of tidestore's CUDA).
//!
//! - **Launch**: torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT`); each rank opens GPU `LOCAL_RANK` (unless `device.ordinal` names
//!   one for the tier; the communicator's GPU is always the local rank's).
//! - **The communicator's id**, 128 bytes that rank 0 makes: with `NCCL_COMM_ID`
//!   (`host:port`) in the environment, NCCL derives it from that address on every rank,
//!   and rank 0 listens there (NCCL's own rendezvous; works across machines). Without it,
//!   rank 0 writes the id into a file named after `MASTER_ADDR` and `MASTER_PORT` in
//!   `TIDESTORE_NCCL_ID_DIR` (default: the system's temporary directory) and the others
//!   read it, as candle's multi-process example does: the ranks must share that
//!   directory (one machine, or a shared file system). No socket of tidestore's own.
//! - **The collectives** take and give host slices ([`Collective`]'s contract, which the
//!   sharded step loop calls with the chunks' host memory): each call copies its input
//!   onto the GPU, runs the collective on this rank's stream and copies the result back,
//!   waiting for the stream. The copies cost PCIe time that NVLink-connected ranks would
//!   not need with device-resident shards; the trainer's step loop holds shards on the
//!   host today.
//! - **A rank that dies**: NCCL has no abort that reaches the other ranks; torchrun's
//!   agent stops them when one exits with an error. Ranks started by hand with these
//!   variables can wait in a collective for a rank that is gone.

use std::sync::Arc;
use std::time::SystemTime;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use tidestore_train::{Collective, Result as TrainResult, TrainError};

use super::id_file::{await_id, publish, IdExchange, ID_BYTES, ID_WAIT};
use crate::error::{Error, Result};

/// This process as one rank of an NCCL communicator.
pub struct NcclRank {
    comm: Comm,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use
// it at once; every call on this rank goes through `tidestore_train::Ranks`, which makes
// them all from its one collectives thread, one after another, and each call binds the
// CUDA context to its thread first.
unsafe impl Send for NcclRank {}

impl NcclRank {
    /// Joins rank `rank` of `world` on GPU `ordinal`, agreeing on the id by `exchange`.
    pub fn init(rank: usize, world: usize, ordinal: usize, exchange: &IdExchange) -> Result<Self> {
        if !crate::gpu::cuda_available() {
            return Err(Error::Finetune(
                "NCCL ranks need a GPU each, and libcuda cannot be loaded on this machine".into(),
            ));
        }
        if !nccl_available() {
            return Err(Error::Finetune(
                "libnccl cannot be loaded: cudarc opens it as libnccl.so (NCCL's -dev package \
                 has that name; its runtime package and PyTorch's nvidia-nccl wheel ship only \
                 libnccl.so.2: link it as libnccl.so in a directory on LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            Error::Finetune(format!(
                "rank {rank}: cannot open GPU {ordinal} for NCCL: {e}"
            ))
        })?;
        let stream = ctx
            .new_stream()
            .map_err(|e| Error::Finetune(format!("rank {rank}: a CUDA stream for NCCL: {e}")))?;
        let id = agree_on_id(rank, exchange)?;
        // NCCL makes the communicator on the GPU current on this thread.
        ctx.bind_to_thread()
            .map_err(|e| Error::Finetune(format!("rank {rank}: binding GPU {ordinal}: {e}")))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(|e| {
            Error::Finetune(format!(
                "rank {rank} of {world}: NCCL could not make the communicator: {e:?}"
            ))
        })?;
        // Every rank is in the communicator now: the id file has served.
        if let (0, IdExchange::File(path)) = (rank, exchange) {
            let _ = std::fs::remove_file(path);
        }
        Ok(NcclRank {
            comm,
            stream,
            ctx,
            rank,
            world,
        })
    }

    /// `input` onto the GPU, `op` on it and a buffer of `out.len()`, the result into
    /// `out`; waits for the stream.
    fn run<T, F>(&mut self, what: &str, input: &[T], out: &mut [T], op: F) -> TrainResult<()>
    where
        T: NcclType + DeviceRepr + ValidAsZeroBits,
        F: FnOnce(&Comm, &CudaSlice<T>, &mut CudaSlice<T>) -> std::result::Result<(), String>,
    {
        if input.is_empty() && out.is_empty() {
            // Nothing to move (a zero-length device buffer is not a valid allocation).
            return Ok(());
        }
        let fail = |e: String| TrainError::Collective(format!("NCCL {what}: {e}"));
        self.ctx.bind_to_thread().map_err(|e| fail(e.to_string()))?;
        let src = self
            .stream
            .clone_htod(input)
            .map_err(|e| fail(e.to_string()))?;
        let mut dst = self
            .stream
            .alloc_zeros::<T>(out.len())
            .map_err(|e| fail(e.to_string()))?;
        op(&self.comm, &src, &mut dst).map_err(fail)?;
        self.stream
            .memcpy_dtoh(&dst, out)
            .map_err(|e| fail(e.to_string()))?;
        self.stream.synchronize().map_err(|e| fail(e.to_string()))
    }

    /// NCCL reads and writes `world` times the shard's length on the whole's side, with
    /// no bound of its own: a whole of another length would be read or written past its
    /// end on the GPU, so it is refused here.
    fn check_lengths(&self, what: &str, shard: usize, whole: usize) -> TrainResult<()> {
        if shard * self.world == whole {
            return Ok(());
        }
        Err(TrainError::Collective(format!(
            "NCCL {what}: {whole} elements for {} ranks of {shard}",
            self.world
        )))
    }

    /// Every rank's `shard` into `out`, in rank order.
    fn gather<T>(&mut self, shard: &[T], out: &mut [T]) -> TrainResult<()>
    where
        T: NcclType + DeviceRepr + ValidAsZeroBits,
    {
        self.check_lengths("all_gather", shard.len(), out.len())?;
        self.run("all_gather", shard, out, |c, s, d| {
            c.all_gather(s, d).map(drop).map_err(nccl_err)
        })
    }
}

/// Whether libnccl can be loaded.
#[cfg(not(feature = "gpu"))]
fn nccl_available() -> bool {
    // SAFETY: only tries to `dlopen` NCCL's library under its known names; its
    // initialisers run as in any NCCL program; no memory of ours is touched.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// Whether libnccl is loaded: with `gpu` cudarc links it, so a process that runs has it.
#[cfg(feature = "gpu")]
fn nccl_available() -> bool {
    true
}

/// The communicator's id: made by rank 0, told to the others by `exchange`.
fn agree_on_id(rank: usize, exchange: &IdExchange) -> Result<Id> {
    let make =
        || Id::new().map_err(|e| Error::Finetune(format!("NCCL could not make an id: {e:?}")));
    match exchange {
        IdExchange::Env => make(),
        IdExchange::File(path) if rank == 0 => {
            let id = make()?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            publish(path, &bytes)?;
            Ok(id)
        }
        IdExchange::File(path) => {
            let bytes = await_id(path, SystemTime::now(), ID_WAIT)?;
            let mut internal = [0 as std::ffi::c_char; ID_BYTES];
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            Ok(Id::uninit(internal))
        }
    }
}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> String {
    format!("{e:?}")
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn engine(&self) -> &str {
        "nccl"
    }

    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> TrainResult<()> {
        self.gather(shard, out)
    }

    fn all_gather_u16(&mut self, shard: &[u16], out: &mut [u16]) -> TrainResult<()> {
        // Gathered as bytes: NCCL moves them without arithmetic.
        self.gather::<u8>(bytemuck::cast_slice(shard), bytemuck::cast_slice_mut(out))
    }

    fn reduce_scatter(&mut self, whole: &[f32], shard: &mut [f32]) -> TrainResult<()> {
        self.check_lengths("reduce_scatter", shard.len(), whole.len())?;
        self.run("reduce_scatter", whole, shard, |c, s, d| {
            c.reduce_scatter(s, d, &ReduceOp::Sum)
                .map(drop)
                .map_err(nccl_err)
        })
    }

    fn all_reduce(&mut self, values: &mut [f64]) -> TrainResult<()> {
        let mine = values.to_vec();
        self.run("all_reduce", &mine, values, |c, s, d| {
            c.all_reduce(s, d, &ReduceOp::Sum)
                .map(drop)
                .map_err(nccl_err)
        })
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> TrainResult<Vec<Vec<u8>>> {
        // Lengths first, then every rank's bytes padded to the longest.
        let mut lens = vec![0u64; self.world];
        self.gather(&[mine.len() as u64], &mut lens)?;
        let longest = lens.iter().copied().max().unwrap_or(0).max(1) as usize;
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let mut all = vec![0u8; longest * self.world];
        self.gather(&padded, &mut all)?;
        Ok(all
            .chunks(longest)
            .zip(&lens)
            .map(|(part, &n)| part[..n as usize].to_vec())
            .collect())
    }
}
