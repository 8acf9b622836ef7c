"""`PdflowConnector`: pdflow as a vLLM v1 KV connector (vLLM 0.32 and 0.33).

Load it with ``--kv-transfer-config '{"kv_connector": "PdflowConnector",
"kv_connector_module_path": "pdflow.vllm", "kv_role": "kv_producer" | "kv_consumer",
"kv_connector_extra_config": {...}}'``.

This module only converts vLLM's objects and forwards each hook to pdflow's Rust actors
(`pdflow._native`): the scheduler role to the SchedulerConnector actor, the worker role to the
SenderListener (P) or Receiver (D) and the tcp transfer engine. The GIL is released while the
actors work. Seed steps: 2–5 (start-up, `register_kv_caches`), 12–13 and 17–18
(`update_state_after_alloc`, `build_connector_meta`), 14, 19 (`start_load_kv`), 23, 26
(`request_finished`), 32–33, 35–37 (`get_transfer_results`, `update_connector_output`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
import vllm
from vllm.logger import init_logger

from pdflow import _native, vllm_version
from pdflow._native import ConfigError
from pdflow.kv_regions import pages_of, regions_of

VLLM_VERSION = vllm_version.check(getattr(vllm, "__version__", ""))

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's own logger, whose handler vLLM configures: its log shows these lines.
logger = init_logger(f"vllm.{__name__}")

__all__ = ["PdflowConnector", "PdflowConnectorMetadata"]


class PdflowConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's instructions to the workers, as one pdflow frame (`frame`).

    vLLM pickles this object from the scheduler process to the workers; only the frame travels.
    The attributes below decode it on first use, shaped like vLLM's MooncakeConnectorMetadata:
    `reqs_to_send` ``{req_id: (transfer_id, [block ids])}``, `reqs_to_recv`
    ``{remote_engine_id: {req_id: pull}}``, `reqs_not_processed` (transfer ids),
    `reqs_to_abort` (request ids whose pull is cancelled) and, for layer-wise P, `reqs_to_save`.
    """

    def __init__(self, frame: Optional[bytes] = None) -> None:
        self.frame: bytes = frame or b""
        self._view: Optional[dict] = None

    def _decoded(self) -> dict:
        if self._view is None:
            self._view = _native.decode_metadata(self.frame)
        return self._view

    @property
    def reqs_to_send(self) -> dict[str, tuple[str, list[int]]]:
        return self._decoded()["reqs_to_send"]

    @property
    def reqs_to_recv(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self._decoded()["reqs_to_recv"]

    @property
    def reqs_not_processed(self) -> set[str]:
        return self._decoded()["reqs_not_processed"]

    @property
    def reqs_to_abort(self) -> set[str]:
        return self._decoded()["reqs_to_abort"]

    @property
    def reqs_to_save(self) -> dict[str, dict[str, Any]]:
        """Layer-wise P: ``{req_id: {transfer_id, block_ids, computed_upto, prompt_len}}``."""
        return self._decoded()["reqs_to_save"]

    def __getstate__(self) -> dict:
        return {"frame": self.frame}

    def __setstate__(self, state: dict) -> None:
        self.frame = state["frame"]
        self._view = None

    def __repr__(self) -> str:
        if not self.frame:
            return "PdflowConnectorMetadata(empty)"
        v = self._decoded()
        return (
            f"PdflowConnectorMetadata(reqs_to_send={v['reqs_to_send']!r}, "
            f"reqs_to_recv={v['reqs_to_recv']!r}, reqs_not_processed={v['reqs_not_processed']!r}, "
            f"reqs_to_abort={v['reqs_to_abort']!r}, reqs_to_save={v['reqs_to_save']!r})"
        )


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes one list of block ids per KV-cache group; pdflow serves one group."""
    if not block_ids:
        return []
    first = block_ids[0]
    return list(first) if isinstance(first, (list, tuple)) else list(block_ids)


def _tp_rank_and_size(vllm_config: "VllmConfig") -> tuple[int, int]:
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed group: a single-process engine (or a test)
        rank = 0
    return rank, size


def _pp_rank_and_size(vllm_config: "VllmConfig") -> tuple[int, int]:
    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    try:
        from vllm.distributed.parallel_state import get_pp_group

        rank = int(get_pp_group().rank_in_group)
    except Exception:  # no distributed group: a single-process engine (or a test)
        rank = 0
    return rank, size


def _total_layers(vllm_config: "VllmConfig") -> Optional[int]:
    """The model's layers over all pipeline stages (None for a test's stand-in config)."""
    try:
        return int(vllm_config.model_config.get_total_num_hidden_layers())
    except Exception:
        return None


def _data_parallel(vllm_config: "VllmConfig") -> tuple[int, int, bool]:
    """The engine's data-parallel rank (``data_parallel_index`` where vLLM has it), its rank on
    this node, and whether each node balances its own engines (external load balancing)."""
    pc = vllm_config.parallel_config
    index = getattr(pc, "data_parallel_index", None)
    rank = int(index if index is not None else getattr(pc, "data_parallel_rank", 0) or 0)
    return rank, int(getattr(pc, "data_parallel_rank_local", 0) or 0), bool(getattr(pc, "local_engines_only", False))


def _kv_events(vllm_config: "VllmConfig") -> Optional[tuple[str, Optional[str], str, int]]:
    """vLLM's KV-event publisher as pdflow advertises it (``advertise_url``): ``(endpoint,
    replay_endpoint, topic, data-parallel engines on this node)``, or None when the engine
    publishes no events on ZeroMQ."""
    kec = getattr(vllm_config, "kv_events_config", None)
    if kec is None or not getattr(kec, "enable_kv_cache_events", False) or getattr(kec, "publisher", None) != "zmq":
        return None
    replay = getattr(kec, "replay_endpoint", None)
    ranks = int(getattr(vllm_config.parallel_config, "data_parallel_size_local", 1) or 1)
    return str(kec.endpoint), (str(replay) if replay else None), str(getattr(kec, "topic", "") or ""), ranks


def _total_kv_heads(vllm_config: "VllmConfig") -> Optional[int]:
    """The model's KV heads before tensor parallelism shards them (MLA: one latent, on every rank;
    None for a test's stand-in config)."""
    try:
        if getattr(vllm_config.model_config, "use_mla", False):
            return 1
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:
        return None


