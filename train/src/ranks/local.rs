//! An in-process group: ranks are threads of one process, every collective an exchange
//! through shared memory. It exists to test the sharding logic of the front ends (two
//! ranks against one with the doubled batch) in one test binary; runs across processes
//! and machines use an engine that exists (MPI, NCCL, torch.distributed).
//!
//! A rank that leaves the group (its handle dropped, as when its thread returns an
//! error) fails every collective the others are in or come to, so a test never hangs on
//! a dead rank; a collective that waits longer than the group's timeout fails too.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::collective::Collective;
use crate::error::{Result, TrainError};

/// The exchange every collective is made of.
#[derive(Debug)]
struct Round {
    /// Contributions to the round in progress, by rank.
    inputs: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// Rounds completed.
    done: u64,
    /// The last completed round's contributions.
    out: Arc<Vec<Vec<u8>>>,
    /// A rank that left the group.
    left: Option<usize>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    round: Mutex<Round>,
    changed: Condvar,
    timeout: Duration,
}

/// One rank of an in-process group (see the module doc).
#[derive(Debug)]
pub struct LocalRank {
    rank: usize,
    shared: Arc<Shared>,
}

/// A group of `world` in-process ranks, one handle each, whose collectives fail after
/// `timeout` of waiting for the others.
pub fn group(world: usize, timeout: Duration) -> Vec<LocalRank> {
    let shared = Arc::new(Shared {
        world,
        round: Mutex::new(Round {
            inputs: vec![None; world],
            arrived: 0,
            done: 0,
            out: Arc::default(),
            left: None,
        }),
        changed: Condvar::new(),
        timeout,
    });
    (0..world)
        .map(|rank| LocalRank {
            rank,
            shared: shared.clone(),
        })
        .collect()
}

impl LocalRank {
    fn lock(&self) -> Result<MutexGuard<'_, Round>> {
        self.shared
            .round
            .lock()
            .map_err(|_| TrainError::Collective("an in-process rank panicked".into()))
    }

    /// Every rank's `mine`, in rank order, once all have given theirs.
    fn exchange(&self, mine: Vec<u8>) -> Result<Arc<Vec<Vec<u8>>>> {
        let mut round = self.lock()?;
        let left = |r: usize| TrainError::Collective(format!("rank {r} left the group"));
        if let Some(r) = round.left {
            return Err(left(r));
        }
        round.inputs[self.rank] = Some(mine);
        round.arrived += 1;
        let waiting_for = round.done;
        if round.arrived == self.shared.world {
            let inputs = round
                .inputs
                .iter_mut()
                .map(|i| i.take().unwrap_or_default());
            round.out = Arc::new(inputs.collect());
            round.arrived = 0;
            round.done += 1;
            self.shared.changed.notify_all();
            return Ok(round.out.clone());
        }
        let deadline = Instant::now() + self.shared.timeout;
        // The round's result stays until every rank has come to the next one, so a
        // rank woken late still reads its own round's.
        while round.done == waiting_for {
            if let Some(r) = round.left {
                return Err(left(r));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TrainError::Collective(format!(
                    "rank {} waited {:?} for the other ranks",
                    self.rank, self.shared.timeout
                )));
            }
            round = self
                .shared
                .changed
                .wait_timeout(round, deadline - now)
                .map_err(|_| TrainError::Collective("an in-process rank panicked".into()))?
                .0;
        }
        Ok(round.out.clone())
    }

    fn exchange_f32(&self, mine: &[f32]) -> Result<Arc<Vec<Vec<u8>>>> {
        self.exchange(bytemuck::cast_slice(mine).to_vec())
    }
}

impl Drop for LocalRank {
    fn drop(&mut self) {
        if let Ok(mut round) = self.shared.round.lock() {
            round.left.get_or_insert(self.rank);
            self.shared.changed.notify_all();
        }
    }
}

/// Reads f32s from bytes another rank sent (`bytemuck` needs alignment a `Vec<u8>`
/// does not promise).
fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(TrainError::Collective(format!(
        "{what}: {got} elements where the ranks' shards make {want}"
    )))
}

