"""Real `vllm serve` engines for hybrid models (the CPU build, vLLM's hybrid KV-cache allocator on):
one P and two D per model (`kv_load_failure_policy` `recompute` and `fail`), `pdflow proxy` in
front of P and the first D, and what the hybrid tests (`test_serve_hybrid_*.py`) check on them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pdflow.traces import read_spans

import cluster
import make_model
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, explain, free_port, prompt_of, wait_until

MAX_TOKENS = 12
D_PULL_TIMEOUT_S = 8


@dataclass
class Hybrid:
    p: VllmServer
    d: VllmServer
    d_fail: VllmServer
    proxy: PdflowProxy
    ports: dict
    traces: Path
    #: bf16 models: tokens are compared up to the first position where P alone's best two are
    #: closer than this (a rounding apart can swap them); None: every token.
    tie_margin: Optional[float] = None
    #: Tokens compared so far (a test checks the comparison was not all ties).
    compared: int = 0

    def reference(self, prompt: list[int]) -> list[int]:
        # P alone computes the whole prompt itself (a request without kv_transfer_params).
        return completion_tokens(self.p.url, prompt, MAX_TOKENS)

    def alone(self, prompt: list[int]) -> dict:
        """P alone's greedy choice for `prompt`, with its top two logprobs per token."""
        status, alone = cluster.post(self.p.url + "/v1/completions", cluster.greedy_body(prompt, MAX_TOKENS, logprobs=2))
        assert status == 200, alone
        return alone["choices"][0]

    def assert_as_alone(self, got: list[int], prompt: list[int], what: str, alone: Optional[dict] = None) -> None:
        """`got` is P alone's greedy continuation of `prompt` (`alone`, when P answered it before),
        up to its first near tie with a `tie_margin`."""
        alone = alone or self.alone(prompt)
        want = alone["token_ids"]
        if self.tie_margin is None:
            assert got == want, f"{what}: {got}, P alone {want}\n{explain(self.p, self.d, self.proxy)}"
            self.compared += len(want)
            return
        for i, top in enumerate(alone["logprobs"]["top_logprobs"]):
            best = sorted(top.values(), reverse=True)
            if len(best) > 1 and best[0] - best[1] < self.tie_margin:
                break
            assert got[i] == want[i], f"{what}: token {i} is {got[i]}, P alone {want[i]} ({got} vs {want})"
            self.compared += 1

    def p_spans(self) -> list[dict]:
        return read_spans(str(self.traces / "p.json"))


def start(shape: str, block: int, log_dir: Path, args: list[str], tie_margin: Optional[float] = None) -> Hybrid:
    model = cluster.REPO / "target" / "vllm-models" / shape
    make_model.make(str(model), shape)
    traces = log_dir / "traces"
    traces.mkdir(exist_ok=True)
    ports = {"p": free_port()}

    def producer(name: str, core: int) -> VllmServer:
        cfg = connector_config("kv_producer", extra={"bootstrap_port": ports[name], "verify_checksums": True}, engine_id=name)
        return VllmServer(name, model, log_dir, core=core, block_size=block, kv_transfer_config=cfg, extra_args=args,
                          env={"PDFLOW_TRACE_FILE": str(traces / f"{name}.json")})  # fmt: skip

    def consumer(name: str, policy: str, core: int) -> VllmServer:
        cfg = connector_config("kv_consumer", policy=policy, extra={"pull_timeout_s": D_PULL_TIMEOUT_S, "verify_checksums": True})
        return VllmServer(name, model, log_dir, core=core, block_size=block, kv_transfer_config=cfg, extra_args=args)

    servers = [producer("p", 0), consumer("d", "recompute", 1), consumer("d_fail", "fail", 1)]
    try:
        cluster.start_all(servers)
        cluster.warm_up(*servers)
        proxy = PdflowProxy(f"proxy-{shape}", [(servers[0].url, ports["p"])], [servers[1].url], log_dir)
        proxy.wait_ready(time.monotonic() + 60)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return Hybrid(*servers, proxy=proxy, ports=ports, traces=traces, tie_margin=tie_margin)


