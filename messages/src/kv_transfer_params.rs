//! `kv_transfer_params`: the only protocol between the proxy and the engines (steps 9–10 of docs/steps.md).
//!
//! The proxy writes it into each request body (steps 9–10); the engine hands it to the scheduler
//! connector (steps 11, 16). P's form says `do_remote_decode`; D's form says `do_remote_prefill`
//! and where to find P (`remote_bootstrap_addr`, `remote_engine_id`). Unknown keys are kept, so a
//! newer proxy's fields survive a round trip. [`KvTransferParams::role`] validates a body into a
//! typed [`TransferRole`].

use serde::{Deserialize, Serialize};

/// The JSON object exactly as vLLM's proxy writes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_bootstrap_addr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// W3C trace context of the client request, so that P's and D's spans join one trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// D's request was sent while P still prefills (pdflow's proxy sends both at once): D may hold
    /// it while another request's load of the same prompt blocks is in flight, since it waits for
    /// P anyway, and then load only the rest. Absent (a proxy that calls D after P answered): D
    /// never holds it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefill_in_flight: bool,
    /// Keys pdflow does not know, kept as they came.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// What a request asks of the connector, once validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferRole {
    /// No disaggregation: an ordinary request.
    Local,
    /// P's side: prefill here, keep the blocks, let D pull them (step 9).
    Prefill { transfer_id: String },
    /// D's side: load the prompt's KV from P (step 10).
    Decode { transfer_id: String, remote_bootstrap_addr: String, remote_engine_id: String },
}

/// Why a `kv_transfer_params` object cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvTransferParamsError {
    #[error("kv_transfer_params sets both do_remote_decode and do_remote_prefill; a request is either P's (do_remote_decode) or D's (do_remote_prefill)")]
    BothRoles,
    #[error(
        "kv_transfer_params lacks `{field}`, which a {role} request needs (the proxy writes it; see seed steps 9–10)"
    )]
    Missing { field: &'static str, role: &'static str },
    #[error("kv_transfer_params is not a JSON object of the expected shape: {0}")]
    Malformed(String),
}

impl KvTransferParams {
    /// P's form (seed step 9).
    pub fn for_prefill(transfer_id: impl Into<String>) -> Self {
        Self { do_remote_decode: true, transfer_id: Some(transfer_id.into()), ..Self::default() }
    }

    /// D's form (seed step 10).
    pub fn for_decode(
        transfer_id: impl Into<String>,
        remote_bootstrap_addr: impl Into<String>,
        remote_engine_id: impl Into<String>,
    ) -> Self {
        Self {
            do_remote_prefill: true,
            transfer_id: Some(transfer_id.into()),
            remote_bootstrap_addr: Some(remote_bootstrap_addr.into()),
            remote_engine_id: Some(remote_engine_id.into()),
            ..Self::default()
        }
    }

    /// Names a P request's transfer after its request id when its proxy named none: vLLM's toy
    /// proxy and vllm-router's NIXL mode send P a bare `do_remote_decode` and forward what P
    /// answers (D's form, naming this transfer) to D, as the bridge's connector expects. Any other
    /// form is left as it is.
    pub fn name_transfer_after(&mut self, request_id: &str) {
        if self.do_remote_decode && !self.do_remote_prefill && self.transfer_id.as_deref().is_none_or(str::is_empty) {
            self.transfer_id = Some(request_id.to_owned());
        }
    }

    /// Parses the JSON value a request carried.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, KvTransferParamsError> {
        serde_json::from_value(value.clone()).map_err(|e| KvTransferParamsError::Malformed(e.to_string()))
    }

    /// Validates the object into what the connector must do.
    pub fn role(&self) -> Result<TransferRole, KvTransferParamsError> {
        let non_empty = |v: &Option<String>| v.as_deref().filter(|s| !s.is_empty()).map(str::to_owned);
        match (self.do_remote_decode, self.do_remote_prefill) {
            (true, true) => Err(KvTransferParamsError::BothRoles),
            (false, false) => Ok(TransferRole::Local),
            (true, false) => Ok(TransferRole::Prefill {
                transfer_id: non_empty(&self.transfer_id).ok_or(KvTransferParamsError::Missing {
                    field: "transfer_id",
                    role: "prefill (do_remote_decode)",
                })?,
            }),
            (false, true) => {
                let role = "decode (do_remote_prefill)";
                Ok(TransferRole::Decode {
                    transfer_id: non_empty(&self.transfer_id)
                        .ok_or(KvTransferParamsError::Missing { field: "transfer_id", role })?,
                    remote_bootstrap_addr: non_empty(&self.remote_bootstrap_addr)
                        .ok_or(KvTransferParamsError::Missing { field: "remote_bootstrap_addr", role })?,
                    remote_engine_id: non_empty(&self.remote_engine_id)
                        .ok_or(KvTransferParamsError::Missing { field: "remote_engine_id", role })?,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_forms_round_trip_through_json() {
        let p = serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"});
        let parsed = KvTransferParams::from_json(&p).expect("P form parses");
        assert_eq!(parsed.role(), Ok(TransferRole::Prefill { transfer_id: "xfer-1".into() }));
        let d = KvTransferParams::for_decode("xfer-1", "http://127.0.0.1:8998", "e1");
        let back = KvTransferParams::from_json(&serde_json::to_value(&d).expect("serialises")).expect("parses");
        assert_eq!(back, d);
    }

    #[test]
    fn a_bare_prefill_form_is_named_after_its_request() {
        let toy = serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        let mut p = KvTransferParams::from_json(&toy).expect("the toy proxy's P form parses");
        assert!(matches!(p.role(), Err(KvTransferParamsError::Missing { field: "transfer_id", .. })));
        p.name_transfer_after("req-7");
        assert_eq!(p.role(), Ok(TransferRole::Prefill { transfer_id: "req-7".into() }));
        let mut named = KvTransferParams::for_prefill("xfer-1");
        named.name_transfer_after("req-8");
        assert_eq!(named.transfer_id.as_deref(), Some("xfer-1"), "a named transfer keeps its name");
        let mut d = KvTransferParams::for_decode("", "http://b", "e");
        d.name_transfer_after("req-9");
        assert_eq!(d.transfer_id.as_deref(), Some(""), "D's form is never named here");
    }

    #[test]
    fn unknown_keys_survive() {
        let v = serde_json::json!({"do_remote_prefill": false, "remote_host": "10.0.0.1"});
        let parsed = KvTransferParams::from_json(&v).expect("parses");
        assert_eq!(serde_json::to_value(&parsed).expect("serialises")["remote_host"], "10.0.0.1");
    }

    #[test]
    fn invalid_forms_name_what_is_wrong() {
        let both = KvTransferParams { do_remote_decode: true, do_remote_prefill: true, ..Default::default() };
        assert_eq!(both.role(), Err(KvTransferParamsError::BothRoles));
        let mut d = KvTransferParams::for_decode("x", "http://b", "e");
        d.remote_engine_id = None;
        assert!(matches!(d.role(), Err(KvTransferParamsError::Missing { field: "remote_engine_id", .. })));
        assert!(KvTransferParams::from_json(&serde_json::json!({"do_remote_decode": "yes"})).is_err());
    }
}
