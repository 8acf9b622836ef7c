"""A Gemma-3-shaped model (`make_model.py --shape gemma3`: layers sliding, sliding, full × 2,
sliding window 128, block 32) inside real `vllm serve` (the CPU build) with vLLM's hybrid
KV-cache allocator on: three KV-cache groups (two of sliding window, one of full attention) over
one buffer, in which one layer of each group shares each page. D loads every full-attention block
it lacks and, of each sliding-window group, only the blocks that cover the window.

What a user checks: greedy outputs through `pdflow proxy` equal a server alone; D computed one
prompt token of each request (vLLM's own counters); P's step 29 moved the window's blocks, not
the prompt's (its span's blocks per group, and its bytes); a partial prefix hit on D loads only
what D lacks; a P that dies while D needs its KV (`recompute` serves the right tokens, `fail`
errors, the engine stays up); both engines back to no block held.
"""

from __future__ import annotations

import pytest

import hybrid_cluster
from cluster import completion_tokens, prompt_of
from hybrid_cluster import MAX_TOKENS, assert_through_proxy_equals_alone, killed_p_then_decode, no_block_held, sources


@pytest.fixture(scope="module")
def gemma3(pdflow_bin, log_dir):
    h = hybrid_cluster.start("gemma3", GEMMA_BLOCK, log_dir, [])
    yield h
    hybrid_cluster.stop(h)


WINDOW, GEMMA_BLOCK, GEMMA_PAGE, GEMMA_PAGES_PER_BLOCK = 128, 32, 32 * 1024, 2


def test_gemma3_shaped_through_the_proxy_equals_a_server_alone_moving_the_window_only(gemma3):
    writes = assert_through_proxy_equals_alone(gemma3, [40, 3 * GEMMA_BLOCK + 1, 300, 700], seed=4100)
    window_blocks = -(-WINDOW // GEMMA_BLOCK) + 1
    for length, span in writes:
        loaded = -(-(length - 1) // GEMMA_BLOCK)
        groups = [int(n) for n in span["tags"]["pd.group_blocks"].split(",")]
        # vLLM orders the groups sliding, sliding, full.
        assert groups[2] == loaded, f"{length} tokens: full attention moved {groups[2]} blocks of {loaded}"
        assert all(0 < n <= min(window_blocks, loaded) for n in groups[:2]), f"{length} tokens: the window moved {groups[:2]}"
        # Each block id is a page of every buffer: one layer of each group shares a page.
        assert int(span["tags"]["pd.bytes"]) == sum(groups) * GEMMA_PAGES_PER_BLOCK * GEMMA_PAGE
    long_groups = [int(n) for n in writes[-1][1]["tags"]["pd.group_blocks"].split(",")]
    assert sum(long_groups[:2]) == 2 * window_blocks, f"a 700-token prompt moves the window's blocks: {long_groups}"
    no_block_held(gemma3.p, gemma3.d)


def test_gemma3_shaped_partial_prefix_hit_on_d_loads_only_what_d_lacks(gemma3):
    # D holds of a loaded prompt its full-attention blocks and only the window's sliding blocks,
    # so its prefix cache hits a later prompt that shares the earlier one up to its last blocks
    # (as a sliding-window hit needs the window before the hit): here 10 of 10.8 blocks.
    first = prompt_of(10 * GEMMA_BLOCK + 26, seed=4200)
    second = first[: 10 * GEMMA_BLOCK] + prompt_of(60, seed=4202)
    assert completion_tokens(gemma3.proxy.url, first, MAX_TOKENS) == gemma3.reference(first)
    local, external = sources(gemma3.d)
    assert completion_tokens(gemma3.proxy.url, second, MAX_TOKENS) == gemma3.reference(second)
    local_after, external_after = sources(gemma3.d)
    loaded = external_after - external
    assert loaded == len(second) - 1 - 10 * GEMMA_BLOCK, f"D loaded {loaded} of {len(second)} tokens, not what its prefix cache lacks"
    no_block_held(gemma3.p, gemma3.d)


def test_zz_gemma3_shaped_p_killed_while_d_needs_its_kv(gemma3):
    killed_p_then_decode(gemma3, seed=4300)
