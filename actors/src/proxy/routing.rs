//! How the Proxy actor picks one engine of a pool for a request (step 8): the pool's [`Policy`]
//! over its healthy candidates, the work each has in flight, and — for `cache_aware` — which
//! prompt prefixes were routed to each.
//!
//! - `round_robin`: the next in turn (what vLLM's example proxy does).
//! - `least_loaded`: the candidate with the fewest tokens in flight (then the fewest requests);
//!   the proxy counts what it sent each engine until P answered (a P) or the request ended (a D)
//!   ([`Picker::done`]).
//! - `cache_aware`: each candidate's likely cache, from the prompts routed to it: a bounded,
//!   least-recently-used set of the chained chunk hashes of those prompts ([`ChunkCache`]). The
//!   candidate whose set holds the longest leading run of the prompt's chunks wins, unless it
//!   already carries far more work than the least loaded one (then the least loaded wins, so that
//!   a hot prefix does not pile every request on one engine); no match at all: least loaded.
//!   What the chosen engine computes is charged as its load: the prompt minus the matched prefix.
//! - `kv_aware`: each candidate's real prefix cache, as its KV events said ([`HeldBlocks`], the
//!   proxy's `kv_events`): the prompt's token ids cut in the engine's block size, and the
//!   candidate holding the longest leading run of them wins, under `cache_aware`'s balance rule
//!   ([`Choice::KvHit`]). A prefix routed to a candidate in the last seconds counts as held there
//!   until its events can say so ([`pending`]): a burst sharing a new prefix follows the first.
//!   A prompt given as text or a chat has no token ids here (the proxy runs
//!   no tokenizer): for it, `kv_aware` is `cache_aware`'s approximation ([`Choice::CacheHit`]).
//!
//! [`LocalPrefill`] decides, before P is picked, whether D serves the request alone.
//!
//! Owns no step of its own: it is the decision inside step 8.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use pdflow_messages::proxy::{Choice, PromptKey};

use super::kv_events::{Held, PromptBlocks};

mod pending;

/// Chunk hashes remembered per engine (~4 M tokens at 16 tokens a chunk: more than an engine's
/// KV cache holds, so the set forgets later than the engine does, and the balance rule covers
/// what it still believes).
pub const CACHE_CHUNKS: usize = 1 << 18;
/// A cache hit is taken unless the engine has this many more tokens in flight than the least
/// loaded one…
pub const BALANCE_TOKENS: usize = 8192;
/// …and more than this many times as many.
pub const BALANCE_RATIO: usize = 2;

/// A pool's routing policy (`--prefill-policy`, `--decode-policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    #[default]
    RoundRobin,
    LeastLoaded,
    CacheAware,
    KvAware,
}

impl Policy {
    pub const NAMES: &'static str = "round_robin, least_loaded, cache_aware, kv_aware";

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
            Policy::CacheAware => "cache_aware",
            Policy::KvAware => "kv_aware",
        }
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round_robin" => Ok(Policy::RoundRobin),
            "least_loaded" | "load_aware" => Ok(Policy::LeastLoaded),
            "cache_aware" => Ok(Policy::CacheAware),
            "kv_aware" => Ok(Policy::KvAware),
            other => Err(format!("unknown routing policy `{other}`; known: {}", Policy::NAMES)),
        }
    }
}

/// When D serves a request alone, computing the prompt itself: no P, no transfer. Disaggregation
/// costs a second engine's queue, a KV transfer and a second request; when what D would still
/// compute is short — a short prompt, or one whose prefix D already holds — computing it on D
/// costs less (`--local-prefill-below`, `--local-prefill-when-d-holds`). Off by default: every
/// request goes through P.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocalPrefill {
    /// D serves alone a prompt of which it would compute fewer (estimated) tokens than this: the
    /// prompt minus the prefix D's pool knows it holds (none with `round_robin` or
    /// `least_loaded`), 0: never.
    pub below_tokens: usize,
    /// With a cache-aware or KV-aware D pool: D's match covering at least this many thousandths
    /// of the prompt's chunks, or (KV events) of its tokens (`None`: never).
    pub d_holds_permille: Option<u32>,
}

