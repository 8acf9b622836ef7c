//! The bridge's errors, and the Python exceptions they become.
//!
//! Every exception is a subclass of `pdflow.PdflowError`, so a caller can catch the family or one
//! kind: `ConfigError` (a bad `kv_connector_extra_config` key or environment variable: fix the
//! setting), `RegistrationError` (the KV tensors cannot be registered: their shape, dtype or
//! device), `ConnectorUnavailable` (an actor is gone or the runtime is not in this process:
//! restart the engine), `MetadataError` (a metadata frame from another pdflow version).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(_native, PdflowError, PyException, "Base class of every pdflow error.");
create_exception!(
    _native,
    ConfigError,
    PdflowError,
    "A setting in kv_connector_extra_config or the environment is invalid."
);
create_exception!(_native, RegistrationError, PdflowError, "The KV cache tensors cannot be registered.");
create_exception!(
    _native,
    ConnectorUnavailable,
    PdflowError,
    "A pdflow actor or the runtime behind the connector is not available."
);
create_exception!(_native, MetadataError, PdflowError, "A connector metadata frame cannot be decoded.");

/// What can go wrong inside the bridge.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Registration(String),
    #[error("pdflow's {what} is unavailable: {reason}; the connector cannot continue (restart the engine)")]
    Unavailable { what: &'static str, reason: String },
    #[error("connector metadata frame: {0} (were the scheduler and the worker started from the same pdflow install?)")]
    Metadata(String),
    #[error("this connector's runtime belongs to process {owner}, not to this one ({current}): create the connector after forking (VLLM_WORKER_MULTIPROC_METHOD=spawn)")]
    ForeignProcess { owner: u32, current: u32 },
}

impl BridgeError {
    pub fn unavailable(what: &'static str, reason: impl std::fmt::Display) -> Self {
        BridgeError::Unavailable { what, reason: reason.to_string() }
    }
}

impl From<BridgeError> for PyErr {
    fn from(e: BridgeError) -> PyErr {
        let msg = e.to_string();
        match e {
            BridgeError::Config(_) => ConfigError::new_err(msg),
            BridgeError::Registration(_) => RegistrationError::new_err(msg),
            BridgeError::Unavailable { .. } | BridgeError::ForeignProcess { .. } => ConnectorUnavailable::new_err(msg),
            BridgeError::Metadata(_) => MetadataError::new_err(msg),
        }
    }
}
