"""Two P and two D, each a real `vllm serve` (the CPU build) with PdflowConnector, at the smallest
block size vLLM's CPU attention takes (32): 2P1D and 1P2D through `pdflow proxy`, 16 concurrent
requests over 2P2D, and P killed while D needs its KV, under both of vLLM's
`kv_load_failure_policy` values (D `recompute` returns the right tokens, D `fail` an error, both
within D's pull deadline), after which both D serve the next request.

The reference is P serving a request alone (no `kv_transfer_params`): `test_serve_pair.py` checks
that this equals a server without a connector.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from pdflow.traces import read_spans

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, free_port, prompt_of

BLOCK = 32
MAX_TOKENS = 16
D_PULL_TIMEOUT_S = 8


@dataclass
class Cluster:
    p_a: VllmServer
    p_b: VllmServer
    d_recompute: VllmServer
    d_fail: VllmServer
    ports: dict  # P name → bootstrap port
    traces: Path
    log_dir: Path

    def proxy(self, name: str, prefill: list[VllmServer], decode: list[VllmServer]) -> PdflowProxy:
        px = PdflowProxy(name, [(p.url, self.ports[p.name]) for p in prefill], [d.url for d in decode], self.log_dir)
        px.wait_ready(time.monotonic() + 60)
        return px

    def reference(self, prompt: list[int]) -> list[int]:
        return completion_tokens(self.p_a.url, prompt, MAX_TOKENS)

    def spans(self, server: VllmServer) -> list[dict]:
        return read_spans(str(self.traces / f"{server.name}.json"))


@pytest.fixture(scope="module")
def topo(model_dir, pdflow_bin, log_dir):
    traces = log_dir / "traces"
    traces.mkdir()
    ports = {"p_a": free_port(), "p_b": free_port()}

    def producer(name: str) -> VllmServer:
        extra = {"bootstrap_port": ports[name], "abort_request_timeout_s": 10}
        cfg = connector_config("kv_producer", extra=extra, engine_id=name)
        return VllmServer(name, model_dir, log_dir, core=0, block_size=BLOCK, kv_transfer_config=cfg,
                          env={"PDFLOW_TRACE_FILE": str(traces / f"{name}.json")})  # fmt: skip

    def consumer(name: str, policy: str) -> VllmServer:
        cfg = connector_config("kv_consumer", policy=policy, extra={"pull_timeout_s": D_PULL_TIMEOUT_S})
        return VllmServer(name, model_dir, log_dir, core=1, block_size=BLOCK, kv_transfer_config=cfg,
                          env={"PDFLOW_TRACE_FILE": str(traces / f"{name}.json")})  # fmt: skip

    servers = [producer("p_a"), producer("p_b"), consumer("d_recompute", "recompute"), consumer("d_fail", "fail")]
    try:
        cluster.start_all(servers)
        yield Cluster(*servers, ports=ports, traces=traces, log_dir=log_dir)
    finally:
        for s in servers:
            s.stop()


def test_2p1d_outputs_equal_one_engine_and_both_p_write_kv(topo):
    proxy = topo.proxy("proxy-2p1d", [topo.p_a, topo.p_b], [topo.d_recompute])
    try:
        for length in (20, BLOCK, BLOCK + 1, 9 * BLOCK + 12):  # shorter, one block, +1, many with a partial last
            for seed in (1, 2):  # round robin: each length through each P
                prompt = prompt_of(length, seed=100 * length + seed)
                assert completion_tokens(proxy.url, prompt, MAX_TOKENS) == topo.reference(prompt), (length, seed)
    finally:
        proxy.stop()
    for p in (topo.p_a, topo.p_b):
        written = [int(s["tags"].get("pd.bytes", 0)) for s in topo.spans(p) if s["step"] == 29]
        assert sum(written) > 0, f"{p.name} wrote no KV"


def test_1p2d_outputs_equal_one_engine_and_both_d_load_kv(topo):
    src = "vllm:prompt_tokens_by_source_total"
    before = {d.name: d.metric(src, source="external_kv_transfer") for d in (topo.d_recompute, topo.d_fail)}
    proxy = topo.proxy("proxy-1p2d", [topo.p_a], [topo.d_recompute, topo.d_fail])
    try:
        for i in range(4):
            prompt = prompt_of(200 + i, seed=500 + i)
            assert completion_tokens(proxy.url, prompt, MAX_TOKENS) == topo.reference(prompt), i
    finally:
        proxy.stop()
    for d in (topo.d_recompute, topo.d_fail):
        cluster.wait_until(lambda d=d: d.metric(src, source="external_kv_transfer") > before[d.name], f"{d.name} loaded KV")


def test_16_concurrent_requests_over_2p2d(topo):
    prompts = [prompt_of(40 + 29 * i, seed=900 + i) for i in range(16)]
    expected = [topo.reference(p) for p in prompts]
    proxy = topo.proxy("proxy-2p2d", [topo.p_a, topo.p_b], [topo.d_recompute, topo.d_fail])
    try:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda p: completion_tokens(proxy.url, p, MAX_TOKENS), prompts))
    finally:
        proxy.stop()
    assert got == expected


def _prefill_on(p: VllmServer, prompt: list[int], transfer_id: str) -> None:
    """P's half, as a proxy sends it: one token, P keeps the blocks for D's pull."""
    status, body = cluster.post(
        p.url + "/v1/completions",
        {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}},
    )  # fmt: skip
    assert status == 200, body


def _decode_on(d: VllmServer, prompt: list[int], transfer_id: str, p_name: str, bootstrap_port: int) -> tuple[int, object]:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
              "remote_engine_id": p_name, "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}"}  # fmt: skip
    return cluster.post(
        d.url + "/v1/completions",
        {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
         "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params},
        timeout=D_PULL_TIMEOUT_S + 60,
    )  # fmt: skip


def test_zz_p_killed_while_d_needs_its_kv_recompute_serves_fail_errors_then_both_serve_again(topo):
    """Runs last in this module: it kills P b."""
    prompts = {d.name: prompt_of(300, seed=777 + i) for i, d in enumerate((topo.d_recompute, topo.d_fail))}
    expected = {name: topo.reference(p) for name, p in prompts.items()}
    transfers = {name: f"xfer-killed-{uuid.uuid4().hex[:8]}" for name in prompts}
    # P b prefills both requests and holds their blocks; D's bootstrap look-ups find it; then it dies.
    for name, prompt in prompts.items():
        _prefill_on(topo.p_b, prompt, transfers[name])
    topo.p_b.kill()

    t0 = time.monotonic()
    status, body = _decode_on(topo.d_recompute, prompts["d_recompute"], transfers["d_recompute"], "p_b", topo.ports["p_b"])
    took = time.monotonic() - t0
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == expected["d_recompute"], "D recomputed the prompt: same tokens"
    assert took < D_PULL_TIMEOUT_S + 30, f"recompute took {took:.1f} s"

    t0 = time.monotonic()
    status, body = _decode_on(topo.d_fail, prompts["d_fail"], transfers["d_fail"], "p_b", topo.ports["p_b"])
    took = time.monotonic() - t0
    failed = status >= 400 or body["choices"][0].get("finish_reason") not in ("length", "stop")
    assert failed, f"kv_load_failure_policy=fail answered as if the KV had arrived: {status} {body}"
    assert took < D_PULL_TIMEOUT_S + 30, f"the failure took {took:.1f} s"

    # Both D serve the next request, from the P that is alive.
    proxy = topo.proxy("proxy-after-kill", [topo.p_a], [topo.d_recompute, topo.d_fail])
    try:
        for i in range(2):  # round robin: one each
            prompt = prompt_of(150 + i, seed=880 + i)
            assert completion_tokens(proxy.url, prompt, MAX_TOKENS) == topo.reference(prompt)
    finally:
        proxy.stop()
