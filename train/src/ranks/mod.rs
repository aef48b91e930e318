//! Data-parallel ranks for a front end that trains through the store: Gemini's layout
//! ([`ShardLayout`]), the collectives it needs ([`Collective`]), and the handle a run's
//! pieces share ([`Ranks`]: it counts what went through each collective and is the step
//! loop's [`NormPeers`]).
//!
//! Every parameter of `n` elements is cut into `world` shards of `ceil(n / world)`
//! elements, rank `r` owning shard `r`, the last ones zero-padded — the layout of
//! `python/tidestore/_shards.py`, so the Rust and the PyTorch front ends cut alike. Each
//! rank's store registers only its shards: it holds `1/world` of the parameters, their
//! master copies, M and V, in its own host pool and on its own NVMe. Before a parameter
//! is computed with, one all-gather assembles it; a gradient, once final, is
//! reduce-scattered, leaving each rank its shard of the ranks' average; the global norm
//! is one all-reduce.
//!
//! The collectives themselves are the engines that exist (MPI, NCCL, torch.distributed):
//! front ends implement [`Collective`] over them. [`local`] is an in-process group of
//! threads for tests of the sharding logic; it is not a transport.
//!
//! A rank's collectives run on a thread of their own, in the order they are asked for
//! ([`worker`]), so that they can run beside compute: [`Overlapped`] starts the
//! all-gathers of the parameters the next fetches need (in the order the last step
//! fetched them) and waits for gradients' reduce-scatters only some gradients later;
//! [`Ranks::waited`] is the time that was not hidden.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, TrainError};
use crate::peers::NormPeers;
use crate::trainer::ParamSpec;

mod ahead;
mod collective;
pub mod local;
mod worker;

pub use ahead::{OverlapStats, Overlapped, Put, Shard};
pub use collective::Collective;

pub use worker::Pending;
use worker::Worker;

/// Collectives a front end keeps in flight unless told otherwise ([`Ranks::with_ahead`]):
/// about one LLaMA block's parameters (seven matrices and two norms) ahead.
pub const DEFAULT_AHEAD: usize = 8;

/// The most collectives a front end may keep in flight (`train.collectives_ahead`).
pub const MAX_AHEAD: usize = 1024;

/// How long [`Ranks::abort`] waits for the collectives queued before it.
const ABORT_WAIT: Duration = Duration::from_secs(30);

/// Where this rank's shard of a parameter is (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    /// This rank.
    pub rank: usize,
    /// Ranks in all.
    pub world: usize,
}

impl ShardLayout {
    /// The layout of rank `rank` of `world`; `None` when `rank` is not below `world`.
    pub fn new(rank: usize, world: usize) -> Option<Self> {
        (rank < world).then_some(ShardLayout { rank, world })
    }

    /// Elements of every shard of a parameter of `n` elements: `ceil(n / world)`.
    pub fn len(&self, n: usize) -> usize {
        n.div_ceil(self.world)
    }

    /// Elements the shards of a parameter of `n` elements add in padding.
    pub fn padding(&self, n: usize) -> usize {
        self.len(n) * self.world - n
    }

    /// The elements of the whole parameter this rank's shard holds (short or empty for
    /// the padded last ranks).
    pub fn range(&self, n: usize) -> Range<usize> {
        let len = self.len(n);
        let lo = (self.rank * len).min(n);
        lo..(lo + len).min(n)
    }

    /// This rank's shard of a whole parameter's flat values, zero-padded.
    pub fn cut(&self, whole: &[f32]) -> Vec<f32> {
        let mut part = whole[self.range(whole.len())].to_vec();
        part.resize(self.len(whole.len()), 0.0);
        part
    }
}

/// What went through a rank's collectives since the group was made: bytes this rank
/// sent into each (a ring's `(world − 1) / world` of the gathered or reduced bytes, as
/// NCCL and MPI move them), and calls.
#[derive(Debug, Default)]
struct Sent {
    gather_bytes: AtomicU64,
    reduce_scatter_bytes: AtomicU64,
    all_reduce_bytes: AtomicU64,
    calls: AtomicU64,
}

