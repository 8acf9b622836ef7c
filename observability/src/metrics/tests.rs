use super::*;
use crate::{attrs, step_span, steps};
use tracing_subscriber::layer::SubscriberExt;

fn with_layer(metrics: &Arc<Metrics>, f: impl FnOnce()) {
    let subscriber = tracing_subscriber::registry().with(MetricsLayer::new(metrics.clone()));
    tracing::subscriber::with_default(subscriber, f);
}

#[test]
fn histogram_text_parses_back() {
    let mut h = Histogram::new(DURATION_BUCKETS);
    h.observe(0.00005);
    h.observe(0.003);
    h.observe(100.0);
    let mut f = Family::new("x_seconds", "help", Kind::Histogram);
    f.histogram(vec![("step", "29".to_owned()), ("name", "a \"quoted\" \\ name".to_owned())], &h);
    let text = expo::render(&[f]);
    assert!(text.starts_with("# HELP x_seconds help\n# TYPE x_seconds histogram\n"), "{text}");
    assert!(
        text.contains("x_seconds_bucket{step=\"29\",name=\"a \\\"quoted\\\" \\\\ name\",le=\"0.0001\"} 1\n"),
        "{text}"
    );
    let parsed =
        parse_histogram(&text, "x_seconds", &[("step", "29"), ("name", "a \"quoted\" \\ name")]).expect("parsed");
    assert_eq!(parsed.count, 3);
    assert!((parsed.sum - 100.00305).abs() < 1e-9, "{}", parsed.sum);
    assert_eq!(parsed.buckets.len(), DURATION_BUCKETS.len() + 1);
    assert_eq!(parsed.buckets[0], (0.0001, 1));
    assert_eq!(parsed.buckets.iter().find(|(le, _)| *le == 0.005).map(|b| b.1), Some(2));
    assert_eq!(parsed.buckets.last(), Some(&(f64::INFINITY, 3)));
    assert!(parsed.buckets.windows(2).all(|w| w[0].1 <= w[1].1), "cumulative");
    assert!(parse_histogram(&text, "x_seconds", &[("step", "30")]).is_none());
}

#[test]
fn step_29_and_34_become_transfer_histograms_on_both_sides() {
    let metrics = Metrics::new();
    metrics.set_block_bytes(8192);
    with_layer(&metrics, || {
        let pull = step_span!(steps::D_SEND_PULL_META, request_id = "d1", transfer_id = "t1");
        drop(pull);
        let wait = step_span!(steps::P_PULL_WAIT_READY, request_id = "p1", transfer_id = "t1");
        drop(wait);
        let write = step_span!(steps::P_TRANSFER_WRITE, request_id = "p1", transfer_id = "t1");
        write.record(attrs::BYTES, 148_635_648u64);
        write.record(attrs::DESCRIPTORS, 36u64);
        write.record(attrs::BLOCKS, 63u64);
        write.record(attrs::OUTCOME, "ok");
        drop(write);
        assert!(metrics.render().contains("pdflow_pulls_in_flight{service=\"prefill\",side=\"p\"} 1\n"));
        assert!(metrics.render().contains("pdflow_pulls_in_flight{service=\"decode\",side=\"d\"} 1\n"));
        drop(step_span!(steps::P_REPLY_FINISH, request_id = "d1", transfer_id = "t1"));
        let result = step_span!(steps::D_PULL_RESULT, request_id = "d1", transfer_id = "t1");
        result.record(attrs::BLOCKS, 63u64);
        result.record(attrs::OUTCOME, "ok");
        drop(result);
    });
    let text = metrics.render();
    let p = [("service", "prefill"), ("side", "p")];
    let d = [("service", "decode"), ("side", "d")];
    let bytes_p = parse_histogram(&text, "pdflow_transfer_bytes", &p).expect("P bytes");
    assert_eq!((bytes_p.count, bytes_p.sum), (1, 148_635_648.0));
    let desc_p = parse_histogram(&text, "pdflow_transfer_descriptors", &p).expect("P descriptors");
    assert_eq!((desc_p.count, desc_p.sum), (1, 36.0));
    let bytes_d = parse_histogram(&text, "pdflow_transfer_bytes", &d).expect("D bytes");
    assert_eq!((bytes_d.count, bytes_d.sum), (1, 63.0 * 8192.0));
    let dur_d = parse_histogram(&text, "pdflow_transfer_duration_seconds", &d).expect("D duration");
    assert_eq!(dur_d.count, 1);
    let step29 = parse_histogram(
        &text,
        "pdflow_step_duration_seconds",
        &[("step", "29"), ("name", "p_transfer_write"), ("service", "prefill")],
    )
    .expect("step 29");
    assert_eq!(step29.count, 1);
    assert!(text.contains("pdflow_pulls_in_flight{service=\"prefill\",side=\"p\"} 0\n"), "{text}");
    assert!(text.contains("pdflow_pulls_in_flight{service=\"decode\",side=\"d\"} 0\n"), "{text}");
    assert!(!text.contains("pdflow_failures_total{"), "no failures expected:\n{text}");
}

