//! Recursive halving and doubling's schedule (Rabenseifner's all-reduce, and recursive
//! doubling, which takes the same partners): who does what, for one rank, on a buffer of `len`
//! elements. Pure arithmetic, tested below on in-memory buffers; `exchange::rhd` sends the
//! messages it says, and the cost model (`cost`) counts its steps and bytes.
//!
//! Among p = 2^k ranks, the reduce-scatter halves the range log2(p) times, with the partner
//! whose number differs in one bit, farthest first; the all-gather retraces the steps. Of the
//! first 2r ranks of another count (r = n - p), each even rank hands its buffer to the odd rank
//! after it and sits out; the others run the algorithm.

use std::ops::Range;

use crate::plan::shard::ShardInfo;

/// What a rank does outside the power-of-two group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra {
    /// In the group from the start.
    None,
    /// Hands its buffer to `rank` first, takes the result from it last, and sits out between.
    SitsOut { partner: usize },
    /// Adds `rank`'s buffer to its own first and hands it the result last.
    Absorbs { partner: usize },
}

/// One step of the halving or doubling: with `partner`, send `send` and receive `recv`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub partner: usize,
    pub send: Range<usize>,
    pub recv: Range<usize>,
}

/// Who does what, for one rank, on a buffer of `len` elements: pure arithmetic, tested apart
/// from the messages.
#[derive(Clone, Debug)]
pub struct RhdSchedule {
    pub extra: Extra,
    /// Reduce-scatter steps (recv: the half kept, to which the partner's copy is added).
    pub halving: Vec<Step>,
    /// All-gather steps (recv: the partner's summed range).
    pub doubling: Vec<Step>,
    /// The range this rank holds summed between the two phases (empty when it sits out).
    pub owned: Range<usize>,
}

impl RhdSchedule {
    pub fn new(len: usize, n: usize, rank: usize) -> RhdSchedule {
        assert!(n >= 1 && rank < n, "rank {rank} of {n}");
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
        let r = n - p;
        let (extra, group_rank) = if rank < 2 * r {
            if rank.is_multiple_of(2) {
                (Extra::SitsOut { partner: rank + 1 }, None)
            } else {
                (Extra::Absorbs { partner: rank - 1 }, Some(rank / 2))
            }
        } else {
            (Extra::None, Some(rank - r))
        };
        let Some(me) = group_rank else {
            return RhdSchedule { extra, halving: Vec::new(), doubling: Vec::new(), owned: 0..0 };
        };
        // Group rank g is world rank 2g+1 for g < r, else g + r.
        let world_of = |g: usize| if g < r { 2 * g + 1 } else { g + r };
        let blocks = ShardInfo::all(len, p);
        let span = |lo: usize, hi: usize| blocks[lo].offset..if hi > lo { blocks[hi - 1].end() } else { blocks[lo].offset };
        let (mut lo, mut hi) = (0, p);
        let mut halving = Vec::new();
        let mut mask = p / 2;
        while mask > 0 {
            let mid = lo + (hi - lo) / 2;
            let partner = world_of(me ^ mask);
            if me & mask == 0 {
                halving.push(Step { partner, send: span(mid, hi), recv: span(lo, mid) });
                hi = mid;
            } else {
                halving.push(Step { partner, send: span(lo, mid), recv: span(mid, hi) });
                lo = mid;
            }
            mask /= 2;
        }
        // The all-gather undoes the halving: send what is owned, receive the partner's half.
        let doubling = halving.iter().rev().map(|s| Step { partner: s.partner, send: s.recv.clone(), recv: s.send.clone() }).collect();
        let owned = span(lo, hi);
        RhdSchedule { extra, halving, doubling, owned }
    }

    /// The largest range received in one step (the scratch a rank needs).
    pub fn largest_receive(&self, len: usize) -> usize {
        let whole = if matches!(self.extra, Extra::Absorbs { .. }) { len } else { 0 };
        self.halving.iter().map(|s| s.recv.len()).max().unwrap_or(0).max(whole)
    }
}

