//! `pdflow proxy --kv-events ENGINE_URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC]`:
//! where each engine publishes its KV events, for the `kv_aware` routing policy (inside step 8),
//! checked against the pools before anything starts.

use pdflow_actors::proxy::kv_events::KvEventSource;
use pdflow_actors::proxy::routing::Policy;

/// The `--kv-events` values, each checked: its form, its engine (one of `prefill` or `decode`,
/// URLs as given), a pool using `kv_aware` (else nothing reads them), and every engine of a
/// `kv_aware` pool named by at least one. Errors go to `errors`.
pub fn sources(
    values: &[String],
    prefill: (&[String], Policy),
    decode: (&[String], Policy),
    errors: &mut Vec<String>,
) -> Vec<KvEventSource> {
    let mut sources = Vec::new();
    for value in values {
        match value.parse::<KvEventSource>() {
            Ok(s) if prefill.0.contains(&s.engine_url) || decode.0.contains(&s.engine_url) => sources.push(s),
            Ok(s) => errors.push(format!(
                "--kv-events {value}: {} is neither a --prefill nor a --decode URL (give it as given there)",
                s.engine_url
            )),
            Err(e) => errors.push(format!("--kv-events {value}: {e}")),
        }
    }
    let kv_aware = [("prefill", prefill), ("decode", decode)].into_iter().filter(|(_, (_, p))| *p == Policy::KvAware);
    let mut any = false;
    for (pool, (urls, _)) in kv_aware {
        any = true;
        for url in urls.iter().filter(|u| !sources.iter().any(|s| &s.engine_url == *u)) {
            errors.push(format!(
                "--{pool}-policy kv_aware: {pool} engine {url} has no --kv-events {url}=tcp://HOST:PORT (the endpoint of its --kv-events-config)"
            ));
        }
    }
    if !any && !values.is_empty() {
        errors.push(
            "--kv-events is read by the kv_aware policy only: give --prefill-policy or --decode-policy kv_aware".into(),
        );
    }
    sources
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kv_aware_engine_needs_its_endpoint_and_every_endpoint_its_engine() {
        let p = ["http://p:1".to_owned()];
        let d = ["http://d:1".to_owned()];
        let values = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut errors = Vec::new();
        let ok = sources(
            &values(&["http://p:1/=tcp://p:5557,replay=tcp://p:5558"]),
            (&p, Policy::KvAware),
            (&d, Policy::RoundRobin),
            &mut errors,
        );
        assert!(errors.is_empty() && ok.len() == 1, "{errors:?}");
        let none = sources(
            &values(&["http://x:1=tcp://x:1", "http://d:1=tcp://*:1"]),
            (&p, Policy::KvAware),
            (&d, Policy::KvAware),
            &mut errors,
        );
        assert!(none.is_empty());
        let all = errors.join("\n");
        for want in
            ["http://x:1 is neither", "wildcard", "prefill engine http://p:1 has no", "decode engine http://d:1 has no"]
        {
            assert!(all.contains(want), "{want}: {all}");
        }
        errors.clear();
        sources(&values(&["http://p:1=tcp://p:1"]), (&p, Policy::CacheAware), (&d, Policy::RoundRobin), &mut errors);
        assert!(errors[0].contains("kv_aware policy only"), "{errors:?}");
    }
}
