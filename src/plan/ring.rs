//! The ring all-reduce's schedule: which chunk each ring position sends and receives at each
//! step, pure arithmetic over the buffer's chunks (one per rank, `ShardInfo`). The ring over MPI
//! (`exchange::ring`) and over node-shared memory (`exchange::shared_ring`) both follow it, so
//! their results have the same bits; the unit tests below run it on in-memory buffers.

use std::ops::Range;

use crate::plan::shard::ShardInfo;

/// Which chunk a ring position sends and receives at each step.
#[derive(Clone, Debug)]
pub struct RingSchedule {
    n: usize,
    pos: usize,
    chunks: Vec<ShardInfo>,
}

impl RingSchedule {
    pub fn new(len: usize, n: usize, pos: usize) -> RingSchedule {
        RingSchedule { n, pos, chunks: ShardInfo::all(len, n) }
    }

    fn chunk(&self, index: isize) -> Range<usize> {
        self.chunks[index.rem_euclid(self.n as isize) as usize].range()
    }

    /// Reduce-scatter step `s` (0..n-1): send chunk pos-s, receive and add chunk pos-s-1.
    pub fn reduce_scatter(&self, s: usize) -> (Range<usize>, Range<usize>) {
        let (p, s) = (self.pos as isize, s as isize);
        (self.chunk(p - s), self.chunk(p - s - 1))
    }

    /// All-gather step `s` (0..n-1): send chunk pos+1-s (summed), receive chunk pos-s.
    pub fn all_gather(&self, s: usize) -> (Range<usize>, Range<usize>) {
        let (p, s) = (self.pos as isize, s as isize);
        (self.chunk(p + 1 - s), self.chunk(p - s))
    }

    /// The chunk this position holds summed after the reduce-scatter, and sends first in the
    /// all-gather: the one after its own position (received at the last reduce-scatter step).
    pub fn reduced_chunk(&self) -> Range<usize> {
        self.chunks[self.reduced_chunk_of(self.pos)].range()
    }

    /// The index of the chunk ring position `pos` holds summed after the reduce-scatter.
    pub fn reduced_chunk_of(&self, pos: usize) -> usize {
        (pos + 1) % self.n
    }

    pub fn largest_chunk(&self) -> usize {
        self.chunks.iter().map(|c| c.len).max().unwrap_or(0)
    }

    /// Hops of the pipelined ring: the n-1 reduce-scatter steps, then the n-1 all-gather steps.
    pub fn hops(&self) -> usize {
        2 * (self.n - 1)
    }

    /// Chunk indices (sent, received) at hop `h`. The chunk received at a hop is the one sent at
    /// the next (the reduce-scatter's last arrival is the all-gather's first send).
    pub fn hop_chunks(&self, h: usize) -> (usize, usize) {
        let (p, n) = (self.pos as isize, self.n as isize);
        let (send, recv) = if (h as isize) < n - 1 {
            (p - h as isize, p - h as isize - 1)
        } else {
            let s = h as isize - (n - 1);
            (p + 1 - s, p - s)
        };
        (send.rem_euclid(n) as usize, recv.rem_euclid(n) as usize)
    }

    /// Pieces every chunk is cut into, for segments of at most `segment` elements: the same
    /// count for every chunk (from the largest), so that sender and receiver agree.
    pub fn pieces_per_chunk(&self, segment: usize) -> usize {
        self.largest_chunk().div_ceil(segment.max(1)).max(1)
    }

