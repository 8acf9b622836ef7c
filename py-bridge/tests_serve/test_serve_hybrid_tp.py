"""A hybrid model between tensor-parallel engines inside real `vllm serve` (the CPU build): the
Gemma-3-shaped model (`make_model.py --shape gemma3`, sliding window 128 beside full attention,
block 32) with P and D at TP 2, each rank's pages moved to the D rank of the same index. (P refuses
a D of another size, whose pages are another shape's: `send_worker`'s unit tests.)

What a user checks: greedy outputs through `pdflow proxy` equal P alone, D computed one prompt
token, no block held after.
"""

from __future__ import annotations

import time

import pytest

import cluster
import make_model
from cluster import PdflowProxy, completion_tokens, free_port, prompt_of, wait_until

BLOCK = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(pdflow_bin, log_dir):
    model = cluster.REPO / "target" / "vllm-models" / "gemma3"
    make_model.make(str(model), "gemma3")
    port = free_port()
    tp = "--tensor-parallel-size"
    p = cluster.sharded_server("hp2", model, log_dir, "kv_producer", core=0, block_size=BLOCK, parallel_flag=tp,
                               size=2, extra={"bootstrap_port": port})  # fmt: skip
    d = cluster.sharded_server("hd2", model, log_dir, "kv_consumer", core=1, block_size=BLOCK, parallel_flag=tp, size=2)
    all_ = [p, d]
    try:
        cluster.start_all(all_)
        cluster.warm_up(*all_)
        yield p, d, port
    finally:
        for s in all_:
            s.stop()


def _proxy(p, d, port, log_dir) -> PdflowProxy:
    proxy = PdflowProxy(f"proxy-{p.name}-{d.name}", [(p.url, port)], [d.url], log_dir)
    proxy.wait_ready(time.monotonic() + 60)
    return proxy


def _usage_zero(*servers) -> None:
    for s in servers:
        wait_until(lambda: s.metric("vllm:kv_cache_usage_perc") == 0.0, f"{s.name}: no KV block held", timeout=60)


def test_gemma3_shaped_between_tp2_engines_equals_p_alone(servers, log_dir):
    p, d, port = servers
    proxy = _proxy(p, d, port, log_dir)
    try:
        src = "vllm:prompt_tokens_by_source_total"
        for length in (300, 3 * BLOCK + 1):
            prompt = prompt_of(length, seed=6100 + length)
            want = completion_tokens(p.url, prompt, MAX_TOKENS)
            local, external = d.metric(src, source="local_compute"), d.metric(src, source="external_kv_transfer")
            got = completion_tokens(proxy.url, prompt, MAX_TOKENS)
            assert got == want, f"{length} tokens: through the proxy {got}, P alone {want}\n{cluster.explain(p, d, proxy)}"
            computed = d.metric(src, source="local_compute") - local
            loaded = d.metric(src, source="external_kv_transfer") - external
            assert (computed, loaded) == (1, length - 1), f"{length} tokens: D computed {computed}, loaded {loaded}"
    finally:
        proxy.stop()
    _usage_zero(p, d)
