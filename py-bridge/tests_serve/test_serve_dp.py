"""Data parallelism inside real `vllm serve` (the CPU build): P runs two data-parallel engines
(`--data-parallel-size 2`, one API server), each registering its worker at the one bootstrap
under its dp_rank with vLLM's engine id `{engine_id}_dp{rank}`. `pdflow proxy` finds both ranks
at the bootstrap and names one per request (`X-data-parallel-rank`); D pulls from the engine
named. Outputs equal a server's alone, both P ranks served, and D loaded the prompts from P. vLLM's toy
proxy protocol (a bare `do_remote_decode` to P, no rank named: P's API server balances; P's
answer, naming the engine that prefilled, forwarded to D) gets the same tokens."""

from __future__ import annotations

import json
import time
import urllib.request

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, explain, free_port, post, prompt_of

BLOCK = 32
MAX_TOKENS = 8
#: D's pull deadline: P's prefill runs inside it, on a core P's two engines share.
D_PULL_TIMEOUT_S = 90


def _query(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=10) as r:
        return json.loads(r.read())


def test_p_with_two_data_parallel_engines_behind_the_proxy(model_dir, pdflow_bin, log_dir):
    port = free_port()
    p_cfg = connector_config("kv_producer", extra={"bootstrap_port": port}, engine_id="p-dp")
    p = VllmServer("p-dp2", model_dir, log_dir, core=0, block_size=BLOCK, kv_transfer_config=p_cfg,
                   env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
                   extra_args=["--data-parallel-size", "2", "--data-parallel-backend", "mp"])  # fmt: skip
    d_cfg = connector_config("kv_consumer", policy="fail", extra={"pull_timeout_s": D_PULL_TIMEOUT_S}, engine_id="d-dp")
    d = VllmServer("d-dp1", model_dir, log_dir, core=1, block_size=BLOCK, kv_transfer_config=d_cfg)
    proxy = None
    try:
        cluster.start_all([p, d])
        table = _query(port)
        assert sorted(table) == ["0", "1"], f"one entry per dp rank: {table}"
        assert [table[r]["engine_id"] for r in ("0", "1")] == ["p-dp_dp0", "p-dp_dp1"], table
        proxy = PdflowProxy("proxy-dp", [(p.url, port)], [d.url], log_dir)
        proxy.wait_ready(time.monotonic() + 60)
        src = "vllm:prompt_tokens_by_source_total"
        before = d.metric(src, source="external_kv_transfer")
        for i, length in enumerate((40, 3 * BLOCK + 5, 70, 2 * BLOCK)):
            prompt = prompt_of(length, seed=8000 + i)
            reference = completion_tokens(d.url, prompt, MAX_TOKENS)
            body = {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            status, out = post(proxy.url + "/v1/completions", body)
            assert status == 200, f"request {i}: HTTP {status}: {out}\n{explain(p, d, proxy)}"
            assert out["choices"][0]["token_ids"] == reference, i
        assert d.metric(src, source="external_kv_transfer") > before, "D loaded the prompts from P"
        # The proxy alternates the ranks: each P engine prefilled (vLLM labels its metrics per engine).
        served = {}
        for key, value in p.metrics().items():
            if key.startswith("vllm:request_success_total{"):
                engine = key.split('engine="')[1].split('"')[0] if 'engine="' in key else "?"
                served[engine] = served.get(engine, 0.0) + value
        assert len([v for v in served.values() if v > 0]) == 2, f"both P ranks served: {served}"
        named = set()
        for i in range(4):
            prompt = prompt_of(50 + 9 * i, seed=8100 + i)
            status, out = post(p.url + "/v1/completions",
                               {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})  # fmt: skip
            assert status == 200, f"{out}\n{explain(p)}"
            params = out.get("kv_transfer_params") or {}
            assert params.get("remote_engine_id") in ("p-dp_dp0", "p-dp_dp1"), out
            named.add(params["remote_engine_id"])
            got = completion_tokens(d.url, prompt, MAX_TOKENS, kv_transfer_params=params)
            assert got == completion_tokens(d.url, prompt, MAX_TOKENS), f"toy protocol, request {i}"
        assert named == {"p-dp_dp0", "p-dp_dp1"}, f"P's API server balanced over both engines: {named}"
    finally:
        if proxy:
            proxy.stop()
        for s in (d, p):
            s.stop()
