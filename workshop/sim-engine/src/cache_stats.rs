//! vLLM's prefix-cache and prompt-token counters, and their `/metrics` text.
//!
//! - `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`: tokens looked up in the local prefix
//!   cache when a request is admitted, and tokens found (prefix caching on only);
//! - `vllm:prompt_tokens_by_source{source}`: each request's prompt tokens once its prefill is done,
//!   by where their KV came from: `local_cache_hit` (the prefix cache), `external_kv_transfer`
//!   (the connector: loaded from P), `local_compute` (the rest).
//!
//! Labelled as vLLM labels them: `model_name`, and `engine` (the data-parallel rank).

use std::fmt::Write;

/// The counters of one engine since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheStats {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens_local_compute: u64,
    pub prompt_tokens_local_cache_hit: u64,
    pub prompt_tokens_external_kv_transfer: u64,
}

/// Where one request's prompt tokens came from (vLLM's `PrefillStats`), recorded at admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PromptSources {
    pub prompt: usize,
    pub local_cache_hit: usize,
    pub external_kv_transfer: usize,
}

impl CacheStats {
    /// A lookup at admission: `queried` tokens, `hits` found.
    pub(crate) fn record_query(&mut self, queried: usize, hits: usize) {
        self.prefix_cache_queries += queried as u64;
        self.prefix_cache_hits += hits as u64;
    }

    /// A request's prefill done.
    pub(crate) fn record_prompt(&mut self, s: PromptSources) {
        let cached = s.local_cache_hit + s.external_kv_transfer;
        self.prompt_tokens_local_cache_hit += s.local_cache_hit as u64;
        self.prompt_tokens_external_kv_transfer += s.external_kv_transfer as u64;
        self.prompt_tokens_local_compute += s.prompt.saturating_sub(cached) as u64;
    }
}

/// One engine's counters and labels.
pub struct EngineCounters<'a> {
    pub model_name: &'a str,
    /// The `engine` label: the data-parallel rank.
    pub engine: u32,
    pub stats: CacheStats,
}

/// The counters in Prometheus' text format, as vLLM's `prometheus_client` writes them
/// (`# HELP`/`# TYPE` named with the `_total` suffix).
pub fn render(engines: &[EngineCounters<'_>]) -> String {
    let mut out = String::new();
    let mut family = |name: &str, help: &str, value: &dyn Fn(&CacheStats) -> u64, source: Option<&str>| {
        if source.is_none_or(|s| s == "local_compute") {
            let _ = writeln!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
        }
        for e in engines {
            let model = escape(e.model_name);
            let source = source.map(|s| format!(",source=\"{s}\"")).unwrap_or_default();
            let _ = writeln!(
                out,
                "{name}_total{{engine=\"{}\",model_name=\"{model}\"{source}}} {}.0",
                e.engine,
                value(&e.stats)
            );
        }
    };
    family(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|s| s.prefix_cache_queries,
        None,
    );
    family(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|s| s.prefix_cache_hits,
        None,
    );
    let by_source = "Number of prompt tokens by source.";
    family("vllm:prompt_tokens_by_source", by_source, &|s| s.prompt_tokens_local_compute, Some("local_compute"));
    family("vllm:prompt_tokens_by_source", by_source, &|s| s.prompt_tokens_local_cache_hit, Some("local_cache_hit"));
    family(
        "vllm:prompt_tokens_by_source",
        by_source,
        &|s| s.prompt_tokens_external_kv_transfer,
        Some("external_kv_transfer"),
    );
    out
}

/// A label value escaped for the text format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllms_names_and_labels() {
        let mut stats = CacheStats::default();
        stats.record_query(32, 16);
        stats.record_prompt(PromptSources { prompt: 32, local_cache_hit: 16, external_kv_transfer: 10 });
        let text = render(&[EngineCounters { model_name: "m", engine: 1, stats }]);
        assert!(text.contains("# TYPE vllm:prefix_cache_queries_total counter\n"));
        assert!(text.contains("vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 32.0\n"));
        assert!(text.contains("vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 16.0\n"));
        assert!(text.contains(
            "vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"local_compute\"} 6.0\n"
        ));
        assert!(text.contains("source=\"external_kv_transfer\"} 10.0\n"));
        assert_eq!(text.matches("# TYPE vllm:prompt_tokens_by_source_total").count(), 1);
    }
}
