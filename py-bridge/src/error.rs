//! The bridge's errors, and the Python exceptions they become.
//!
//! Every exception is a subclass of `pdflow.PdflowError`, so a caller can catch the family or one
//! kind: `ConfigError` (a bad `kv_connector_extra_config` key, environment variable or vLLM
//! parallel setting: fix the setting), `RegistrationError` (the KV tensors cannot be registered:
//! their shape, dtype, device, or a share of the model other than their rank's),
//! `ConnectorUnavailable` (an actor is gone or the runtime is not in this process: restart the
//! engine), `MetadataError` (a metadata frame from another pdflow version).
//!
//! Each [`BridgeError`] keeps its typed cause; which exception it becomes is decided once, in
//! `impl From<BridgeError> for PyErr`.

use pdflow_kv::memory::ExternalRegionError;
use pdflow_messages::frame::FrameError;
use pdflow_node::ports::ConnectorError;
use pdflow_node::registration::PlacementError;
use pdflow_node::NodeError;
use pyo3::PyErr;

use crate::config::ConfigError;

/// The exception classes of `pdflow._native` (re-exported by `pdflow`).
pub mod exceptions {
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;

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
}

/// Why vLLM's KV tensors cannot be registered by this worker.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    #[error("register_kv_caches was already called for this connector")]
    AlreadyRegistered,
    /// The tensors are not this worker's share of the model (heads, layers, split).
    #[error(transparent)]
    Share(#[from] pdflow_node::RegistrationError),
    /// The tensors' memory does not make a KV cache (region count, address, length, device).
    #[error(transparent)]
    Memory(#[from] ExternalRegionError),
    /// CUDA KV tensors, and a wheel built without the `cuda` feature.
    #[error("KV cache on cuda:{device}: this pdflow wheel was built without GPU support (build it with `maturin build --features cuda`)")]
    NoGpuSupport { device: usize },
}

/// A metadata frame (or a request's `kv_transfer_params`) that cannot be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// What can go wrong inside the bridge.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    /// The worker side could not start (an actor, a port, the transfer engine).
    #[error("{0}{hint}", hint = node_hint(.0))]
    Node(#[from] NodeError),
    /// A worker-role call refused or unanswered by the actors.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    #[error("pdflow's {what} is unavailable: {reason}; the connector cannot continue (restart the engine)")]
    Unavailable { what: &'static str, reason: String },
    #[error("connector metadata frame: {0} (were the scheduler and the worker started from the same pdflow install?)")]
    Metadata(#[from] MetadataError),
    #[error("this connector's runtime belongs to process {owner}, not to this one ({current}): create the connector after forking (VLLM_WORKER_MULTIPROC_METHOD=spawn)")]
    ForeignProcess { owner: u32, current: u32 },
}

impl BridgeError {
    pub fn unavailable(what: &'static str, reason: impl std::fmt::Display) -> Self {
        BridgeError::Unavailable { what, reason: reason.to_string() }
    }

    /// Whether a node error is the bootstrap's (its port or address: settings the user moves).
    fn is_bootstrap(e: &NodeError) -> bool {
        matches!(
            e,
            NodeError::ActorStart { actor: "Bootstrap", .. }
                | NodeError::Bind { what: "the bootstrap HTTP server", .. }
                | NodeError::InvalidAddress { what: "the bootstrap HTTP server", .. }
        )
    }
}

/// What a node error's message adds for a vLLM user: the settings that move a bootstrap that
/// cannot start; that the connector cannot continue without an actor.
fn node_hint(e: &NodeError) -> &'static str {
    match e {
        e if BridgeError::is_bootstrap(e) => {
            " (set VLLM_MOONCAKE_BOOTSTRAP_PORT or kv_connector_extra_config[\"bootstrap_port\"])"
        }
        NodeError::ActorStart { .. } => "; the connector cannot continue (restart the engine)",
        _ => "",
    }
}

impl From<PlacementError> for BridgeError {
    fn from(e: PlacementError) -> Self {
        BridgeError::Config(e.into())
    }
}

impl From<pdflow_node::RegistrationError> for BridgeError {
    fn from(e: pdflow_node::RegistrationError) -> Self {
        BridgeError::Registration(e.into())
    }
}

impl From<FrameError> for BridgeError {
    fn from(e: FrameError) -> Self {
        BridgeError::Metadata(e.into())
    }
}

impl From<ConfigError> for PyErr {
    fn from(e: ConfigError) -> PyErr {
        BridgeError::from(e).into()
    }
}

impl From<BridgeError> for PyErr {
    fn from(e: BridgeError) -> PyErr {
        use exceptions::{ConfigError, ConnectorUnavailable, MetadataError, RegistrationError};
        let msg = e.to_string();
        match e {
            BridgeError::Config(_) => ConfigError::new_err(msg),
            BridgeError::Registration(_) => RegistrationError::new_err(msg),
            // An actor that did not start (other than the bootstrap, whose port is a setting).
            BridgeError::Node(ref node @ NodeError::ActorStart { .. }) if !BridgeError::is_bootstrap(node) => {
                ConnectorUnavailable::new_err(msg)
            }
            // A port, an address, the transfer engine, GPU support: what the configuration asks.
            BridgeError::Node(_) => ConfigError::new_err(msg),
            BridgeError::Connector(ConnectorError::RolesDisagree { .. }) => ConfigError::new_err(msg),
            BridgeError::Connector(ConnectorError::Unavailable { .. })
            | BridgeError::Unavailable { .. }
            | BridgeError::ForeignProcess { .. } => ConnectorUnavailable::new_err(msg),
            BridgeError::Metadata(_) => MetadataError::new_err(msg),
        }
    }
}
