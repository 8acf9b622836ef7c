"""Drives vLLM 0.33's real v1 Scheduler with `PdflowConnector`, without a GPU or a model.

The model is the seed's (Qwen3-8B: 36 layers, 8 KV heads, head_dim 128, bf16, block 16), read
from the local `qwen3-8b-config/config.json` (no hub access; no tokenizer). The "model runner" is
this module: it samples the tokens a test asks for and plays the worker's `KVConnectorOutput`.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402

MODEL_DIR = Path(__file__).parent / "qwen3-8b-config"
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 36, 8, 128, 16
EOS = 151645
SEED_PROMPT = 1000  # tokens: 63 blocks, 148,635,648 bytes of KV
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]

init_none_hash(sha256)
_ids = itertools.count(1)


def vllm_config(
    kv_role: str,
    *,
    policy: str = "fail",
    max_num_batched_tokens: int = 8192,
    extra: Optional[dict[str, Any]] = None,
    engine_id: Optional[str] = None,
    prefix_caching: bool = True,
) -> VllmConfig:
    model = ModelConfig(model=str(MODEL_DIR), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
    sched = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=prefix_caching)
    kv = KVTransferConfig(
        kv_connector="PdflowConnector",
        kv_connector_module_path="pdflow.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=extra or {},
        kv_load_failure_policy=policy,
        engine_id=engine_id,
    )
    return VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=kv, device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])


def scheduler(config: VllmConfig, num_blocks: int = 512) -> Scheduler:
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def prompt_tokens(n: int, salt: int) -> list[int]:
    """A deterministic prompt, distinct per salt (so prefix caching never shares blocks)."""
    return [1000 + ((salt * 7919 + i * 104729) % 100000) for i in range(n)]


def request(
    kv_transfer_params: Optional[dict[str, Any]],
    *,
    prompt_len: int = SEED_PROMPT,
    max_tokens: int = 1,
    request_id: Optional[str] = None,
    salt: Optional[int] = None,
    prompt_token_ids: Optional[list[int]] = None,
) -> Request:
    n = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        request_id=request_id or f"req-{n}",
        prompt_token_ids=prompt_token_ids or prompt_tokens(prompt_len, salt if salt is not None else n),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return req


def p_params(transfer_id: str) -> dict[str, Any]:
    """What the proxy writes into P's request (seed step 9)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def d_params(transfer_id: str, bootstrap: str = "http://127.0.0.1:8998", engine: str = "p-engine") -> dict[str, Any]:
    """What the proxy writes into D's request (seed step 10)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap,
        "remote_engine_id": engine,
    }


class Runner:
    """The model runner's side of one engine: runs `schedule()` / `update_from_output()` and
    samples tokens; `kv` gives the worker connector's output of each step."""

    def __init__(self, s: Scheduler, token: Callable[[Request], int] = lambda r: 7) -> None:
        self.s = s
        self.token = token
        self.finished: dict[str, Any] = {}
        self.metas: list = []

    def step(self, kv: Optional[KVConnectorOutput] = None, worker: Optional[Callable[[Any], Optional[KVConnectorOutput]]] = None):
        out = self.s.schedule()
        meta = out.kv_connector_metadata
        self.metas.append(meta)
        if worker is not None:
            kv = worker(out)
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.s.requests[req_id]
            req_ids.append(req_id)
            # A prefill chunk that does not reach the end of the prompt samples nothing.
            sampled.append([self.token(req)] if req.num_computed_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv,
        )
        engine_outputs = self.s.update_from_output(out, mro)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        return out, meta


def kv_output(
    sending: Iterable[str] = (), recving: Iterable[str] = (), failed: Iterable[str] = ()
) -> KVConnectorOutput:
    return KVConnectorOutput(finished_sending=set(sending) or None, finished_recving=set(recving) or None, failed_recving=set(failed))


__all__ = [
    "EOS", "SEED_PROMPT", "Runner", "RequestStatus", "d_params", "free_blocks", "kv_output", "p_params", "request",
    "scheduler", "vllm_config", "KVConnectorOutput", "LAYER_NAMES", "NUM_LAYERS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_SIZE",
]
