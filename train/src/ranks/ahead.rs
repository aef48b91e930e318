//! A data-parallel rank's collectives overlapped with its compute: parameters'
//! all-gathers started ahead of the fetches that use them, and gradients'
//! reduce-scatters left running behind the backward that made them.
//!
//! The all-gathers follow the order the last iteration fetched parameters in — the
//! same lifetime plan the chunk store learns its prefetches from, one level up: an
//! iteration is the fetches between two steps, and the next one is expected to fetch
//! alike. While it does, each fetch starts the gathers of the next `depth` fetches
//! (their shards read from the store now), so that by the time compute asks for one,
//! the collective ran while the blocks before it computed. A fetch that differs from the
//! order (another shape of iteration: an evaluation, a shorter last batch) waits out the
//! gathers in flight, discards them and gathers at the call for the rest of the
//! iteration, which becomes the order for the next.
//!
//! Every rank makes the same fetches in the same order, so every rank starts the same
//! gathers at the same points: the collectives match ([`super::worker`]). Nothing is
//! gathered across a step: the values a gather ahead reads are the ones the fetch would
//! read (a parameter changes only in the step; a step deferred into the next forward is
//! made by the fetch that reads the shard, ahead or not).
//!
//! Gradients are reduce-scattered in the order they are put and put into the store in
//! that order, at the latest `depth` gradients later, and all before anything reads them
//! ([`Overlapped::flush`]): the same sums, in the same order, as waiting at each.

use std::collections::VecDeque;

use super::{Pending, Ranks};
use crate::error::Result;

/// A shard the front end read for a gather: this rank's `values` of a parameter of `n`
/// elements, gathered as bf16 when `bf16`.
#[derive(Debug)]
pub struct Shard {
    /// This rank's shard, `layout().len(n)` elements.
    pub values: Vec<f32>,
    /// Elements of the whole parameter.
    pub n: usize,
    /// Whether the parameter is gathered in 16 bits (see [`Ranks::gather_later`]).
    pub bf16: bool,
}

/// Where reduce-scattered gradients go: `(parameter, this rank's shard, first, last)`,
/// as the trainer's `put_grad` takes them.
pub type Put<'a> = dyn FnMut(usize, &[f32], bool, bool) -> Result<()> + 'a;

/// A gradient reduce-scatter in flight: the parameter and the part it is of.
#[derive(Debug)]
struct Scatter {
    param: usize,
    first: bool,
    last: bool,
    shard: Pending<Vec<f32>>,
}

/// What [`Overlapped`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverlapStats {
    /// Fetches whose all-gather had been started ahead.
    pub gathers_ahead: u64,
    /// Fetches gathered at the call (the first of an iteration, those of an iteration
    /// that fetched otherwise than the last, or with a depth of 0).
    pub gathers_at_call: u64,
    /// Gathers started ahead and dropped (their iteration fetched otherwise).
    pub gathers_discarded: u64,
    /// Gradients reduce-scattered while later ones were given.
    pub scatters_behind: u64,
}

/// One rank's collectives in flight; `K` names a fetch (a parameter and how it is
/// taken) as the front end does.
#[derive(Debug)]
pub struct Overlapped<K> {
    ranks: Ranks,
    depth: usize,
    /// The last whole iteration's fetches, in order.
    order: Vec<K>,
    /// This iteration's fetches so far.
    seen: Vec<K>,
    /// Whether this iteration has fetched as `order` says so far.
    following: bool,
    /// Gathers started ahead: the place in `order` each is for, oldest first.
    gathers: VecDeque<(usize, Pending<Vec<f32>>)>,
    /// The place in `order` of the next gather to start.
    next: usize,
    scatters: VecDeque<Scatter>,
    stats: OverlapStats,
}

impl<K: Copy + Eq> Overlapped<K> {
    /// `ranks`' collectives, up to `depth` gathers ahead and `depth` scatters behind
    /// (0: each collective waits where it is asked for).
    pub fn new(ranks: Ranks, depth: usize) -> Self {
        Overlapped {
            ranks,
            depth,
            order: Vec::new(),
            seen: Vec::new(),
            following: false,
            gathers: VecDeque::new(),
            next: 0,
            scatters: VecDeque::new(),
            stats: OverlapStats::default(),
        }
    }

