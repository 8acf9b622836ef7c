//! Step 8's check of a client's body before P or D sees it: every field an engine would refuse,
//! refused here with a 400 that names it.
//!
//! The proxy rewrites P's copy (`max_tokens` and `max_completion_tokens` 1, `stream` false,
//! `stream_options` and `min_tokens` dropped), so a client value of those that only D refuses
//! would let P prefill and then hold its blocks for a pull that never comes. Those are checked
//! as D (vLLM or the simulated engine) checks them; so are the prompt, `n` (one prefill per
//! request serves one choice) and the sampling fields' types, which both engines would refuse, so
//! that the client hears which field is wrong without either engine doing any work. Fields the
//! proxy does not know are left to the engines, which see them alike.

use serde_json::{Map, Value};

/// The body's field that makes it unservable (a 400 naming it).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidField {
    /// A field of the wrong type or out of range.
    #[error("`{field}` must be {expected}, not {got}")]
    Wrong { field: &'static str, expected: &'static str, got: String },
    /// A field the request needs.
    #[error("`{field}` is missing: send {expected}")]
    Missing { field: &'static str, expected: &'static str },
    /// `stream_options` without `stream: true` (vLLM's D refuses it; P never sees it).
    #[error("`stream_options` is only allowed with `\"stream\": true`: drop it or stream the answer")]
    StreamOptionsWithoutStream,
    /// `min_tokens` above the request's maximum (vLLM's D refuses it; P never sees it).
    #[error(
        "`min_tokens` ({min}) must not be more than `{max_field}` ({max}): lower `min_tokens` or raise `{max_field}`"
    )]
    MinAboveMax { min: u64, max: u64, max_field: &'static str },
}

impl InvalidField {
    /// The field named (OpenAI's error `param`).
    pub fn field(&self) -> &'static str {
        match self {
            InvalidField::Wrong { field, .. } | InvalidField::Missing { field, .. } => field,
            InvalidField::StreamOptionsWithoutStream => "stream_options",
            InvalidField::MinAboveMax { .. } => "min_tokens",
        }
    }
}

const POSITIVE_INTEGER: &str = "a positive integer (at least 1) or null";
const ONE: &str = "1 or null (the proxy sends one prefill per request, so it serves one choice: send n requests)";

/// Checks a completion (`chat` false) or chat completion body; `Err` names the first bad field.
pub fn validate(body: &Map<String, Value>, chat: bool) -> Result<(), InvalidField> {
    if chat {
        messages(body.get("messages"))?;
    } else {
        prompt(body.get("prompt"))?;
    }
    optional(body, "model", "a string (the served model's name) or null", Value::is_string)?;
    let max_tokens = optional_u64(body, "max_tokens", POSITIVE_INTEGER, |n| n >= 1)?;
    let max_completion_tokens =
        if chat { optional_u64(body, "max_completion_tokens", POSITIVE_INTEGER, |n| n >= 1)? } else { None };
    let stream = optional(body, "stream", "true, false or null", Value::is_boolean)?;
    optional(body, "stream_options", "an object or null", Value::is_object)?;
    // vLLM refuses options that say something (an empty object says nothing) on a request that
    // does not stream.
    let says_something = |v: &Value| v.as_object().is_none_or(|o| !o.is_empty());
    if present(body, "stream_options").is_some_and(says_something) && !stream.is_some_and(|s| s == &Value::Bool(true)) {
        return Err(InvalidField::StreamOptionsWithoutStream);
    }
    optional_u64(body, "n", ONE, |n| n == 1)?;
    for field in ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"] {
        optional(body, field, "a number or null", Value::is_number)?;
    }
    optional(body, "stop_token_ids", "a list of token ids (integers from 0) or null", |v| {
        v.as_array().is_some_and(|ids| ids.iter().all(is_token_id))
    })?;
    if let Some(v) = body.get("ignore_eos").filter(|v| !v.is_boolean()) {
        return Err(wrong("ignore_eos", "true or false", v));
    }
    let min_tokens = optional_u64(body, "min_tokens", "an integer from 0 or null", |_| true)?;
    // Chat's maximum is max_completion_tokens when given (as the engines read it).
    let (max_field, max) = match max_completion_tokens {
        Some(n) => ("max_completion_tokens", Some(n)),
        None => ("max_tokens", max_tokens),
    };
    if let (Some(min), Some(max)) = (min_tokens, max) {
        if min > max {
            return Err(InvalidField::MinAboveMax { min, max, max_field });
        }
    }
    Ok(())
}

/// A completion's `prompt`: non-empty text, or a non-empty list of token ids (one prompt per
/// request: each is one transfer).
fn prompt(value: Option<&Value>) -> Result<(), InvalidField> {
    const EXPECTED: &str = "a non-empty string or a non-empty list of token ids (one prompt per request: send each prompt of a batch as a request of its own)";
    match value {
        None | Some(Value::Null) => Err(InvalidField::Missing { field: "prompt", expected: EXPECTED }),
        Some(Value::String(s)) if !s.is_empty() => Ok(()),
        Some(Value::Array(ids)) if !ids.is_empty() && ids.iter().all(is_token_id) => Ok(()),
        Some(v) => Err(wrong("prompt", EXPECTED, v)),
    }
}

