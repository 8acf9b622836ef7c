//! Requests the proxy refuses before P or D sees them, and D's refusals cancelling P: what keeps
//! P from holding a prompt's blocks for a transfer D will never pull.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{one_p_one_d, seed_request, Mode};

/// A field the engines would refuse — D alone for those the proxy rewrites for P (`max_tokens`,
/// `stream`), so that P would prefill and hold the blocks for nobody — is a 400 naming it (in the
/// message and in `param`), and neither P nor D sees the request.
#[tokio::test]
async fn a_field_the_engines_would_refuse_is_400_naming_it_before_p_or_d_sees_it() {
    let (_proxy, base, p, d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let client = reqwest::Client::new();
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    for (api, body, field) in [
        ("/v1/completions", json!({"prompt": "hello", "max_tokens": -1}), "max_tokens"),
        ("/v1/completions", json!({"prompt": "hello", "max_tokens": 8, "stream": "yes"}), "stream"),
        ("/v1/completions", json!({"prompt": "hello", "stream_options": {"include_usage": true}}), "stream_options"),
        ("/v1/completions", json!({"prompt": "hello", "max_tokens": 2, "min_tokens": 5}), "min_tokens"),
        ("/v1/completions", json!({"max_tokens": 8}), "prompt"),
        ("/v1/completions", json!({"prompt": ""}), "prompt"),
        ("/v1/completions", json!({"prompt": "hello", "n": 3}), "n"),
        ("/v1/completions", json!({"prompt": "hello", "temperature": "warm"}), "temperature"),
        ("/v1/chat/completions", chat(json!({"max_completion_tokens": 0})), "max_completion_tokens"),
        ("/v1/chat/completions", json!({"messages": "hi"}), "messages"),
    ] {
        let resp = client.post(format!("{base}{api}")).json(&body).send().await.expect("request");
        assert_eq!(resp.status(), 400, "{body}");
        let err: Value = resp.json().await.expect("a JSON error");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
        assert_eq!(err["error"]["param"], field, "{err}");
        let message = err["error"]["message"].as_str().expect("message");
        assert!(message.contains(&format!("`{field}`")), "the message names the field: {message}");
    }
    assert!(p.state.bodies.lock().expect("lock").is_empty(), "P saw none of them");
    assert!(d.state.bodies.lock().expect("lock").is_empty(), "D saw none of them");
    // `min_tokens` within bounds is served: D keeps it, P's one-token copy drops it (as vLLM's
    // toy proxy does: vLLM refuses min_tokens above max_tokens 1).
    let mut req = seed_request();
    req["min_tokens"] = 4.into();
    let resp = client.post(format!("{base}/v1/completions")).json(&req).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    assert!(p.state.bodies.lock().expect("lock")[0].1.get("min_tokens").is_none());
    assert_eq!(d.state.bodies.lock().expect("lock")[0].1["min_tokens"], 4);
}

/// D refuses what the proxy could not see (a 4xx) while P is still prefilling: the client gets
/// D's status and message at once, and P's request is cancelled (its connection closed), so P
/// frees the prompt's blocks instead of finishing and holding them for a pull that never comes.
#[tokio::test]
async fn a_decode_4xx_cancels_the_prefill_at_once() {
    let (_proxy, base, mut p, _d, _) = one_p_one_d(Mode::Slow, Mode::Fail(400)).await;
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&seed_request())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 400);
    // D's own error body, relayed as it came.
    let body: Value = resp.json().await.expect("a JSON error");
    assert_eq!(body["message"], "D refused", "{body}");
    assert!(started.elapsed() < Duration::from_secs(2), "the client waited for P: {:?}", started.elapsed());
    let seen = tokio::time::timeout(Duration::from_secs(3), p.cancelled.recv()).await;
    assert_eq!(seen.expect("P saw its request cancelled before it answered"), Some("cancelled"));
}