impl Collective for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn engine(&self) -> &str {
        "in-process"
    }

    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("all-gather", out.len(), shard.len() * self.shared.world)?;
        let all = self.exchange_f32(shard)?;
        for (dst, src) in out.chunks_exact_mut(shard.len().max(1)).zip(all.iter()) {
            check_len("all-gather", src.len() / 4, dst.len())?;
            dst.iter_mut().zip(f32s(src)).for_each(|(d, s)| *d = s);
        }
        Ok(())
    }

    fn all_gather_u16(&mut self, shard: &[u16], out: &mut [u16]) -> Result<()> {
        check_len("all-gather", out.len(), shard.len() * self.shared.world)?;
        let all = self.exchange(bytemuck::cast_slice(shard).to_vec())?;
        for (dst, src) in out.chunks_exact_mut(shard.len().max(1)).zip(all.iter()) {
            check_len("all-gather", src.len() / 2, dst.len())?;
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, whole: &[f32], shard: &mut [f32]) -> Result<()> {
        check_len(
            "reduce-scatter",
            whole.len(),
            shard.len() * self.shared.world,
        )?;
        let all = self.exchange_f32(whole)?;
        let lo = self.rank * shard.len() * 4;
        let hi = lo + shard.len() * 4;
        shard.fill(0.0);
        for src in all.iter() {
            check_len("reduce-scatter", src.len() / 4, whole.len())?;
            shard
                .iter_mut()
                .zip(f32s(&src[lo..hi]))
                .for_each(|(d, s)| *d += s);
        }
        Ok(())
    }

    fn all_reduce(&mut self, values: &mut [f64]) -> Result<()> {
        let all = self.exchange(bytemuck::cast_slice(values).to_vec())?;
        values.fill(0.0);
        for src in all.iter() {
            check_len("all-reduce", src.len() / 8, values.len())?;
            for (d, b) in values.iter_mut().zip(src.chunks_exact(8)) {
                *d += f64::from_le_bytes(b.try_into().expect("chunks of 8"));
            }
        }
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(self.exchange(mine.to_vec())?.as_ref().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<R: Send>(world: usize, f: impl Fn(LocalRank) -> R + Sync) -> Vec<R> {
        let ranks = group(world, Duration::from_secs(20));
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|r| {
                    let f = &f;
                    s.spawn(move || f(r))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_gather_sum_and_scatter_in_rank_order() {
        let got = on_ranks(3, |mut r| {
            let me = r.rank() as f32;
            let mut all = vec![0.0; 6];
            r.all_gather(&[me, me + 0.5], &mut all).unwrap();
            let whole: Vec<f32> = (0..6).map(|i| i as f32 * (me + 1.0)).collect();
            let mut part = vec![0.0; 2];
            r.reduce_scatter(&whole, &mut part).unwrap();
            let mut n = [me as f64, 1.0];
            r.all_reduce(&mut n).unwrap();
            let bytes = r
                .all_gather_bytes(&vec![r.rank() as u8; r.rank() + 1])
                .unwrap();
            (all, part, n, bytes)
        });
        for (rank, (all, part, n, bytes)) in got.into_iter().enumerate() {
            assert_eq!(all, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            // Element i summed over ranks: i · (1 + 2 + 3).
            let want: Vec<f32> = (2 * rank..2 * rank + 2).map(|i| i as f32 * 6.0).collect();
            assert_eq!(part, want);
            assert_eq!(n, [3.0, 3.0]);
            assert_eq!(bytes, vec![vec![0u8], vec![1, 1], vec![2, 2, 2]]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_collectives() {
        let got = on_ranks(2, |mut r| {
            if r.rank() == 1 {
                return Ok(());
            }
            let mut v = [1.0];
            r.all_reduce(&mut v)
        });
        let err = got[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 1 left the group"), "{err}");
    }

    #[test]
    fn a_collective_with_a_missing_rank_times_out() {
        let mut ranks = group(2, Duration::from_millis(50));
        let _other = ranks.pop();
        let err = ranks[0].all_reduce(&mut [1.0]).unwrap_err().to_string();
        assert!(err.contains("waited"), "{err}");
    }
}
