"""Multi-head latent attention inside real `vllm serve` (the CPU build, its CPU_MLA backend): a
DeepSeek-V2-shaped model whose every layer caches one latent of 576 values per token
(`make_model.py --shape mla`). pdflow registers each layer's `[num_blocks, block_size, 576]` cache
as one "head"; at tensor-parallel size 2 each rank holds the whole latent, so one P rank sends it
to each D rank. P → D through `pdflow proxy` at TP 2 → 1 and 1 → 2 (each side at TP 1 once), with
`verify_checksums` (D checks every block it loads against P's digests): D loads the prompt from P
and continues as a server alone does. A TP 2 and a TP 1 server (`kv_both`) serve both directions:
one start-up for both.

"As a server alone" is checked to the float rounding of vLLM's MLA. A server alone attends over
the whole prompt in one prefill (the latent up-projected, SDPA); a D that loaded the prompt computes
its last token as a decode over the cache (the absorbed kernel); at TP 2 the all-reduces round
differently again. On this model those paths move a token's logprob by up to ~0.3, and a TP 2
server parts from a TP 1 one at a margin of 0.54 (vLLM's own ExampleConnector loads and the two
servers alone: docs/vllm-cpu.md), so a near tie can break the other way. Checked: the first token
is the server's, and every token is, up to the first position where the server's best two are
within `TIE_MARGIN`. A P whose KV is not the
prompt's (another model's weights) fails this at the first or second token."""

from __future__ import annotations

import time

import pytest

import cluster
import make_model
from cluster import explain, post, prompt_of

#: vLLM's CPU MLA kernel runs block size 16 only (the platform forces it for MLA models).
BLOCK = 16
MAX_TOKENS = 12
TIE_MARGIN = 1.0
#: vLLM's CPU build prefers its AMX MLA backend on CPUs with AMX, which takes bf16 weights only
#: ("expect weight to be bfloat16, …" at start-up); the portable CPU_MLA runs the float32 model.
CPU_MLA = ["--attention-backend", "CPU_MLA"]
#: Tokens compared over the test's prompts, at least: the check is not all ties.
MIN_COMPARED = 12


@pytest.fixture(scope="module")
def mla_model():
    out = cluster.REPO / "target" / "vllm-models" / "mla"
    make_model.make(str(out), "mla")
    return out


@pytest.fixture(scope="module")
def mla_servers(mla_model, pdflow_bin, log_dir):
    """A TP 2 and a TP 1 server (`kv_both`): one start-up for 2 → 1 and 1 → 2."""
    ways = cluster.BothWays("mla-tp", mla_model, log_dir, block_size=BLOCK, parallel_flag="--tensor-parallel-size", big=2,
                            args=CPU_MLA)  # fmt: skip
    yield ways.start()
    ways.stop()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_mla_between_p_and_d_continues_as_one_server(mla_servers, p_tp, d_tp):
    with mla_servers.p_to_d(p_tp, d_tp) as (p, d, proxy):
        assert "CPU_MLA" in d.log_text(), "D runs vLLM's MLA attention backend"
        # D alone (a request without kv_transfer_params runs where it is sent): its TP rounds as
        # D's decode does; a TP 2 server and a TP 1 one alone part at margins of ~0.5 here.
        reference_url = d.url
        src = "vllm:prompt_tokens_by_source_total"
        before = d.metric(src, source="external_kv_transfer")
        compared = 0
        for length in (40, 3 * BLOCK + 5, 8 * BLOCK, BLOCK + 1, 70, 100):
            body = cluster.greedy_body(prompt_of(length, seed=7100 + length), MAX_TOKENS, logprobs=2)
            status, alone = post(reference_url + "/v1/completions", body)
            assert status == 200, f"{reference_url}: HTTP {status}: {alone}"
            started = time.monotonic()
            status, out = post(proxy.url + "/v1/completions", body)
            took = time.monotonic() - started
            assert status == 200, f"{length} tokens: HTTP {status} after {took:.1f} s: {out}\n{explain(p, d, proxy)}"
            compared += _assert_continues_as(alone["choices"][0], out["choices"][0], length)
        assert compared >= MIN_COMPARED, f"only {compared} tokens were clear of ties"
        assert d.metric(src, source="external_kv_transfer") > before, "D loaded the prompts from P"


def _assert_continues_as(alone: dict, pd: dict, length: int) -> int:
    """`pd`'s tokens are `alone`'s: the first, and every one before `alone`'s first near tie.
    Returns how many were compared."""
    want, got = alone["token_ids"], pd["token_ids"]
    assert got[0] == want[0], f"{length} tokens: first token {got[0]}, a server alone gives {want[0]} ({got} vs {want})"
    for i, top in enumerate(alone["logprobs"]["top_logprobs"]):
        best = sorted(top.values(), reverse=True)
        if i > 0 and len(best) > 1 and best[0] - best[1] < TIE_MARGIN:
            return i
        assert got[i] == want[i], f"{length} tokens: token {i} is {got[i]}, a server alone gives {want[i]} ({got} vs {want})"
    return len(want)
