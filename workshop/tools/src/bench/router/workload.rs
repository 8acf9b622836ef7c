//! The router bench's workloads, generated from a seed: what clients send, as token ids, so that
//! every front and policy sees the same prompts.
//!
//! - `shared`: multi-turn chat sessions (each on one of a few system prompts; a turn's prompt is
//!   the whole conversation so far — the previous prompts, the engine's answers, the new user
//!   message) mixed with few-shot requests (one of a few long templates, then a short question).
//!   Sizes are ShareGPT-like: user turns of 32–400 tokens, system prompts of 256–1024, templates
//!   of 1024–3072.
//! - `unique`: single requests whose prompts share nothing, of the same sizes.
//!
//! [`shared_tokens`] counts, over the prompts in the order they were sent, the tokens an ideal
//! router's engines would have found cached: the full blocks each prompt shares with an earlier
//! one.

use std::collections::HashSet;

use pdflow_actors::proxy::flow::prompt_key;

/// Token ids are drawn from here: clear of the simulated engine's special ids, within its
/// vocabulary (32,000).
const TOKEN_IDS: std::ops::Range<u64> = 1000..31_000;

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    Shared,
    Unique,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Shared => "shared prefixes",
            WorkloadKind::Unique => "no shared prefix",
        }
    }
}

/// The workload's sizes.
#[derive(Debug, Clone, Copy)]
pub struct WorkloadSpec {
    pub kind: WorkloadKind,
    pub seed: u64,
    /// Chat sessions, of 2–6 turns each.
    pub sessions: usize,
    /// Few-shot requests, over [`Self::templates`] templates.
    pub few_shot: usize,
    pub templates: usize,
    /// System prompts the sessions are spread over.
    pub system_prompts: usize,
}

/// One client's sequence: turns sent one after another, each once the previous one's answer is
/// in (a session), or one request.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// The first prompt's tokens (a session's system prompt and first user turn; a request's
    /// template and question, or its whole prompt).
    pub first: Vec<u32>,
    /// The user turns after the first: each prompt is the previous prompt, its answer, then this.
    pub later_turns: Vec<Vec<u32>>,
}

impl Sequence {
    pub fn turns(&self) -> usize {
        1 + self.later_turns.len()
    }
}

/// SplitMix64: a seeded stream of numbers, the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        let span = TOKEN_IDS.end - TOKEN_IDS.start;
        (0..n).map(|_| (TOKEN_IDS.start + self.next() % span) as u32).collect()
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

fn user_turn(rng: &mut Rng) -> usize {
    // ShareGPT's user turns: most short, some long.
    if rng.next().is_multiple_of(4) {
        rng.between(200, 400)
    } else {
        rng.between(32, 200)
    }
}

/// The sequences of a workload, in the order clients take them.
pub fn generate(spec: &WorkloadSpec) -> Vec<Sequence> {
    let mut rng = Rng(spec.seed);
    let systems: Vec<Vec<u32>> = (0..spec.system_prompts.max(1))
        .map(|_| {
            let n = rng.between(256, 1024);
            rng.tokens(n)
        })
        .collect();
    let templates: Vec<Vec<u32>> = (0..spec.templates.max(1))
        .map(|_| {
            let n = rng.between(1024, 3072);
            rng.tokens(n)
        })
        .collect();
    let mut sequences = Vec::with_capacity(spec.sessions + spec.few_shot);
    for _ in 0..spec.sessions {
        let system = &systems[rng.between(0, systems.len() - 1)];
        let turns = rng.between(2, 6);
        let first_user = user_turn(&mut rng);
        let later_turns = (1..turns)
            .map(|_| {
                let n = user_turn(&mut rng);
                rng.tokens(n)
            })
            .collect();
        let first = match spec.kind {
            WorkloadKind::Shared => [system.clone(), rng.tokens(first_user)].concat(),
            WorkloadKind::Unique => rng.tokens(system.len() + first_user),
        };
        let later_turns = match spec.kind {
            WorkloadKind::Shared => later_turns,
            WorkloadKind::Unique => Vec::new(),
        };
        sequences.push(Sequence { first, later_turns });
    }
    for _ in 0..spec.few_shot {
        let template = &templates[rng.between(0, templates.len() - 1)];
        let question = rng.between(32, 256);
        let first = match spec.kind {
            WorkloadKind::Shared => [template.clone(), rng.tokens(question)].concat(),
            WorkloadKind::Unique => rng.tokens(template.len() + question),
        };
        sequences.push(Sequence { first, later_turns: Vec::new() });
    }
    rng.shuffle(&mut sequences);
    sequences
}

/// The tokens of `prompts` (in the order sent) that an ideal router would find cached: for each
/// prompt, its leading full blocks of `block_size` already seen in an earlier prompt.
pub fn shared_tokens(prompts: &[Vec<u32>], block_size: usize) -> usize {
    let mut seen = HashSet::new();
    let mut shared = 0;
    for prompt in prompts {
        // The proxy's chained chunk hashes: two prompts sharing a prefix share their leading ones.
        let blocks = prompt_key::chain(prompt.chunks_exact(block_size));
        shared += blocks.iter().take_while(|b| seen.contains(*b)).count() * block_size;
        seen.extend(blocks);
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: WorkloadKind) -> WorkloadSpec {
        WorkloadSpec { kind, seed: 7, sessions: 20, few_shot: 30, templates: 3, system_prompts: 2 }
    }

    #[test]
    fn a_seed_gives_the_same_workload() {
        let (a, b) = (generate(&spec(WorkloadKind::Shared)), generate(&spec(WorkloadKind::Shared)));
        assert_eq!(a.len(), 50);
        assert!(a.iter().zip(&b).all(|(x, y)| x.first == y.first && x.later_turns == y.later_turns));
    }

    #[test]
    fn the_shared_workload_shares_its_templates_and_the_unique_one_nothing() {
        let firsts = |kind| generate(&spec(kind)).into_iter().map(|s| s.first).collect::<Vec<_>>();
        let shared = firsts(WorkloadKind::Shared);
        let total: usize = shared.iter().map(Vec::len).sum();
        let frac = shared_tokens(&shared, 16) as f64 / total as f64;
        assert!(frac > 0.4, "few-shot templates and system prompts are shared: {frac}");
        assert_eq!(shared_tokens(&firsts(WorkloadKind::Unique), 16), 0);
        let unique = generate(&spec(WorkloadKind::Unique));
        assert!(unique.iter().all(|s| s.turns() == 1));
    }

    #[test]
    fn shared_tokens_count_leading_blocks_only() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 9999; // the second block differs: only the first is shared
        assert_eq!(shared_tokens(&[a.clone(), b, a], 16), 16 + 64);
    }
}
