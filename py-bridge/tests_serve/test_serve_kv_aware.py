"""`pdflow proxy` with the `kv_aware` policy in front of real `vllm serve` engines (the CPU build)
with PdflowConnector and vLLM's KV events (`--kv-events-config`, with a replay socket): two P
and one D. What a user checks: a repeated prefix, given as token ids, goes to the P whose prefix
cache holds it — P's own counters show the hit —, and a proxy started with
`--local-prefill-when-d-holds` (learning D's cache from its replay socket) lets D alone serve a
prompt whose prefix D holds, with the same greedy tokens as through P.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, free_port, prompt_of, wait_until

BLOCK = 128
MAX_TOKENS = 8
#: Four full blocks shared by every prompt of the test, then a few tokens of each prompt's own.
PREFIX = prompt_of(4 * BLOCK, seed=4242)


def kv_events_config(port: int, replay_port: int) -> str:
    """vLLM's `--kv-events-config`: events on a PUB socket and kept for replay."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


class Engine:
    """A `vllm serve` with PdflowConnector and KV events, and its `--kv-events` for the proxy."""

    def __init__(self, name: str, role: str, model, log_dir, *, core: int):
        self.events, self.replay = free_port(), free_port()
        self.bootstrap_port = free_port() if role == "kv_producer" else None
        extra = {"bootstrap_port": self.bootstrap_port} if self.bootstrap_port else {}
        cfg = connector_config(role, policy=None if role == "kv_producer" else "recompute", extra=extra)
        args = ["--kv-events-config", kv_events_config(self.events, self.replay)]
        self.server = VllmServer(name, model, log_dir, core=core, block_size=BLOCK, kv_transfer_config=cfg,
                                 extra_args=args)  # fmt: skip

    @property
    def url(self) -> str:
        return self.server.url

    def kv_events_arg(self) -> list[str]:
        return ["--kv-events", f"{self.url}=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay}"]

    def finished(self) -> float:
        return self.server.metric("vllm:request_success_total")


class KvAware:
    def __init__(self, prefill: list[Engine], decode: Engine, log_dir):
        self.prefill, self.decode, self.log_dir = prefill, decode, log_dir

    def proxy(self, name: str, *extra: str) -> PdflowProxy:
        # Every request through P unless the test says otherwise (D alone is on by default here).
        alone = [] if "--local-prefill-when-d-holds" in extra else ["--local-prefill-when-d-holds", "off"]
        args = ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", *alone, *extra]
        for e in [*self.prefill, self.decode]:
            args += e.kv_events_arg()
        p = [(e.url, e.bootstrap_port) for e in self.prefill]
        proxy = PdflowProxy(name, p, [self.decode.url], self.log_dir, extra_args=args)
        proxy.wait_ready(time.monotonic() + 60)
        return proxy


@pytest.fixture(scope="module")
def engines(model_dir, pdflow_bin, log_dir):
    # Two P, one on each core; D shares the second core (only one engine computes at a time here).
    p0 = Engine("prefill0", "kv_producer", model_dir, log_dir, core=0)
    p1 = Engine("prefill1", "kv_producer", model_dir, log_dir, core=1)
    d = Engine("decode", "kv_consumer", model_dir, log_dir, core=1)
    servers = [p0.server, p1.server, d.server]
    try:
        cluster.start_all(servers)
        cluster.warm_up(*servers)
        yield KvAware([p0, p1], d, log_dir)
    finally:
        for s in servers:
            s.stop()


def proxy_metric(proxy: PdflowProxy, family: str, **labels: str) -> float:
    """The sum of the proxy's samples of `family` whose labels include `labels`."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rpartition(" ")[2])
    return total


def learned(proxy: PdflowProxy, engine: Engine) -> None:
    """Waits until the proxy applied KV events of `engine`."""
    wait_until(
        lambda: proxy_metric(proxy, "pdflow_proxy_kv_events_total", engine=engine.url, outcome="applied") > 0,
        f"the proxy applied KV events of {engine.url}",
        timeout=60,
    )


def prompt(turn: int) -> list[int]:
    return PREFIX + prompt_of(16, seed=100 + turn)


def test_a_repeated_prefix_goes_to_the_p_that_holds_it_and_d_alone_serves_what_it_holds(engines):
    proxy = engines.proxy("proxy-kv-aware")
    try:
        before = [p.finished() for p in engines.prefill]
        first = completion_tokens(proxy.url, prompt(0), MAX_TOKENS)
        counts = wait_until(
            lambda: (lambda d: d if sum(d) >= 1 else None)([p.finished() - b for p, b in zip(engines.prefill, before)]),
            "P's finished request count",
        )
        x = counts.index(1)
        holder = engines.prefill[x]
        learned(proxy, holder)
        learned(proxy, engines.decode)

        src = "vllm:prompt_tokens_by_source_total"
        hits0 = holder.server.metric(src, source="local_cache_hit")
        for turn in (1, 2):
            completion_tokens(proxy.url, prompt(turn), MAX_TOKENS)
        want = [0, 0]
        want[x] = 3
        wait_until(
            lambda: [p.finished() - b for p, b in zip(engines.prefill, before)] == want,
            f"every request of the prefix prefilled on {holder.server.name}",
        )
        assert proxy_metric(proxy, "pdflow_proxy_routes_total", pool="prefill", choice="kv_hit") == 2
        hits = wait_until(
            lambda: (holder.server.metric(src, source="local_cache_hit") - hits0) or None, "P's prefix-cache hits"
        )
        assert hits >= 2 * 4 * BLOCK, f"{holder.server.name} computed the shared prefix again ({hits} tokens hit)"
    finally:
        proxy.stop()

    # A proxy started now knows D's cache from D's replay socket: D alone serves the prefix.
    alone = engines.proxy("proxy-d-alone", "--local-prefill-when-d-holds", "0.8")
    try:
        learned(alone, engines.decode)
        before = [p.finished() for p in engines.prefill]
        d_before = engines.decode.finished()
        tokens = completion_tokens(alone.url, prompt(0), MAX_TOKENS)
        assert tokens == first, "D alone answered other tokens than P and D together"
        wait_until(lambda: engines.decode.finished() > d_before, "D's finished request count")
        assert [p.finished() - b for p, b in zip(engines.prefill, before)] == [0, 0], "a P prefilled a prompt D holds"
        assert proxy_metric(alone, "pdflow_proxy_routes_total", pool="prefill", choice="skipped") == 1
        assert proxy_metric(alone, "pdflow_proxy_routes_total", pool="decode", choice="kv_hit") == 1
    finally:
        alone.stop()