/// Whether recursive halving gives every one of `n` ranks a shard: only for powers of two.
pub fn zero_shards_balance(n: usize) -> bool {
    n.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The extra ranks' hand-over before either algorithm: each absorbing rank adds its
    /// partner's buffer.
    fn pre_step<T: Copy + std::ops::AddAssign>(bufs: &mut [Vec<T>], s: &[RhdSchedule]) {
        for r in 0..bufs.len() {
            if let Extra::Absorbs { partner } = s[r].extra {
                assert_eq!(s[partner].extra, Extra::SitsOut { partner: r });
                let theirs = bufs[partner].clone();
                bufs[r].iter_mut().zip(&theirs).for_each(|(a, b)| *a += *b);
            }
        }
    }

    /// The hand-back after either algorithm: each rank that sat out takes its partner's result.
    fn post_step<T: Clone>(bufs: &mut [Vec<T>], s: &[RhdSchedule]) {
        for r in 0..bufs.len() {
            if let Extra::SitsOut { partner } = s[r].extra {
                bufs[r] = bufs[partner].clone();
            }
        }
    }

    /// Runs every rank's schedule on in-memory buffers, moving ranges as the messages would.
    fn simulate(inputs: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let n = inputs.len();
        let len = inputs[0].len();
        let mut bufs = inputs.to_vec();
        let s: Vec<RhdSchedule> = (0..n).map(|r| RhdSchedule::new(len, n, r)).collect();
        pre_step(&mut bufs, &s);
        let steps = s.iter().map(|x| x.halving.len()).max().unwrap_or(0);
        for k in 0..steps {
            let sent: Vec<Option<Vec<f64>>> = (0..n).map(|r| s[r].halving.get(k).map(|st| bufs[r][st.send.clone()].to_vec())).collect();
            for r in 0..n {
                if let Some(st) = s[r].halving.get(k) {
                    let theirs = sent[st.partner].as_ref().expect("partners step together");
                    assert_eq!(s[st.partner].halving[k].partner, r);
                    assert_eq!(theirs.len(), st.recv.len(), "n {n} rank {r} step {k}");
                    bufs[r][st.recv.clone()].iter_mut().zip(theirs).for_each(|(a, b)| *a += b);
                }
            }
        }
        for k in 0..steps {
            let sent: Vec<Option<Vec<f64>>> = (0..n).map(|r| s[r].doubling.get(k).map(|st| bufs[r][st.send.clone()].to_vec())).collect();
            for r in 0..n {
                if let Some(st) = s[r].doubling.get(k) {
                    bufs[r][st.recv.clone()].copy_from_slice(sent[st.partner].as_ref().unwrap());
                }
            }
        }
        post_step(&mut bufs, &s);
        bufs
    }

    #[test]
    fn every_rank_ends_with_the_sum_for_every_rank_count_and_length() {
        for n in 1..=9 {
            for len in [0, 1, 2, 3, 7, 8, 13, 100] {
                let inputs: Vec<Vec<f64>> = (0..n).map(|r| (0..len).map(|i| (r * 1000 + i) as f64).collect()).collect();
                let expected: Vec<f64> = (0..len).map(|i| (0..n).map(|r| (r * 1000 + i) as f64).sum()).collect();
                for (r, out) in simulate(&inputs).into_iter().enumerate() {
                    assert_eq!(out, expected, "n {n} len {len} rank {r}");
                }
            }
        }
    }

    /// Recursive doubling on in-memory f32 buffers, as `doubling_host` moves them.
    fn simulate_doubling(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let n = inputs.len();
        let mut bufs = inputs.to_vec();
        let s: Vec<RhdSchedule> = (0..n).map(|r| RhdSchedule::new(1, n, r)).collect();
        pre_step(&mut bufs, &s);
        for k in 0..s.iter().map(|x| x.halving.len()).max().unwrap_or(0) {
            let before = bufs.clone();
            for r in 0..n {
                if let Some(st) = s[r].halving.get(k) {
                    assert_eq!(s[st.partner].halving[k].partner, r, "partners step together");
                    bufs[r].iter_mut().zip(&before[st.partner]).for_each(|(a, b)| *a += b);
                }
            }
        }
        post_step(&mut bufs, &s);
        bufs
    }

    #[test]
    fn recursive_doubling_leaves_every_rank_the_same_bits() {
        // Values whose f32 sums round differently in different orders: every rank must still
        // hold the same bits (partners add the same partial sums, in opposite order).
        for n in 1..=9 {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..50).map(|i| ((r * 7919 + i * 104729) % 1000) as f32 * 1.37e-3 + 1e3 * (i % 3) as f32).collect()).collect();
            let out = simulate_doubling(&inputs);
            for r in 1..n {
                assert_eq!(out[r].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), out[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n {n} rank {r}");
            }
            for (i, v) in out[0].iter().enumerate() {
                let exact: f64 = inputs.iter().map(|b| b[i] as f64).sum();
                assert!((*v as f64 - exact).abs() <= 1e-5 * exact.abs().max(1.0), "n {n} element {i}: {v} against {exact}");
            }
        }
    }

    #[test]
    fn steps_are_logarithmic_and_owned_ranges_tile_the_buffer() {
        let (n, len) = (8, 1000);
        let mut owned: Vec<Range<usize>> = (0..n).map(|r| RhdSchedule::new(len, n, r)).map(|s| {
            assert_eq!(s.halving.len(), 3);
            assert_eq!(s.halving.iter().map(|st| st.send.len()).sum::<usize>(), len - s.owned.len());
            s.owned
        }).collect();
        owned.sort_by_key(|r| r.start);
        assert!(owned.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!((owned[0].start, owned[n - 1].end), (0, len));
        // 6 ranks: 2 extra ranks sit out (0 and 2), 4 run the algorithm.
        let extras: Vec<Extra> = (0..6).map(|r| RhdSchedule::new(10, 6, r).extra).collect();
        assert_eq!(extras[0], Extra::SitsOut { partner: 1 });
        assert_eq!(extras[3], Extra::Absorbs { partner: 2 });
        assert_eq!(extras[5], Extra::None);
    }

    #[test]
    fn zero_shards_balance_exactly_when_every_rank_owns_a_part() {
        for n in 1..=17 {
            let every_rank_owns = (0..n).all(|r| !RhdSchedule::new(1000, n, r).owned.is_empty());
            assert_eq!(zero_shards_balance(n), every_rank_owns, "n {n}");
        }
    }
}
