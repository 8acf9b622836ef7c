"""Tensor parallelism inside real `vllm serve` (the CPU build): P at TP 2 → D at TP 1, P at TP 1 →
D at TP 2 and TP 2 on both, through `pdflow proxy`. Each rank of a TP 2 server is its own worker
process with half the model's KV heads; each D rank pulls its heads from the P ranks holding them.
The outputs equal a server's alone, and D loads the prompt from P. A model with one KV head at
TP 2 holds a replica of it on each rank: one P rank sends it, and the D rank reads it once.

A TP 2 and a TP 1 server (`kv_both`, each with its own bootstrap) serve both directions of a
model: one start-up for 2 → 1 and 1 → 2."""

from __future__ import annotations

import time

import pytest

import cluster
import make_model
from cluster import VllmServer, completion_tokens, explain, post, prompt_of

BLOCK = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["tiny", "one-kv-head"])
def tp_servers(request, model_dir, pdflow_bin, log_dir):
    """A TP 2 and a TP 1 server of the tiny model, or of one with a single KV head (replicated on
    both TP 2 ranks)."""
    if request.param == "tiny":
        model, tag = model_dir, "tp"
    else:
        model = cluster.REPO / "target" / "vllm-models" / "one-kv-head"
        make_model.make(str(model), "one-kv-head")
        tag = "tp-1kv-"
    ways = cluster.BothWays(tag, model, log_dir, block_size=BLOCK, parallel_flag="--tensor-parallel-size", big=2)
    yield ways.start()
    ways.stop()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_tp_between_p_and_d_outputs_equal_one_server(tp_servers, p_tp, d_tp):
    with tp_servers.p_to_d(p_tp, d_tp) as (p, d, proxy):
        # A TP 1 server alone (a request without kv_transfer_params runs where it is sent).
        _outputs_equal(p, d, proxy, reference_url=tp_servers.servers[1].url)


@pytest.mark.parametrize("tp_servers", ["tiny"], indirect=True)
def test_tp_2_on_both_sides_outputs_equal_one_server(tp_servers, log_dir):
    """P is the fixture's TP 2 server; D a TP 2 server of its own."""
    p, port = tp_servers.servers[2], tp_servers.ports[2]
    d = cluster.sharded_server("d-tp2", p.model, log_dir, "kv_consumer", core=1, block_size=BLOCK,
                               parallel_flag="--tensor-parallel-size", size=2)  # fmt: skip
    with cluster.p_and_d_behind_proxy(p, d, port, log_dir, "proxy-tp22", stop_p=False) as proxy:
        # A TP 2 server alone.
        _outputs_equal(p, d, proxy, reference_url=p.url)


def _outputs_equal(p: VllmServer, d: VllmServer, proxy, reference_url: str) -> None:
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
