//! tidestore-train: training over a tidestore chunk store — the one place where
//! training meets the store.
//!
//! The layers below keep tensors in chunks (`tidestore-chunk`, over `tidestore-tiers`
//! and `tidestore-io`) and step AdamW over slices (`tidestore-optimizer`, pure compute).
//! This crate is where the two meet, once:
//! - [`Trainer`] ([`trainer`]): a training run's store opened from a config and the
//!   model's parameter specs; values in and out; gradients taken (written, their norm
//!   taken, reported to the step loop — once, here); the step; checkpoints;
//! - [`blocks`]: the layer-streamed block driver over a framework-free [`Blocks`] trait;
//! - [`step`]: the step loop that steps each tensor's groups where the store holds them;
//! - [`peers`]: what the step needs of the other ranks of a data-parallel run;
//! - [`ranks`]: Gemini's shard layout and the collectives of a data-parallel run;
//! - [`checkpoint`] and [`CheckpointDir`]: checkpoints streamed out of the store and back;
//! - [`hf`]: the Hugging Face formats a model comes in and goes out in;
//! - [`aio`]: the block-I/O engine, for front ends that move tensors to and from files
//!   themselves (the Python package's async tensor I/O).
//!
//! Front ends (the candle models, the Python package, the bench) import this crate, not
//! the store's: the types they need of the layers below are re-exported here.
//!
//! Every fallible function returns [`TrainError`], the one error type of the crate.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod blocks;
pub mod checkpoint;
pub mod checkpoint_dir;
pub mod error;
pub mod hf;
pub mod peers;
pub mod ranks;
pub mod step;
pub mod trainer;

pub use blocks::{
    train_step, BlockGrads, BlockParams, BlockSchedule, Blocks, Loan, MicroBatchOrder, SavedInputs,
    StepTimes, StreamedStep, Upstream,
};
pub use checkpoint::{CheckpointState, FileTensor, CHECKPOINT_FORMAT};
pub use checkpoint_dir::CheckpointDir;
pub use error::{Result, TrainError};
pub use peers::NormPeers;
pub use ranks::{
    Collective, OverlapStats, Overlapped, Pending, Ranks, SentBytes, Shard, ShardLayout,
};
pub use step::{
    GradPlace, Observer, Overlap, StepConfig, StepLoop, StepOutcome, StepPlace, StepStats,
    StepTensor,
};
pub use trainer::{
    decide_step_place, decode_moment, Budget, DeviceChoice, DeviceShare, Lease, NvmeTraffic,
    ParamSpec, Precision, Resident, StepDevice, StepNeeds, Trainer, TrainerConfig, Values,
};

/// The store's vocabulary a front end needs: element types, moment forms, list roles,
/// tensor numbers and states, the store's counters and errors, and the I/O settings of a swap file.
pub use tidestore_chunk::{
    typed, ChunkError, DType, ListKind, MomentForm, StoreStats, TensorId, TensorState, TensorView,
    TensorViewMut,
};
pub use tidestore_io::IoConfig;
/// The optimizer's types a front end configures a run with.
pub use tidestore_optimizer::{HyperParams, Mode, OptimError, StepDecision, StepState};
/// What a [`TensorView`] on the device tier is: host bytes (the simulation) or GPU memory.
pub use tidestore_tiers::{CudaSpan, CudaSpanMut, DeviceView, DeviceViewMut};

/// The block-I/O engine (io_uring, or the thread-pool fallback) and its aligned buffers:
/// for front ends that read and write tensors to files themselves, outside a store.
pub mod aio {
    pub use tidestore_io::{
        check_writable_dir, BufferPool, Engine, EngineChoice, IoConfig, IoError, IoRequest, Op,
        ALIGN_BYTES,
    };
}
