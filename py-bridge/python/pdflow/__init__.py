"""pdflow: prefill/decode disaggregation for vLLM, as a dataflow of Rust actors.

Load the connector in vLLM with::

    --kv-transfer-config '{"kv_connector": "PdflowConnector",
                           "kv_connector_module_path": "pdflow.vllm",
                           "kv_role": "kv_producer"}'

`pdflow.vllm` imports vLLM; this package itself does not.
"""

from pdflow._native import (
    ConfigError,
    ConnectorUnavailable,
    MetadataError,
    PdflowError,
    RegistrationError,
    __version__,
)

__all__ = [
    "ConfigError",
    "ConnectorUnavailable",
    "MetadataError",
    "PdflowError",
    "RegistrationError",
    "__version__",
]