/// A chat's `messages`: a non-empty list of objects whose `role` is text and `content` text or
/// a list of parts.
fn messages(value: Option<&Value>) -> Result<(), InvalidField> {
    const EXPECTED: &str =
        "a non-empty list of messages, each an object with a string `role` and a string (or list of parts) `content`";
    let fine = |m: &Value| {
        m.as_object().is_some_and(|m| {
            m.get("role").is_none_or(|r| r.is_string() || r.is_null())
                && m.get("content").is_none_or(|c| c.is_string() || c.is_array() || c.is_null())
        })
    };
    match value {
        None | Some(Value::Null) => Err(InvalidField::Missing { field: "messages", expected: EXPECTED }),
        Some(Value::Array(list)) if !list.is_empty() && list.iter().all(fine) => Ok(()),
        Some(v) => Err(wrong("messages", EXPECTED, v)),
    }
}

fn is_token_id(v: &Value) -> bool {
    v.as_u64().is_some_and(|t| t <= u64::from(u32::MAX))
}

/// `field`'s value when present and not null.
fn present<'a>(body: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    body.get(field).filter(|v| !v.is_null())
}

/// `field` absent, null, or `ok`; its value when present.
fn optional<'a>(
    body: &'a Map<String, Value>,
    field: &'static str,
    expected: &'static str,
    ok: impl Fn(&Value) -> bool,
) -> Result<Option<&'a Value>, InvalidField> {
    match present(body, field) {
        Some(v) if !ok(v) => Err(wrong(field, expected, v)),
        v => Ok(v),
    }
}

/// `field` absent, null, or an unsigned integer that passes `ok`; its value when present.
fn optional_u64(
    body: &Map<String, Value>,
    field: &'static str,
    expected: &'static str,
    ok: impl Fn(u64) -> bool,
) -> Result<Option<u64>, InvalidField> {
    match present(body, field) {
        None => Ok(None),
        Some(v) => v.as_u64().filter(|&n| ok(n)).map(Some).ok_or_else(|| wrong(field, expected, v)),
    }
}

/// The value as the client sent it, cut short.
fn wrong(field: &'static str, expected: &'static str, got: &Value) -> InvalidField {
    let mut got = got.to_string();
    if got.len() > 80 {
        let cut = (0..=77).rev().find(|&i| got.is_char_boundary(i)).unwrap_or(0);
        got.truncate(cut);
        got.push_str("...");
    }
    InvalidField::Wrong { field, expected, got }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body: Value, chat: bool) -> Result<(), InvalidField> {
        match body {
            Value::Object(map) => validate(&map, chat),
            other => panic!("a test body must be an object: {other}"),
        }
    }

    #[test]
    fn what_the_engines_serve_passes() {
        for body in [
            json!({"model": "m", "prompt": "hello", "max_tokens": 128, "temperature": 0}),
            json!({"prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true}}),
            json!({"prompt": "x", "stream": false, "stream_options": {}}),
            json!({"prompt": "x", "max_tokens": null, "stream": null, "n": 1, "stop_token_ids": [7], "ignore_eos": true,
                   "min_tokens": 2, "top_p": 0.9, "kv_transfer_params": {"anything": 1}, "unknown_field": [1]}),
        ] {
            assert_eq!(check(body.clone(), false), Ok(()), "{body}");
        }
        let chat = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
                          "max_completion_tokens": 5, "max_tokens": 2, "min_tokens": 4});
        assert_eq!(check(chat, true), Ok(()));
    }

    #[test]
    fn each_refused_field_is_named() {
        let cases = [
            (json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 2.5}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": "5"}), "max_tokens"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"prompt": "x", "stream": false, "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"prompt": "x", "stream": true, "stream_options": 3}), "stream_options"),
            (json!({"max_tokens": 3}), "prompt"),
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": 42}), "prompt"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({"prompt": [1, -2]}), "prompt"),
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "top_p": [1]}), "top_p"),
            (json!({"prompt": "x", "stop_token_ids": [1, "2"]}), "stop_token_ids"),
            (json!({"prompt": "x", "ignore_eos": "true"}), "ignore_eos"),
            (json!({"prompt": "x", "model": 7}), "model"),
            (json!({"prompt": "x", "max_tokens": 3, "min_tokens": 4}), "min_tokens"),
            (json!({"prompt": "x", "min_tokens": -1}), "min_tokens"),
        ];
        for (body, field) in cases {
            let e = check(body.clone(), false).expect_err(&format!("{body} is refused"));
            assert_eq!(e.field(), field, "{body}: {e}");
            assert!(e.to_string().contains(&format!("`{field}`")), "the message names the field: {e}");
        }
        for (body, field) in [
            (json!({"prompt": "x"}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": [{"role": 1, "content": "x"}]}), "messages"),
            (json!({"messages": ["hi"]}), "messages"),
            (json!({"messages": [{"content": "x"}], "max_completion_tokens": -1}), "max_completion_tokens"),
            (
                json!({"messages": [{"content": "x"}], "max_completion_tokens": 3, "max_tokens": 9, "min_tokens": 5}),
                "min_tokens",
            ),
        ] {
            let e = check(body.clone(), true).expect_err(&format!("{body} is refused"));
            assert_eq!(e.field(), field, "{body}: {e}");
        }
    }

    #[test]
    fn a_long_value_is_cut_short_in_the_message() {
        let e = check(json!({"prompt": "x", "temperature": "é".repeat(500)}), false).expect_err("refused");
        assert!(e.to_string().len() < 200, "{e}");
    }
}