    /// What it did so far.
    pub fn stats(&self) -> OverlapStats {
        self.stats
    }

    /// The ranks.
    pub fn ranks(&self) -> &Ranks {
        &self.ranks
    }

    /// The whole parameter `key` names: gathered ahead when the order foresaw it, else
    /// gathered now from the shard `read` gives. Then starts the gathers of the next
    /// fetches the order expects, reading their shards through `read`.
    pub fn whole(&mut self, key: K, read: &mut dyn FnMut(K) -> Result<Shard>) -> Result<Vec<f32>> {
        let place = self.seen.len();
        self.seen.push(key);
        if self.following && self.order.get(place) != Some(&key) {
            self.following = false;
            self.discard_gathers()?;
        }
        let ahead = match self.gathers.front() {
            Some((p, _)) if self.following && *p == place => self.gathers.pop_front(),
            _ => None,
        };
        let whole = match ahead {
            Some((_, pending)) => {
                self.stats.gathers_ahead += 1;
                pending.wait()?
            }
            None => {
                self.stats.gathers_at_call += 1;
                let s = read(key)?;
                self.ranks.gather_later(s.values, s.n, s.bf16)?.wait()?
            }
        };
        if self.following {
            self.next = self.next.max(place + 1);
            let end = self.order.len().min(place + 1 + self.depth);
            while self.next < end {
                let s = read(self.order[self.next])?;
                let pending = self.ranks.gather_later(s.values, s.n, s.bf16)?;
                self.gathers.push_back((self.next, pending));
                self.next += 1;
            }
        }
        Ok(whole)
    }

    /// Waits out the gathers in flight and drops their results.
    fn discard_gathers(&mut self) -> Result<()> {
        let mut first = Ok(());
        for (_, pending) in self.gathers.drain(..) {
            self.stats.gathers_discarded += 1;
            if let Err(e) = pending.wait() {
                first = first.and(Err(e));
            }
        }
        first.map(drop)
    }

    /// Starts reduce-scattering `whole` (a part of parameter `param`'s gradient: `first`
    /// and `last` as the trainer's `put_grad` takes them); scatters more than `depth`
    /// behind are put through `put` first, oldest first.
    pub fn scatter(
        &mut self,
        param: usize,
        whole: Vec<f32>,
        (first, last): (bool, bool),
        put: &mut Put<'_>,
    ) -> Result<()> {
        let shard = self.ranks.average_shard_later(whole);
        self.scatters.push_back(Scatter {
            param,
            first,
            last,
            shard,
        });
        while self.scatters.len() > self.depth {
            self.put_oldest(put)?;
        }
        if !self.scatters.is_empty() {
            self.stats.scatters_behind += 1;
        }
        Ok(())
    }

    /// Puts every gradient reduce-scattered so far through `put`, in order: before
    /// anything reads gradients (the step, an early step, a gradient's values).
    pub fn flush(&mut self, put: &mut Put<'_>) -> Result<()> {
        while !self.scatters.is_empty() {
            self.put_oldest(put)?;
        }
        Ok(())
    }

    fn put_oldest(&mut self, put: &mut Put<'_>) -> Result<()> {
        let Some(s) = self.scatters.pop_front() else {
            return Ok(());
        };
        let shard = s.shard.wait()?;
        put(s.param, &shard, s.first, s.last)
    }

    /// The iteration ended (the step): its fetches are the order the next one is
    /// expected to follow. Gathers still in flight (it fetched less than the order
    /// foresaw) are waited out and dropped.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.discard_gathers()?;
        self.order = std::mem::take(&mut self.seen);
        self.following = self.depth > 0;
        self.next = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranks::local;
    use std::time::Duration;

