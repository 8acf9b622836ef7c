//! Conversion between vLLM's Python objects and pdflow's messages — nothing else happens here.
//!
//! `kv_transfer_params` is read field by field from the request's dict (no JSON round trip: this
//! runs in every scheduler hook). A field of the wrong type counts as absent, so a malformed
//! request is served locally with a warning instead of raising inside vLLM's scheduler loop.

use std::collections::BTreeSet;

use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::scheduler_connector::{ConnectorMetadata, SchedRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PySet, PyString, PyTuple};

fn opt_string(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<String>> {
    Ok(match d.get_item(key)? {
        Some(v) if !v.is_none() => v.extract::<String>().ok(),
        _ => None,
    })
}

fn flag(d: &Bound<'_, PyDict>, key: &str) -> PyResult<bool> {
    Ok(match d.get_item(key)? {
        Some(v) => v.is_truthy().unwrap_or(false),
        None => false,
    })
}

/// The fields of `kv_transfer_params` pdflow reads (unknown keys stay in vLLM's dict untouched).
pub fn params_from_dict(d: &Bound<'_, PyDict>) -> PyResult<KvTransferParams> {
    Ok(KvTransferParams {
        do_remote_decode: flag(d, "do_remote_decode")?,
        do_remote_prefill: flag(d, "do_remote_prefill")?,
        transfer_id: opt_string(d, "transfer_id")?,
        remote_bootstrap_addr: opt_string(d, "remote_bootstrap_addr")?,
        remote_engine_id: opt_string(d, "remote_engine_id")?,
        traceparent: opt_string(d, "traceparent")?,
        prefill_in_flight: flag(d, "prefill_in_flight")?,
        extra: serde_json::Map::new(),
    })
}

/// What the hooks see of a vLLM request.
pub fn sched_request(
    request_id: String,
    num_prompt_tokens: usize,
    params: Option<&Bound<'_, PyDict>>,
) -> PyResult<SchedRequest> {
    let kv_transfer_params = params.map(params_from_dict).transpose()?;
    let traceparent = kv_transfer_params.as_ref().and_then(|p| p.traceparent.clone());
    Ok(SchedRequest { request_id: request_id.into(), prompt_len: num_prompt_tokens, kv_transfer_params, traceparent })
}

/// A JSON value as the Python object `json.loads` would give.
pub fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        serde_json::Value::Null => py.None().into_bound(py),
        serde_json::Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => PyFloat::new(py, n.as_f64().unwrap_or(f64::NAN)).into_any(),
        },
        serde_json::Value::String(s) => PyString::new(py, s).into_any(),
        serde_json::Value::Array(a) => {
            let items = a.iter().map(|x| json_to_py(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        serde_json::Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

fn str_set<'py, T: AsRef<str>>(py: Python<'py>, items: &BTreeSet<T>) -> PyResult<Bound<'py, PySet>> {
    PySet::new(py, items.iter().map(AsRef::as_ref))
}

/// The metadata as plain Python data, shaped like vLLM's `MooncakeConnectorMetadata`:
/// `reqs_to_send` `{req_id: (transfer_id, [block ids])}`, `reqs_to_recv`
/// `{remote_engine_id: {req_id: {...pull...}}}`, `reqs_not_processed` and `reqs_to_abort` sets.
pub fn metadata_to_py<'py>(py: Python<'py>, meta: &ConnectorMetadata) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let send = PyDict::new(py);
    for (req_id, (transfer_id, blocks)) in &meta.reqs_to_send {
        send.set_item(
            req_id.as_str(),
            PyTuple::new(
                py,
                [transfer_id.as_str().into_pyobject(py)?.into_any(), PyList::new(py, blocks.flat())?.into_any()],
            )?,
        )?;
    }
    let recv = PyDict::new(py);
    for (engine_id, pulls) in &meta.reqs_to_recv {
        let per_engine = PyDict::new(py);
        for (req_id, pull) in pulls {
            let p = PyDict::new(py);
            p.set_item("d_req_id", pull.d_req_id.as_str())?;
            p.set_item("transfer_id", pull.transfer_id.as_str())?;
            p.set_item("local_block_ids", PyList::new(py, pull.local_block_ids.flat())?)?;
            p.set_item("remote_engine_id", pull.remote_engine_id.as_str())?;
            p.set_item("remote_bootstrap_addr", &pull.remote_bootstrap_addr)?;
            p.set_item("traceparent", pull.traceparent.as_deref())?;
            per_engine.set_item(req_id.as_str(), p)?;
        }
        recv.set_item(engine_id.as_str(), per_engine)?;
    }
    out.set_item("reqs_to_send", send)?;
    out.set_item("reqs_to_recv", recv)?;
    out.set_item("reqs_not_processed", str_set(py, &meta.reqs_not_processed)?)?;
    out.set_item("reqs_to_abort", str_set(py, &meta.reqs_to_abort)?)?;
    let save = PyDict::new(py);
    for (req_id, s) in &meta.reqs_to_save {
        let d = PyDict::new(py);
        d.set_item("transfer_id", s.transfer_id.as_str())?;
        d.set_item("block_ids", PyList::new(py, &s.block_ids)?)?;
        d.set_item("computed_upto", s.computed_upto)?;
        d.set_item("prompt_len", s.prompt_len)?;
        save.set_item(req_id.as_str(), d)?;
    }
    out.set_item("reqs_to_save", save)?;
    Ok(out)
}
