"""One P and one D, each a real `vllm serve` (the CPU build) with PdflowConnector, `pdflow proxy`
in front, beside a single `vllm serve` without a connector as the reference; vLLM's default CPU
block size (128). The pair runs as a deployment across hosts would: one cluster secret (a file,
`cluster_secret_file` in both connectors' extra config, the proxy's environment), TLS on the
side and data channels, the KV over tcp (`transport: tcp`, so the socket is used on one host).

What a user checks: greedy outputs through the proxy equal the single server's, token by token,
whatever the prompt's length against the block size, on both APIs, streamed or not; D loaded the
prompt's KV instead of computing it (its own counters) and P's step 29 carried exactly the
request's blocks; prefix caching pulls only what D lacks; one trace per request across the three
processes, from OTLP and from the trace files; pdflow's lines in vLLM's log; a client that leaves
mid-stream and a D that dies leave no block held; the bootstrap refuses unsigned and forged
calls and P's log says so; vLLM's own proxy works in front of the authenticated engines.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pdflow.traces import read_spans

import cluster
from cluster import PdflowProxy, VllmServer, completion_tokens, connector_config, free_port, prompt_of, wait_until
from otlp_receiver import OtlpReceiver

BLOCK = 128
KV_BYTES_PER_TOKEN = 4096  # the tiny model: 2 · 4 layers · 2 KV heads · 64 · 4 B (float32)
BLOCK_BYTES = BLOCK * KV_BYTES_PER_TOKEN
MAX_TOKENS = 24
P_ABORT_TIMEOUT_S = 8
D_PULL_TIMEOUT_S = 15


@dataclass
class Pair:
    single: VllmServer
    prefill: VllmServer
    decode: VllmServer
    proxy: PdflowProxy
    bootstrap_port: int
    traces: Path
    otlp: OtlpReceiver
    log_dir: Path
    secret_file: Path
    _reference: dict = field(default_factory=dict)

    def reference(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._reference:
            self._reference[key] = completion_tokens(self.single.url, prompt, max_tokens)
        return self._reference[key]

    def p_spans(self) -> list[dict]:
        return read_spans(str(self.traces / "prefill.json"))

    def d_spans(self) -> list[dict]:
        return read_spans(str(self.traces / "decode.json"))


@pytest.fixture(scope="module")
def pair(model_dir, pdflow_bin, log_dir):
    otlp = OtlpReceiver()
    traces = log_dir / "traces"
    traces.mkdir()
    bootstrap_port = free_port()
    secret_file = log_dir / "cluster-secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    secure = {"cluster_secret_file": str(secret_file), "tls": True, "transport": "tcp"}
    single = VllmServer("single", model_dir, log_dir, core=1, block_size=BLOCK)
    prefill = VllmServer(
        "prefill", model_dir, log_dir, core=0, block_size=BLOCK,
        kv_transfer_config=connector_config(
            "kv_producer",
            extra={"bootstrap_port": bootstrap_port, "abort_request_timeout_s": P_ABORT_TIMEOUT_S, **secure}),
        env={"PDFLOW_TRACE_FILE": str(traces / "prefill.json"), **otlp.env()},
    )  # fmt: skip
    decode = VllmServer(
        "decode", model_dir, log_dir, core=1, block_size=BLOCK,
        kv_transfer_config=connector_config(
            "kv_consumer", policy="recompute", extra={"pull_timeout_s": D_PULL_TIMEOUT_S, **secure}),
        env={"PDFLOW_TRACE_FILE": str(traces / "decode.json"), **otlp.env()},
    )  # fmt: skip
    servers = [single, prefill, decode]
    proxy = None
    try:
        cluster.start_all(servers)
        proxy_env = {"PDFLOW_CLUSTER_SECRET_FILE": str(secret_file), **otlp.env()}
        proxy = PdflowProxy("proxy", [(prefill.url, bootstrap_port)], [decode.url], log_dir, env=proxy_env)
        proxy.wait_ready(time.monotonic() + 60)
        yield Pair(single, prefill, decode, proxy, bootstrap_port, traces, otlp, log_dir, secret_file)
    finally:
        for s in ([proxy] if proxy else []) + servers:
            s.stop()
        otlp.close()


def step_spans(spans: list[dict], step: int, since_us: int = 0) -> list[dict]:
    return [s for s in spans if s["step"] == step and s["start_us"] >= since_us]


def now_us() -> int:
    return int(time.time() * 1e6)


# ------------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize(
    "length",
    [50, BLOCK, BLOCK + 1, 5 * BLOCK + 60],
    ids=["shorter-than-a-block", "one-block", "one-block-plus-one", "many-blocks-partial-last"],
)
def test_greedy_tokens_through_the_proxy_equal_a_single_servers(pair, length):
    prompt = prompt_of(length, seed=length)
    expected = pair.reference(prompt)
    assert len(expected) == MAX_TOKENS
    assert completion_tokens(pair.proxy.url, prompt, MAX_TOKENS) == expected


def test_a_request_without_kv_transfer_params_is_served_by_either_engine_alone(pair):
    prompt = prompt_of(300, seed=7)
    expected = pair.reference(prompt)
    assert completion_tokens(pair.prefill.url, prompt, MAX_TOKENS) == expected
    assert completion_tokens(pair.decode.url, prompt, MAX_TOKENS) == expected


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_completions_and_chat_text_equal_a_single_servers(pair, streamed):
    text = "the quick brown fox jumps over the lazy dog. " * 12
    want = cluster.completion_text(pair.single.url, text, MAX_TOKENS)
    assert cluster.completion_text(pair.proxy.url, text, MAX_TOKENS, streamed=streamed) == want
    messages = [{"role": "system", "content": "you answer briefly."}, {"role": "user", "content": text}]
    want_chat = cluster.chat_text(pair.single.url, messages, MAX_TOKENS)
    assert want_chat
    assert cluster.chat_text(pair.proxy.url, messages, MAX_TOKENS, streamed=streamed) == want_chat


# ------------------------------------------------------------------- the KV really moved


def test_d_loads_the_prompt_instead_of_computing_it_and_p_writes_its_blocks(pair):
    length = 5 * BLOCK + 60  # 6 blocks, the last one partial
    prompt = prompt_of(length, seed=1001)
    expected = pair.reference(prompt)
    src = "vllm:prompt_tokens_by_source_total"
    local0 = pair.decode.metric(src, source="local_compute")
    ext0 = pair.decode.metric(src, source="external_kv_transfer")
    since = now_us()
    assert completion_tokens(pair.proxy.url, prompt, MAX_TOKENS) == expected
    # vLLM's stats reach the API server once per engine step: wait for this request's.
    ext = wait_until(
        lambda: (pair.decode.metric(src, source="external_kv_transfer") - ext0) or None, "D's external_kv_transfer count"
    )
    local = pair.decode.metric(src, source="local_compute") - local0
    assert local <= 1, f"D computed {local} prompt tokens itself; it should load all but the last"
    assert ext + local == length, (ext, local)
    writes = wait_until(lambda: step_spans(pair.p_spans(), 29, since), "P's step 29 in its trace file", timeout=10)
    assert len(writes) == 1, writes
    assert int(writes[0]["tags"]["pd.bytes"]) == 6 * BLOCK_BYTES, writes[0]["tags"]


def test_with_prefix_caching_d_pulls_only_the_blocks_it_lacks(pair):
    first = prompt_of(5 * BLOCK + 60, seed=2002)
    assert completion_tokens(pair.proxy.url, first, MAX_TOKENS) == pair.reference(first)
    # Shares 4 full blocks with `first`, which D now has in its prefix cache.
    second = first[: 4 * BLOCK] + prompt_of(BLOCK + 60, seed=2003)
    expected = pair.reference(second)
    since = now_us()
    assert completion_tokens(pair.proxy.url, second, MAX_TOKENS) == expected
    writes = wait_until(lambda: step_spans(pair.p_spans(), 29, since), "P's step 29", timeout=10)
    assert [int(w["tags"]["pd.bytes"]) for w in writes] == [2 * BLOCK_BYTES]


def test_a_full_prefix_hit_moves_no_kv_and_p_frees_at_once(pair):
    prompt = prompt_of(5 * BLOCK + 1, seed=3003)  # D's cache can hold every token but the last
    expected = pair.reference(prompt)
    assert completion_tokens(pair.proxy.url, prompt, MAX_TOKENS) == expected
    ext = "vllm:prompt_tokens_by_source_total"
    time.sleep(1.0)  # the first request's stats have reached D's API server
    ext0 = pair.decode.metric(ext, source="external_kv_transfer")
    since = now_us()
    t0 = time.monotonic()
    assert completion_tokens(pair.proxy.url, prompt, MAX_TOKENS) == expected
    # P reported the request sent (step 32, so vLLM frees its blocks) long before its abort
    # timeout, and wrote nothing: D recomputes the last prompt token after any load anyway.
    sent = wait_until(lambda: step_spans(pair.p_spans(), 32, since), "P's step 32 for the full hit", timeout=P_ABORT_TIMEOUT_S)
    assert time.monotonic() - t0 < P_ABORT_TIMEOUT_S
    assert len(sent) == 1, sent
    written = [int(w["tags"].get("pd.bytes", 0)) for w in step_spans(pair.p_spans(), 29, since)]
    assert sum(written) == 0, written
    time.sleep(1.0)
    assert pair.decode.metric(ext, source="external_kv_transfer") == ext0
    assert pair.decode.metric(ext, source="local_cache_hit") > 0


def test_16_concurrent_requests_each_equal_a_single_servers(pair):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [prompt_of(100 + 37 * i, seed=4000 + i) for i in range(16)]
    expected = [pair.reference(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: completion_tokens(pair.proxy.url, p, MAX_TOKENS), prompts))
    assert got == expected


# ------------------------------------------------------------------------ vLLM's own proxies


def test_p_answers_the_kv_transfer_params_d_needs_when_the_proxy_names_no_transfer(pair):
    """The protocol of vLLM's toy proxy: a bare do_remote_decode to P, P's answer forwarded to D."""
    prompt = prompt_of(3 * BLOCK + 5, seed=8008)
    status, out = cluster.post(
        pair.prefill.url + "/v1/completions",
        {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                "remote_block_ids": None, "remote_host": None, "remote_port": None}},
    )  # fmt: skip
    assert status == 200, out
    params = out.get("kv_transfer_params")
    assert params and params["do_remote_prefill"] and params["transfer_id"], out
    assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{pair.bootstrap_port}", params
    since = now_us()
    got = completion_tokens(pair.decode.url, prompt, MAX_TOKENS, kv_transfer_params=params)
    assert got == pair.reference(prompt)
    writes = wait_until(lambda: step_spans(pair.p_spans(), 29, since), "P's step 29", timeout=10)
    assert [int(w["tags"]["pd.bytes"]) for w in writes] == [4 * BLOCK_BYTES]


def test_vllms_toy_proxy_in_front_of_pdflow_engines(pair):
    """vLLM's proxy (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, which vLLM's
    MooncakeConnector guide uses) is not in vLLM's wheel and its code is not pdflow's to ship."""
    path = os.environ.get("PDFLOW_VLLM_TOY_PROXY")
    if not path:
        pytest.skip("set PDFLOW_VLLM_TOY_PROXY to a copy of vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py")
    port = free_port()
    host, p_port = pair.prefill.url.removeprefix("http://").split(":")
    _, d_port = pair.decode.url.removeprefix("http://").split(":")
    argv = [sys.executable, path, "--port", str(port), "--prefiller-host", host, "--prefiller-port", p_port,
            "--decoder-host", host, "--decoder-port", d_port]  # fmt: skip
    proxy = cluster.Process("vllm-toy-proxy", argv, dict(os.environ), pair.log_dir)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proxy.alive(), f"vLLM's toy proxy exited:\n{proxy.log_tail()}"
            return _answers(url + "/healthcheck")

        wait_until(up, "vLLM's toy proxy up", timeout=60)
        for length in (50, 2 * BLOCK + 3):
            prompt = prompt_of(length, seed=8100 + length)
            assert completion_tokens(url, prompt, MAX_TOKENS) == pair.reference(prompt)
        text = "the quick brown fox jumps over the lazy dog. " * 12
        assert cluster.completion_text(url, text, MAX_TOKENS, streamed=True) == cluster.completion_text(
            pair.single.url, text, MAX_TOKENS
        )
    finally:
        proxy.stop()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------- observability


def test_one_trace_per_request_across_proxy_p_and_d_in_otlp_and_in_the_trace_files(pair):
    trace_id = secrets.token_hex(16)
    prompt = prompt_of(300, seed=5005)
    status, body = cluster.post(
        pair.proxy.url + "/v1/completions",
        {"model": cluster.MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    assert status == 200, body
    # Every step the bridge records for a request (20, D's bootstrap look-up, happens once per P).
    p_steps = {13, 14, 22, 26, 27, 28, 29, 30, 31, 32}
    d_steps = {18, 19, 21, 34, 35, 36}

    def steps_by_service(spans):
        out: dict[str, set[int]] = {}
        for s in spans:
            if s["trace_id"] == trace_id and s["step"]:
                out.setdefault(s["service"], set()).add(s["step"])
        return out

    def complete(by, proxy_steps=frozenset({8, 9, 10, 25, 43})):
        return (
            proxy_steps <= by.get("pdflow-proxy", set())
            and p_steps <= by.get("pdflow-prefill", set())
            and d_steps <= by.get("pdflow-decode", set())
        )

    seen: dict[str, set[int]] = {}

    def otlp_steps():
        by: dict[str, set[int]] = {}
        for s in pair.otlp.snapshot():
            if s["trace_id"] == trace_id and s["attrs"].get("pd.step"):
                by.setdefault(s["service"], set()).add(int(s["attrs"]["pd.step"]))
        seen.clear()
        seen.update(by)
        return by if complete(by) else None

    try:
        wait_until(otlp_steps, "the request's steps at the OTLP receiver", timeout=60)
    except AssertionError as e:
        raise AssertionError(f"{e}; steps seen per service: {seen}") from None
    # The servers are still running: their files are written while they run.
    def file_steps():
        by = steps_by_service(pair.p_spans() + pair.d_spans())
        # (The proxy writes no trace file here: its steps were checked at the receiver.)
        return by if complete(by, proxy_steps=frozenset()) else None

    wait_until(file_steps, "the request's steps in P's and D's trace files", timeout=10)
    # Each of a server's processes keeps its own file (engine core and worker).
    assert len({s["file"] for s in pair.p_spans()}) >= 2


def test_pdflows_lines_are_in_vllms_log(pair):
    for server in (pair.prefill, pair.decode):
        log = server.log_text()
        assert "pdflow connector: engine" in log, server.log_tail()
        assert "pdflow connector registered" in log, server.log_tail()
    # Under a secret, the start-up warning about an open cluster is not given.
    assert "no cluster secret" not in pair.prefill.log_text(), pair.prefill.log_tail()


# ------------------------------------------------------------------------------- security


def test_the_bootstrap_refuses_unsigned_and_forged_calls_and_ps_log_says_so(pair):
    """An attacker who reaches P's bootstrap (launched inside P's `vllm serve`) reads nothing and
    registers nothing: an unsigned `/query`, a `/register` with a made-up proof and one naming a
    key nobody holds get a 401 that says what to do; P's stderr (vLLM's log) has the refusal,
    once per peer; the engines serve on."""
    base = f"http://127.0.0.1:{pair.bootstrap_port}"

    def status(req: urllib.request.Request) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    code, body = status(urllib.request.Request(base + "/query"))
    assert code == 401, body
    assert "cluster secret" in body, body
    forged = json.dumps({"engine_id": "attacker", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                         "addr": "tcp://127.0.0.1:1"}).encode()  # fmt: skip
    for header in ("v1." + "00" * 16 + f".{int(time.time() * 1000)}." + "ab" * 40, "garbage"):
        req = urllib.request.Request(base + "/register", data=forged, method="POST",
                                     headers={"Content-Type": "application/json", "X-Pdflow-Auth": header})  # fmt: skip
        code, body = status(req)
        assert code == 401, body
    wait_until(lambda: "peer refused" in pair.prefill.log_text(), "P's log names the refusal", timeout=10)
    refusals = [line for line in pair.prefill.log_text().splitlines() if "peer refused" in line]
    assert any("socket=\"bootstrap\"" in line or "socket=bootstrap" in line for line in refusals), refusals
    # Still serving, under the secret.
    prompt = prompt_of(90, seed=4242)
    assert completion_tokens(pair.proxy.url, prompt, MAX_TOKENS) == pair.reference(prompt)


# ------------------------------------------------------------------------------------ faults


def _kv_usage(server: VllmServer) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def _idle_usage(server: VllmServer) -> float:
    """KV usage once the server has stepped again: a one-token request without KV transfer makes
    its engine publish fresh stats (the gauge is updated per engine step)."""
    completion_tokens(server.url, prompt_of(10, seed=9), 1)
    time.sleep(0.5)
    return _kv_usage(server)


def test_a_client_that_leaves_mid_stream_frees_both_sides(pair):
    body = {"model": cluster.MODEL_NAME, "prompt": prompt_of(400, seed=6006), "max_tokens": 1500,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    host, port = pair.proxy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:
        line = resp.fp.readline()
        assert line, "the stream ended before three events"
        seen += line.startswith(b"data:")
    assert pair.decode.metric("vllm:num_requests_running") >= 1
    conn.sock.shutdown(2)
    conn.close()
    wait_until(lambda: pair.decode.metric("vllm:num_requests_running") == 0, "D's request aborted", timeout=30)
    wait_until(lambda: _idle_usage(pair.decode) == 0.0, "D's blocks back to baseline", timeout=30)
    wait_until(lambda: _idle_usage(pair.prefill) == 0.0, "P's blocks back to baseline", timeout=30)


def test_zz_a_dead_d_gives_the_client_an_error_and_p_returns_its_blocks(pair):
    """Runs last in this module: it kills D."""
    pair.decode.kill()
    t0 = time.monotonic()
    status, body = cluster.post(
        pair.proxy.url + "/v1/completions",
        {"model": cluster.MODEL_NAME, "prompt": prompt_of(600, seed=7007), "max_tokens": 8},
        timeout=60,
    )
    assert status >= 500, (status, body)
    assert time.monotonic() - t0 < 30
    # P prefilled and holds the blocks for a pull that will never come, until its abort timeout.
    wait_until(lambda: _idle_usage(pair.prefill) == 0.0, "P's held blocks back to baseline", timeout=P_ABORT_TIMEOUT_S + 20)
