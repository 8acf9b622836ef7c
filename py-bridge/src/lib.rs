//! `pdflow._native` — the native half of `pdflow.vllm.PdflowConnector` (PyO3, abi3).
//!
//! Python stays thin: `pdflow/vllm.py` converts vLLM's objects and forwards each hook here; this
//! crate forwards each call to pdflow's actors. [`scheduler`] is the scheduler role, [`worker`]
//! the worker role ([`topology`]: where vLLM placed the worker, checked by `pdflow-node`;
//! [`advertise`]: the engine advertised for the proxy's discovery),
//! [`convert`] the conversions, [`config`] the extra-config keys and environment.

mod advertise;
mod config;
mod convert;
mod error;
mod runtime;
mod scheduler;
mod topology;
mod trace_export;
mod worker;

use pdflow_messages::frame;
use pdflow_messages::scheduler_connector::ConnectorMetadata;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Decodes a metadata frame into plain Python data (`reqs_to_send`, `reqs_to_recv`,
/// `reqs_not_processed`, `reqs_to_abort`, `reqs_to_save`), for `PdflowConnectorMetadata`'s
/// attributes.
#[pyfunction]
fn decode_metadata<'py>(py: Python<'py>, frame_bytes: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let meta: ConnectorMetadata = if frame_bytes.is_empty() {
        ConnectorMetadata::default()
    } else {
        frame::decode(frame_bytes, "connector metadata").map_err(error::BridgeError::from)?
    };
    convert::metadata_to_py(py, &meta)
}

/// Installs the process's log lines (to stderr, `PDFLOW_LOG` filters) and its trace exporter when
/// OpenTelemetry's variables (or `PDFLOW_TRACE_FILE`) ask for one; idempotent. `PdflowConnector`
/// calls it when it is created.
#[pyfunction]
fn install_trace_export() -> PyResult<()> {
    trace_export::install_from_env()?;
    Ok(())
}

/// Sends the spans not yet exported and writes the trace file; `PdflowConnector.shutdown` calls it.
#[pyfunction]
fn flush_traces(py: Python<'_>) {
    py.detach(trace_export::flush);
}

/// Validates `kv_connector_extra_config` (as JSON) with the environment; raises `ConfigError`.
#[pyfunction]
fn check_config(extra_config_json: &str) -> PyResult<()> {
    config::BridgeConfig::from_json(extra_config_json, &|k| std::env::var(k).ok())?;
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<scheduler::SchedulerBridge>()?;
    m.add_class::<worker::WorkerBridge>()?;
    m.add_class::<topology::TopologyBridge>()?;
    m.add_function(wrap_pyfunction!(decode_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(install_trace_export, m)?)?;
    m.add_function(wrap_pyfunction!(flush_traces, m)?)?;
    use error::exceptions::{ConfigError, ConnectorUnavailable, MetadataError, PdflowError, RegistrationError};
    m.add("PdflowError", py.get_type::<PdflowError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RegistrationError", py.get_type::<RegistrationError>())?;
    m.add("ConnectorUnavailable", py.get_type::<ConnectorUnavailable>())?;
    m.add("MetadataError", py.get_type::<MetadataError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether this build takes CUDA KV tensors (built with `--features cuda`).
    m.add("GPU_KV", cfg!(feature = "cuda"))?;
    // Whether this build writes KV one-sided through libfabric (`transport: rdma`; `--features rdma`).
    m.add("RDMA", cfg!(feature = "rdma"))?;
    Ok(())
}