/// Bytes this rank sent into each kind of collective, and the calls made (see
/// [`Ranks::sent`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SentBytes {
    /// Into all-gathers (parameters assembled before compute).
    pub all_gather: u64,
    /// Into reduce-scatters (gradients).
    pub reduce_scatter: u64,
    /// Into all-reduces (the gradient norm, losses).
    pub all_reduce: u64,
    /// Collectives called.
    pub calls: u64,
}

/// One rank's handle on its group, shared by the pieces of a run (the front end's
/// parameters, the step loop's [`NormPeers`]): clones are the same group. Its
/// collectives run on one thread of their own, in the order they are asked for
/// ([`worker`]): the `*_later` calls start one and return at once, the others wait.
#[derive(Clone)]
pub struct Ranks {
    worker: Arc<Worker>,
    layout: ShardLayout,
    engine: String,
    sent: Arc<Sent>,
    ahead: usize,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks")
            .field("rank", &self.layout.rank)
            .field("world", &self.layout.world)
            .field("engine", &self.engine)
            .finish()
    }
}

impl Ranks {
    /// The handle on `group`, whose collectives run on a thread started here.
    pub fn new(group: Box<dyn Collective>) -> Result<Self> {
        let layout = ShardLayout::new(group.rank(), group.world()).ok_or_else(|| {
            TrainError::Collective(format!(
                "rank {} of {} ranks: a rank is below the world size",
                group.rank(),
                group.world()
            ))
        })?;
        Ok(Ranks {
            engine: group.engine().to_string(),
            worker: Arc::new(Worker::start(group)?),
            layout,
            sent: Arc::default(),
            ahead: DEFAULT_AHEAD,
        })
    }

    /// These ranks with front ends keeping up to `depth` collectives in flight beside
    /// their compute: parameters' all-gathers started that many fetches ahead,
    /// gradients' reduce-scatters waited for that many gradients later
    /// ([`Overlapped`]); 0: each collective waits where it is asked for.
    pub fn with_ahead(mut self, depth: usize) -> Self {
        self.ahead = depth;
        self
    }

    /// The depth front ends overlap collectives to ([`Ranks::with_ahead`]).
    pub fn ahead(&self) -> usize {
        self.ahead
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.layout.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.layout.world
    }

    /// The engine's name.
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// This rank's shard layout.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// Bytes sent into each kind of collective so far.
    pub fn sent(&self) -> SentBytes {
        let s = &self.sent;
        SentBytes {
            all_gather: s.gather_bytes.load(Ordering::Relaxed),
            reduce_scatter: s.reduce_scatter_bytes.load(Ordering::Relaxed),
            all_reduce: s.all_reduce_bytes.load(Ordering::Relaxed),
            calls: s.calls.load(Ordering::Relaxed),
        }
    }

    /// How long this rank's callers blocked on collectives' results so far: the time
    /// collectives were not hidden behind compute.
    pub fn waited(&self) -> Duration {
        self.worker.waited()
    }