impl LocalPrefill {
    /// `pdflow proxy`'s share of a prompt D must hold to serve it alone, with a D pool that knows
    /// what it holds (`cache_aware`, `kv_aware`): the best of 0.5–0.97 on `pdflow bench router`'s
    /// shared-prefix workload, for time to first token and requests/s together
    /// (docs/routing-bench.md).
    pub const D_HOLDS_PERMILLE_DEFAULT: u32 = 930;

    /// Whether any request may be served by D alone.
    pub fn enabled(&self) -> bool {
        self.below_tokens > 0 || self.d_holds_permille.is_some()
    }

    /// Whether `prompt`, for which D's pool chose `decode_choice`, is served by D alone.
    pub fn applies(&self, prompt: &PromptKey, decode_choice: Choice) -> bool {
        if prompt.tokens.saturating_sub(held_tokens(prompt, decode_choice)) < self.below_tokens {
            return true;
        }
        match (self.d_holds_permille, decode_choice) {
            (Some(share), Choice::CacheHit { chunks }) if !prompt.chunks.is_empty() => {
                chunks * 1000 >= prompt.chunks.len() * share as usize
            }
            (Some(share), Choice::KvHit { tokens, .. }) if prompt.tokens > 0 => {
                tokens * 1000 >= prompt.tokens * share as usize
            }
            _ => false,
        }
    }
}

/// The tokens of `prompt` the engine a pool chose holds, as far as the pool knows: its KV events'
/// tokens, or the matched chunks' share of the prompt's (estimated) tokens.
fn held_tokens(prompt: &PromptKey, choice: Choice) -> usize {
    match choice {
        Choice::KvHit { tokens, .. } => tokens.min(prompt.tokens),
        Choice::CacheHit { chunks } if !prompt.chunks.is_empty() => {
            let of = prompt.chunks.len();
            (prompt.tokens * chunks.min(of)).div_ceil(of)
        }
        _ => 0,
    }
}

/// Work in flight on one engine, as the proxy sent it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub requests: usize,
    pub tokens: usize,
}

/// What each candidate's prefix cache holds, as its KV events said (`kv_aware`).
pub trait HeldBlocks<K>: Send + Sync + std::fmt::Debug {
    /// The leading blocks of `prompt` that `key` holds (none known: nothing).
    fn held(&self, key: K, prompt: &mut PromptBlocks) -> Held;
}

/// One pool's picker: its policy, its turn, and per candidate its load and likely cache.
#[derive(Debug)]
pub struct Picker<K> {
    policy: Policy,
    next: usize,
    loads: HashMap<K, Load>,
    caches: HashMap<K, ChunkCache>,
    cache_chunks: usize,
    /// `kv_aware`: what each candidate holds.
    held: Option<Arc<dyn HeldBlocks<K>>>,
    /// `kv_aware`: the prompts routed to each candidate that its events cannot show yet.
    pending: HashMap<K, pending::Pending>,
}

impl<K: Copy + Eq + Hash> Picker<K> {
    pub fn new(policy: Policy) -> Self {
        Self::with_cache_chunks(policy, CACHE_CHUNKS)
    }

    /// A picker whose per-engine caches remember `cache_chunks` chunk hashes.
    pub fn with_cache_chunks(policy: Policy, cache_chunks: usize) -> Self {
        Self {
            policy,
            next: 0,
            loads: HashMap::new(),
            caches: HashMap::new(),
            cache_chunks,
            held: None,
            pending: HashMap::new(),
        }
    }

