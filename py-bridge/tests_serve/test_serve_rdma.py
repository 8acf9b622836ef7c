"""One-sided RDMA between real `vllm serve` engines (the CPU build): P's and D's connectors have
`transport: rdma`, so libfabric loads in each vLLM worker process, D registers the blocks of each
request and sends their keys inside its sealed pull (a cluster secret is set), and P writes them
with RDMA WRITEs — on libfabric's software `tcp` provider here, run in a verbs NIC's registration
modes. D has `kv_load_failure_policy: fail`, so a load that did not land fails the request.

What a user checks: greedy outputs through `pdflow proxy` equal a single server's, D loaded the
prompt from P instead of computing it, P's step 29 says `backend=rdma` and its provider, and both
engines' KV usage returns to baseline. Both engines also advertise themselves (`advertise_url`;
D at P's bootstrap through `advertise_to`, P there as its own, P with its KV-event endpoints), and a
second `pdflow proxy` given only `--discover` P's bootstrap serves through them, signed with the
cluster secret. Skipped, saying why, when the wheel was built without the `rdma` feature or
libfabric is missing.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import secrets
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from pdflow import _native
from pdflow.traces import read_spans

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, free_port, prompt_of, wait_until

BLOCK = 32
MAX_TOKENS = 12

if not getattr(_native, "RDMA", False):
    pytest.skip("this pdflow wheel was built without the rdma feature", allow_module_level=True)
if ctypes.util.find_library("fabric") is None:
    pytest.skip("libfabric is not installed here (Debian: libfabric1)", allow_module_level=True)


@dataclass
class Discovery:
    """The proxy that found the engines at P's bootstrap, and what they advertised there."""

    proxy: PdflowProxy
    secret_file: Path
    bootstrap_port: int
    p_events: int
    p_replay: int


@pytest.fixture(scope="module")
def rdma(model_dir, pdflow_bin, log_dir):
    bootstrap_port = free_port()
    bootstrap_url = f"http://127.0.0.1:{bootstrap_port}"
    # The engines' ports are known before they start: each advertises its URL (`advertise_url`).
    p_port, d_port, p_events, p_replay = free_port(), free_port(), free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{p_events}",
              "replay_endpoint": f"tcp://*:{p_replay}"}  # fmt: skip
    secret_file = log_dir / "rdma-cluster-secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    common = {"cluster_secret_file": str(secret_file), "transport": "rdma"}
    p_trace = log_dir / "prefill-rdma.json"
    single = VllmServer("single", model_dir, log_dir, core=1, block_size=BLOCK)
    prefill = VllmServer(
        "prefill", model_dir, log_dir, core=0, block_size=BLOCK, port=p_port,
        kv_transfer_config=connector_config(
            "kv_producer", extra={"bootstrap_port": bootstrap_port, "abort_request_timeout_s": 20,
                                  "advertise_url": f"http://127.0.0.1:{p_port}", **common}),
        env={"PDFLOW_TRACE_FILE": str(p_trace)},
        extra_args=["--kv-events-config", json.dumps(events)],
    )  # fmt: skip
    decode = VllmServer(
        "decode", model_dir, log_dir, core=1, block_size=BLOCK, port=d_port,
        kv_transfer_config=connector_config("kv_consumer", policy="fail", extra={
            "pull_timeout_s": 25, "advertise_url": f"http://127.0.0.1:{d_port}", "advertise_to": [bootstrap_url],
            **common}),
    )  # fmt: skip
    servers = [single, prefill, decode]
    proxies: list[PdflowProxy] = []
    try:
        cluster.start_all(servers)
        proxy_env = {"PDFLOW_CLUSTER_SECRET_FILE": str(secret_file)}
        proxy = PdflowProxy("proxy", [(prefill.url, bootstrap_port)], [decode.url], log_dir, env=proxy_env)
        proxies.append(proxy)
        # Knows no engine but what P's bootstrap lists; follows P's KV events (kv_aware).
        discovering = PdflowProxy("proxy-discover", [], [], log_dir, env=proxy_env,
                                  extra_args=["--discover", bootstrap_url, "--prefill-policy", "kv_aware"])  # fmt: skip
        proxies.append(discovering)
        proxy.wait_ready(time.monotonic() + 60)
        discovering.wait_ready(time.monotonic() + 60)
        found = Discovery(discovering, secret_file, bootstrap_port, p_events, p_replay)
        yield single, prefill, decode, proxy, str(p_trace), found
    finally:
        for s in proxies + servers:
            s.stop()


