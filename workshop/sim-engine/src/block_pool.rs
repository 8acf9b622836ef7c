//! The paged block pool (vLLM's `BlockPool`, without prefix caching): a fixed number of blocks and a
//! FIFO free list. Every block id `0..num_blocks` is usable: unlike vLLM there is no reserved null
//! block. A block has one owner at a time (a request), which is what makes the raw memory access of
//! the model and the transfer engines safe (`memory.rs`).

use std::collections::VecDeque;

use pdflow_messages::BlockId;

/// A fixed pool of KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    total: usize,
    free: VecDeque<BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let free = (0..num_blocks).filter_map(|b| BlockId::try_from(b).ok()).collect();
        Self { total: num_blocks, free }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks from the head of the free list, or none if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.drain(..n).collect())
    }

    /// Returns blocks to the tail of the free list.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.free.extend(blocks);
        debug_assert!(self.free.len() <= self.total, "a block was freed twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_fifo_and_refuses_beyond_capacity() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).expect("3 of 4 free");
        assert_eq!(a, vec![0, 1, 2]);
        assert!(pool.allocate(2).is_none());
        pool.free(a);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.allocate(2).expect("free"), vec![3, 0]);
    }
}
