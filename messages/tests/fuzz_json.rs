//! Fuzz targets (bad input) for pdflow's JSON bodies: `kv_transfer_params`
//! (steps 9–11 and 16) and the bootstrap bodies (`POST /register`, `GET /query`: steps 4, 7, 20).
//!
//! Properties, each over a bounded number of proptest cases:
//! - [`KvTransferParams::from_json`] and [`KvTransferParams::role`] never panic on any JSON value,
//!   and a value that passes `role()` has every field its role needs (non-empty), while a refusal
//!   names exactly what is wrong; whatever parses survives a JSON round trip;
//! - the bootstrap bodies ([`RegisterWorker`], [`QueryResponse`], [`EngineEntry::workers`]) never
//!   panic on any JSON value or any bytes, and `workers()` either gives numeric ranks for every
//!   address or names the non-numeric key.

use pdflow_messages::bootstrap::{BootstrapBodyError, EngineEntry, QueryResponse, RegisterWorker};
use pdflow_messages::kv_transfer_params::{KvTransferParams, KvTransferParamsError, TransferRole};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Map, Value};

fn cfg(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        prop::collection::vec(any::<char>(), 0..10).prop_map(String::from_iter),
        "[0-9]{1,3}",
        Just("xfer-1".to_string()),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from), // NaN and infinities become null
        (0u32..4).prop_map(Value::from),
        text().prop_map(Value::String),
    ]
}

/// Any JSON value, nested a few levels.
fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(text(), inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A JSON object whose keys are mostly the ones `kv_transfer_params` knows, with values of the
/// right type, the wrong type, empty or missing: near-valid bodies, where the bugs are.
fn near_kv_transfer_params() -> impl Strategy<Value = Value> {
    const KEYS: [&str; 8] = [
        "do_remote_decode",
        "do_remote_prefill",
        "transfer_id",
        "remote_bootstrap_addr",
        "remote_engine_id",
        "traceparent",
        "remote_host",
        "x",
    ];
    let value_for = |key: &'static str| -> BoxedStrategy<Value> {
        if key.starts_with("do_") {
            prop_oneof![4 => any::<bool>().prop_map(Value::Bool), 1 => json()].boxed()
        } else {
            prop_oneof![4 => text().prop_map(Value::String), 1 => Just(Value::Null), 1 => json()].boxed()
        }
    };
    let entries: Vec<BoxedStrategy<Option<(String, Value)>>> = KEYS
        .iter()
        .map(|&k| prop::option::weighted(0.6, value_for(k).prop_map(move |v| (k.to_string(), v))).boxed())
        .collect();
    entries.prop_map(|kvs| Value::Object(kvs.into_iter().flatten().collect::<Map<String, Value>>()))
}

