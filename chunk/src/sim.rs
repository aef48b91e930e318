//! A pure simulator of one tier, an offline Belady reference, and a GPT trace generator.
//!
//! [`simulate`] replays an [`AccessTrace`] (per moment, the chunks that must be resident
//! together) against a tier of a given byte capacity with any [`EvictionPolicy`], with
//! or without the [`PrefetchPlanner`], and counts the bytes moved: every load moves the
//! chunk's bytes in, every eviction moves them out (a conservative model: it does not
//! know which chunks are clean). The tier never holds more than its capacity; a moment
//! whose chunks cannot fit together is an error saying by how much.
//!
//! [`offline_belady`] is an independent reference: it computes each access's next use
//! by one backward scan over the whole trace (not through [`crate::Schedule`]) and
//! evicts the resident chunk used farthest in the future, never-again first, ties to
//! the smaller dense id, exactly the rule [`crate::Lifetime`] applies to a schedule of
//! the same trace. With equal-sized chunks it is optimal (Belady), which is what the
//! property tests lean on for "lifetime never moves more than lru".
//!
//! [`GptShape`] / [`gpt_trace`] generate a GPT-style iteration: embeddings, `L`
//! transformer blocks (two norms, qkv, proj, mlp up and down), final norm and head;
//! forward in model order, then backward in reverse, each access one moment using its
//! tensor's Params chunk, optionally followed by the optimizer step over every chunk
//! group.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::layout::{Layout, LayoutConfig, TensorSpec};
use crate::planner::{PrefetchPlanner, Residency};
use crate::policy::EvictionPolicy;
use crate::search::{search_chunk_size, SearchConfig, SearchReport};
use crate::tracer::Schedule;
use crate::Result;

/// Per moment, the chunks that must be resident together; and every chunk's size.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccessTrace {
    /// `steps[m]`: the chunks used at moment `m` (duplicates are ignored).
    pub steps: Vec<Vec<ChunkId>>,
    /// Byte size per dense chunk id.
    pub chunk_bytes: Vec<u64>,
}

impl AccessTrace {
    /// A trace.
    pub fn new(steps: Vec<Vec<ChunkId>>, chunk_bytes: Vec<u64>) -> Self {
        AccessTrace { steps, chunk_bytes }
    }

    /// Number of moments.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether the trace has no moments.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The trace repeated `times` times (iterations of training).
    pub fn repeat(&self, times: usize) -> AccessTrace {
        AccessTrace {
            steps: (0..times)
                .flat_map(|_| self.steps.iter().cloned())
                .collect(),
            chunk_bytes: self.chunk_bytes.clone(),
        }
    }

    /// The schedule of this trace (one moment per step).
    pub fn schedule(&self) -> Schedule {
        Schedule::from_groups(&self.steps, &[])
    }

    fn size(&self, chunk: ChunkId) -> Result<u64> {
        self.chunk_bytes
            .get(chunk.dense())
            .copied()
            .ok_or(ChunkError::UnknownChunk { chunk })
    }

    /// Moment `m`'s chunks without duplicates, checked to fit `capacity_bytes`.
    fn group(&self, m: usize, capacity_bytes: u64) -> Result<Vec<ChunkId>> {
        let mut g: Vec<ChunkId> = Vec::with_capacity(self.steps[m].len());
        let mut needed = 0u64;
        for &c in &self.steps[m] {
            if !g.contains(&c) {
                needed += self.size(c)?;
                g.push(c);
            }
        }
        if needed > capacity_bytes {
            return Err(ChunkError::WorkingSetTooLarge {
                moment: m as u64,
                needed_bytes: needed,
                capacity_bytes,
                short_bytes: needed - capacity_bytes,
            });
        }
        Ok(g)
    }
}

/// What a simulation moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimReport {
    /// Bytes loaded into the tier.
    pub bytes_in: u64,
    /// Bytes evicted from the tier.
    pub bytes_out: u64,
    /// Loads.
    pub loads: u64,
    /// Evictions.
    pub evictions: u64,
    /// Bytes loaded on demand (the computation waits for them).
    pub demand_bytes_in: u64,
    /// Bytes loaded ahead of need by the prefetcher.
    pub prefetch_bytes_in: u64,
    /// The most bytes resident at any point (never above the capacity).
    pub peak_resident_bytes: u64,
}

impl SimReport {
    /// Bytes moved in both directions.
    pub fn bytes_moved(&self) -> u64 {
        self.bytes_in + self.bytes_out
    }
}

/// Prefetching during a simulation: the planner and the schedule it reads.
#[derive(Debug, Clone, Copy)]
pub struct Prefetch<'a> {
    /// The schedule (absolute trace moments are read with the planner's horizon).
    pub schedule: &'a Schedule,
    /// The planner.
    pub planner: PrefetchPlanner,
}

