//! Block checks the backends' tests share: D's blocks hold P's bytes, or were never written.

use pdflow_kv::memory::KvCache;
use pdflow_messages::BlockId;

/// Each of `dst`'s `dst_blocks` holds the bytes of `src`'s block at the same position (and the
/// source blocks hold a pattern, so that equal zeros prove nothing).
pub(crate) fn assert_copied(src: &KvCache, dst: &KvCache, src_blocks: &[BlockId], dst_blocks: &[BlockId]) {
    for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
        let want = src.block_bytes(s).expect("src block");
        assert!(want.iter().any(|&b| b != 0), "source block {s} should hold a pattern");
        assert!(dst.block_bytes(d).expect("dst block") == want, "D's block {d} differs from P's block {s}");
    }
}

/// None of `dst`'s `blocks` was written (they are still zero).
pub(crate) fn assert_untouched(dst: &KvCache, blocks: &[BlockId]) {
    for &d in blocks {
        assert!(dst.block_bytes(d).expect("dst block").iter().all(|&b| b == 0), "D's block {d} was written");
    }
}
