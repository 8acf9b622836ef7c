//! The proxy's KV-event counters (its `kv_aware` routing policy's input, step 8):
//! `pdflow_proxy_kv_events_total{engine,outcome}` — events applied to an engine's index, or
//! ignored (another block size, a LoRA or multimodal prompt's blocks, a lower tier's, an
//! unknown type) — and `pdflow_proxy_kv_stream_total{engine,event}` — what happened to the
//! stream of batches ([`KvStreamEvent`]). `engine` is the engine's URL as the proxy was given it.

use std::collections::BTreeMap;

use super::expo::{Family, Kind};

/// Something that happened to one engine's stream of KV-event batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KvStreamEvent {
    /// A payload that is not a batch (skipped).
    Malformed,
    /// A batch taken already (the live socket and a replay overlapped).
    Duplicate,
    /// A replay asked of the engine's replay socket.
    Replay,
    /// The index was cleared: batches were missed that could not be replayed.
    ClearedGap,
    /// The index was cleared: the engine's sequence started again (it restarted).
    ClearedRestart,
    /// The index was cleared: it passed its bound.
    ClearedBound,
}

impl KvStreamEvent {
    /// The `event` label.
    pub fn label(self) -> &'static str {
        match self {
            KvStreamEvent::Malformed => "malformed",
            KvStreamEvent::Duplicate => "duplicate",
            KvStreamEvent::Replay => "replay",
            KvStreamEvent::ClearedGap => "cleared_gap",
            KvStreamEvent::ClearedRestart => "cleared_restart",
            KvStreamEvent::ClearedBound => "cleared_bound",
        }
    }
}

/// The counts, by engine.
#[derive(Debug, Default)]
pub(crate) struct KvCounts {
    events: BTreeMap<(String, &'static str), u64>,
    stream: BTreeMap<(String, KvStreamEvent), u64>,
}

impl KvCounts {
    pub(crate) fn events(&mut self, engine: &str, applied: u64, ignored: u64) {
        for (outcome, n) in [("applied", applied), ("ignored", ignored)] {
            if n > 0 {
                *self.events.entry((engine.to_owned(), outcome)).or_default() += n;
            }
        }
    }

    pub(crate) fn stream(&mut self, engine: &str, event: KvStreamEvent) {
        *self.stream.entry((engine.to_owned(), event)).or_default() += 1;
    }

    pub(crate) fn families(&self) -> [Family; 2] {
        let mut events = Family::new(
            "pdflow_proxy_kv_events_total",
            "KV events the proxy took from each engine (kv_aware routing), by outcome: applied to its index, or ignored (another block size, LoRA or multimodal blocks, a lower tier's, an unknown type).",
            Kind::Counter,
        );
        for ((engine, outcome), n) in &self.events {
            events.sample(vec![("engine", engine.clone()), ("outcome", (*outcome).to_owned())], *n as f64);
        }
        let mut stream = Family::new(
            "pdflow_proxy_kv_stream_total",
            "What happened to each engine's stream of KV-event batches: malformed payloads, duplicates, replays asked, and index clears (cleared_gap, cleared_restart, cleared_bound).",
            Kind::Counter,
        );
        for ((engine, event), n) in &self.stream {
            stream.sample(vec![("engine", engine.clone()), ("event", event.label().to_owned())], *n as f64);
        }
        [events, stream]
    }
}
