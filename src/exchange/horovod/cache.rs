//! Horovod's response cache (horovod/common/response_cache.cc), as a data structure apart from
//! the MPI code that keeps it equal on every rank.
//!
//! A response is what negotiation agreed for one tensor (here its id and element count). The
//! cache holds up to `capacity` of them, each at a bit position; once every rank has a cached
//! tensor ready, one bitwise AND over the ranks (see the background thread) replaces the
//! negotiation through rank 0. Every rank applies the same operations in the same order (from
//! the agreed response lists), so the positions stay equal everywhere. As in Horovod:
//! - `put` of a new response at capacity evicts the least recently used entry, and the new
//!   entry takes over the evicted one's bit;
//! - `put` of a cached response and `get` make it the most recently used;
//! - `erase` frees a bit, and `compact` (Horovod's `update_cache_bits`) then renumbers the
//!   entries, the least recently used first;
//! - capacity 0 turns the cache off (`put` keeps nothing).

use std::collections::{BTreeMap, HashMap};

/// A negotiated tensor: its id (the same on every rank) and element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub id: usize,
    pub len: usize,
}

/// What the cache says about a tensor a rank has ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheState {
    /// Cached with the same element count, at this bit.
    Hit(usize),
    /// Cached at this bit, but with another element count: the entry must go everywhere before
    /// the tensor is negotiated again.
    Invalid(usize),
    Miss,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    response: Response,
    /// When it was last used: the key of `recency`.
    tick: u64,
}

#[derive(Debug)]
pub struct ResponseCache {
    capacity: usize,
    /// Entries by bit position; `None` after an erase, until `compact`.
    slots: Vec<Option<Entry>>,
    bit_of: HashMap<usize, usize>,
    /// Use order: tick -> bit, the least recently used first.
    recency: BTreeMap<u64, usize>,
    tick: u64,
    evictions: u64,
}

impl ResponseCache {
    pub fn new(capacity: usize) -> ResponseCache {
        ResponseCache { capacity, slots: Vec::new(), bit_of: HashMap::new(), recency: BTreeMap::new(), tick: 0, evictions: 0 }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.bit_of.len()
    }

    /// Bit positions in use, erased ones included until `compact` (the length of the bit
    /// vector the ranks AND together).
    pub fn bits(&self) -> usize {
        self.slots.len()
    }

