"""Type stubs of pdflow's native module (the Rust half of `pdflow.vllm.PdflowConnector`)."""

from typing import Any, Optional

__version__: str
GPU_KV: bool
"""Whether this build registers CUDA KV tensors (built with ``--features cuda``)."""

class PdflowError(Exception): ...
class ConfigError(PdflowError): ...
class RegistrationError(PdflowError): ...
class ConnectorUnavailable(PdflowError): ...
class MetadataError(PdflowError): ...

def decode_metadata(frame_bytes: bytes) -> dict[str, Any]:
    """``{"reqs_to_send": {req_id: (transfer_id, [block ids])}, "reqs_to_recv": {engine_id: {req_id:
    pull}}, "reqs_not_processed": set[str], "reqs_to_abort": set[str]}``."""

def check_config(extra_config_json: str) -> None:
    """Raises ConfigError if ``kv_connector_extra_config`` (JSON) or the environment is invalid."""

def install_trace_export() -> None:
    """Installs the process's step-span exporter if OTEL_* variables or PDFLOW_TRACE_FILE ask for one."""

def flush_traces() -> None:
    """Sends pending spans and writes the PDFLOW_TRACE_FILE trace file."""

class SchedulerConnector:
    """Scheduler role: each method is one ask to the SchedulerConnector actor."""

    engine_id: str
    def __init__(self, engine_id: str, kv_role: str, extra_config_json: str = "") -> None: ...
    def on_new_request(
        self, request_id: str, num_prompt_tokens: int, kv_transfer_params: Optional[dict[str, Any]]
    ) -> Optional[str]: ...
    def get_num_new_matched_tokens(
        self, request_id: str, num_prompt_tokens: int, num_computed_tokens: int, kv_transfer_params: Optional[dict[str, Any]]
    ) -> tuple[int, bool]: ...
    def update_state_after_alloc(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Optional[dict[str, Any]],
        block_ids: list[int],
        num_external_tokens: int,
    ) -> bool: ...
    def build_connector_meta(self, scheduled: Optional[list[tuple[str, list[int], int]]] = None) -> Optional[bytes]: ...
    def request_finished(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Optional[dict[str, Any]],
        status: str,
        block_ids: list[int],
    ) -> tuple[bool, Optional[dict[str, Any]]]: ...
    def update_connector_output(
        self,
        finished_sending: Optional[list[str]] = None,
        finished_recving: Optional[list[str]] = None,
        failed_recving: Optional[list[str]] = None,
    ) -> None: ...
    def shutdown(self) -> None: ...

class WorkerConnector:
    """Worker role: the SenderListener (P) or Receiver (D) over vLLM's KV tensors."""

    engine_id: str
    def __init__(self, engine_id: str, kv_role: str, extra_config_json: str) -> None: ...
    def register_kv_caches(
        self,
        regions: list[tuple[int, int]],
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype_bytes: int,
        owner: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: Optional[int] = None,
        total_kv_heads: Optional[int] = None,
        dp_rank: int = 0,
        launches_bootstrap: Optional[bool] = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        total_layers: Optional[int] = None,
        first_layer: Optional[int] = None,
    ) -> dict[str, Any]: ...
    def start_load_kv(self, metadata: bytes) -> None: ...
    def bind_reqs_to_save(self, metadata: bytes) -> None: ...
    def save_kv_layer(self, region: int) -> None: ...
    def get_transfer_results(self) -> tuple[list[str], list[str], list[str]]: ...
    def get_block_ids_with_load_errors(self) -> list[int]: ...
    def info(self) -> Optional[dict[str, Any]]: ...
    def shutdown(self) -> None: ...
