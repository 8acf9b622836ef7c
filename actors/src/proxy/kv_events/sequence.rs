//! Where one KV-event stream stands: the sequence numbers of the batches taken from one engine's
//! publisher, and the verdict on each new one (the `kv_aware` policy's input, step 8's routing).
//!
//! A publisher numbers its batches from 0, one by one. A batch numbered right after the last is
//! the next; one further on means batches were missed (a gap, to be replayed); one at or below the
//! last is either a batch seen already (the live socket and a replay overlap: the same number and
//! the same payload) or a publisher that started again from 0 (the engine restarted: the same
//! number, another payload, or a number older than those remembered).

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

/// Batches remembered, to tell a replayed batch seen live from a restarted engine's.
pub const REMEMBERED: usize = 1024;

/// What a batch is to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing taken yet: this one starts the stream.
    First,
    /// The one after the last.
    Next,
    /// Already taken.
    Duplicate,
    /// Batches between the last and this one are missing.
    Gap { last: u64 },
    /// The publisher started again (the engine restarted).
    Restart,
}

/// A payload's digest: tells two batches of one number apart.
pub fn digest(payload: &[u8]) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// The batches taken from one publisher.
#[derive(Debug, Default)]
pub struct Sequence {
    /// (sequence number, digest) of the latest taken, oldest first.
    recent: VecDeque<(u64, u64)>,
}

impl Sequence {
    /// The last batch taken.
    pub fn last(&self) -> Option<u64> {
        self.recent.back().map(|(seq, _)| *seq)
    }

    pub fn judge(&self, seq: u64, digest: u64) -> Verdict {
        let Some(last) = self.last() else { return Verdict::First };
        if seq == last.wrapping_add(1) {
            return Verdict::Next;
        }
        if seq > last {
            return Verdict::Gap { last };
        }
        match self.recent.iter().find(|(s, _)| *s == seq) {
            Some((_, d)) if *d == digest => Verdict::Duplicate,
            _ => Verdict::Restart,
        }
    }

    /// Takes the batch `seq` (judged [`Verdict::First`], [`Verdict::Next`], or after a gap or a
    /// restart was dealt with).
    pub fn take(&mut self, seq: u64, digest: u64) {
        self.recent.push_back((seq, digest));
        while self.recent.len() > REMEMBERED {
            self.recent.pop_front();
        }
    }

    /// Starts over (the index behind it was cleared).
    pub fn reset(&mut self) {
        self.recent.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_next_gap_duplicate_and_restart_apart() {
        let mut s = Sequence::default();
        assert_eq!(s.judge(5, 1), Verdict::First);
        s.take(5, 1);
        assert_eq!(s.judge(6, 2), Verdict::Next);
        s.take(6, 2);
        assert_eq!(s.judge(9, 3), Verdict::Gap { last: 6 });
        assert_eq!(s.judge(5, 1), Verdict::Duplicate, "a replayed batch seen live");
        assert_eq!(s.judge(5, 7), Verdict::Restart, "the same number, another payload");
        assert_eq!(s.judge(0, 7), Verdict::Restart, "a number older than any remembered");
        s.reset();
        assert_eq!((s.last(), s.judge(0, 7)), (None, Verdict::First));
    }

    #[test]
    fn remembers_a_bounded_number_of_batches() {
        let mut s = Sequence::default();
        for seq in 0..(REMEMBERED as u64 + 10) {
            s.take(seq, seq);
        }
        assert_eq!(s.judge(9, 9), Verdict::Restart, "forgotten");
        assert_eq!(s.judge(10, 10), Verdict::Duplicate);
    }
}