    /// Two ranks fetching `fetches` (parameter ids; rank r's shard of parameter p holds
    /// `p * 10 + r`) for `iterations` steps with `depth`, returning each rank's wholes
    /// how many shard reads it made, and its stats.
    fn run(depth: usize, iterations: &[Vec<usize>]) -> Vec<(Vec<Vec<f32>>, usize, OverlapStats)> {
        let groups = local::group(2, Duration::from_secs(30));
        let iterations = iterations.to_vec();
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let iterations = iterations.clone();
                std::thread::spawn(move || {
                    let ranks = Ranks::new(Box::new(g)).unwrap();
                    let r = ranks.rank();
                    let mut o = Overlapped::new(ranks, depth);
                    let mut reads = 0;
                    let mut wholes = Vec::new();
                    for fetches in &iterations {
                        for &p in fetches {
                            let mut read = |k: usize| {
                                reads += 1;
                                Ok(Shard {
                                    values: vec![(k * 10 + r) as f32; 2],
                                    n: 3,
                                    bf16: false,
                                })
                            };
                            wholes.push(o.whole(p, &mut read).unwrap());
                        }
                        o.end_iteration().unwrap();
                    }
                    (wholes, reads, o.stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn gathers_ahead_give_what_gathers_at_the_call_give() {
        let same = vec![0, 1, 2, 1, 0];
        // Diverges at its third fetch, with two gathers in flight.
        let other = vec![0, 1, 3];
        let iterations = vec![same.clone(), same.clone(), other, same.clone(), same];
        let at_call = run(0, &iterations);
        let ahead = run(2, &iterations);
        for r in 0..2 {
            assert_eq!(ahead[r].0, at_call[r].0, "rank {r}");
            assert_eq!(at_call[r].1, 5 + 5 + 3 + 5 + 5);
            // Step 1 learns; steps 2 and 5 follow, each shard read once; step 3
            // discards the gathers of places 2 and 3 and reads parameter 3 again;
            // step 4 follows step 3's order for two fetches and discards one gather.
            assert_eq!(ahead[r].1, 5 + 5 + 5 + 6 + 5, "rank {r}");
            let want = OverlapStats {
                gathers_ahead: 4 + 1 + 1 + 4,
                gathers_at_call: 5 + 1 + 2 + 4 + 1,
                gathers_discarded: 2 + 1,
                scatters_behind: 0,
            };
            assert_eq!(ahead[r].2, want, "rank {r}");
            assert_eq!(at_call[r].2.gathers_at_call, 23);
        }
        assert_eq!(at_call[0].0[0], vec![0.0, 0.0, 1.0]);
        assert_eq!(at_call[1].0[2], vec![20.0, 20.0, 21.0]);
    }

    #[test]
    fn scatters_are_put_in_order_at_most_depth_behind() {
        let groups = local::group(2, Duration::from_secs(30));
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let ranks = Ranks::new(Box::new(g)).unwrap();
                    let r = ranks.rank() as f32;
                    let mut o: Overlapped<usize> = Overlapped::new(ranks, 2);
                    let mut put_log = Vec::new();
                    for k in 0..5usize {
                        let whole = vec![k as f32 + r; 4];
                        let mut put = |key: usize, s: &[f32], first: bool, last: bool| {
                            put_log.push((key, s.to_vec(), first, last));
                            Ok(())
                        };
                        o.scatter(k, whole, (k == 0, k == 4), &mut put).unwrap();
                        assert_eq!(put_log.len(), (k + 1).saturating_sub(2));
                    }
                    assert_eq!(o.stats().scatters_behind, 5);
                    o.flush(&mut |key, s, first, last| {
                        put_log.push((key, s.to_vec(), first, last));
                        Ok(())
                    })
                    .unwrap();
                    put_log
                })
            })
            .collect();
        for h in handles {
            let log = h.join().unwrap();
            let keys: Vec<usize> = log.iter().map(|l| l.0).collect();
            assert_eq!(keys, vec![0, 1, 2, 3, 4]);
            // The average of k and k + 1 over the two ranks.
            assert_eq!(log[3].1, vec![3.5, 3.5]);
            assert!(log[0].2 && !log[0].3 && log[4].3);
        }
    }
}