fn non_empty(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

/// Checks `from_json` + `role()` on `value`.
fn check_kv_transfer_params(value: &Value) -> Result<(), TestCaseError> {
    let Ok(params) = KvTransferParams::from_json(value) else {
        prop_assert!(!value.is_object() || has_wrong_typed_field(value), "a well-typed object must parse: {value}");
        return Ok(());
    };
    prop_assert!(value.is_object(), "only an object parses: {value}");
    // Whatever parses survives a JSON round trip (unknown keys included).
    let again = serde_json::to_value(&params).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let back = KvTransferParams::from_json(&again);
    prop_assert_eq!(back.as_ref(), Ok(&params));
    match params.role() {
        Ok(TransferRole::Local) => prop_assert!(!params.do_remote_decode && !params.do_remote_prefill),
        Ok(TransferRole::Prefill { transfer_id }) => {
            prop_assert!(params.do_remote_decode && !params.do_remote_prefill);
            prop_assert_eq!(Some(transfer_id.as_str()), non_empty(&params.transfer_id));
        }
        Ok(TransferRole::Decode { transfer_id, remote_bootstrap_addr, remote_engine_id }) => {
            prop_assert!(params.do_remote_prefill && !params.do_remote_decode);
            prop_assert_eq!(Some(transfer_id.as_str()), non_empty(&params.transfer_id));
            prop_assert_eq!(Some(remote_bootstrap_addr.as_str()), non_empty(&params.remote_bootstrap_addr));
            prop_assert_eq!(Some(remote_engine_id.as_str()), non_empty(&params.remote_engine_id));
        }
        Err(KvTransferParamsError::BothRoles) => prop_assert!(params.do_remote_decode && params.do_remote_prefill),
        Err(e @ KvTransferParamsError::Missing { field, .. }) => {
            let missing = match field {
                "transfer_id" => &params.transfer_id,
                "remote_bootstrap_addr" => &params.remote_bootstrap_addr,
                "remote_engine_id" => &params.remote_engine_id,
                other => return Err(TestCaseError::fail(format!("role() names an unknown field {other}"))),
            };
            prop_assert!(non_empty(missing).is_none(), "{field} is there but reported missing");
            prop_assert!(e.to_string().contains(field), "{e}");
        }
        Err(KvTransferParamsError::Malformed(m)) => prop_assert!(false, "role() never answers Malformed: {}", m),
    }
    Ok(())
}

/// True when a known key of `value` holds a value of the wrong JSON type.
fn has_wrong_typed_field(value: &Value) -> bool {
    let Some(obj) = value.as_object() else { return true };
    obj.iter().any(|(k, v)| match k.as_str() {
        "do_remote_decode" | "do_remote_prefill" => !v.is_boolean(),
        "transfer_id" | "remote_bootstrap_addr" | "remote_engine_id" | "traceparent" => !(v.is_string() || v.is_null()),
        _ => false,
    })
}

/// Checks every bootstrap body on `value`.
fn check_bootstrap_bodies(value: &Value) -> Result<(), TestCaseError> {
    if let Ok(w) = serde_json::from_value::<RegisterWorker>(value.clone()) {
        let again = serde_json::to_value(&w).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(serde_json::from_value::<RegisterWorker>(again).ok(), Some(w));
    }
    if let Ok(entry) = serde_json::from_value::<EngineEntry>(value.clone()) {
        check_workers(&entry)?;
    }
    if let Ok(query) = serde_json::from_value::<QueryResponse>(value.clone()) {
        for entry in query.values() {
            check_workers(entry)?;
        }
    }
    Ok(())
}

fn check_workers(entry: &EngineEntry) -> Result<(), TestCaseError> {
    let is_rank = |k: &String| k.parse::<u32>().is_ok();
    match entry.workers() {
        Ok(workers) => {
            for (tp, pps) in &entry.worker_addr {
                prop_assert!(is_rank(tp), "tp key {tp:?} accepted");
                for (pp, addr) in pps {
                    prop_assert!(is_rank(pp), "pp key {pp:?} accepted");
                    let (tp, pp) = (tp.parse::<u32>().unwrap_or_default(), pp.parse::<u32>().unwrap_or_default());
                    // Keys that parse to the same rank ("1" and "01") collapse: one of them wins.
                    prop_assert!(workers.get(&tp).and_then(|m| m.get(&pp)).is_some(), "worker {tp}/{pp} lost");
                    let _ = addr;
                }
            }
        }
        Err(BootstrapBodyError::BadRank(key)) => {
            prop_assert!(!is_rank(&key), "{key:?} is a rank");
            let present = entry.worker_addr.iter().any(|(tp, pps)| *tp == key || pps.contains_key(&key));
            prop_assert!(present, "the error names a key of the body: {key:?}");
        }
    }
    Ok(())
}

/// Bodies shaped like `/query` answers, with ranks and addresses of any kind.
fn near_query() -> impl Strategy<Value = Value> {
    let rank_key = prop_oneof![4 => (0u32..4).prop_map(|r| r.to_string()), 1 => text()];
    let pps = prop::collection::btree_map(
        rank_key.clone(),
        prop_oneof![4 => text().prop_map(Value::String), 1 => json()],
        0..3,
    );
    let worker_addr =
        prop::collection::btree_map(rank_key.clone(), pps.prop_map(|m| Value::Object(m.into_iter().collect())), 0..3);
    let entry = (text(), worker_addr).prop_map(|(engine_id, w)| {
        serde_json::json!({"engine_id": engine_id, "worker_addr": Value::Object(w.into_iter().collect())})
    });
    prop::collection::btree_map(rank_key, prop_oneof![4 => entry, 1 => json()], 0..3)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
}

/// Bodies shaped like `/register` bodies.
fn near_register() -> impl Strategy<Value = Value> {
    let rank = prop_oneof![4 => (0u32..4).prop_map(Value::from), 1 => leaf()];
    (text(), rank.clone(), rank.clone(), rank, text(), prop::option::of(json())).prop_map(
        |(engine_id, dp, tp, pp, addr, extra)| {
            let mut body =
                serde_json::json!({"engine_id": engine_id, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp, "addr": addr});
            if let Some(extra) = extra {
                body["extra"] = extra;
            }
            body
        },
    )
}

proptest! {
    #![proptest_config(cfg(512))]

    #[test]
    fn kv_transfer_params_from_any_json(value in json()) {
        check_kv_transfer_params(&value)?;
    }

    #[test]
    fn kv_transfer_params_from_near_valid_objects(value in near_kv_transfer_params()) {
        check_kv_transfer_params(&value)?;
    }

    #[test]
    fn kv_transfer_params_from_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
        let _ = serde_json::from_slice::<KvTransferParams>(&bytes);
        if let Ok(value) = serde_json::from_slice::<Value>(&bytes) {
            check_kv_transfer_params(&value)?;
        }
    }

    #[test]
    fn bootstrap_bodies_from_any_json(value in prop_oneof![json(), near_query(), near_register()]) {
        check_bootstrap_bodies(&value)?;
    }

    #[test]
    fn bootstrap_bodies_from_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
        let _ = serde_json::from_slice::<RegisterWorker>(&bytes);
        if let Ok(query) = serde_json::from_slice::<QueryResponse>(&bytes) {
            for entry in query.values() {
                check_workers(entry)?;
            }
        }
    }

    #[test]
    fn bootstrap_bodies_from_mutated_valid_text(body in near_query(), cut in any::<usize>(), flip in any::<(usize, u8)>()) {
        // Truncations and byte changes of a serialised body, as a broken peer would send them.
        let text = body.to_string().into_bytes();
        let mut bytes = text[..cut % (text.len() + 1)].to_vec();
        if !bytes.is_empty() {
            let i = flip.0 % bytes.len();
            bytes[i] ^= flip.1;
        }
        if let Ok(query) = serde_json::from_slice::<QueryResponse>(&bytes) {
            for entry in query.values() {
                check_workers(entry)?;
            }
        }
        let _ = serde_json::from_slice::<RegisterWorker>(&bytes);
    }
}