def _worker_topology(vllm_config: "VllmConfig", layer_names: list[str], heads: bool = True) -> "_native.WorkerTopology":
    """Where vLLM placed this worker, read from its parallel state and config. pdflow's Rust half
    checks it against the KV tensors and decides what follows from it (the data-parallel rank P
    registers under, which worker launches the bootstrap); raises ConfigError for a rank outside
    its group. `heads=False`: the KV is registered as pages (a hybrid model), not by head."""
    tp_rank, tp_size = _tp_rank_and_size(vllm_config)
    pp_rank, pp_size = _pp_rank_and_size(vllm_config)
    dp_rank, dp_rank_local, local_engines_only = _data_parallel(vllm_config)
    return _native.WorkerTopology(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        total_kv_heads=_total_kv_heads(vllm_config) if heads else None,
        total_layers=_total_layers(vllm_config),
        layer_names=layer_names,
        data_parallel_rank=dp_rank,
        data_parallel_rank_local=dp_rank_local,
        local_engines_only=local_engines_only,
    )


def _kv_groups(kv_cache_config: "KVCacheConfig | None") -> Optional[list[tuple[str, int, int]]]:
    """A hybrid model's KV-cache groups as ``(kind, block_size, sliding_window)`` for pdflow's
    scheduler connector (kind ``full``, ``sliding_window`` or ``state``); None for a model of one
    group. Raises ConfigError naming a group of a kind pdflow does not move."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) if kv_cache_config is not None else None
    if not groups or len(groups) <= 1:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out: list[tuple[str, int, int]] = []
    for i, g in enumerate(groups):
        sp = getattr(g, "kv_cache_spec", None)
        if isinstance(sp, SlidingWindowSpec):
            out.append(("sliding_window", int(sp.block_size), int(sp.sliding_window)))
        elif isinstance(sp, MambaSpec):
            out.append(("state", int(sp.block_size), 0))
        elif isinstance(sp, FullAttentionSpec) and not getattr(sp, "attention_chunk_size", None):
            out.append(("full", int(sp.block_size), 0))
        else:
            raise ConfigError(
                f"KV-cache group {i} ({type(sp).__name__}, {len(getattr(g, 'layer_names', []) or [])} layers): "
                "pdflow moves full attention, sliding-window and state (Mamba, linear attention) groups; "
                "serve this model without P/D disaggregation, or with --disable-hybrid-kv-cache-manager "
                "if its layers are all attention"
            )
    return out


def _hybrid_refusal(groups: list[tuple[str, int, int]], vllm_config: "VllmConfig", layerwise: bool) -> Optional[str]:
    """Why this hybrid model cannot be served in this setup, or None. Every group is moved whole
    at the end of the prefill, page by page between ranks of engines of one tensor-parallel size
    (P refuses a pull from a D of another)."""
    named = ", ".join(f"{kind}" + (f"({window})" if window else "") for kind, _, window in groups)
    if layerwise:
        return (
            f"this model has {len(groups)} KV-cache groups ({named}); layer-wise transfer is for models of one "
            'group: leave "layerwise" out of kv_connector_extra_config'
        )
    _, pp = _pp_rank_and_size(vllm_config)
    if pp > 1:
        return (
            f"this model has {len(groups)} KV-cache groups ({named}); pdflow serves hybrid models at "
            f"pipeline-parallel size 1 so far (this engine: PP {pp})"
        )
    return None


class PdflowConnector(KVConnectorBase_V1, SupportsHMA):
    """pdflow's KV connector: P (``kv_producer``) keeps a finished prefill's blocks until D pulls
    them; D (``kv_consumer``) waits in WAITING_FOR_REMOTE_KVS while its worker pulls the KV."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.engine_id: str = str(ktc.engine_id)
        self.kv_role: str = str(ktc.kv_role)
        extra = dict(ktc.kv_connector_extra_config or {})
        try:
            self._extra_json = json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config is not JSON-serialisable: {e}") from e
        _native.check_config(self._extra_json)
        _native.install_trace_export()
        # Layer-wise P: the scheduler tracks each request's blocks (vLLM hands only the new ones
        # of a running request); the worker maps each attention layer to its KV regions.
        self._layerwise = bool(extra.get("layerwise", False))
        # A hybrid model (vLLM's hybrid allocator): one block list per group.
        self._kv_groups = _kv_groups(kv_cache_config)
        if self._kv_groups is not None:
            refusal = _hybrid_refusal(self._kv_groups, vllm_config, self._layerwise)
            if refusal is not None:
                raise ConfigError(refusal)
        # The tokens of a block as the prefix cache hashes them (a dense model's block size); 0
        # without prefix caching, where a load that lands caches nothing to wait for (vLLM still
        # hashes a request's blocks for its connector).
        cache_config = getattr(vllm_config, "cache_config", None)
        caching = bool(getattr(cache_config, "enable_prefix_caching", False))
        self._hash_block_size = int(getattr(cache_config, "block_size", 0) or 0) if caching else 0
        self._scheduler: Optional[_native.SchedulerConnector] = None
        self._worker: Optional[_native.WorkerConnector] = None
        self._blocks: dict[str, list[int]] = {}
        # P of a hybrid model: requests whose prompt lost its last token(s) to D (once each).
        self._truncated: set[str] = set()
        self._layer_regions: dict[str, list[int]] = {}
        self._saving_meta: Optional[KVConnectorMetadata] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _native.SchedulerConnector(self.engine_id, self.kv_role, self._extra_json, self._kv_groups)
        elif role == KVConnectorRole.WORKER:
            self._worker = _native.WorkerConnector(self.engine_id, self.kv_role, self._extra_json)
        logger.info("pdflow connector: engine %s, %s, role %s", self.engine_id, self.kv_role, role.name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None
        # One contiguous region per layer, K and V side by side in each block: the layout
        # pdflow's planner coalesces (36 descriptors for the seed's request).
        return "LBHNC"

    # ---------------------------------------------------------------- scheduler role

    def _sched(self) -> "_native.SchedulerConnector":
        if self._scheduler is None:
            raise RuntimeError("a scheduler hook was called on the worker-role PdflowConnector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        params = request.kv_transfer_params
        hashes: list[int] = []
        block_size = self._hash_block_size
        if params and params.get("prefill_in_flight") and self._kv_groups is None and block_size > 0:
            # The prompt's block hashes (prefix caching on), so that D, asked while P still
            # prefills, waits for a load of the same blocks already in flight instead of pulling
            # them twice; a count that does not match the block size (another hashing
            # granularity) is not used.
            block_hashes = getattr(request, "block_hashes", None) or []
            if len(block_hashes) == request.num_prompt_tokens // block_size:
                hashes = [hash(h) for h in block_hashes]
        return self._sched().get_num_new_matched_tokens(
            request.request_id,
            request.num_prompt_tokens,
            num_computed_tokens,
            params,
            hashes,
            block_size,
        )

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        block_ids: Any
        if num_external_tokens <= 0:
            block_ids = []
        elif self._kv_groups is not None:
            # Every group's blocks from the prompt's first: pdflow skips what D's prefix cache
            # holds (the hit it was told) and what each group does not need.
            block_ids = [(0, list(ids)) for ids in blocks.get_block_ids()]
        else:
            # Only the blocks D's prefix cache did not fill are loaded.
            block_ids = _first_group(blocks.get_unhashed_block_ids_all_groups())
        clear = self._sched().update_state_after_alloc(
            request.request_id, request.num_prompt_tokens, params, block_ids, num_external_tokens
        )
        if clear:
            # Request.kv_transfer_params is the dict the scheduler reads: one pull per request.
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PdflowConnectorMetadata:
        scheduled = self._scheduled_chunks(scheduler_output) if self._layerwise else None
        return PdflowConnectorMetadata(self._sched().build_connector_meta(scheduled))

    def _scheduled_chunks(self, out: "SchedulerOutput") -> list[tuple[str, list[int], int]]:
        """What the step computes: per request, its blocks and its tokens with KV after the step."""
        counts = out.num_scheduled_tokens
        chunks = []
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = _first_group(new.block_ids)
            chunks.append((new.req_id, self._blocks[new.req_id], new.num_computed_tokens + counts.get(new.req_id, 0)))
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                blocks = _first_group(new_blocks)
                self._blocks[req_id] = blocks if req_id in resumed else self._blocks.get(req_id, []) + blocks
            computed = cached.num_computed_tokens[i] + counts.get(req_id, 0)
            chunks.append((req_id, self._blocks.get(req_id, []), computed))
        return chunks

    def on_new_request(self, request: "Request") -> None:
        reason = self._sched().on_new_request(request.request_id, request.num_prompt_tokens, request.kv_transfer_params)
        if reason is not None:
            logger.warning("request %s: %s; it is served without KV transfer", request.request_id, reason)
            return
        backoff = self._sched().prefill_backoff(request.kv_transfer_params)
        if backoff and request.request_id not in self._truncated:
            self._truncate_prompt(request, backoff)

    def _truncate_prompt(self, request: "Request", backoff: int) -> None:
        """P of a hybrid model prefills all but the prompt's last `backoff` tokens, which D
        computes: a state group then holds the state D continues from, and a sliding window the
        blocks D's first token attends to. Its one sampled token is not used."""
        if request.num_prompt_tokens <= backoff or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        self._truncated.add(request.request_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._finished(request, list(block_ids))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        if self._kv_groups is None:
            return self._finished(request, _first_group(block_ids))
        return self._finished(request, [(0, list(ids)) for ids in block_ids])

    def _finished(self, request: "Request", block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        self._blocks.pop(request.request_id, None)
        self._truncated.discard(request.request_id)
        params = request.kv_transfer_params
        if not params:
            return False, None
        delay, out = self._sched().request_finished(
            request.request_id, request.num_prompt_tokens, params, request.status.name, block_ids
        )
        if params.get("do_remote_prefill"):
            # Aborted before its pull was issued: the (empty) pull is recorded; never twice.
            params["do_remote_prefill"] = False
        return delay, out

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched().update_connector_output(
            list(connector_output.finished_sending or ()),
            list(connector_output.finished_recving or ()),
            list(getattr(connector_output, "failed_recving", None) or ()),
        )

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        groups = getattr(self._kv_cache_config, "transfer_group_ids", None)
        if groups is not None:
            return tuple(groups)
        return super().get_loaded_kv_cache_group_ids(request)

    # ---------------------------------------------------------------- worker role

    def _work(self) -> "_native.WorkerConnector":
        if self._worker is None:
            raise RuntimeError("a worker hook was called on the scheduler-role PdflowConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        # A hybrid model's groups share one buffer of pages; a dense model is one region per layer.
        r = pages_of(kv_caches) if self._kv_groups is not None else regions_of(kv_caches)
        # Each layer's regions, in registration order: one (LBHNC) or two (K and V apart).
        first = 0
        for name in r.layers:
            count = 2 if kv_caches[name].dim() == 5 else 1
            self._layer_regions[name] = list(range(first, first + count))
            first += count
        topology = _worker_topology(self._vllm_config, r.layers, heads=self._kv_groups is None)
        info = self._work().register_kv_caches(
            r.regions, r.geometry, r.owners, r.device, topology, _kv_events(self._vllm_config)
        )
        logger.info(
            "pdflow connector registered %d KV regions of %d blocks (%r): %s", len(r.regions), r.geometry[0], topology, info
        )

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PdflowConnectorMetadata):
            raise TypeError(f"PdflowConnector got {type(meta).__name__} metadata; is another connector configured?")
        if meta.frame:
            self._work().start_load_kv(meta.frame)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """KV arrives whole, before the request is scheduled: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise P: this layer's KV of the step is written; the step's prefills stream it to D
        (the call returns at once). Otherwise D pulls from P's blocks after the prefill."""
        if not self._layerwise:
            return
        # vLLM starts the step's loads after launching its forward: the metadata bound for this
        # forward names the requests to stream, once per step.
        meta = self._get_connector_metadata()
        if meta is not self._saving_meta:
            self._saving_meta = meta
            self._work().bind_reqs_to_save(meta.frame if isinstance(meta, PdflowConnectorMetadata) else b"")
        for region in self._layer_regions.get(layer_name, ()):
            self._work().save_kv_layer(region)

    def wait_for_save(self) -> None:
        """Nothing to wait for: P's blocks stay held (delayed free) until D has them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=set(sending), finished_recving=set(recving), failed_recving=set(failed)
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = set(self._work().get_block_ids_with_load_errors())
        if self._kv_groups is not None:
            # vLLM recovers block-level errors for one group only; with several, the failed
            # request (in failed_recving) follows kv_load_failure_policy whole.
            return set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        _native.flush_traces()
