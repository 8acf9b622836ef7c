"""A Qwen3.5-shaped Gated DeltaNet hybrid (`make_model.py --shape qwen3_5`: three GDN linear-attention
layers and one gated full-attention layer, bfloat16) inside real `vllm serve` (the CPU build) with
vLLM's hybrid KV-cache allocator on and vLLM's defaults (prefix caching on, Mamba cache mode
`align`): four KV-cache groups of block 128 (vLLM raises the attention block until its page holds
a GDN state page). P prefills all but the last prompt token; D loads the GDN states and the
attention blocks, and computes the last token itself, so each state advances past it exactly once.

bfloat16 because vLLM's CPU GDN kernel takes nothing else (`CPU GDN attention requires BF16`);
`--dtype bfloat16` comes after the `--dtype float32` every test server gets (the later one counts).
The model's head_dim 80 keeps vLLM's CPU attention on its portable kernel on AMX CPUs too
(`make_model.py`).

What a user checks: greedy outputs through `pdflow proxy` equal a server alone; D computed one
prompt token of each request; P's step 29 moved the attention group's blocks and a state page per
GDN group; a P that dies while D needs its KV (`recompute` serves the right tokens, `fail`
errors, the engine stays up); both engines back to no block held.
"""

from __future__ import annotations

import pytest

import hybrid_cluster
from cluster import completion_tokens, prompt_of
from hybrid_cluster import MAX_TOKENS, assert_through_proxy_equals_alone, killed_p_then_decode, no_block_held, sources

BLOCK = 128
GDN_LAYERS = 3
#: bf16 logits here move in steps of 0.125: two steps apart is clear of a rounding swap.
TIE_MARGIN = 0.3
#: Tokens compared over the module's prompts, at least: the check is not all ties.
MIN_COMPARED = 24


@pytest.fixture(scope="module")
def qwen3_5(pdflow_bin, log_dir):
    h = hybrid_cluster.start("qwen3_5", BLOCK, log_dir, ["--dtype", "bfloat16"], tie_margin=TIE_MARGIN)
    yield h
    hybrid_cluster.stop(h)


def test_qwen3_5_shaped_gdn_hybrid_through_the_proxy_equals_a_server_alone(qwen3_5):
    # bf16: D computes the last prompt token on its own (one token on the loaded state) where a
    # server alone computes it inside the prompt; logits are bf16 (steps of 0.125 at this model's
    # magnitudes) and come out a step apart, so a greedy token at a near tie can part (the
    # 700-token prompt of this seed: ' wz' and 'mxqk' both -1.248 alone; -1.325 and -1.200 after
    # P → D). Tokens are compared up to P alone's first near tie (TIE_MARGIN).
    writes = assert_through_proxy_equals_alone(qwen3_5, [40, BLOCK + 1, 300, 520, 700], seed=5500)
    assert qwen3_5.compared >= MIN_COMPARED, f"only {qwen3_5.compared} tokens were clear of ties"
    for length, span in writes:
        groups = [int(n) for n in span["tags"]["pd.group_blocks"].split(",")]
        attention = -(-(length - 1) // BLOCK)
        # Three GDN groups (one state page each) and the attention group's blocks.
        assert len(groups) == GDN_LAYERS + 1, f"{length} tokens: {groups}"
        assert groups.count(1) >= GDN_LAYERS and sum(groups) == GDN_LAYERS + attention, f"{length} tokens: {groups}"
    no_block_held(qwen3_5.p, qwen3_5.d)


def test_qwen3_5_shaped_prompts_d_has_seen_load_what_d_lacks_and_compute_at_least_one_token(qwen3_5):
    # D's prefix cache after loaded prompts (vLLM's `align` mode keeps GDN states at block
    # boundaries D computed): the same prompt again, and one sharing its first blocks, come out as
    # P alone's, D loading at most what its cache lacks and never left with zero tokens to compute
    # (vLLM #53514: Mamba's N-1 with a local hit).
    first = prompt_of(4 * BLOCK + 26, seed=5600)
    second = first[: 4 * BLOCK] + prompt_of(60, seed=5602)
    for what, prompt in (("first", first), ("the same again", first), ("sharing 4 blocks", second)):
        local, external = sources(qwen3_5.d)
        got = completion_tokens(qwen3_5.proxy.url, prompt, MAX_TOKENS)
        qwen3_5.assert_as_alone(got, prompt, what)
        local_after, external_after = sources(qwen3_5.d)
        computed, loaded = local_after - local, external_after - external
        assert computed >= 1, f"{what}: D computed no prompt token (loaded {loaded})"
        assert computed + loaded <= len(prompt), f"{what}: D computed {computed} and loaded {loaded} of {len(prompt)}"
    no_block_held(qwen3_5.p, qwen3_5.d)


def test_qwen3_5_shaped_partial_prefix_hit_on_d_loads_only_what_d_lacks(qwen3_5):
    # D computed a prompt alone (its GDN states cached at block boundaries, vLLM's `align` mode,
    # and its attention blocks): a P/D request sharing its first 4 blocks hits them in every group
    # on D, which loads from P the attention blocks after them and the GDN states at N - 1.
    first = prompt_of(4 * BLOCK + 40, seed=5700)
    second = first[: 4 * BLOCK] + prompt_of(50, seed=5702)
    assert completion_tokens(qwen3_5.d.url, first, MAX_TOKENS)
    local, external = sources(qwen3_5.d)
    got = completion_tokens(qwen3_5.proxy.url, second, MAX_TOKENS)
    qwen3_5.assert_as_alone(got, second, "sharing 4 blocks D computed")
    local_after, external_after = sources(qwen3_5.d)
    computed, loaded = local_after - local, external_after - external
    assert (computed, loaded) == (1, len(second) - 1 - 4 * BLOCK), (
        f"D computed {computed} and loaded {loaded} of {len(second)} tokens with 4 blocks cached"
    )
    no_block_held(qwen3_5.p, qwen3_5.d)


def test_zz_qwen3_5_shaped_p_killed_while_d_needs_its_kv(qwen3_5):
    killed_p_then_decode(qwen3_5, seed=5730)
