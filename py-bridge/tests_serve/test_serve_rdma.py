"""One-sided RDMA between real `vllm serve` engines (the CPU build): P's and D's connectors have
`transport: rdma`, so libfabric loads in each vLLM worker process, D registers the blocks of each
request and sends their keys inside its sealed pull (a cluster secret is set), and P writes them
with RDMA WRITEs — on libfabric's software `tcp` provider here, run in a verbs NIC's registration
modes. D has `kv_load_failure_policy: fail`, so a load that did not land fails the request.

What a user checks: greedy outputs through `pdflow proxy` equal a single server's, D loaded the
prompt from P instead of computing it, P's step 29 says `backend=rdma` and its provider, and both
engines' KV usage returns to baseline. Skipped, saying why, when the wheel was built without the
`rdma` feature or libfabric is missing.
"""

from __future__ import annotations

import ctypes.util
import secrets
import time

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


@pytest.fixture(scope="module")
def rdma(model_dir, pdflow_bin, log_dir):
    bootstrap_port = free_port()
    secret_file = log_dir / "rdma-cluster-secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    common = {"cluster_secret_file": str(secret_file), "transport": "rdma"}
    p_trace = log_dir / "prefill-rdma.json"
    single = VllmServer("single", model_dir, log_dir, core=1, block_size=BLOCK)
    prefill = VllmServer(
        "prefill", model_dir, log_dir, core=0, block_size=BLOCK,
        kv_transfer_config=connector_config(
            "kv_producer", extra={"bootstrap_port": bootstrap_port, "abort_request_timeout_s": 20, **common}),
        env={"PDFLOW_TRACE_FILE": str(p_trace)},
    )  # fmt: skip
    decode = VllmServer(
        "decode", model_dir, log_dir, core=1, block_size=BLOCK,
        kv_transfer_config=connector_config("kv_consumer", policy="fail", extra={"pull_timeout_s": 25, **common}),
    )  # fmt: skip
    servers = [single, prefill, decode]
    proxy = None
    try:
        cluster.start_all(servers)
        proxy_env = {"PDFLOW_CLUSTER_SECRET_FILE": str(secret_file)}
        proxy = PdflowProxy("proxy", [(prefill.url, bootstrap_port)], [decode.url], log_dir, env=proxy_env)
        proxy.wait_ready(time.monotonic() + 60)
        yield single, prefill, decode, proxy, str(p_trace)
    finally:
        for s in ([proxy] if proxy else []) + servers:
            s.stop()


def idle_usage(server: VllmServer) -> float:
    """KV usage once the server has stepped again (the gauge is updated per engine step)."""
    completion_tokens(server.url, prompt_of(10, seed=9), 1)
    time.sleep(0.5)
    return server.metric("vllm:kv_cache_usage_perc")


@pytest.mark.parametrize("length", [BLOCK + 1, 6 * BLOCK + 7], ids=["one-block-plus-one", "many-blocks"])
def test_outputs_over_rdma_equal_a_single_servers_and_d_loads_the_prompt(rdma, length):
    single, _prefill, decode, proxy, _ = rdma
    prompt = prompt_of(length, seed=8100 + length)
    src = "vllm:prompt_tokens_by_source_total"
    loaded = decode.metric(src, source="external_kv_transfer")
    assert completion_tokens(proxy.url, prompt, MAX_TOKENS) == completion_tokens(single.url, prompt, MAX_TOKENS)
    wait_until(lambda: decode.metric(src, source="external_kv_transfer") > loaded, "D loaded the prompt from P")


def test_ps_writes_went_one_sided_and_both_sides_return_to_baseline(rdma):
    _single, prefill, decode, proxy, p_trace = rdma
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
