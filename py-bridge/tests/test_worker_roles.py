"""The worker role of `pdflow._native` as vLLM's workers see it, without a model: which halves a
role runs (`register_kv_caches`' answer) and what happens when the scheduler and the worker were
given different roles — a clear ConfigError on the first step that needs the missing half, not a
request that hangs.
"""

import json
import socket

import pytest
import torch

import pdflow
from pdflow import _native
from vllm_harness import d_params

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 8, 2, 16, 8, 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def register(worker):
    """Host KV tensors in vLLM 0.33's layout (LBHNC), registered with the worker."""
    tensors = [torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    return worker.register_kv_caches(regions, NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, 2, tensors)


def config(**extra) -> str:
    return json.dumps({"bootstrap_port": free_port(), "transport": "tcp", **extra})


def pull_frame(engine_id: str) -> bytes:
    """A consumer scheduler's metadata frame that asks its workers to load one request."""
    sched = _native.SchedulerConnector(engine_id, "kv_consumer", config())
    try:
        params = d_params("xfer-roles", engine="p-elsewhere")
        assert sched.on_new_request("req-roles", 40, params) is None
        count, load_async = sched.get_num_new_matched_tokens("req-roles", 40, 0, params)
        assert count > 0 and load_async, "D loads the prompt from P"
        sched.update_state_after_alloc("req-roles", 40, params, [0, 1, 2], count)
        frame = sched.build_connector_meta()
        assert frame and _native.decode_metadata(frame)["reqs_to_recv"], "the frame asks for a pull"
        return frame
    finally:
        sched.shutdown()


def test_each_role_starts_the_halves_it_needs():
    started = {}
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        worker = _native.WorkerConnector(f"roles-{role}", role, config())
        try:
            started[role] = register(worker)
        finally:
            worker.shutdown()
    assert "bootstrap_url" in started["kv_producer"] and "data_addr" not in started["kv_producer"]
    assert "data_addr" in started["kv_consumer"] and "bootstrap_url" not in started["kv_consumer"]
    assert {"bootstrap_url", "data_addr"} <= started["kv_both"].keys(), "kv_both sends and loads"


def test_a_producer_worker_asked_to_load_says_the_roles_disagree():
    worker = _native.WorkerConnector("roles-p", "kv_producer", config())
    try:
        register(worker)
        with pytest.raises(pdflow.ConfigError, match="roles disagree"):
            worker.start_load_kv(pull_frame("roles-d"))
        assert worker.get_transfer_results() == ([], [], []), "nothing started, nothing reported"
    finally:
        worker.shutdown()