    /// Entries evicted to make room since the cache was made.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn cached(&self, id: usize, len: usize) -> CacheState {
        match self.bit_of.get(&id) {
            Some(&bit) if self.entry(bit).response.len == len => CacheState::Hit(bit),
            Some(&bit) => CacheState::Invalid(bit),
            None => CacheState::Miss,
        }
    }

    /// The response at `bit`, leaving the use order alone.
    pub fn peek(&self, bit: usize) -> Response {
        self.entry(bit).response
    }

    /// The response at `bit`, which becomes the most recently used.
    pub fn get(&mut self, bit: usize) -> Response {
        self.touch(bit);
        self.entry(bit).response
    }

    /// Caches `response` as the most recently used entry (a no-op at capacity 0). A new entry
    /// at capacity takes the place and bit of the least recently used one, which is returned.
    /// An entry of the same id must have been erased first if its element count changed.
    pub fn put(&mut self, response: Response) -> Option<Response> {
        if self.capacity == 0 {
            return None;
        }
        if let Some(&bit) = self.bit_of.get(&response.id) {
            debug_assert_eq!(self.entry(bit).response, response, "an invalid entry is erased before it is cached again");
            self.slots[bit].as_mut().expect("a mapped bit holds an entry").response = response;
            self.touch(bit);
            return None;
        }
        let (bit, evicted) = if self.len() == self.capacity {
            let (_, &bit) = self.recency.iter().next().expect("a full cache of capacity > 0 has an entry");
            let old = self.entry(bit);
            self.recency.remove(&old.tick);
            self.bit_of.remove(&old.response.id);
            self.evictions += 1;
            (bit, Some(old.response))
        } else {
            self.slots.push(None);
            (self.slots.len() - 1, None)
        };
        self.tick += 1;
        self.slots[bit] = Some(Entry { response, tick: self.tick });
        self.recency.insert(self.tick, bit);
        self.bit_of.insert(response.id, bit);
        evicted
    }

    /// Removes the entry at `bit`; its position stays empty until `compact`.
    pub fn erase(&mut self, bit: usize) {
        if let Some(entry) = self.slots.get_mut(bit).and_then(Option::take) {
            self.recency.remove(&entry.tick);
            self.bit_of.remove(&entry.response.id);
        }
    }

    /// After erases, numbers the entries 0.. again, the least recently used first (Horovod's
    /// `update_cache_bits`); nothing changes when nothing was erased.
    pub fn compact(&mut self) {
        if self.slots.iter().all(Option::is_some) {
            return;
        }
        let order: Vec<Entry> = self.recency.values().map(|&bit| self.entry(bit)).collect();
        self.slots = order.iter().map(|&e| Some(e)).collect();
        self.recency = order.iter().enumerate().map(|(bit, e)| (e.tick, bit)).collect();
        self.bit_of = order.iter().enumerate().map(|(bit, e)| (e.response.id, bit)).collect();
    }

    fn entry(&self, bit: usize) -> Entry {
        self.slots[bit].expect("a bit in use holds an entry")
    }

    fn touch(&mut self, bit: usize) {
        let entry = self.slots[bit].as_mut().expect("a bit in use holds an entry");
        self.recency.remove(&entry.tick);
        self.tick += 1;
        entry.tick = self.tick;
        self.recency.insert(self.tick, bit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(id: usize, len: usize) -> Response {
        Response { id, len }
    }

    #[test]
    fn hits_misses_and_invalid_entries() {
        let mut cache = ResponseCache::new(4);
        assert_eq!(cache.cached(7, 10), CacheState::Miss);
        cache.put(r(7, 10));
        cache.put(r(8, 3));
        assert_eq!(cache.cached(7, 10), CacheState::Hit(0));
        assert_eq!(cache.cached(8, 3), CacheState::Hit(1));
        assert_eq!(cache.cached(8, 4), CacheState::Invalid(1));
        assert_eq!(cache.peek(1), r(8, 3));
        assert_eq!((cache.len(), cache.bits()), (2, 2));
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_into_its_bit() {
        let mut cache = ResponseCache::new(3);
        for id in 0..3 {
            assert_eq!(cache.put(r(id, 1)), None);
        }
        // Use 0 (get) and 1 (put again): 2 is now the least recently used.
        cache.get(0);
        cache.put(r(1, 1));
        assert_eq!(cache.put(r(9, 5)), Some(r(2, 1)));
        assert_eq!(cache.cached(9, 5), CacheState::Hit(2), "the new entry takes the evicted one's bit");
        assert_eq!(cache.cached(2, 1), CacheState::Miss);
        // Now 0 is the oldest use.
        assert_eq!(cache.put(r(10, 1)), Some(r(0, 1)));
        assert_eq!(cache.cached(10, 1), CacheState::Hit(0));
        assert_eq!((cache.len(), cache.bits(), cache.evictions()), (3, 3, 2));
        // peek does not count as a use.
        cache.peek(1);
        assert_eq!(cache.put(r(11, 1)), Some(r(1, 1)));
    }

    #[test]
    fn capacity_one_keeps_the_last_put_and_zero_keeps_nothing() {
        let mut one = ResponseCache::new(1);
        for id in 0..5 {
            one.put(r(id, 2));
        }
        assert_eq!(one.len(), 1);
        assert_eq!(one.cached(4, 2), CacheState::Hit(0));
        assert_eq!(one.cached(3, 2), CacheState::Miss);
        let mut off = ResponseCache::new(0);
        assert_eq!(off.put(r(1, 1)), None);
        assert_eq!((off.len(), off.bits()), (0, 0));
        assert_eq!(off.cached(1, 1), CacheState::Miss);
    }

    #[test]
    fn erase_then_compact_renumbers_oldest_first() {
        let mut cache = ResponseCache::new(8);
        for id in [10, 11, 12, 13] {
            cache.put(r(id, id));
        }
        cache.get(0); // 10 becomes the most recent: use order 11, 12, 13, 10
        cache.erase(2); // 12
        assert_eq!(cache.bits(), 4, "the erased bit stays until compact");
        assert_eq!(cache.cached(12, 12), CacheState::Miss);
        cache.compact();
        assert_eq!(cache.bits(), 3);
        assert_eq!(cache.cached(11, 11), CacheState::Hit(0));
        assert_eq!(cache.cached(13, 13), CacheState::Hit(1));
        assert_eq!(cache.cached(10, 10), CacheState::Hit(2));
        // The use order survives the renumbering: 11 is still the next to go.
        for id in 20..24 {
            cache.put(r(id, 1));
        }
        assert_eq!(cache.len(), 7);
        cache.put(r(30, 1));
        assert_eq!(cache.put(r(31, 1)), Some(r(11, 11)));
    }

    #[test]
    fn the_same_operations_give_the_same_bits_on_every_rank() {
        // Two caches fed the same agreed responses stay equal bit for bit, evictions included.
        let ops: Vec<Response> = (0..40).map(|i| r((i * 7) % 13, 1 + i % 3)).collect();
        let (mut a, mut b) = (ResponseCache::new(5), ResponseCache::new(5));
        for op in &ops {
            for cache in [&mut a, &mut b] {
                if let CacheState::Invalid(bit) = cache.cached(op.id, op.len) {
                    cache.erase(bit);
                    cache.compact();
                }
                cache.put(*op);
            }
        }
        for bit in 0..a.bits() {
            assert_eq!(a.peek(bit), b.peek(bit));
        }
    }
}
