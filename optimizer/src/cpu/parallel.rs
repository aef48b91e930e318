//! Splitting a job over the threads of a rayon pool in large contiguous blocks.
//!
//! A job (the arrays of one call) is halved recursively at block boundaries until each
//! piece is at most one block; the two halves of every split run under `rayon::join`, so
//! a thread walks long contiguous spans and steals only when another falls behind. The
//! split tree depends only on the length and the block size, never on the thread count
//! or the scheduling, so reductions (the gradient norm) give the same bits with 1 or N
//! threads. No allocation: the halves are sub-slices.

use rayon::ThreadPool;

use crate::slices::{Grads, ParamOut};

/// A set of equally long arrays that can be cut at an element index.
/// Splits an optional 16-bit output at `mid`, as the job it belongs to.
pub(super) fn split_out(
    out: Option<ParamOut<'_>>,
    mid: usize,
) -> (Option<ParamOut<'_>>, Option<ParamOut<'_>>) {
    match out {
        Some(o) => {
            let (a, b) = o.split_at(mid);
            (Some(a), Some(b))
        }
        None => (None, None),
    }
}

pub(crate) trait Split: Sized + Send {
    /// Elements per array.
    fn len(&self) -> usize;
    /// `[..mid]` and `[mid..]` of every array.
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// Runs `leaf` on blocks of at most `block` elements, in parallel on `pool` when it has
/// more than one thread (otherwise on the calling thread), and folds the results with
/// `combine` along the fixed split tree.
pub(crate) fn run_blocks<J, R, F, C>(
    pool: Option<&ThreadPool>,
    block: usize,
    job: J,
    leaf: &F,
    combine: &C,
) -> R
where
    J: Split,
    R: Send,
    F: Fn(J) -> R + Sync,
    C: Fn(R, R) -> R + Sync,
{
    match pool {
        Some(pool) if pool.current_num_threads() > 1 => {
            pool.install(|| recurse::<true, J, R, F, C>(block, job, leaf, combine))
        }
        _ => recurse::<false, J, R, F, C>(block, job, leaf, combine),
    }
}

fn recurse<const PAR: bool, J, R, F, C>(block: usize, job: J, leaf: &F, combine: &C) -> R
where
    J: Split,
    R: Send,
    F: Fn(J) -> R + Sync,
    C: Fn(R, R) -> R + Sync,
{
    let n = job.len();
    if n <= block {
        return leaf(job);
    }
    // n > block >= 1, so there are at least two blocks and 0 < mid < n.
    let mid = n.div_ceil(block) / 2 * block;
    let (a, b) = job.split_at(mid);
    let (ra, rb) = if PAR {
        rayon::join(
            || recurse::<PAR, J, R, F, C>(block, a, leaf, combine),
            || recurse::<PAR, J, R, F, C>(block, b, leaf, combine),
        )
    } else {
        (
            recurse::<PAR, J, R, F, C>(block, a, leaf, combine),
            recurse::<PAR, J, R, F, C>(block, b, leaf, combine),
        )
    };
    combine(ra, rb)
}

/// The arrays of a step (or of the memory probe).
pub(crate) struct StepJob<'a> {
    pub p: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub g: Grads<'a>,
    pub out: Option<ParamOut<'a>>,
}

impl<'a> StepJob<'a> {
    /// The job over `p`, `m`, `v`, `g` and `out`, once every length is `p`'s.
    pub(crate) fn checked(
        p: &'a mut [f32],
        m: &'a mut [f32],
        v: &'a mut [f32],
        g: Grads<'a>,
        out: Option<ParamOut<'a>>,
    ) -> crate::error::Result<Self> {
        use crate::error::check_len;
        let n = p.len();
        check_len("m", m.len(), "master", n)?;
        check_len("v", v.len(), "master", n)?;
        check_grads_out(n, &g, &out)?;
        Ok(StepJob { p, m, v, g, out })
    }
}

/// The gradients and the 16-bit output of a step over `n` parameters, checked: what every
/// step and probe checks besides its moments.
pub(crate) fn check_grads_out(
    n: usize,
    g: &Grads<'_>,
    out: &Option<ParamOut<'_>>,
) -> crate::error::Result<()> {
    use crate::error::check_len;
    check_len("grads", g.len(), "master", n)?;
    if let Some(o) = out {
        check_len("out", o.len(), "master", n)?;
    }
    Ok(())
}

impl Split for StepJob<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (m0, m1) = self.m.split_at_mut(mid);
        let (v0, v1) = self.v.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (o0, o1) = split_out(self.out, mid);
        (
            StepJob {
                p: p0,
                m: m0,
                v: v0,
                g: g0,
                out: o0,
            },
            StepJob {
                p: p1,
                m: m1,
                v: v1,
                g: g1,
                out: o1,
            },
        )
    }
}

impl Split for Grads<'_> {
    fn len(&self) -> usize {
        Grads::len(self)
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        Grads::split_at(self, mid)
    }
}

/// An fp32 array and gradients beside it: an accumulator and the gradients added into
/// it, or a buffer and the gradients widened into it.
pub(crate) struct AccJob<'a> {
    pub acc: &'a mut [f32],
    pub g: Grads<'a>,
}

impl Split for AccJob<'_> {
    fn len(&self) -> usize {
        self.acc.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.acc.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        (AccJob { acc: a0, g: g0 }, AccJob { acc: a1, g: g1 })
    }
}

/// fp32 parameters and their 16-bit destination.
pub(crate) struct CastJob<'a> {
    pub src: &'a [f32],
    pub out: ParamOut<'a>,
}

impl Split for CastJob<'_> {
    fn len(&self) -> usize {
        self.src.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (s0, s1) = self.src.split_at(mid);
        let (o0, o1) = self.out.split_at(mid);
        (CastJob { src: s0, out: o0 }, CastJob { src: s1, out: o1 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that records which ranges its leaves saw.
    struct Range(usize, usize);

    impl Split for Range {
        fn len(&self) -> usize {
            self.1 - self.0
        }

        fn split_at(self, mid: usize) -> (Self, Self) {
            (Range(self.0, self.0 + mid), Range(self.0 + mid, self.1))
        }
    }

    /// Leaves tile the job exactly, in order, each at most one block, and every leaf but
    /// the last starts on a block boundary — with and without a pool.
    #[test]
    fn leaves_tile_the_job_on_block_boundaries() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for n in [0usize, 1, 15, 16, 17, 100, 1000, 4097] {
            for block in [16usize, 32, 48, 4096] {
                for p in [None, Some(&pool)] {
                    let leaves = run_blocks(
                        p,
                        block,
                        Range(0, n),
                        &|r: Range| vec![(r.0, r.1)],
                        &|mut a: Vec<(usize, usize)>, b| {
                            a.extend(b);
                            a
                        },
                    );
                    let mut at = 0;
                    for &(s, e) in &leaves {
                        assert_eq!(s, at, "n {n} block {block}");
                        assert!(e - s <= block && s % block == 0);
                        at = e;
                    }
                    assert_eq!(at, n);
                }
            }
        }
    }
}