/// The tier's contents during a simulation.
struct Tier {
    capacity: u64,
    used: u64,
    resident: Vec<bool>,
    list: Vec<ChunkId>,
    report: SimReport,
}

impl Tier {
    fn new(capacity: u64, dense_len: usize) -> Self {
        Tier {
            capacity,
            used: 0,
            resident: vec![false; dense_len],
            list: Vec::new(),
            report: SimReport::default(),
        }
    }

    fn is_resident(&self, c: ChunkId) -> bool {
        self.resident.get(c.dense()).copied().unwrap_or(false)
    }

    fn insert(&mut self, c: ChunkId, bytes: u64) {
        if c.dense() >= self.resident.len() {
            self.resident.resize(c.dense() + 1, false);
        }
        self.resident[c.dense()] = true;
        self.list.push(c);
        self.used += bytes;
        self.report.bytes_in += bytes;
        self.report.loads += 1;
        self.report.peak_resident_bytes = self.report.peak_resident_bytes.max(self.used);
    }

    /// The resident chunks `pinned` (indexed densely) does not mark: what may be evicted.
    fn unpinned(&self, pinned: &[bool]) -> Vec<ChunkId> {
        self.list
            .iter()
            .copied()
            .filter(|v| !pinned[v.dense()])
            .collect()
    }

    fn remove(&mut self, c: ChunkId, bytes: u64) {
        self.resident[c.dense()] = false;
        if let Some(i) = self.list.iter().position(|&x| x == c) {
            self.list.swap_remove(i);
        }
        self.used -= bytes;
        self.report.bytes_out += bytes;
        self.report.evictions += 1;
    }
}

/// Replays `trace` on a tier of `capacity_bytes` with `policy`, prefetching when
/// `prefetch` is given. Moments passed to the policy are absolute trace indices.
pub fn simulate(
    trace: &AccessTrace,
    capacity_bytes: u64,
    policy: &mut dyn EvictionPolicy,
    prefetch: Option<Prefetch<'_>>,
) -> Result<SimReport> {
    let mut tier = Tier::new(capacity_bytes, trace.chunk_bytes.len());
    let mut pinned = vec![false; trace.chunk_bytes.len()];
    for m in 0..trace.len() {
        let moment = m as u64;
        let group = trace.group(m, capacity_bytes)?;
        for &c in &group {
            pinned[c.dense()] = true;
        }
        for &c in &group {
            if tier.is_resident(c) {
                policy.on_access(c, moment);
                continue;
            }
            let bytes = trace.size(c)?;
            while tier.used + bytes > tier.capacity {
                let candidates = tier.unpinned(&pinned);
                let victim = policy
                    .choose_victim(&candidates, moment)
                    .filter(|v| candidates.contains(v))
                    .ok_or(ChunkError::NoVictim {
                        moment,
                        chunk: c,
                        policy: policy.name(),
                    })?;
                tier.remove(victim, trace.size(victim)?);
                policy.on_evict(victim, moment);
            }
            tier.insert(c, bytes);
            tier.report.demand_bytes_in += bytes;
            policy.on_insert(c, moment);
        }
        if let Some(p) = prefetch {
            let evictable = tier.unpinned(&pinned);
            let plan = p.planner.plan(
                p.schedule,
                moment,
                Residency {
                    resident: &tier.resident,
                    evictable: &evictable,
                    chunk_bytes: &trace.chunk_bytes,
                    free_bytes: tier.capacity - tier.used,
                    pool: None,
                },
            )?;
            for step in plan {
                for v in step.evict {
                    tier.remove(v, trace.size(v)?);
                    policy.on_evict(v, moment);
                }
                let bytes = trace.size(step.chunk)?;
                tier.insert(step.chunk, bytes);
                tier.report.prefetch_bytes_in += bytes;
                policy.on_insert(step.chunk, moment);
            }
        }
        for &c in &group {
            pinned[c.dense()] = false;
        }
    }
    Ok(tier.report)
}

