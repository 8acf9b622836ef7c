"""Type stubs of pdflow's native module (the Rust half of `pdflow.vllm.PdflowConnector`).

Kept in step with ``py-bridge/src`` by ``py-bridge/tests/test_stub.py``: every public name of the
module and of its classes is declared here, and nothing else is (names starting with ``_`` are
typing helpers only).
"""

from typing import Any, Optional, TypedDict, Union

__version__: str
GPU_KV: bool
"""Whether this build registers CUDA KV tensors (built with ``--features cuda``)."""
RDMA: bool
"""Whether this build writes KV one-sided through libfabric (``transport: rdma``; built with
``--features rdma``)."""

class PdflowError(Exception): ...
class ConfigError(PdflowError): ...
class RegistrationError(PdflowError): ...
class ConnectorUnavailable(PdflowError): ...
class MetadataError(PdflowError): ...

class _MetadataView(TypedDict):
    """What `decode_metadata` returns."""

    reqs_to_send: dict[str, tuple[str, list[int]]]
    """``{req_id: (transfer_id, [block ids])}``: P's sends to expect."""
    reqs_to_recv: dict[str, dict[str, dict[str, Any]]]
    """``{remote_engine_id: {req_id: pull}}``: D's pulls to make."""
    reqs_not_processed: set[str]
    """Transfer ids of requests that ended before their KV was sent."""
    reqs_to_abort: set[str]
    """Request ids whose pull is cancelled."""
    reqs_to_save: dict[str, dict[str, Any]]
    """Layer-wise P: ``{req_id: {transfer_id, block_ids, computed_upto, prompt_len}}``."""

def decode_metadata(frame_bytes: bytes) -> _MetadataView:
    """A metadata frame as plain Python data (an empty frame: nothing to do); raises MetadataError."""

def check_config(extra_config_json: str) -> None:
    """Raises ConfigError if ``kv_connector_extra_config`` (JSON) or the environment is invalid."""

def install_trace_export() -> None:
    """Installs the process's step-span exporter if OTEL_* variables or PDFLOW_TRACE_FILE ask for one."""

def flush_traces() -> None:
    """Sends pending spans and writes the PDFLOW_TRACE_FILE trace file."""

class SchedulerConnector:
    """Scheduler role: each method is one ask to the SchedulerConnector actor."""

    engine_id: str
    def __init__(
        self,
        engine_id: str,
        kv_role: str,
        extra_config_json: str = "",
        kv_groups: Optional[list[tuple[str, int, int]]] = None,
    ) -> None: ...
    def on_new_request(
        self, request_id: str, num_prompt_tokens: int, kv_transfer_params: Optional[dict[str, Any]]
    ) -> Optional[str]: ...
    def prefill_backoff(self, kv_transfer_params: Optional[dict[str, Any]]) -> int: ...
    def get_num_new_matched_tokens(
        self,
        request_id: str,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        kv_transfer_params: Optional[dict[str, Any]],
        block_hashes: list[int] = ...,
        block_size: int = 0,
    ) -> tuple[Optional[int], bool]: ...
    def update_state_after_alloc(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Optional[dict[str, Any]],
        block_ids: Union[list[int], list[tuple[Optional[int], list[int]]]],
        num_external_tokens: int,
    ) -> bool: ...
    def build_connector_meta(self, scheduled: Optional[list[tuple[str, list[int], int]]] = None) -> Optional[bytes]: ...
    def request_finished(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Optional[dict[str, Any]],
        status: str,
        block_ids: Union[list[int], list[tuple[Optional[int], list[int]]]],
    ) -> tuple[bool, Optional[dict[str, Any]]]: ...
    def update_connector_output(
        self,
        finished_sending: Optional[list[str]] = None,
        finished_recving: Optional[list[str]] = None,
        failed_recving: Optional[list[str]] = None,
    ) -> None: ...
    def shutdown(self) -> None: ...

class WorkerTopology:
    """Where vLLM placed one worker; checked (ConfigError) and interpreted by pdflow's Rust half."""

    def __init__(
        self,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        total_kv_heads: Optional[int] = None,
        total_layers: Optional[int] = None,
        layer_names: Optional[list[str]] = None,
        data_parallel_rank: int = 0,
        data_parallel_rank_local: int = 0,
        local_engines_only: bool = False,
    ) -> None: ...
    @property
    def launches_bootstrap(self) -> bool:
        """Whether this worker launches P's bootstrap when no ``bootstrap_url`` is configured."""
    @property
    def dp_rank(self) -> int:
        """The data-parallel rank P's workers register under at the bootstrap."""
    @property
    def first_layer(self) -> Optional[int]:
        """The model layer of a pipeline stage's first KV cache, when its names carry one."""

class WorkerConnector:
    """Worker role: the SenderListener (P) or Receiver (D) over vLLM's KV tensors."""

    engine_id: str
    def __init__(self, engine_id: str, kv_role: str, extra_config_json: str) -> None: ...
    def register_kv_caches(
        self,
        regions: list[tuple[int, int]],
        geometry: tuple[int, int, int, int, int],
        owner: Any,
        device: Optional[int] = None,
        topology: Optional[WorkerTopology] = None,
        kv_events: Optional[tuple[str, Optional[str], str, int]] = None,
    ) -> dict[str, Any]:
        """``geometry``: ``(num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes)``, as
        `pdflow.kv_regions.regions_of` gives it; ``kv_events``: vLLM's KV-event publisher as
        ``(endpoint, replay_endpoint, topic, data-parallel engines on this node)``, advertised with
        ``advertise_url``. Raises RegistrationError (or ConfigError)."""
    def start_load_kv(self, metadata: bytes) -> None: ...
    def bind_reqs_to_save(self, metadata: bytes) -> None: ...
    def save_kv_layer(self, region: int) -> None: ...
    def get_transfer_results(self) -> tuple[list[str], list[str], list[str]]: ...
    def get_block_ids_with_load_errors(self) -> list[int]: ...
    def info(self) -> Optional[dict[str, Any]]: ...
    def shutdown(self) -> None: ...
