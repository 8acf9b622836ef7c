"""The worker role of `pdflow._native` as vLLM's workers see it, without a model: which halves a
role runs (`register_kv_caches`' answer) and what happens when the scheduler and the worker were
given different roles — a clear ConfigError on the first step that needs the missing half, not a
request that hangs.
"""

import json
import socket
import time
import urllib.request

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


def free_pair() -> int:
    """A port that is free, and the one after it too."""
    for _ in range(100):
        base = free_port()
        if base < 65535:
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def register(worker, topology=None, kv_events=None):
    """Host KV tensors in vLLM 0.33's layout (LBHNC), registered with the worker placed where
    `topology` says (None: the one worker of its engine); `kv_events`: vLLM's KV-event publisher
    as `pdflow.vllm` reads it."""
    tensors = [torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    geometry = (NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, 2)
    return worker.register_kv_caches(regions, geometry, tensors, None, topology, kv_events)


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


def test_rust_decides_which_worker_launches_the_bootstrap():
    """vLLM's rule, asked of the native half: the first worker (tp and pp rank 0) of the first
    data-parallel engine — of each node's first engine with external load balancing, which then
    registers under its local rank."""
    assert _native.WorkerTopology().launches_bootstrap
    assert not _native.WorkerTopology(tp_rank=1, tp_size=2).launches_bootstrap
    assert not _native.WorkerTopology(pp_rank=1, pp_size=2).launches_bootstrap
    second = _native.WorkerTopology(data_parallel_rank=1, data_parallel_rank_local=1)
    assert not second.launches_bootstrap and second.dp_rank == 1
    node_first = _native.WorkerTopology(data_parallel_rank=4, data_parallel_rank_local=0, local_engines_only=True)
    assert node_first.launches_bootstrap and node_first.dp_rank == 0


def test_a_worker_that_does_not_launch_the_bootstrap_registers_with_the_launchers():
    """Tensor ranks 0 and 1 of one producer engine: rank 0 launches the bootstrap on the configured
    port, rank 1 registers there."""
    port = free_port()
    launcher = _native.WorkerConnector("boot-p", "kv_producer", config(bootstrap_port=port))
    other = _native.WorkerConnector("boot-p", "kv_producer", config(bootstrap_port=port))
    try:
        url = f"http://127.0.0.1:{port}"
        assert register(launcher, _native.WorkerTopology(tp_rank=0, tp_size=2))["bootstrap_url"] == url
        assert register(other, _native.WorkerTopology(tp_rank=1, tp_size=2))["bootstrap_url"] == url
    finally:
        other.shutdown()
        launcher.shutdown()


def test_pinned_base_ports_give_each_worker_of_a_host_its_own_port():
    """`side_channel_port` and `data_port` pin the ports a firewall must open: each worker of a
    host listens on the base plus its index there (tensor rank 1 of 2: base + 1); past 65535 is a
    ConfigError naming the key."""
    side, data = free_pair(), free_pair()
    cfg = config(side_channel_port=side, data_port=data)
    launcher = _native.WorkerConnector("pinned", "kv_both", cfg)
    other = _native.WorkerConnector("pinned", "kv_both", cfg)
    try:
        first = register(launcher, _native.WorkerTopology(tp_rank=0, tp_size=2))
        second = register(other, _native.WorkerTopology(tp_rank=1, tp_size=2))
    finally:
        other.shutdown()
        launcher.shutdown()
    assert first["side_channel_addr"] == f"127.0.0.1:{side}" and first["data_addr"] == f"127.0.0.1:{data}"
    assert second["side_channel_addr"] == f"127.0.0.1:{side + 1}" and second["data_addr"] == f"127.0.0.1:{data + 1}"
    high = _native.WorkerConnector("pinned-high", "kv_consumer", config(data_port=65535))
    try:
        with pytest.raises(pdflow.ConfigError, match="data_port 65535"):
            register(high, _native.WorkerTopology(tp_rank=1, tp_size=2))
    finally:
        high.shutdown()


def advertised_at(bootstrap_port: int, count: int) -> dict:
    """The engines the bootstrap lists (`GET /engines`) by engine id, once it lists `count`."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{bootstrap_port}/engines", timeout=5) as r:
            engines = {e["engine_id"]: e for e in json.load(r)["engines"]}
        if len(engines) >= count or time.monotonic() > deadline:
            return engines
        time.sleep(0.05)


def test_the_worker_that_launches_the_bootstrap_advertises_the_engine():
    """With `advertise_url`, one worker per engine advertises it for `pdflow proxy --discover`:
    P's that launches its bootstrap, there — its URL, the bootstrap's port, and vLLM's KV-event
    endpoints at the URL's host, one per data-parallel engine of its node at vLLM's port offsets
    (the node's first engine is rank 4 here, with external load balancing) —; not its other tensor
    rank; D's at each `advertise_to`, without a KV-event endpoint vLLM connects to instead of
    binding."""
    port = free_port()
    bootstrap = f"http://127.0.0.1:{port}"
    p_cfg = config(bootstrap_port=port, advertise_url="http://127.0.0.1:8100/")
    d_cfg = config(advertise_url="http://127.0.0.1:8200", advertise_to=[bootstrap + "/", bootstrap])
    dp = {"data_parallel_rank": 4, "data_parallel_rank_local": 0, "local_engines_only": True}
    events = ("tcp://*:5557", "tcp://*:5600", "kv", 2)
    p0 = _native.WorkerConnector("adv-p", "kv_producer", p_cfg)
    p1 = _native.WorkerConnector("adv-p", "kv_producer", p_cfg)
    d = _native.WorkerConnector("adv-d", "kv_consumer", d_cfg)
    try:
        first = register(p0, _native.WorkerTopology(tp_rank=0, tp_size=2, **dp), events)
        second = register(p1, _native.WorkerTopology(tp_rank=1, tp_size=2, **dp), events)
        on_d = register(d, None, ("tcp://10.0.0.9:5557", None, "", 1))
        assert first["advertised_at"] == bootstrap and on_d["advertised_at"] == bootstrap, (first, on_d)
        assert "advertised" not in second, second
        listed = advertised_at(port, 2)
        assert set(listed) == {"adv-p", "adv-d"}, listed
        p, dec = listed["adv-p"], listed["adv-d"]
        assert (p["role"], p["url"], p["bootstrap_port"]) == ("prefill", "http://127.0.0.1:8100", port), p
        assert p["kv_events"] == [
            {"endpoint": "tcp://127.0.0.1:5561", "replay_endpoint": "tcp://127.0.0.1:5604", "topic": "kv"},
            {"endpoint": "tcp://127.0.0.1:5562", "replay_endpoint": "tcp://127.0.0.1:5605", "topic": "kv"},
        ], p
        assert p["generation"] > 0 and json.loads(first["advertised"]) == p
        assert (dec["role"], dec["url"], dec.get("bootstrap_port"), dec.get("kv_events")) == (
            "decode", "http://127.0.0.1:8200", None, None
        ), dec
    finally:
        d.shutdown()
        p1.shutdown()
        p0.shutdown()