/// Belady's offline rule computed directly on the whole trace (see the module doc).
pub fn offline_belady(trace: &AccessTrace, capacity_bytes: u64) -> Result<SimReport> {
    const NEVER: u64 = u64::MAX;
    let groups = (0..trace.len())
        .map(|m| trace.group(m, capacity_bytes))
        .collect::<Result<Vec<_>>>()?;
    // next[m][i]: the next moment after m that uses groups[m][i].
    let mut next: Vec<Vec<u64>> = vec![Vec::new(); groups.len()];
    let mut seen: HashMap<ChunkId, u64> = HashMap::new();
    for m in (0..groups.len()).rev() {
        next[m] = groups[m]
            .iter()
            .map(|c| seen.get(c).copied().unwrap_or(NEVER))
            .collect();
        for &c in &groups[m] {
            seen.insert(c, m as u64);
        }
    }
    let mut resident: HashMap<ChunkId, u64> = HashMap::new(); // chunk -> next use
    let mut used = 0u64;
    let mut report = SimReport::default();
    for (m, group) in groups.iter().enumerate() {
        for (i, &c) in group.iter().enumerate() {
            if let Some(n) = resident.get_mut(&c) {
                *n = next[m][i];
                continue;
            }
            let bytes = trace.size(c)?;
            while used + bytes > capacity_bytes {
                let victim = resident
                    .iter()
                    .filter(|(v, _)| !group.contains(v))
                    .max_by_key(|(v, &n)| (n, std::cmp::Reverse(v.dense())))
                    .map(|(&v, _)| v)
                    .ok_or(ChunkError::NoVictim {
                        moment: m as u64,
                        chunk: c,
                        policy: "offline-belady",
                    })?;
                resident.remove(&victim);
                let vb = trace.size(victim)?;
                used -= vb;
                report.bytes_out += vb;
                report.evictions += 1;
            }
            resident.insert(c, next[m][i]);
            used += bytes;
            report.bytes_in += bytes;
            report.demand_bytes_in += bytes;
            report.loads += 1;
            report.peak_resident_bytes = report.peak_resident_bytes.max(used);
        }
    }
    Ok(report)
}

/// The shape of a GPT-style model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Learned positions (0 for none).
    pub positions: usize,
    /// MLP width as a multiple of `hidden`.
    pub ffn_mult: usize,
    /// Parameter dtype.
    pub dtype: DType,
    /// Whether the tensors are trainable (full fine-tuning) or frozen.
    pub trainable: bool,
    /// The token embedding and the head are registered as this many row blocks
    /// (vocabulary-parallel style), so they need not set the minimum chunk size; 1 keeps
    /// each whole.
    pub vocab_shards: usize,
}

impl GptShape {
    /// GPT-2 XL: 48 layers, hidden 1600, vocabulary 50257, 1024 positions (1.56 B
    /// parameters with an untied head), fp16, trainable.
    pub fn gpt2_xl() -> Self {
        GptShape {
            layers: 48,
            hidden: 1600,
            vocab: 50257,
            positions: 1024,
            ffn_mult: 4,
            dtype: DType::F16,
            trainable: true,
            vocab_shards: 1,
        }
    }

    /// With the embedding and head registered as `shards` row blocks.
    pub fn with_vocab_shards(mut self, shards: usize) -> Self {
        self.vocab_shards = shards;
        self
    }

    /// Row counts of the vocabulary blocks (as even as possible, none empty).
    fn vocab_blocks(&self) -> Vec<usize> {
        let k = self.vocab_shards.clamp(1, self.vocab.max(1));
        (0..k)
            .map(|i| self.vocab / k + usize::from(i < self.vocab % k))
            .collect()
    }

    /// The tensors in forward order.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let (h, f) = (self.hidden, self.hidden * self.ffn_mult);
        let t = |name: String, shape: &[usize]| {
            TensorSpec::new(name, shape, self.dtype, self.trainable)
        };
        let blocks = self.vocab_blocks();
        let vocab = |v: &mut Vec<TensorSpec>, name: &str| {
            if blocks.len() == 1 {
                v.push(t(name.to_string(), &[self.vocab, h]));
            } else {
                for (i, &rows) in blocks.iter().enumerate() {
                    v.push(t(format!("{name}.{i}"), &[rows, h]));
                }
            }
        };
        let mut v = Vec::new();
        vocab(&mut v, "wte");
        if self.positions > 0 {
            v.push(t("wpe".into(), &[self.positions, h]));
        }
        for l in 0..self.layers {
            v.push(t(format!("h.{l}.ln_1"), &[h]));
            v.push(t(format!("h.{l}.attn.qkv"), &[3 * h, h]));
            v.push(t(format!("h.{l}.attn.proj"), &[h, h]));
            v.push(t(format!("h.{l}.ln_2"), &[h]));
            v.push(t(format!("h.{l}.mlp.up"), &[f, h]));
            v.push(t(format!("h.{l}.mlp.down"), &[h, f]));
        }
        v.push(t("ln_f".into(), &[h]));
        vocab(&mut v, "lm_head");
        v
    }
}

/// A generated GPT iteration.
#[derive(Debug, Clone)]
pub struct GptTrace {
    /// The chunk-size search behind the layout.
    pub search: SearchReport,
    /// The layout of the model's tensors.
    pub layout: Layout,
    /// One iteration: one moment per tensor access.
    pub iteration: AccessTrace,
}

