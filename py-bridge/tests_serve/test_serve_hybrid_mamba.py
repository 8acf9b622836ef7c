"""A Granite-4.0-H-shaped Mamba2 hybrid (`make_model.py --shape granite-hybrid`: three Mamba2
layers and one attention layer) inside real `vllm serve` (the CPU build) with vLLM's hybrid
KV-cache allocator on, block 64, prefix caching off (vLLM's CPU build needs it off for Mamba):
four KV-cache groups, one state page per Mamba group. P prefills all but the last prompt token;
D loads that state and the attention blocks, and computes the last token itself, so each state
advances past it exactly once.

What a user checks: greedy outputs through `pdflow proxy` equal a server alone; D computed one
prompt token of each request; P's step 29 moved one page per state group and the attention
group's blocks; a P that dies while D needs its KV (`recompute` serves the right tokens, `fail`
errors, the engine stays up); both engines back to no block held.
"""

from __future__ import annotations

import pytest

import hybrid_cluster
from hybrid_cluster import assert_through_proxy_equals_alone, killed_p_then_decode, no_block_held

BLOCK = 64


@pytest.fixture(scope="module")
def granite(pdflow_bin, log_dir):
    h = hybrid_cluster.start("granite-hybrid", BLOCK, log_dir, ["--no-enable-prefix-caching"])
    yield h
    hybrid_cluster.stop(h)


def test_granite_shaped_mamba2_hybrid_through_the_proxy_equals_a_server_alone(granite):
    writes = assert_through_proxy_equals_alone(granite, [40, 65, 300, 700], seed=5100)
    for length, span in writes:
        groups = [int(n) for n in span["tags"]["pd.group_blocks"].split(",")]
        # Three state groups (one page each) and the attention group's blocks.
        assert groups.count(1) >= 3 and sum(groups) == 3 + -(-(length - 1) // BLOCK), f"{length} tokens: {groups}"
    no_block_held(granite.p, granite.d)


def test_zz_granite_shaped_p_killed_while_d_needs_its_kv(granite):
    killed_p_then_decode(granite, seed=5300)
