//! Tests of the timeline model and its HTML.

use super::*;
use pdflow_observability::export::{AttrValue, FinishedSpan};
use pdflow_observability::trace_context::{SpanId, TraceId};

fn synthetic_file() -> JaegerFile {
    let (startup, request) = (TraceId::random(), TraceId::random());
    let spans: Vec<FinishedSpan> = steps::STEPS
        .iter()
        .map(|s| {
            let start = 1_000_000_000u64 * if s.number <= 7 { 1 } else { 5 } + u64::from(s.number) * 100_000;
            FinishedSpan {
                trace_id: if s.number <= 7 { startup } else { request },
                span_id: SpanId::random(),
                parent: None,
                name: s.span_name.to_owned(),
                step: s.number,
                service: pdflow_observability::export::service_of_step(s.number).to_owned(),
                start_unix_nanos: start,
                end_unix_nanos: start + 80_000,
                attrs: vec![
                    ("pd.step".into(), AttrValue::Int(i64::from(s.number))),
                    ("pd.bytes".into(), AttrValue::Int(148_635_648)),
                ],
            }
        })
        .collect();
    JaegerFile::from_spans(&spans)
}

#[test]
fn every_step_has_its_lane() {
    assert_eq!(lane_of(&steps::CLIENT_REQUEST), 0);
    assert_eq!(lane_of(&steps::BOOTSTRAP_START), 5);
    assert_eq!(lane_of(&steps::P_TRANSFER_WRITE), 4);
    assert_eq!(lane_of(&steps::P_HTTP_DONE), 2);
    assert_eq!(lane_of(&steps::D_MARK_RECV), 7);
    assert_eq!(lane_of(&steps::D_HTTP_RESPONSE), 6);
    assert_eq!(lane_of(&steps::D_FIRST_TOKEN), 8);
    assert_eq!(lane_of(&steps::PROXY_RESPONSE), 1);
}

#[test]
fn timeline_has_43_bars_in_9_lanes_and_the_ttft_parts() {
    let t = Timeline::from_file(&synthetic_file(), None).expect("a request trace");
    assert_eq!(t.startup.len(), 7);
    assert_eq!(t.request.len(), 36);
    assert!(t.missing.is_empty());
    // 8 starts at +0.8 ms, 39 ends at +3.9 ms + 0.08 ms.
    assert_eq!(t.ttft_us, Some(3_180));
    let total: u64 = t.ttft.iter().map(|s| s.end_us - s.start_us).sum();
    assert_eq!(Some(total), t.ttft_us, "the parts add up to the TTFT");
    assert_eq!(t.ttft.iter().filter(|s| s.label != "other").count(), 6);

    let html = html::page(&t);
    let steps: std::collections::BTreeSet<&str> =
        html.match_indices("class=\"bar\" data-step=\"").map(|(i, m)| &html[i + m.len()..i + m.len() + 2]).collect();
    assert_eq!(steps.len(), 43);
    assert_eq!(html.matches("class=\"lane\"").count(), 9);
    assert!(html.contains("pd.bytes = 148635648"), "figures on hover");
    assert!(
        !html.contains("http://")
            || html.matches("http://").all(|_| html.contains("xmlns=\"http://www.w3.org/2000/svg\"")),
        "no external resources"
    );
    assert!(!html.contains("<script"));
}

#[test]
fn a_file_without_a_request_is_an_error() {
    let mut file = synthetic_file();
    file.data.retain(|t| !t.spans.iter().any(|s| s.operation_name.starts_with("step.08")));
    assert!(matches!(Timeline::from_file(&file, None), Err(RenderError::NoRequest)));
    assert!(matches!(Timeline::from_file(&synthetic_file(), Some("00")), Err(RenderError::NoSuchTrace(_))));
}
