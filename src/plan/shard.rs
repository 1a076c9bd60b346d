//! Shard arithmetic: which part of a count each of n parts owns, balanced to within one
//! element (as llm.c's `ShardInfo` in zero.cuh). The ring's chunks, recursive halving's blocks,
//! ZeRO's shards and evaluation's shares of the test set all cut counts this way.

/// One part of a count split into near-equal parts: the first `total % parts` parts hold one more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    pub offset: usize,
    pub len: usize,
}

impl ShardInfo {
    pub fn split(total: usize, parts: usize, index: usize) -> ShardInfo {
        assert!(parts > 0 && index < parts, "shard {index} of {parts}");
        let base = total / parts;
        let extra = total % parts;
        let len = base + usize::from(index < extra);
        let offset = index * base + index.min(extra);
        ShardInfo { offset, len }
    }

    pub fn all(total: usize, parts: usize) -> Vec<ShardInfo> {
        (0..parts).map(|i| ShardInfo::split(total, parts, i)).collect()
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_count_exactly_once() {
        for total in [0usize, 1, 2, 7, 10, 64, 1001] {
            for parts in 1..=9 {
                let shards = ShardInfo::all(total, parts);
                let mut next = 0;
                for s in &shards {
                    assert_eq!(s.offset, next);
                    next = s.end();
                }
                assert_eq!(next, total);
                let max = shards.iter().map(|s| s.len).max().unwrap();
                let min = shards.iter().map(|s| s.len).min().unwrap();
                assert!(max - min <= 1, "total {total} parts {parts}");
            }
        }
    }
}