#[test]
fn failures_are_counted_by_step_and_cause_and_successes_are_not() {
    let metrics = Metrics::new();
    with_layer(&metrics, || {
        for outcome in ["transfer_failed", "transfer_failed", "ok", "200"] {
            let s = step_span!(steps::P_TRANSFER_WRITE, request_id = "p1", transfer_id = "t1");
            s.record(attrs::OUTCOME, outcome);
        }
        let s = step_span!(steps::DISPATCH_DECODE, request_id = "r1");
        s.record(attrs::OUTCOME, "503");
        drop(s);
        drop(tracing::info_span!("not a step", pd.outcome = "failed"));
    });
    let text = metrics.render();
    assert!(text.contains("# TYPE pdflow_failures_total counter\n"), "{text}");
    assert!(
        text.contains("pdflow_failures_total{service=\"prefill\",step=\"29\",cause=\"transfer_failed\"} 2\n"),
        "{text}"
    );
    assert!(text.contains("pdflow_failures_total{service=\"proxy\",step=\"10\",cause=\"503\"} 1\n"), "{text}");
    assert_eq!(text.matches("pdflow_failures_total{").count(), 2, "{text}");
    let step29 = parse_histogram(&text, "pdflow_step_duration_seconds", &[("step", "29")]).expect("step 29");
    assert_eq!(step29.count, 4);
}

#[test]
fn causes_beyond_the_cap_are_counted_as_other() {
    let metrics = Metrics::new();
    with_layer(&metrics, || {
        for i in 0..(MAX_CAUSES_PER_STEP + 3) {
            let s = step_span!(steps::P_TRANSFER_WRITE);
            s.record(attrs::OUTCOME, format!("cause-{i}").as_str());
        }
    });
    let text = metrics.render();
    assert!(text.contains("cause=\"other\"} 3\n"), "{text}");
}

#[test]
fn gauges_registered_and_extra_share_families() {
    let metrics = Metrics::new();
    metrics.register_gauge("pdflow_blocks_held", "blocks held", || {
        vec![GaugeSample { labels: vec![("engine_id", "a".to_owned())], value: 3.0 }]
    });
    let extra = Gauge {
        name: "pdflow_blocks_held",
        help: "blocks held",
        samples: vec![GaugeSample { labels: vec![("engine_id", "b".to_owned())], value: 5.0 }],
    };
    let text = metrics.render_with(&[extra]);
    assert_eq!(text.matches("# TYPE pdflow_blocks_held gauge\n").count(), 1, "{text}");
    assert!(text.contains("pdflow_blocks_held{engine_id=\"a\"} 3\npdflow_blocks_held{engine_id=\"b\"} 5\n"), "{text}");
}

#[test]
fn outcomes_classified() {
    for ok in ["ok", "ready", "received", "length", "stop", "freed_only", "200", "204"] {
        assert!(is_success(ok), "{ok}");
    }
    for bad in ["failed", "transfer_failed", "503", "abort", "Aborted", "timeout", "2000"] {
        assert!(!is_success(bad), "{bad}");
    }
}

#[test]
fn step_29_writes_are_counted_by_backend_and_outcome() {
    let metrics = Metrics::new();
    with_layer(&metrics, || {
        for (backend, outcome) in [
            (Some("tcp"), "ok"),
            (Some("tcp"), "ok"),
            (Some("cuda-peer"), "ok"),
            (Some("tcp"), "refused"),
            (None, "ok"),
        ] {
            let write = step_span!(steps::P_TRANSFER_WRITE, request_id = "p1", transfer_id = "t1");
            if let Some(b) = backend {
                write.record(attrs::BACKEND, b);
            }
            write.record(attrs::OUTCOME, outcome);
        }
        // Other steps are not writes.
        drop(step_span!(steps::P_BUILD_TRANSFER, request_id = "p1", transfer_id = "t1"));
    });
    let text = metrics.render();
    for (labels, count) in [
        ("backend=\"tcp\",outcome=\"ok\"", 2),
        ("backend=\"cuda-peer\",outcome=\"ok\"", 1),
        ("backend=\"tcp\",outcome=\"refused\"", 1),
        ("backend=\"unknown\",outcome=\"ok\"", 1),
    ] {
        let line = format!("pdflow_transfer_writes_total{{service=\"prefill\",{labels}}} {count}\n");
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    assert_eq!(text.matches("pdflow_transfer_writes_total{").count(), 4, "{text}");
}

#[test]
fn a_hybrid_model_s_step_29_bytes_are_counted_per_kv_cache_group() {
    let metrics = Metrics::new();
    with_layer(&metrics, || {
        for groups in ["327680,327680,2162688", "163840,163840,327680", "not,a,number"] {
            let write = step_span!(steps::P_TRANSFER_WRITE, request_id = "p1", transfer_id = "t1");
            write.record(attrs::GROUP_BYTES, groups);
        }
        // A dense model's write names no groups.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "p2", transfer_id = "t2"));
    });
    let text = metrics.render();
    for (group, bytes) in [(0, 491_520), (1, 491_520), (2, 2_490_368)] {
        let line = format!("pdflow_transfer_group_bytes_total{{service=\"prefill\",group=\"{group}\"}} {bytes}\n");
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    assert_eq!(text.matches("pdflow_transfer_group_bytes_total{").count(), 3, "{text}");
}
