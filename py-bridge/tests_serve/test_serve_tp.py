"""Tensor parallelism inside real `vllm serve` (the CPU build): P at TP 2 → D at TP 1, P at TP 1 →
D at TP 2 and TP 2 on both, through `pdflow proxy`. Each rank of a TP 2 server is its own worker
process with half the model's KV heads; each D rank pulls its heads from the P ranks holding them.
The outputs equal a server's alone, and D loads the prompt from P. A model with one KV head at
TP 2 holds a replica of it on each rank: one P rank sends it, and the D rank reads it once."""

from __future__ import annotations

import time

import pytest

import cluster
import make_model
from cluster import VllmServer, completion_tokens, explain, free_port, post, prompt_of

BLOCK = 32
MAX_TOKENS = 12


def _server(name, model_dir, log_dir, role: str, tp: int, core: int, **extra) -> VllmServer:
    return cluster.sharded_server(name, model_dir, log_dir, role, core=core, block_size=BLOCK,
                                  parallel_flag="--tensor-parallel-size", size=tp, extra=extra)  # fmt: skip


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2)])
def test_tp_between_p_and_d_outputs_equal_one_server(model_dir, pdflow_bin, log_dir, p_tp, d_tp):
    _p_to_d_equals_one_server(model_dir, log_dir, p_tp, d_tp, "")


@pytest.fixture(scope="module")
def one_kv_head_model():
    out = cluster.REPO / "target" / "vllm-models" / "one-kv-head"
    make_model.make(str(out), "one-kv-head")
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_replicated_kv_head_between_p_and_d(one_kv_head_model, pdflow_bin, log_dir, p_tp, d_tp):
    _p_to_d_equals_one_server(one_kv_head_model, log_dir, p_tp, d_tp, "-1kv")


def _p_to_d_equals_one_server(model_dir, log_dir, p_tp: int, d_tp: int, tag: str) -> None:
    port = free_port()
    p = _server(f"p-tp{p_tp}{tag}", model_dir, log_dir, "kv_producer", p_tp, 0, bootstrap_port=port)
    d = _server(f"d-tp{d_tp}{tag}", model_dir, log_dir, "kv_consumer", d_tp, 1)
    with cluster.p_and_d_behind_proxy(p, d, port, log_dir, f"proxy-tp{p_tp}{d_tp}{tag}") as proxy:
        # A TP 1 server alone (a request without kv_transfer_params runs where it is sent); at
        # TP 2 on both sides, a TP 2 server alone.
        reference_url = d.url if d_tp == 1 else p.url
        src = "vllm:prompt_tokens_by_source_total"
        before = d.metric(src, source="external_kv_transfer")
        for length in (40, 3 * BLOCK + 5):
            prompt = prompt_of(length, seed=7000 + length)
            reference = completion_tokens(reference_url, prompt, MAX_TOKENS)
            started = time.monotonic()
            status, body = post(proxy.url + "/v1/completions", cluster.greedy_body(prompt, MAX_TOKENS))
            took = time.monotonic() - started
            assert status == 200, f"{length} tokens: HTTP {status} after {took:.1f} s: {body}\n{explain(p, d, proxy)}"
            assert body["choices"][0]["token_ids"] == reference, length
        assert d.metric(src, source="external_kv_transfer") > before, "D loaded the prompts from P"