    /// Queues `f` behind every collective asked for before it.
    fn later<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        self.sent.calls.fetch_add(1, Ordering::Relaxed);
        self.worker.submit(f)
    }

    /// The whole parameter of `n` elements from every rank's `shard` (this rank's:
    /// `layout().len(n)` elements), in fp32.
    pub fn gather(&self, shard: Vec<f32>, n: usize) -> Result<Vec<f32>> {
        self.gather_later(shard, n, false)?.wait()
    }

    /// Starts [`Ranks::gather`] of `shard`, taken over; the whole comes through the
    /// returned [`Pending`]. With `bf16` (a parameter stored in bf16: a trainable one in
    /// bf16 precision) the shard's values, exact in bf16, cross as 16 bits — half of
    /// f32's bytes, as Gemini gathers 16-bit parameters.
    pub fn gather_later(&self, shard: Vec<f32>, n: usize, bf16: bool) -> Result<Pending<Vec<f32>>> {
        let world = self.world();
        self.check_shard(shard.len(), n)?;
        let ring = ring_bytes(shard.len(), world);
        if bf16 {
            self.sent
                .gather_bytes
                .fetch_add(ring / 2, Ordering::Relaxed);
            let bits: Vec<u16> = shard
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            return Ok(self.later(move |g| {
                let mut whole = vec![0u16; bits.len() * world];
                g.all_gather_u16(&bits, &mut whole)?;
                whole.truncate(n);
                Ok(whole
                    .into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect())
            }));
        }
        self.sent.gather_bytes.fetch_add(ring, Ordering::Relaxed);
        Ok(self.later(move |g| {
            let mut whole = vec![0.0; shard.len() * world];
            g.all_gather(&shard, &mut whole)?;
            whole.truncate(n);
            Ok(whole)
        }))
    }

    /// Refuses a shard of `len` elements for a parameter of `n`: this rank's holds
    /// `layout().len(n)`.
    fn check_shard(&self, len: usize, n: usize) -> Result<()> {
        let want = self.layout.len(n);
        if len == want {
            return Ok(());
        }
        Err(TrainError::Collective(format!(
            "a shard of {len} elements for a parameter of {n} over {} ranks (want {want})",
            self.world()
        )))
    }

    /// Starts taking this rank's shard of the ranks' *average* of `whole` (a whole
    /// gradient, each rank's own, taken over): the sum reduce-scattered, then divided
    /// by the world size, as DDP averages. The shard comes through the returned
    /// [`Pending`].
    pub fn average_shard_later(&self, mut whole: Vec<f32>) -> Pending<Vec<f32>> {
        let world = self.world();
        let len = self.layout.len(whole.len());
        whole.resize(len * world, 0.0);
        self.sent
            .reduce_scatter_bytes
            .fetch_add(ring_bytes(len, world), Ordering::Relaxed);
        self.later(move |g| {
            let mut shard = vec![0.0; len];
            g.reduce_scatter(&whole, &mut shard)?;
            let inv = 1.0 / world as f32;
            shard.iter_mut().for_each(|v| *v *= inv);
            Ok(shard)
        })
    }

    /// `values` summed over the ranks, in place.
    pub fn sum(&self, values: &mut [f64]) -> Result<()> {
        let mut mine = values.to_vec();
        let summed = self
            .later(move |g| {
                g.all_reduce(&mut mine)?;
                Ok(mine)
            })
            .wait()?;
        values.copy_from_slice(&summed);
        // A ring all-reduce: a reduce-scatter and an all-gather of the f64s.
        let world = self.world();
        let bytes = 2 * (world - 1) * values.len() * 8 / world;
        self.sent
            .all_reduce_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Ends every rank of the group (see [`Collective::abort`]); returns where the
    /// engine has no such call. Behind collectives already asked for (every rank asks
    /// for those too, so they finish), for at most [`ABORT_WAIT`].
    pub fn abort(&self, code: i32) {
        let done = self.later(move |g| {
            g.abort(code);
            Ok(())
        });
        if let Err(e) = done.wait_at_most(ABORT_WAIT) {
            tracing::error!(error = %e, "aborting the ranks");
        }
    }

    /// Every rank's `mine` (lengths may differ), in rank order.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mine = mine.to_vec();
        self.later(move |g| g.all_gather_bytes(&mine)).wait()
    }

    /// Rank 0's `mine` on every rank (the others' are not sent on): what rank 0
    /// decides, told to all.
    pub fn from_rank0(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let mut all = self.all_gather_bytes(mine)?;
        Ok(std::mem::take(&mut all[0]))
    }

    /// Every rank's `mine`, in rank order.
    pub fn gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_gather_bytes(mine)
    }

    /// Checks that every rank registers the same parameters (names, whole shapes, what
    /// trains), naming the first difference (see [`Ranks::check_alike`]).
    pub fn check_specs(&self, specs: &[ParamSpec]) -> Result<()> {
        let registration: Vec<String> = specs
            .iter()
            .map(|s| format!("{}{:?}{}", s.name, s.shape, s.trainable))
            .collect();
        let first_trained = specs.iter().find(|s| s.trainable).map(|s| s.name.clone());
        self.check_alike(&[
            ("parameters".into(), specs.len().to_string()),
            (
                "the first trained parameter".into(),
                first_trained.unwrap_or_else(|| "none".into()),
            ),
            (
                "the parameters' names, shapes and training".into(),
                format!(
                    "crc32c {:08x}",
                    crc32c::crc32c(registration.join(",").as_bytes())
                ),
            ),
        ])
    }

    /// Every rank's `mine` (`what` it is, for errors), in rank order, as JSON: for the
    /// small facts ranks exchange (settings, checkpoint steps, report figures).
    pub fn gather_json<T: serde::de::DeserializeOwned>(
        &self,
        mine: &impl serde::Serialize,
        what: &str,
    ) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(mine)
            .map_err(|e| TrainError::Collective(format!("this rank's {what}: {e}")))?;
        let all = self.all_gather_bytes(&bytes)?;
        all.iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice(b).map_err(|e| {
                    TrainError::Collective(format!("rank {r} sent unreadable {what}: {e}"))
                })
            })
            .collect()
    }

    /// Checks that every rank runs the same thing: `facts` (name and value pairs: the
    /// config, the model's fingerprint, the parameter count) against rank 0's. A
    /// difference is an error on every rank, naming the first fact that differs and the
    /// first rank it differs on.
    pub fn check_alike(&self, facts: &[(String, String)]) -> Result<()> {
        let all: Vec<Vec<(String, String)>> = self.gather_json(&facts, "start-up facts")?;
        let first = &all[0];
        for (r, theirs) in all.iter().enumerate().skip(1) {
            if let Some(why) = first_difference(first, theirs) {
                return Err(TrainError::Collective(format!(
                    "rank {r} differs from rank 0: {why}"
                )));
            }
        }
        Ok(())
    }
}

