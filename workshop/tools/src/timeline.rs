//! The seed's timeline rebuilt from captured step spans: for each of the 43 steps, when it started
//! and how long it took, relative to the first start-up step.

use std::collections::BTreeMap;
use std::time::Instant;

use pdflow_observability::capture::CapturedSpan;
use pdflow_observability::{steps, STEPS};
use serde::Serialize;

/// One step of the timeline, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct StepTiming {
    pub step: u8,
    pub name: &'static str,
    pub start_ms: f64,
    pub duration_ms: f64,
    /// The step's figures (pd.blocks, pd.bytes, …) as recorded on its span.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub figures: BTreeMap<String, String>,
}

/// The timeline of one request, plus the start-up steps before it.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub steps: Vec<StepTiming>,
    /// Step numbers never observed.
    pub missing: Vec<u8>,
}

fn ms(from: Instant, to: Instant) -> f64 {
    let d = if to >= from { (to - from).as_secs_f64() } else { -(from - to).as_secs_f64() };
    (d * 1e6).round() / 1e3
}

const FIGURES: [&str; 8] = [
    pdflow_observability::attrs::BLOCKS,
    pdflow_observability::attrs::BYTES,
    pdflow_observability::attrs::DESCRIPTORS,
    pdflow_observability::attrs::TOKENS,
    pdflow_observability::attrs::OUTCOME,
    pdflow_observability::attrs::KV_CHECKSUM,
    pdflow_observability::attrs::BACKEND,
    pdflow_observability::attrs::ENGINE_ID,
];

impl Timeline {
    /// Steps 1–7 are the first spans of each start-up step; steps 8–43 the first spans that
    /// started at or after `request_start` (the demo sends one request at a time).
    pub fn build(spans: &[CapturedSpan], request_start: Instant) -> Self {
        let t0 = spans.iter().map(|s| s.start).min().unwrap_or(request_start);
        let mut steps = Vec::new();
        let mut missing = Vec::new();
        for step in STEPS.iter() {
            let found = spans
                .iter()
                .filter(|s| s.step == step.number)
                .filter(|s| step.number <= 7 || s.start >= request_start)
                .min_by_key(|s| s.start);
            match found {
                Some(s) => steps.push(StepTiming {
                    step: step.number,
                    name: step.span_name,
                    start_ms: ms(t0, s.start),
                    duration_ms: s.end.map(|e| ms(s.start, e)).unwrap_or(0.0),
                    figures: FIGURES.iter().filter_map(|k| s.attr(k).map(|v| (k.to_string(), v.to_string()))).collect(),
                }),
                None => missing.push(step.number),
            }
        }
        Self { steps, missing }
    }

    /// The step, if observed.
    pub fn step(&self, number: u8) -> Option<&StepTiming> {
        self.steps.iter().find(|s| s.step == number)
    }

    /// A figure recorded on a step, parsed as a number.
    pub fn figure(&self, number: u8, key: &str) -> Option<u64> {
        self.step(number)?.figures.get(key)?.parse().ok()
    }

    /// The table `pdflow demo` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{:>3}  {:<26} {:>11} {:>11}  {:<20} {}\n",
            "#", "step", "start ms", "dur ms", "owner", "figures"
        ));
        for s in &self.steps {
            let owner = steps::by_number(s.step).map(|c| format!("{:?}", c.owner)).unwrap_or_default();
            let figures: Vec<String> = s
                .figures
                .iter()
                .filter(|(k, _)| k.as_str() != pdflow_observability::attrs::ENGINE_ID)
                .map(|(k, v)| format!("{}={}", k.trim_start_matches("pd."), v))
                .collect();
            let short = s.name.splitn(3, '.').nth(2).unwrap_or(s.name);
            out.push_str(&format!(
                "{:>3}  {:<26} {:>11.3} {:>11.3}  {:<20} {}\n",
                s.step,
                short,
                s.start_ms,
                s.duration_ms,
                owner,
                figures.join(" ")
            ));
        }
        for m in &self.missing {
            let name = steps::by_number(*m).map(|s| s.span_name).unwrap_or("?");
            out.push_str(&format!("{m:>3}  {name}: NOT OBSERVED\n"));
        }
        out
    }
}
