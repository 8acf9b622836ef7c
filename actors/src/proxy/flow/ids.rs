//! A request's identity in the proxy (seed step 8): the request_id it is known by upstream and the
//! W3C trace context whose span id is the proxy's step-8 span.

use axum::http::HeaderMap;

/// The request's W3C trace context, whose span id is the proxy's step-8 span: a child of the
/// client's context when it sent a valid one (same trace, new span id; returned with the client's
/// span id, step 8's parent), else a new trace.
pub(super) fn traceparent(headers: &HeaderMap) -> (String, Option<String>) {
    let span = uuid::Uuid::new_v4().simple().to_string();
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        let parts: Vec<&str> = tp.split('-').collect();
        if let [version, trace, parent, flags] = parts[..] {
            let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
            if hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2) && trace.bytes().any(|b| b != b'0')
            {
                return (
                    format!("00-{}-{}-{flags}", trace.to_ascii_lowercase(), &span[..16]),
                    Some(parent.to_ascii_lowercase()),
                );
            }
        }
    }
    let trace = uuid::Uuid::new_v4().simple().to_string();
    (format!("00-{trace}-{}-01", &span[..16]), None)
}

/// Longest client `X-Request-Id` the proxy adopts.
const MAX_CLIENT_REQUEST_ID: usize = 64;

/// The request's id (step 8): `{client id}-{8 hex}` when the client sent a sane `X-Request-Id`
/// (1..=64 chars of `[A-Za-z0-9._-]`; the suffix keeps it unique when a client reuses ids, and a
/// fault plan's `request_id` filter — a substring — still matches), else a fresh uuid.
pub fn flow_request_id(headers: &HeaderMap) -> String {
    let fresh = uuid::Uuid::new_v4();
    let Some(value) = headers.get("x-request-id") else { return fresh.to_string() };
    let sane = |s: &str| {
        (1..=MAX_CLIENT_REQUEST_ID).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    match value.to_str().ok().filter(|s| sane(s)) {
        Some(client_id) => format!("{client_id}-{}", &fresh.simple().to_string()[..8]),
        None => {
            tracing::debug!(header = ?value, "client X-Request-Id ignored: expected 1-64 characters of [A-Za-z0-9._-]");
            fresh.to_string()
        }
    }
}

#[cfg(test)]
mod traceparent_tests {
    use super::*;

    #[test]
    fn a_client_traceparent_becomes_the_parent_of_a_new_span_in_the_same_trace() {
        let mut headers = HeaderMap::new();
        headers
            .insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse().expect("header"));
        let (tp, parent) = traceparent(&headers);
        assert!(tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"), "same trace: {tp}");
        assert!(!tp.contains("b7ad6b7169203331"), "a new span id, not the client's: {tp}");
        assert_eq!(parent.as_deref(), Some("b7ad6b7169203331"));
        headers
            .insert("traceparent", "00-00000000000000000000000000000000-b7ad6b7169203331-01".parse().expect("header"));
        let (tp, parent) = traceparent(&headers);
        assert!(
            parent.is_none() && !tp.contains("0000000000000000000000000000000"),
            "an invalid context starts a new trace: {tp}"
        );
        let (tp, parent) = traceparent(&HeaderMap::new());
        assert_eq!((tp.len(), parent), (55, None));
    }
}