    /// The picker, matching prompts against what `held` says each candidate holds (`kv_aware`;
    /// without it, `kv_aware` is `cache_aware`).
    pub fn with_held(mut self, held: Arc<dyn HeldBlocks<K>>) -> Self {
        self.held = Some(held);
        self
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Picks one of `candidates` (not empty) for `prompt`, charges it the tokens it will compute
    /// (returned), and remembers the prompt's chunks there.
    pub fn pick(&mut self, candidates: &[K], prompt: &PromptKey) -> Option<(K, Choice, usize)> {
        let first = *candidates.first()?;
        let turn = self.next;
        self.next = self.next.wrapping_add(1);
        // kv_aware: the tokens the chosen engine's events say it holds.
        let mut held_by_events = None;
        let (chosen, choice) = match self.policy {
            Policy::RoundRobin => (candidates[turn % candidates.len()], Choice::RoundRobin),
            Policy::LeastLoaded => (self.least_loaded(candidates, turn).unwrap_or(first), Choice::LeastLoaded),
            Policy::CacheAware => self.cache_aware(candidates, prompt, turn).unwrap_or((first, Choice::LeastLoaded)),
            Policy::KvAware => match (&prompt.token_ids, &self.held) {
                (Some(ids), Some(held)) => {
                    self.kv_aware(candidates, ids, &prompt.chunks, held.as_ref(), turn).map(|(k, choice, held)| {
                        held_by_events = Some(held);
                        (k, choice)
                    })
                }
                // Text or a chat: no token ids to match, the routed prompts' approximation.
                _ => self.cache_aware(candidates, prompt, turn),
            }
            .unwrap_or((first, Choice::LeastLoaded)),
        };
        let tokens = match (choice, held_by_events) {
            (Choice::CacheHit { chunks }, _) => {
                prompt.tokens.saturating_sub(prompt.tokens * chunks / prompt.chunks.len().max(1))
            }
            // A prefix only routed there is still being computed (or queued): charged in full.
            (_, Some(held)) => prompt.tokens.saturating_sub(held),
            (Choice::KvHit { tokens, .. }, None) => prompt.tokens.saturating_sub(tokens),
            _ => prompt.tokens,
        };
        let load = self.loads.entry(chosen).or_default();
        load.requests += 1;
        load.tokens += tokens;
        let approximated = match self.policy {
            Policy::CacheAware => true,
            Policy::KvAware => prompt.token_ids.is_none(),
            _ => false,
        };
        if approximated && !prompt.chunks.is_empty() {
            let cap = self.cache_chunks;
            self.caches.entry(chosen).or_insert_with(|| ChunkCache::new(cap)).insert(&prompt.chunks);
        } else if self.policy == Policy::KvAware && !prompt.chunks.is_empty() {
            self.pending.entry(chosen).or_default().insert(&prompt.chunks, Instant::now());
        }
        Some((chosen, choice, tokens))
    }

    /// A request routed to `key` with `tokens` charged has ended.
    pub fn done(&mut self, key: K, tokens: usize) {
        if let Some(load) = self.loads.get_mut(&key) {
            load.requests = load.requests.saturating_sub(1);
            load.tokens = load.tokens.saturating_sub(tokens);
        }
    }

    /// Work in flight on `key`.
    pub fn load(&self, key: K) -> Load {
        self.loads.get(&key).copied().unwrap_or_default()
    }

    /// Forgets what `key` was thought to hold (the engine restarted or was removed).
    pub fn forget(&mut self, key: K) {
        self.caches.remove(&key);
        self.pending.remove(&key);
    }

    /// The least loaded candidate; ties go to the one next in turn from `turn`.
    fn least_loaded(&self, candidates: &[K], turn: usize) -> Option<K> {
        let n = candidates.len();
        (0..n).map(|i| candidates[(turn + i) % n]).min_by_key(|k| {
            let l = self.load(*k);
            (l.tokens, l.requests)
        })
    }

    fn cache_aware(&self, candidates: &[K], prompt: &PromptKey, turn: usize) -> Option<(K, Choice)> {
        let least = self.least_loaded(candidates, turn)?;
        let n = candidates.len();
        let best = (0..n)
            .map(|i| candidates[(turn + i) % n])
            .map(|k| (k, self.caches.get(&k).map_or(0, |c| c.matched(&prompt.chunks))))
            .max_by_key(|(_, matched)| *matched)
            .filter(|(_, matched)| *matched > 0);
        Some(self.balanced(least, best.map(|(k, chunks)| (k, Choice::CacheHit { chunks }))))
    }

    /// The candidate holding the longest prefix of the prompt, by its KV events or, for the part
    /// they cannot show yet, by what was routed to it in the last moments ([`pending`]); with the
    /// tokens its events say it holds.
    fn kv_aware(
        &self,
        candidates: &[K],
        ids: &Arc<[u32]>,
        chunks: &[u64],
        held: &dyn HeldBlocks<K>,
        turn: usize,
    ) -> Option<(K, Choice, usize)> {
        let least = self.least_loaded(candidates, turn)?;
        let mut prompt = PromptBlocks::new(ids.clone());
        let now = Instant::now();
        // As vLLM, the prompt's last token is never a hit: it is computed for the first sample.
        let most = ids.len().saturating_sub(1);
        let n = candidates.len();
        let scored: Vec<(K, Held, usize)> = (0..n)
            .map(|i| candidates[(turn + i) % n])
            .map(|k| {
                let events = held.held(k, &mut prompt);
                let routed = self.pending.get(&k).map_or(0, |p| p.matched(chunks, now));
                let routed_tokens = (routed * super::flow::prompt_key::CHUNK_TOKENS).min(most);
                let hit =
                    if routed_tokens > events.tokens { Held { blocks: routed, tokens: routed_tokens } } else { events };
                (k, hit, events.tokens)
            })
            .collect();
        let best = scored.iter().max_by_key(|(_, h, _)| h.tokens).filter(|(_, h, _)| h.blocks > 0);
        let (k, choice) =
            self.balanced(least, best.map(|(k, h, _)| (*k, Choice::KvHit { blocks: h.blocks, tokens: h.tokens })));
        let by_events = scored.iter().find(|(c, _, _)| *c == k).map_or(0, |(_, _, t)| *t);
        Some((k, choice, if choice == Choice::LeastLoaded { 0 } else { by_events }))
    }

    /// The best match, unless its engine carries far more work than the least loaded one (then
    /// the least loaded, so that a hot prefix does not pile every request on one engine); no
    /// match: the least loaded.
    fn balanced(&self, least: K, best: Option<(K, Choice)>) -> (K, Choice) {
        let Some((best, choice)) = best else { return (least, Choice::LeastLoaded) };
        let (busy, idle) = (self.load(best).tokens, self.load(least).tokens);
        let overloaded = busy > idle + BALANCE_TOKENS && busy > idle.saturating_mul(BALANCE_RATIO);
        if overloaded {
            (least, Choice::LeastLoaded)
        } else {
            (best, choice)
        }
    }
}

/// The chunk hashes last routed to one engine, at most `capacity`, the least recently used
/// forgotten first.
#[derive(Debug)]
pub struct ChunkCache {
    capacity: usize,
    tick: u64,
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl ChunkCache {
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), tick: 0, last_use: HashMap::new(), by_age: BTreeMap::new() }
    }

    /// How many of `chunks`, from the first, are held.
    pub fn matched(&self, chunks: &[u64]) -> usize {
        chunks.iter().take_while(|c| self.last_use.contains_key(c)).count()
    }

    /// Holds `chunks` as just used, forgetting the least recently used past the capacity.
    pub fn insert(&mut self, chunks: &[u64]) {
        for &chunk in chunks {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(chunk, self.tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.tick, chunk);
        }
        while self.last_use.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else { break };
            self.last_use.remove(&oldest);
        }
    }

    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::kv_events::index::RankIndex;
    use super::*;

    fn key(chunks: &[u64]) -> PromptKey {
        PromptKey { chunks: chunks.to_vec(), tokens: chunks.len() * 16, token_ids: None }
    }

    #[test]
    fn round_robin_takes_turns() {
        let mut p = Picker::new(Policy::RoundRobin);
        let picks: Vec<_> = (0..4).map(|_| p.pick(&[0, 1, 2], &key(&[1])).map(|x| x.0)).collect();
        assert_eq!(picks, [Some(0), Some(1), Some(2), Some(0)]);
    }

    #[test]
    fn least_loaded_picks_the_engine_with_the_fewest_tokens_in_flight() {
        let mut p = Picker::new(Policy::LeastLoaded);
        let (a, _, big) = p.pick(&[0, 1], &key(&[1; 100])).expect("a pick");
        let (b, _, _) = p.pick(&[0, 1], &key(&[2])).expect("a pick");
        let (c, _, _) = p.pick(&[0, 1], &key(&[3])).expect("a pick");
        assert_ne!(a, b, "the second request avoids the busy engine");
        assert_eq!(b, c, "and so does the third, while the first is in flight");
        p.done(a, big);
        assert_eq!(p.load(a), Load::default());
    }

    #[test]
    fn cache_aware_follows_the_prefix_and_charges_only_what_is_left_to_compute() {
        let mut p = Picker::new(Policy::CacheAware);
        let (first, choice, _) = p.pick(&[0, 1, 2], &key(&[10, 11, 12, 13])).expect("a pick");
        assert_eq!(choice, Choice::LeastLoaded, "nothing routed yet");
        for last in 100..103 {
            let (k, choice, tokens) = p.pick(&[0, 1, 2], &key(&[10, 11, 12, last])).expect("a pick");
            assert_eq!((k, choice), (first, Choice::CacheHit { chunks: 3 }));
            assert_eq!(tokens, 16, "three of four chunks were routed there before");
        }
        let (other, choice, _) = p.pick(&[0, 1, 2], &key(&[50, 51])).expect("a pick");
        assert_ne!(other, first, "a new prompt goes to a less loaded engine");
        assert_eq!(choice, Choice::LeastLoaded);
    }

    #[test]
    fn a_hot_prefix_spills_over_once_its_engine_is_far_busier() {
        let mut p = Picker::new(Policy::CacheAware);
        let hot = PromptKey { chunks: vec![7, 8], tokens: 6000, token_ids: None };
        let (first, _, _) = p.pick(&[0, 1], &hot).expect("a pick");
        let mut spilled = false;
        for _ in 0..10 {
            let long = PromptKey { chunks: vec![7, 8, 9], tokens: 9000, token_ids: None };
            let (k, choice, _) = p.pick(&[0, 1], &long).expect("a pick");
            if k != first {
                assert_eq!(choice, Choice::LeastLoaded);
                spilled = true;
                break;
            }
        }
        assert!(spilled, "every request of a hot prefix piled on one engine: {:?}", p.load(first));
    }

    #[test]
    fn the_chunk_cache_forgets_the_least_recently_used() {
        let mut c = ChunkCache::new(3);
        c.insert(&[1, 2, 3]);
        c.insert(&[1]);
        c.insert(&[4]);
        // 2 is the least recently used: 1 was used again after it.
        assert_eq!((c.len(), c.matched(&[1]), c.matched(&[2]), c.matched(&[3, 4])), (3, 1, 0, 2));
    }

    #[test]
    fn d_alone_serves_short_prompts_and_those_it_holds_most_of() {
        let off = LocalPrefill::default();
        assert!(!off.enabled() && !off.applies(&key(&[1]), Choice::CacheHit { chunks: 1 }));
        let on = LocalPrefill { below_tokens: 64, d_holds_permille: Some(800) };
        assert!(on.applies(&key(&[1, 2, 3]), Choice::RoundRobin), "48 tokens: short");
        let ten = key(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert!(!on.applies(&ten, Choice::CacheHit { chunks: 6 }), "D holds 6 of 10 chunks, 64 tokens left");
        assert!(on.applies(&ten, Choice::CacheHit { chunks: 8 }), "D holds 8 of 10");
    }

    #[test]
    fn d_alone_serves_a_prompt_whose_part_d_lacks_is_short() {
        let on = LocalPrefill { below_tokens: 300, d_holds_permille: None };
        // 1,000 tokens; D's events say it holds 720 of them: 280 left to compute.
        assert!(on.applies(&ids(0..1000), Choice::KvHit { blocks: 45, tokens: 720 }));
        assert!(!on.applies(&ids(0..1000), Choice::KvHit { blocks: 40, tokens: 640 }), "360 left");
        // 62 chunks of 16 ids; 45 routed to D before: 992 × 45 / 62 ≈ 720 held.
        assert!(on.applies(&ids(0..992), Choice::CacheHit { chunks: 45 }));
        assert!(!on.applies(&ids(0..992), Choice::CacheHit { chunks: 40 }));
        // A D pool that knows nothing: the whole prompt is left.
        assert!(!on.applies(&ids(0..992), Choice::LeastLoaded));
        assert!(on.applies(&ids(0..299), Choice::RoundRobin));
    }

    /// Candidates' caches as their KV events would fill them (block size 4).
    #[derive(Debug)]
    struct Caches(Vec<RankIndex>);

    impl HeldBlocks<usize> for Caches {
        fn held(&self, key: usize, prompt: &mut PromptBlocks) -> Held {
            self.0.get(key).map(|index| index.matched(prompt)).unwrap_or_default()
        }
    }

    fn holding(prefixes: &[&[u32]]) -> Arc<Caches> {
        let indexes = prefixes
            .iter()
            .map(|tokens| {
                let mut index = RankIndex::new(1024);
                let blocks = tokens.len() / 4;
                let hashes: Vec<u64> = (0..blocks as u64).map(|b| 1000 + b).collect();
                index.store(0, &hashes, None, &tokens[..blocks * 4], 4).expect("stored");
                index
            })
            .collect();
        Arc::new(Caches(indexes))
    }

    fn ids(range: std::ops::Range<u32>) -> PromptKey {
        let ids: Vec<u32> = range.collect();
        let request = serde_json::json!({ "prompt": ids });
        crate::proxy::flow::prompt_key::prompt_key(request.as_object().expect("an object"), false)
    }

    #[test]
    fn kv_aware_follows_what_the_engines_hold_and_charges_the_rest() {
        let held: Vec<u32> = (0..32).collect();
        let mut p = Picker::new(Policy::KvAware).with_held(holding(&[&[], &held, &[7; 8]]));
        let (k, choice, tokens) = p.pick(&[0, 1, 2], &ids(0..40)).expect("a pick");
        assert_eq!((k, choice, tokens), (1, Choice::KvHit { blocks: 8, tokens: 32 }, 8));
        // Still held, whatever was routed since: the events, not the routing, say so.
        let (k, choice, _) = p.pick(&[0, 1, 2], &ids(0..12)).expect("a pick");
        assert_eq!((k, choice), (1, Choice::KvHit { blocks: 2, tokens: 8 }), "the last token is never a hit");
        let (k, choice, _) = p.pick(&[0, 1, 2], &ids(100..140)).expect("a pick");
        assert!(k != 1 && choice == Choice::LeastLoaded, "no engine holds it: the least loaded ({k})");
        // A prompt given as text: the routed prompts' approximation.
        let (_, choice, _) = p.pick(&[0, 1, 2], &key(&[5, 6])).expect("a pick");
        assert_eq!(choice, Choice::LeastLoaded);
        let (_, choice, _) = p.pick(&[0, 1, 2], &key(&[5, 6, 9])).expect("a pick");
        assert_eq!(choice, Choice::CacheHit { chunks: 2 });
    }

    #[test]
    fn kv_aware_spills_a_hot_prefix_over_once_its_engine_is_far_busier() {
        let held: Vec<u32> = (0..32).collect();
        let mut p = Picker::new(Policy::KvAware).with_held(holding(&[&held, &[]]));
        let picks: Vec<_> = (0..4).map(|_| p.pick(&[0, 1], &ids(0..6000)).expect("a pick")).collect();
        assert!(picks.iter().any(|(k, c, _)| *k == 1 && *c == Choice::LeastLoaded), "{picks:?}");
        assert_eq!(picks[0].1, Choice::KvHit { blocks: 8, tokens: 32 });
    }

    #[test]
    fn kv_aware_sends_a_burst_sharing_a_new_prefix_where_the_first_went() {
        let mut p = Picker::new(Policy::KvAware).with_held(holding(&[&[], &[]]));
        let (first, choice, _) = p.pick(&[0, 1], &ids(0..64)).expect("a pick");
        assert_eq!(choice, Choice::LeastLoaded, "no engine holds it yet");
        let (k, choice, tokens) = p.pick(&[0, 1], &ids(0..80)).expect("a pick");
        assert_eq!((k, choice), (first, Choice::KvHit { blocks: 4, tokens: 64 }), "it follows the first");
        assert_eq!(tokens, 80, "charged in full: the engine's events do not show the prefix yet");
    }

    #[test]
    fn d_alone_serves_a_prompt_its_kv_events_say_it_holds_most_of() {
        let on = LocalPrefill { below_tokens: 0, d_holds_permille: Some(800) };
        assert!(on.applies(&ids(0..100), Choice::KvHit { blocks: 5, tokens: 80 }));
        assert!(!on.applies(&ids(0..100), Choice::KvHit { blocks: 4, tokens: 64 }));
    }

    #[test]
    fn policies_parse_by_name() {
        assert_eq!("cache_aware".parse(), Ok(Policy::CacheAware));
        assert_eq!("load_aware".parse(), Ok(Policy::LeastLoaded));
        let err = "random".parse::<Policy>().expect_err("unknown");
        assert_eq!("kv_aware".parse(), Ok(Policy::KvAware));
        assert!(err.contains("round_robin, least_loaded, cache_aware, kv_aware"), "{err}");
    }
}