/// Lays out `shape` with the searched chunk size (`search`, under `layout`) and
/// generates one iteration: forward, backward, then (with `optimizer_step`) one moment
/// per chunk group using its Params, master, M and V chunks.
pub fn gpt_trace(
    shape: &GptShape,
    layout: LayoutConfig,
    search: &SearchConfig,
    optimizer_step: bool,
) -> Result<GptTrace> {
    let specs = shape.tensors();
    let report = search_chunk_size(&specs, &layout, search)?;
    let layout = Layout::new(
        LayoutConfig {
            chunk_elements: report.chosen.chunk_elements,
            ..layout
        },
        specs,
    )?;
    let n = layout.tensors().len() as u32;
    let param = |t: u32| {
        layout
            .location(TensorId(t), ListKind::Params)
            .map(|l| l.chunk)
            .ok_or(ChunkError::UnknownTensor { id: t, count: n })
    };
    let mut steps = Vec::new();
    for t in 0..n {
        steps.push(vec![param(t)?]);
    }
    for t in (0..n).rev() {
        steps.push(vec![param(t)?]);
    }
    if optimizer_step {
        for p in layout.chunks(ListKind::Params) {
            let group: Vec<ChunkId> = ListKind::ALL
                .into_iter()
                .filter(|&l| l != ListKind::Grads)
                .map(|l| p.in_list(l))
                .filter(|&c| layout.chunk_exists(c))
                .collect();
            steps.push(group);
        }
    }
    let chunk_bytes = layout.dense_chunk_bytes();
    Ok(GptTrace {
        search: report,
        iteration: AccessTrace::new(steps, chunk_bytes),
        layout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Fifo, Lifetime, Lru};
    use crate::tracer::Horizon;
    use std::sync::Arc;

    fn c(i: u32) -> ChunkId {
        ChunkId::new(ListKind::Params, i)
    }

    fn trace(seq: &[u32], size: u64) -> AccessTrace {
        AccessTrace::new(
            seq.iter().map(|&i| vec![c(i)]).collect(),
            vec![size; 5 * 16],
        )
    }

    #[test]
    fn classic_belady_example() {
        // The textbook reference string with 3 frames: OPT 9 faults, LRU 12, FIFO 15.
        let seq = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1];
        let t = trace(&seq, 1);
        let opt = offline_belady(&t, 3).unwrap();
        assert_eq!(opt.loads, 9);
        let lru = simulate(&t, 3, &mut Lru::new(), None).unwrap();
        assert_eq!(lru.loads, 12);
        let fifo = simulate(&t, 3, &mut Fifo::new(), None).unwrap();
        assert_eq!(fifo.loads, 15);
        let s = Arc::new(t.schedule());
        let life = simulate(&t, 3, &mut Lifetime::new(s, Horizon::Once), None).unwrap();
        assert_eq!(life, opt);
        assert_eq!(opt.bytes_out, 6);
    }

    #[test]
    fn working_set_too_large_says_by_how_much() {
        let t = AccessTrace::new(vec![vec![c(0), c(1)]], vec![10; 10]);
        let e = simulate(&t, 15, &mut Lru::new(), None).unwrap_err();
        assert_eq!(
            e,
            ChunkError::WorkingSetTooLarge {
                moment: 0,
                needed_bytes: 20,
                capacity_bytes: 15,
                short_bytes: 5
            }
        );
        assert!(offline_belady(&t, 15).is_err());
        let t = AccessTrace::new(vec![vec![c(100)]], vec![10; 10]);
        assert!(matches!(
            simulate(&t, 15, &mut Lru::new(), None),
            Err(ChunkError::UnknownChunk { .. })
        ));
    }

    #[test]
    fn gpt_trace_shape() {
        let shape = GptShape {
            layers: 4,
            hidden: 256,
            vocab: 1000,
            positions: 128,
            ffn_mult: 4,
            dtype: DType::F16,
            trainable: true,
            vocab_shards: 1,
        };
        let sharded = shape.with_vocab_shards(3).tensors();
        assert_eq!(sharded.len(), shape.tensors().len() + 4);
        assert_eq!(sharded[0].shape, vec![334, 256]);
        assert_eq!(sharded.last().unwrap().shape, vec![333, 256]);
        let g = gpt_trace(&shape, LayoutConfig::new(1), &SearchConfig::new(4096), true).unwrap();
        let n = shape.tensors().len();
        assert_eq!(n, 2 + 6 * 4 + 2);
        let chunks = g.layout.chunks_per_list() as usize;
        assert_eq!(g.iteration.len(), 2 * n + chunks);
        // Backward mirrors forward.
        assert_eq!(g.iteration.steps[0], g.iteration.steps[2 * n - 1]);
        assert_eq!(g.iteration.steps[2 * n].len(), 4);
    }
}