/// The first fact `b` (a rank's) has otherwise than `a` (rank 0's), in words.
fn first_difference(a: &[(String, String)], b: &[(String, String)]) -> Option<String> {
    for (name, va) in a {
        match b.iter().find(|(n, _)| n == name) {
            Some((_, vb)) if vb != va => return Some(format!("{name} = {vb} against {va}")),
            None => return Some(format!("{name} is missing (rank 0 has {va})")),
            Some(_) => {}
        }
    }
    b.iter()
        .find(|(n, _)| !a.iter().any(|(m, _)| m == n))
        .map(|(n, v)| format!("{n} = {v}, which rank 0 does not have"))
}

/// Bytes one rank sends in a ring collective over `world` shards of `len` f32 elements.
fn ring_bytes(len: usize, world: usize) -> u64 {
    ((world - 1) * len * 4) as u64
}

impl NormPeers for Ranks {
    fn sum_sq_norm(&mut self, local: f64) -> Result<f64> {
        let mut v = [local];
        self.sum(&mut v)?;
        Ok(v[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_a_parameter_once_and_pad_the_last() {
        for (n, world) in [(10usize, 2usize), (10, 3), (7, 4), (1, 4), (4096, 4)] {
            let whole: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
            let mut seen = Vec::new();
            for rank in 0..world {
                let l = ShardLayout::new(rank, world).unwrap();
                let cut = l.cut(&whole);
                assert_eq!(cut.len(), n.div_ceil(world));
                let r = l.range(n);
                assert_eq!(&cut[..r.len()], &whole[r.clone()]);
                assert!(cut[r.len()..].iter().all(|&v| v == 0.0));
                seen.extend_from_slice(&whole[r]);
            }
            assert_eq!(seen, whole, "n {n} world {world}");
            let l = ShardLayout::new(0, world).unwrap();
            assert_eq!(l.len(n) * world - l.padding(n), n);
        }
        assert!(ShardLayout::new(2, 2).is_none());
    }

    #[test]
    fn differences_name_the_fact_and_both_values() {
        let f = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let a = f(&[("model", "abc"), ("lr", "0.01")]);
        assert_eq!(first_difference(&a, &a), None);
        assert_eq!(
            first_difference(&a, &f(&[("model", "abc"), ("lr", "0.02")])).unwrap(),
            "lr = 0.02 against 0.01"
        );
        assert!(first_difference(&a, &f(&[("model", "abc")]))
            .unwrap()
            .contains("lr is missing"));
        assert!(first_difference(&f(&[("model", "abc")]), &a)
            .unwrap()
            .contains("which rank 0 does not have"));
    }
}
