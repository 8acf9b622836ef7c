//! Coalescing: pieces that are contiguous on both sides become one descriptor.

use crate::planner::Descriptor;

/// Merges every piece that starts where another ends on both sides, after ordering by source:
/// the same bytes, fewer descriptors. Unlike [`crate::planner::contiguous_runs`] this also joins
/// runs whose block ids descend in the request (P's 5, 4 → D's 7, 6 is one run of 2 blocks).
pub(super) fn coalesce(mut pieces: Vec<Descriptor>) -> Vec<Descriptor> {
    pieces.sort_unstable_by_key(|d| (d.src, d.dst));
    let mut out: Vec<Descriptor> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match out.last_mut() {
            Some(last) if last.src + last.len == piece.src && last.dst + last.len == piece.dst => last.len += piece.len,
            _ => out.push(piece),
        }
    }
    out
}
