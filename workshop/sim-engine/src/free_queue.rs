//! The block pool's free queue (vLLM's `FreeKVCacheBlockQueue`): free blocks in the order they
//! are handed out, head first. Blocks join at either end and leave from the head, or from
//! anywhere when a prefix-cache hit takes a free cached block back (`touch`). An ordered map
//! keyed by a position that decreases at the head and increases at the tail keeps each of those
//! O(log n).

use std::collections::BTreeMap;

use pdflow_messages::BlockId;

/// Free blocks, head first.
#[derive(Debug)]
pub(crate) struct FreeQueue {
    order: BTreeMap<i64, BlockId>,
    /// Each block's position in `order`, `None` while it is not free.
    position: Vec<Option<i64>>,
    /// The next position at the head (decreasing) and at the tail (increasing).
    head: i64,
    tail: i64,
}

impl FreeQueue {
    /// Every block `0..num_blocks` free, in id order.
    pub fn full(num_blocks: usize) -> Self {
        let mut q = Self { order: BTreeMap::new(), position: vec![None; num_blocks], head: -1, tail: 0 };
        for b in 0..num_blocks {
            if let Ok(id) = BlockId::try_from(b) {
                q.push_back(id);
            }
        }
        q
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn contains(&self, block: BlockId) -> bool {
        self.position.get(block as usize).is_some_and(Option::is_some)
    }

    /// Appends `block` at the tail (handed out last).
    pub fn push_back(&mut self, block: BlockId) {
        if self.contains(block) {
            debug_assert!(false, "block {block} freed twice");
            return;
        }
        self.order.insert(self.tail, block);
        if let Some(p) = self.position.get_mut(block as usize) {
            *p = Some(self.tail);
        }
        self.tail += 1;
    }

    /// Prepends `block` at the head (handed out next).
    pub fn push_front(&mut self, block: BlockId) {
        if self.contains(block) {
            debug_assert!(false, "block {block} freed twice");
            return;
        }
        self.order.insert(self.head, block);
        if let Some(p) = self.position.get_mut(block as usize) {
            *p = Some(self.head);
        }
        self.head -= 1;
    }

    /// Takes the block at the head.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let (_, block) = self.order.pop_first()?;
        if let Some(p) = self.position.get_mut(block as usize) {
            *p = None;
        }
        Some(block)
    }

    /// Takes `block` out wherever it is; false if it was not free.
    pub fn remove(&mut self, block: BlockId) -> bool {
        let Some(at) = self.position.get_mut(block as usize).and_then(Option::take) else { return false };
        self.order.remove(&at);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_leave_from_the_head_or_from_anywhere() {
        let mut q = FreeQueue::full(4);
        assert_eq!(q.pop_front(), Some(0));
        assert!(q.remove(2));
        assert!(!q.remove(2));
        q.push_front(2);
        q.push_back(0);
        let order: Vec<BlockId> = std::iter::from_fn(|| q.pop_front()).collect();
        assert_eq!(order, vec![2, 1, 3, 0]);
        assert_eq!(q.len(), 0);
    }
}