def stop(h: Hybrid) -> None:
    h.proxy.stop()
    for s in (h.p, h.d, h.d_fail):
        s.stop()


def sources(d: VllmServer) -> tuple[float, float]:
    src = "vllm:prompt_tokens_by_source_total"
    return d.metric(src, source="local_compute"), d.metric(src, source="external_kv_transfer")


def write_span(h: Hybrid, before: int) -> dict:
    """P's step-29 span of the latest write, once there are more than `before`."""
    spans = []

    def found() -> bool:
        spans[:] = [s for s in h.p_spans() if s["step"] == 29]
        return len(spans) > before

    wait_until(found, "P's step-29 span in its trace file", timeout=30)
    return spans[-1]


def assert_through_proxy_equals_alone(h: Hybrid, lengths: list[int], seed: int) -> list[tuple[int, dict]]:
    """Each prompt through the proxy equals P alone, and D computed exactly its last token; returns
    (prompt length, P's step-29 span) per prompt."""
    out = []
    for length in lengths:
        prompt = prompt_of(length, seed=seed + length)
        writes_before = len([s for s in h.p_spans() if s["step"] == 29])
        local, external = sources(h.d)
        got = completion_tokens(h.proxy.url, prompt, MAX_TOKENS)
        h.assert_as_alone(got, prompt, f"{length} tokens through the proxy")
        local_after, external_after = sources(h.d)
        assert (local_after - local, external_after - external) == (1, length - 1), (
            f"{length} tokens: D computed {local_after - local} prompt tokens and loaded {external_after - external}"
        )
        out.append((length, write_span(h, writes_before)))
    return out


def no_block_held(*servers: VllmServer) -> None:
    for s in servers:
        wait_until(lambda: s.metric("vllm:kv_cache_usage_perc") == 0.0, f"{s.name}: no KV block held", timeout=30)


def killed_p_then_decode(h: Hybrid, seed: int) -> None:
    """P prefills two requests and holds their blocks, then dies (a module's last test); D
    `recompute` serves P alone's tokens, D `fail` an error, each within its deadline; both D serve
    on, and no block of any group stays held on either."""
    prompts = {name: prompt_of(300, seed=seed + i) for i, name in enumerate(("d", "d_fail"))}
    alone = h.alone(prompts["d"])
    transfers = {name: f"xfer-killed-{seed}-{name}" for name in prompts}
    for name, prompt in prompts.items():
        status, body = cluster.post(
            h.p.url + "/v1/completions",
            {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfers[name]}},
        )  # fmt: skip
        assert status == 200, body
    h.p.kill()
    for name, d in (("d", h.d), ("d_fail", h.d_fail)):
        params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfers[name],
                  "remote_engine_id": "p", "remote_bootstrap_addr": f"http://127.0.0.1:{h.ports['p']}"}  # fmt: skip
        started = time.monotonic()
        status, body = cluster.post(
            d.url + "/v1/completions", cluster.greedy_body(prompts[name], MAX_TOKENS, kv_transfer_params=params),
            timeout=D_PULL_TIMEOUT_S + 60,
        )
        took = time.monotonic() - started
        assert took < D_PULL_TIMEOUT_S + 30, f"{name}: {took:.1f} s"
        if name == "d":
            assert status == 200, body
            h.assert_as_alone(body["choices"][0]["token_ids"], prompts[name], "D recomputed the prompt", alone)
        else:
            failed = status >= 400 or body["choices"][0].get("finish_reason") not in ("length", "stop")
            assert failed, f"kv_load_failure_policy=fail answered as if the KV had arrived: {status} {body}"
    # Both D serve the next request of their own (the engine did not die), and hold nothing after.
    for d in (h.d, h.d_fail):
        status, _ = cluster.post(d.url + "/v1/completions", cluster.greedy_body(prompt_of(120, seed=seed + 9), 2))
        assert status == 200, f"{d.name} still serves"
    no_block_held(h.d, h.d_fail)