def idle_usage(server: VllmServer) -> float:
    """KV usage once the server has stepped again (the gauge is updated per engine step)."""
    completion_tokens(server.url, prompt_of(10, seed=9), 1)
    time.sleep(0.5)
    return server.metric("vllm:kv_cache_usage_perc")


@pytest.mark.parametrize("length", [BLOCK + 1, 6 * BLOCK + 7], ids=["one-block-plus-one", "many-blocks"])
def test_outputs_over_rdma_equal_a_single_servers_and_d_loads_the_prompt(rdma, length):
    single, _prefill, decode, proxy, *_ = rdma
    prompt = prompt_of(length, seed=8100 + length)
    src = "vllm:prompt_tokens_by_source_total"
    loaded = decode.metric(src, source="external_kv_transfer")
    assert completion_tokens(proxy.url, prompt, MAX_TOKENS) == completion_tokens(single.url, prompt, MAX_TOKENS)
    wait_until(lambda: decode.metric(src, source="external_kv_transfer") > loaded, "D loaded the prompt from P")


def test_ps_writes_went_one_sided_and_both_sides_return_to_baseline(rdma):
    _single, prefill, decode, proxy, p_trace, *_ = rdma
    completion_tokens(proxy.url, prompt_of(3 * BLOCK, seed=8200), 4)
    writes = wait_until(
        lambda: [s for s in read_spans(p_trace) if s["step"] == 29] or None, "P's step 29 in its trace file", timeout=20
    )
    for span in writes:
        assert span["tags"].get("pd.backend") == "rdma", span["tags"]
        assert span["tags"].get("pd.provider") == "tcp", span["tags"]
        assert span["tags"].get("pd.outcome") == "ok", span["tags"]
    # D's worker registered its KV with an RDMA endpoint on the software provider.
    assert "'rdma': 'tcp on lo'" in decode.log_text()
    wait_until(lambda: idle_usage(decode) == 0.0, "D's blocks back to baseline", timeout=30)
    wait_until(lambda: idle_usage(prefill) == 0.0, "P's blocks back to baseline", timeout=30)


def test_a_proxy_that_discovers_the_engines_at_ps_bootstrap_serves_through_them(rdma, pdflow_bin):
    """The proxy given only `--discover` P's bootstrap: its outputs equal the single server's;
    `pdflow admin list`, signed with the cluster secret, shows P (its bootstrap, its KV-event
    endpoints at the host of its URL) and D, both healthy and routed to; it applies P's KV events."""
    single, prefill, decode, _proxy, _, found = rdma
    prompt = prompt_of(2 * BLOCK + 5, seed=8300)
    assert completion_tokens(found.proxy.url, prompt, MAX_TOKENS) == completion_tokens(single.url, prompt, MAX_TOKENS)
    listed = subprocess.run(
        [str(pdflow_bin), "admin", "--proxy", found.proxy.url, "list"],
        env={**os.environ, "PDFLOW_CLUSTER_SECRET_FILE": str(found.secret_file)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr + listed.stdout
    engines = {e["url"]: e for e in json.loads(listed.stdout)["engines"]}
    assert set(engines) == {prefill.url, decode.url}, engines
    p, d = engines[prefill.url], engines[decode.url]
    assert (p["pool"], d["pool"]) == ("prefill", "decode"), engines
    assert p["healthy"] and d["healthy"] and p["routed"] >= 1 and d["routed"] >= 1, engines
    assert p["bootstrap_addr"] == f"http://127.0.0.1:{found.bootstrap_port}", p
    assert p["kv_events"] == [
        {"endpoint": f"tcp://127.0.0.1:{found.p_events}", "replay_endpoint": f"tcp://127.0.0.1:{found.p_replay}"}
    ], p
    wait_until(
        lambda: proxy_metric(found.proxy, "pdflow_proxy_kv_events_total", engine=prefill.url, outcome="applied") > 0,
        "the discovering proxy applied P's KV events",
        timeout=30,
    )


def proxy_metric(proxy: PdflowProxy, family: str, **labels: str) -> float:
    """The sum of the proxy's samples of `family` whose labels include `labels`."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rpartition(" ")[2])
    return total
