"""Layer-wise P in real `vllm serve` (the CPU build): P's connector has `layerwise: true`, so each
attention layer's KV of a prefill goes to D from vLLM's `save_kv_layer` while the later layers
compute. Beside a single `vllm serve` as the reference, over tcp, D with `kv_load_failure_policy:
fail` (a load that did not land fails the request instead of being recomputed).

What a user checks: greedy outputs through `pdflow proxy` equal the single server's whatever the
prompt's length against the block size, D loaded the prompt instead of computing it; and with D's
pull waiting at P before P's request arrives, P's trace shows the KV leaving during the prefill
(step 29 opens before step 27, P's request ready), every block written once.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import pytest
from pdflow.traces import read_spans

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, free_port, prompt_of, wait_until

BLOCK = 32
KV_BYTES_PER_TOKEN = 4096  # the tiny model: 2 · 4 layers · 2 KV heads · 64 · 4 B (float32)
MAX_TOKENS = 16
P_ENGINE = "p-layerwise"


@dataclass
class LayerwisePair:
    single: VllmServer
    prefill: VllmServer
    decode: VllmServer
    proxy: PdflowProxy
    bootstrap_port: int
    p_trace: str


@pytest.fixture(scope="module")
def lw(model_dir, pdflow_bin, log_dir):
    bootstrap_port = free_port()
    p_trace = str(log_dir / "prefill-layerwise.json")
    single = VllmServer("single", model_dir, log_dir, core=1, block_size=BLOCK)
    prefill = VllmServer(
        "prefill", model_dir, log_dir, core=0, block_size=BLOCK,
        kv_transfer_config=connector_config(
            "kv_producer", engine_id=P_ENGINE,
            extra={"bootstrap_port": bootstrap_port, "abort_request_timeout_s": 20, "transport": "tcp", "layerwise": True}),
        env={"PDFLOW_TRACE_FILE": p_trace},
    )  # fmt: skip
    decode = VllmServer(
        "decode", model_dir, log_dir, core=1, block_size=BLOCK,
        kv_transfer_config=connector_config("kv_consumer", policy="fail", extra={"pull_timeout_s": 25, "transport": "tcp"}),
    )  # fmt: skip
    servers = [single, prefill, decode]
    proxy = None
    try:
        cluster.start_all(servers)
        proxy = PdflowProxy("proxy", [(prefill.url, bootstrap_port)], [decode.url], log_dir)
        proxy.wait_ready(time.monotonic() + 60)
        yield LayerwisePair(single, prefill, decode, proxy, bootstrap_port, p_trace)
    finally:
        for s in ([proxy] if proxy else []) + servers:
            s.stop()


@pytest.mark.parametrize("length", [20, BLOCK + 1, 7 * BLOCK + 5], ids=["short", "one-block-plus-one", "many-blocks"])
def test_layer_wise_outputs_through_the_proxy_equal_a_single_servers(lw, length):
    prompt = prompt_of(length, seed=5000 + length)
    src = "vllm:prompt_tokens_by_source_total"
    ext0 = lw.decode.metric(src, source="external_kv_transfer")
    assert completion_tokens(lw.proxy.url, prompt, MAX_TOKENS) == completion_tokens(lw.single.url, prompt, MAX_TOKENS)
    if length > 1:
        wait_until(lambda: lw.decode.metric(src, source="external_kv_transfer") > ext0, "D loaded the prompt from P")


def test_a_pull_waiting_at_p_gets_the_kv_while_p_prefills(lw):
    length = 7 * BLOCK + 5
    prompt = prompt_of(length, seed=6001)
    expected = completion_tokens(lw.single.url, prompt, MAX_TOKENS)
    tid = f"xfer-layerwise-{uuid.uuid4().hex[:8]}"
    d_params = {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
        "remote_engine_id": P_ENGINE, "remote_bootstrap_addr": f"http://127.0.0.1:{lw.bootstrap_port}",
    }  # fmt: skip
    got: dict = {}

    def decode() -> None:
        got["tokens"] = completion_tokens(lw.decode.url, prompt, MAX_TOKENS, kv_transfer_params=d_params)

    d_thread = threading.Thread(target=decode)
    d_thread.start()
    # D's pull reaches P and waits there (P's ready deadline is 20 s) before P has the request.
    time.sleep(2.0)
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    completion_tokens(lw.prefill.url, prompt, 1, kv_transfer_params=p_params)
    d_thread.join(timeout=60)
    assert got.get("tokens") == expected

    def spans_of(step: int) -> list[dict]:
        return [s for s in read_spans(lw.p_trace) if s["step"] == step and s["tags"].get("pd.transfer_id") == tid]

    write = wait_until(lambda: spans_of(29) or None, "P's step 29 in its trace file", timeout=15)[0]
    ready = wait_until(lambda: spans_of(27) or None, "P's step 27 in its trace file", timeout=15)[0]
    assert write["start_us"] < ready["start_us"], "the KV left P before P's request was ready"
    blocks = -(-length // BLOCK)
    assert int(write["tags"]["pd.bytes"]) == blocks * BLOCK * KV_BYTES_PER_TOKEN, write["tags"]
