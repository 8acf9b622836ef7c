"""Pipeline parallelism inside real `vllm serve` (the CPU build): P at PP 2 → D at PP 1 and P at
PP 1 → D at PP 2, through `pdflow proxy`. Each stage is its own worker process holding its share
of the layers (vLLM's default split: layers 0–1 and 2–3 of the tiny model's 4); it registers at
P's bootstrap under its pp_rank, and each D stage pulls its layers from the P stages holding them.
The outputs equal a server's alone, and D loads the prompt from P.

vLLM's CPU build runs PP only with the model compiled (`eager=False`): under `--enforce-eager` it
skips the warm-up run that allocates a later stage's activation buffer, and that stage fails its
first step (docs/vllm-cpu.md). Every server here is compiled alike, so greedy tokens compare
exactly. A PP 2 and a PP 1 server (`kv_both`) serve both directions: one start-up for both."""

from __future__ import annotations

import time

import pytest

import cluster
from cluster import completion_tokens, explain, post, prompt_of

BLOCK = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pp_servers(model_dir, pdflow_bin, log_dir):
    """A PP 2 and a PP 1 server (`kv_both`): one start-up for 2 → 1 and 1 → 2."""
    ways = cluster.BothWays("pp", model_dir, log_dir, block_size=BLOCK, parallel_flag="--pipeline-parallel-size",
                            big=2, eager=False)  # fmt: skip
    yield ways.start()
    ways.stop()


@pytest.mark.parametrize("p_pp,d_pp", [(2, 1), (1, 2)])
def test_pp_between_p_and_d_outputs_equal_one_server(pp_servers, p_pp, d_pp):
    with pp_servers.p_to_d(p_pp, d_pp) as (p, d, proxy):
        src = "vllm:prompt_tokens_by_source_total"
        before = d.metric(src, source="external_kv_transfer")
        for length in (40, 3 * BLOCK + 5):
            prompt = prompt_of(length, seed=7200 + length)
            reference = completion_tokens(d.url, prompt, MAX_TOKENS)
            started = time.monotonic()
            status, out = post(proxy.url + "/v1/completions", cluster.greedy_body(prompt, MAX_TOKENS))
            took = time.monotonic() - started
            assert status == 200, f"{length} tokens: HTTP {status} after {took:.1f} s: {out}\n{explain(p, d, proxy)}"
            assert out["choices"][0]["token_ids"] == reference, length
        assert d.metric(src, source="external_kv_transfer") > before, "D loaded the prompts from P"
        stages = pp_servers.servers[2]
        assert stages.log_text().count("pdflow connector registered 2 KV regions") == 2, "each stage registered its 2 layers"