// ---- plain tests of the edges ----------------------------------------------------------------

#[test]
fn deeply_nested_json_is_refused_not_a_stack_overflow() {
    let deep = format!("{{\"kv_transfer_params\": {}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(serde_json::from_str::<Value>(&deep).is_err(), "serde_json's recursion limit refuses it");
    let deep_params = format!(
        "{{\"do_remote_decode\": true, \"transfer_id\": \"x\", \"extra\": {}1{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(serde_json::from_str::<KvTransferParams>(&deep_params).is_err());
    assert!(serde_json::from_str::<QueryResponse>(&format!("{{\"0\": {}}}", "{\"a\":".repeat(100_000))).is_err());
}

#[test]
fn empty_strings_do_not_satisfy_a_role() {
    let v = serde_json::json!({"do_remote_prefill": true, "transfer_id": "x", "remote_bootstrap_addr": "", "remote_engine_id": "e"});
    let params = KvTransferParams::from_json(&v).expect("well typed");
    assert!(matches!(params.role(), Err(KvTransferParamsError::Missing { field: "remote_bootstrap_addr", .. })));
    let v = serde_json::json!({"do_remote_decode": true, "transfer_id": ""});
    assert!(matches!(
        KvTransferParams::from_json(&v).expect("well typed").role(),
        Err(KvTransferParamsError::Missing { field: "transfer_id", .. })
    ));
}

#[test]
fn wrong_types_and_non_objects_are_malformed_with_the_parser_message() {
    for v in [
        serde_json::json!(null),
        serde_json::json!([1, 2]),
        serde_json::json!("x"),
        serde_json::json!({"transfer_id": 7}),
    ] {
        match KvTransferParams::from_json(&v) {
            Err(e @ KvTransferParamsError::Malformed(_)) => {
                assert!(e.to_string().contains("not a JSON object of the expected shape"), "{e}")
            }
            other => panic!("{v} gave {other:?}"),
        }
    }
}

#[test]
fn negative_or_huge_ranks_and_non_numeric_rank_keys_are_refused() {
    let body = serde_json::json!({"engine_id": "e", "dp_rank": -1, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    assert!(serde_json::from_value::<RegisterWorker>(body).is_err());
    let body = serde_json::json!({"engine_id": "e", "dp_rank": 4_294_967_296u64, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    assert!(serde_json::from_value::<RegisterWorker>(body).is_err());
    let q: QueryResponse =
        serde_json::from_str(r#"{"0": {"engine_id": "e", "worker_addr": {"zero": {"0": "tcp://h:1"}}}}"#)
            .expect("shape");
    assert_eq!(q["0"].workers(), Err(BootstrapBodyError::BadRank("zero".into())));
    let q: QueryResponse =
        serde_json::from_str(r#"{"0": {"engine_id": "e", "worker_addr": {"0": {"-1": "tcp://h:1"}}}}"#).expect("shape");
    assert_eq!(q["0"].workers(), Err(BootstrapBodyError::BadRank("-1".into())));
}