    /// The buffer's ranges, chunk by chunk, each chunk cut into `pieces` near-equal pieces
    /// (piece k of chunk c at index c * pieces + k).
    pub fn piece_bounds(&self, pieces: usize) -> Vec<Range<usize>> {
        self.chunks
            .iter()
            .flat_map(|c| ShardInfo::all(c.len, pieces).into_iter().map(move |p| c.offset + p.offset..c.offset + p.end()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{accumulate, accumulate_scaled};

    /// Runs the schedule on n in-memory buffers, moving chunks as the ring would; a mean is
    /// scaled in the last reduce-scatter step, as the ring does.
    fn simulate(inputs: &[Vec<f32>], mean: bool) -> Vec<Vec<f32>> {
        let n = inputs.len();
        let len = inputs[0].len();
        let mut bufs = inputs.to_vec();
        let schedules: Vec<RingSchedule> = (0..n).map(|p| RingSchedule::new(len, n, p)).collect();
        for s in 0..n.saturating_sub(1) {
            let sent: Vec<Vec<f32>> = (0..n).map(|p| bufs[p][schedules[p].reduce_scatter(s).0].to_vec()).collect();
            for p in 0..n {
                let from = (p + n - 1) % n;
                let recv = schedules[p].reduce_scatter(s).1;
                assert_eq!(recv.len(), sent[from].len(), "sender and receiver agree on the chunk");
                let scale = (mean && s == n - 2).then_some(1.0 / n as f32);
                match scale {
                    Some(f) => accumulate_scaled(&mut bufs[p][recv], &sent[from], f),
                    None => accumulate(&mut bufs[p][recv], &sent[from]),
                }
            }
        }
        for s in 0..n.saturating_sub(1) {
            let sent: Vec<Vec<f32>> = (0..n).map(|p| bufs[p][schedules[p].all_gather(s).0].to_vec()).collect();
            for p in 0..n {
                let recv = schedules[p].all_gather(s).1;
                bufs[p][recv].copy_from_slice(&sent[(p + n - 1) % n]);
            }
        }
        bufs
    }

    #[test]
    fn the_schedule_sums_every_element_on_every_rank() {
        for n in [1, 2, 3, 5, 7] {
            for len in [0, 1, 2, 6, 7, 13, 100] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| (r * 100 + i) as f32).collect()).collect();
                let expected: Vec<f32> = (0..len).map(|i| (0..n).map(|r| (r * 100 + i) as f32).sum()).collect();
                for out in simulate(&inputs, false) {
                    assert_eq!(out, expected, "n {n} len {len}");
                }
                let mean: Vec<f32> = expected.iter().map(|v| v / n as f32).collect();
                for out in simulate(&inputs, true) {
                    for (a, b) in out.iter().zip(&mean) {
                        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "n {n} len {len}: {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn each_rank_sends_two_n_minus_one_over_n_of_the_buffer() {
        let (len, n) = (1000, 4);
        for p in 0..n {
            let s = RingSchedule::new(len, n, p);
            let sent: usize = (0..n - 1).map(|k| s.reduce_scatter(k).0.len() + s.all_gather(k).0.len()).sum();
            assert_eq!(sent, 2 * (n - 1) * len / n);
        }
    }

    #[test]
    fn hops_chain_what_arrives_into_what_is_sent_next() {
        for n in [2, 3, 5, 7] {
            for p in 0..n {
                let s = RingSchedule::new(100, n, p);
                assert_eq!(s.hops(), 2 * (n - 1));
                for h in 0..s.hops() {
                    let (send, recv) = s.hop_chunks(h);
                    // Hop h mirrors the per-step schedule...
                    let (send_r, recv_r) = if h < n - 1 { s.reduce_scatter(h) } else { s.all_gather(h - (n - 1)) };
                    assert_eq!((s.chunks[send].range(), s.chunks[recv].range()), (send_r, recv_r));
                    // ...what this position receives is what its left neighbour sends...
                    let left = RingSchedule::new(100, n, (p + n - 1) % n);
                    assert_eq!(left.hop_chunks(h).0, recv);
                    // ...and what arrives is sent on at the next hop.
                    if h + 1 < s.hops() {
                        assert_eq!(s.hop_chunks(h + 1).0, recv);
                    }
                }
            }
        }
    }

    #[test]
    fn pieces_tile_each_chunk_and_fit_the_largest_ones_scratch() {
        let s = RingSchedule::new(1001, 3, 0);
        let pieces = s.pieces_per_chunk(100);
        assert_eq!(pieces, 4); // the largest chunk has 334 elements
        let bounds = s.piece_bounds(pieces);
        assert_eq!(bounds.len(), 3 * pieces);
        assert!(bounds.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!((bounds[0].start, bounds.last().unwrap().end), (0, 1001));
        let largest = ShardInfo::all(s.largest_chunk(), pieces);
        for (i, b) in bounds.iter().enumerate() {
            assert!(b.len() <= largest[i % pieces].len, "piece {i} fits its scratch piece");
        }
        assert_eq!(RingSchedule::new(5, 7, 0).pieces_per_chunk(4096), 1);
    }
}
