"""Real `vllm serve` P/D on this CPU: pdflow against vLLM's own P/D connectors and one server.

    .venv-vllm-cpu/bin/python scripts/bench_vllm.py [--requests 20] [--json out.json]

Runs, one after another on one model and the same pinning (P, or the single server, on core 0; D
on core 1; every thread of each server's processes pinned to its core once it is up, so that no
connector's idle threads spin on the other server's core):

- `single`: one `vllm serve` without a connector (the reference);
- `pdflow`: P and D with PdflowConnector, requests sent client → P → D, and through `pdflow proxy`
  (P's pdflow threads on D's core, as a GPU host's connector has CPU cores apart from the forward);
- `pdflow-layerwise`: the same with `layerwise` on P (through the proxy, which sends P's and D's
  requests at once, D's pull waits at P and the KV leaves P layer by layer during the prefill);
- `nixl`: P and D with vLLM's NixlConnector (`kv_buffer_device: cpu`, UCX over TCP/shared memory
  on loopback), client → P → D with the parameters P returns;
- `mooncake`: vLLM's MooncakeConnector, where `mooncake-transfer-engine-non-cuda` loads.

The model is made here (`py-bridge/tests_serve/make_model.py --shape seed`): the seed's KV per
token (147,456 B: 36 layers, 8 KV heads, head_dim 64, float32), so a 1000-token prompt moves
~151 MB. Reported per configuration: TTFT median, p10 and p90 over `--requests` sequential
requests (streamed, time to the first token at the client), requests/s with 8 concurrent clients,
and for pdflow the KV bytes of each request and its step-29 write rate inside vLLM (from P's trace
files), beside `pdflow bench transfer`'s rate for the seed request measured in the same run.
`--setup` installs NixlConnector's and Mooncake's packages into this environment first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py-bridge" / "tests_serve"))

import cluster  # noqa: E402
import make_model  # noqa: E402
from cluster import MODEL_NAME, PdflowProxy, VllmServer, free_port, prompt_of  # noqa: E402

BLOCK = 128
MAX_TOKENS_TTFT = 2
MAX_TOKENS_RPS = 16


def pin(server: VllmServer, core: int) -> None:
    """Every thread of every process in the server's group onto one core."""
    out = subprocess.run(["pgrep", "-g", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in out:
        subprocess.run(["taskset", "-a", "-cp", str(core), pid], capture_output=True)


def pin_connector(server: VllmServer, core: int) -> None:
    """P's pdflow runtime threads (`pdflow-worker`: side channel, the KV writes) onto `core`, away
    from P's forward: on a GPU host the forward runs on the GPU and the connector has CPU cores to
    itself; here the forward is P's one pinned core. Threads they start later inherit it."""
    out = subprocess.run(["pgrep", "-g", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in out:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            if comm == "pdflow-worker":
                subprocess.run(["taskset", "-cp", str(core), task.name], capture_output=True)


def first_token_s(url: str, body: dict) -> float:
    """Streams `body` to `url`; seconds until the first event with text."""
    t0 = time.perf_counter()
    for ev in cluster.stream(url + "/v1/completions", body):
        if ev.get("choices"):
            return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def body_of(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


class Direct:
    """A client that is its own proxy: P's request, then D's with the parameters P returns (what
    vLLM's toy proxy does) or with pdflow's (transfer id, P's engine id and bootstrap)."""

    def __init__(self, p: VllmServer, d: VllmServer, p_params, d_params):
        self.p, self.d, self.p_params, self.d_params = p, d, p_params, d_params

    @classmethod
    def naming_the_transfer(cls, p: VllmServer, d: VllmServer, p_engine_id: str, bootstrap_port: int) -> "Direct":
        """The client names the transfer and tells D where P is (pdflow proxy's and vLLM 0.32's
        MooncakeConnector's protocol)."""
        return cls(
            p, d,
            lambda x: {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": x},
            lambda x, _: {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": x,
                          "remote_engine_id": p_engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}"},
        )  # fmt: skip

    def ttft(self, prompt: list[int], max_tokens: int) -> float:
        t0 = time.perf_counter()
        self.generate(prompt, max_tokens, stream_d=True)
        return time.perf_counter() - t0

    def generate(self, prompt: list[int], max_tokens: int, stream_d: bool = False) -> None:
        xfer = f"bench-{uuid.uuid4().hex[:12]}"
        status, out = cluster.post(self.p.url + "/v1/completions", {**body_of(prompt, 1), "kv_transfer_params": self.p_params(xfer)})
        if status != 200:
            raise RuntimeError(f"P answered {status}: {out}")
        params = self.d_params(xfer, out.get("kv_transfer_params"))
        body = {**body_of(prompt, max_tokens), "kv_transfer_params": params}
        if stream_d:
            first_token_s(self.d.url, body)
        else:
            status, out = cluster.post(self.d.url + "/v1/completions", body)
            if status != 200:
                raise RuntimeError(f"D answered {status}: {out}")


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
    return {"median_ms": 1e3 * statistics.median(xs), "p10_ms": 1e3 * q[0], "p90_ms": 1e3 * q[8], "n": len(xs)}


def measure(name: str, ttft_once, generate_once, requests: int, seed0: int) -> dict:
    # Two warm-up requests (first-use costs: connections, handles, caches).
    for i in range(2):
        ttft_once(prompt_of(1000, seed0 - 1 - i))
    window = [int(time.time() * 1e6)]
    ttfts = [ttft_once(prompt_of(1000, seed0 + i)) for i in range(requests)]
    window.append(int(time.time() * 1e6))
    prompts = [prompt_of(1000, seed0 + 10_000 + i) for i in range(4 * 8)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(generate_once, prompts))
    rps = len(prompts) / (time.perf_counter() - t0)
    row = {"config": name, "ttft": summary(ttfts), "rps_8_concurrent": rps, "ttft_window_us": window}
    print(json.dumps(row), flush=True)
    return row


def start(servers: list, cores: list[int]) -> None:
    cluster.start_all(servers)
    for s, c in zip(servers, cores):
        pin(s, c)


def run_single(model: Path, logs: Path, requests: int) -> dict:
    s = VllmServer("single", model, logs, core=0, block_size=BLOCK)
    try:
        start([s], [0])
        return measure(
            "single server", lambda p: first_token_s(s.url, {**body_of(p, MAX_TOKENS_TTFT), "stream": True}),
            lambda p: cluster.post(s.url + "/v1/completions", body_of(p, MAX_TOKENS_RPS)), requests, 1000,
        )  # fmt: skip
    finally:
        s.stop()


def run_pdflow(model: Path, logs: Path, requests: int, layerwise: bool = False) -> list[dict]:
    tag = " layer-wise" if layerwise else ""
    traces = logs / ("pdflow-layerwise-traces" if layerwise else "pdflow-traces")
    shutil.rmtree(traces, ignore_errors=True)  # each process's file is named by its pid
    traces.mkdir()
    bport = free_port()
    p_extra = {"bootstrap_port": bport, **({"layerwise": True} if layerwise else {})}
    p = VllmServer("pdflow-prefill", model, logs, core=0, block_size=BLOCK, env=engine_env(traces, "p"),
                   kv_transfer_config=cluster.connector_config("kv_producer", extra=p_extra, engine_id="bench-p"))  # fmt: skip
    d = VllmServer("pdflow-decode", model, logs, core=1, block_size=BLOCK, env=engine_env(traces, "d"),
                   kv_transfer_config=cluster.connector_config("kv_consumer"))  # fmt: skip
    proxy = None
    try:
        start([p, d], [0, 1])
        pin_connector(p, 1)
        direct = Direct.naming_the_transfer(p, d, "bench-p", bport)
        rows = [measure(f"pdflow{tag} (client → P → D)", lambda pr: direct.ttft(pr, MAX_TOKENS_TTFT),
                        lambda pr: direct.generate(pr, MAX_TOKENS_RPS), requests, 2000)]  # fmt: skip
        proxy = PdflowProxy("pdflow-proxy", [(p.url, bport)], [d.url], logs)
        proxy.wait_ready(time.monotonic() + 60)
        rows.append(measure(
            f"pdflow{tag} (pdflow proxy)", lambda pr: first_token_s(proxy.url, {**body_of(pr, MAX_TOKENS_TTFT), "stream": True}),
            lambda pr: cluster.post(proxy.url + "/v1/completions", body_of(pr, MAX_TOKENS_RPS)), requests, 3000,
        ))  # fmt: skip
        time.sleep(1.5)  # the trace files are rewritten every 500 ms
        # The writes of the sequential TTFT requests, not those under the 8-client load.
        rows[0]["step29"] = step29(str(traces / "p.json"), *rows[0]["ttft_window_us"])
        return rows
    finally:
        for s in ([proxy] if proxy else []) + [p, d]:
            s.stop()


def engine_env(traces: Path, name: str) -> dict:
    return {"PDFLOW_TRACE_FILE": str(traces / f"{name}.json")}


def step29(path: str, since_us: int, until_us: int) -> dict:
    from pdflow.traces import read_spans

    writes = [
        s for s in read_spans(path)
        if s["step"] == 29 and int(s["tags"].get("pd.bytes", 0)) > 0 and since_us <= s["start_us"] <= until_us
    ]  # fmt: skip
    rates = [int(s["tags"]["pd.bytes"]) / (s["duration_us"] / 1e6) / 1e9 for s in writes if s["duration_us"] > 0]
    return {
        "writes": len(writes),
        "bytes_per_request": statistics.median(int(s["tags"]["pd.bytes"]) for s in writes) if writes else 0,
        "median_ms": statistics.median(s["duration_us"] / 1e3 for s in writes) if writes else 0,
        "median_gb_s": statistics.median(rates) if rates else 0,
        "backend": sorted({s["tags"].get("pd.backend", "?") for s in writes}),
    }


def nixl_env(port: int) -> dict:
    return {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}  # fmt: skip


def run_nixl(model: Path, logs: Path, requests: int) -> dict:
    try:
        import nixl  # noqa: F401
    except ImportError as e:
        return {"config": "nixl", "skipped": f"nixl is not installed ({e}); run with --setup"}
    cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    p = VllmServer("nixl-prefill", model, logs, core=0, block_size=BLOCK, kv_transfer_config=cfg, env=nixl_env(free_port()))
    d = VllmServer("nixl-decode", model, logs, core=1, block_size=BLOCK, kv_transfer_config=cfg, env=nixl_env(free_port()))
    try:
        start([p, d], [0, 1])
        direct = Direct(
            p, d,
            lambda x: {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None},
            lambda x, returned: returned,
        )  # fmt: skip
        return measure("NixlConnector (client → P → D)", lambda pr: direct.ttft(pr, MAX_TOKENS_TTFT),
                       lambda pr: direct.generate(pr, MAX_TOKENS_RPS), requests, 4000)  # fmt: skip
    except Exception as e:  # a connector that does not run here is reported, not fatal
        return {"config": "nixl", "failed": str(e)[:2000]}
    finally:
        p.stop()
        d.stop()


def run_mooncake(model: Path, logs: Path, requests: int) -> dict:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as e:
        return {"config": "mooncake", "skipped": f"mooncake-transfer-engine-non-cuda does not load here ({e})"}
    bport = free_port()
    p_cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "mc-p"})
    d_cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})
    # MooncakeConnector's worker asks torch.accelerator for a device index, which PyPI's (CUDA) torch
    # answers by raising on a machine without a GPU: answer 0 there, in these two servers only.
    shim = Path(tempfile.mkdtemp())
    (shim / "sitecustomize.py").write_text(
        "import torch\nif not torch.cuda.is_available():\n    torch.accelerator.current_device_index = lambda: 0\n"
    )
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bport), **path}
    p = VllmServer("mooncake-prefill", model, logs, core=0, block_size=BLOCK, kv_transfer_config=p_cfg, env=env)
    d = VllmServer("mooncake-decode", model, logs, core=1, block_size=BLOCK, kv_transfer_config=d_cfg, env=path)
    try:
        start([p, d], [0, 1])
        direct = Direct.naming_the_transfer(p, d, "mc-p", bport)
        return measure("MooncakeConnector (client → P → D)", lambda pr: direct.ttft(pr, MAX_TOKENS_TTFT),
                       lambda pr: direct.generate(pr, MAX_TOKENS_RPS), requests, 5000)  # fmt: skip
    except Exception as e:
        return {"config": "mooncake", "failed": str(e)[:2000]}
    finally:
        p.stop()
        d.stop()


def bench_transfer() -> dict:
    """`pdflow bench transfer`'s seed request over what a node on one host uses (same-host), on
    the one core P's worker has in the runs above (`taskset -c 0`: the copy runs in P's process),
    and unpinned for reference."""
    release = REPO / "target" / "release" / "pdflow"
    binary = release if release.exists() else cluster.pdflow_bin()
    out = {"binary": str(binary)}
    for name, prefix in (("one_core", ["taskset", "-c", "0"]), ("unpinned", [])):
        path = Path(tempfile.mkdtemp()) / "transfer.json"
        argv = prefix + [str(binary), "bench", "transfer", "--backend", "same-host", "--runs", "10", "--json", str(path)]
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
        rows = json.loads(path.read_text())["rows"]
        out[name] = next(r for r in rows if r["name"] == "actors seed coalesced" and r["concurrency"] == 1)
    return out


def setup() -> None:
    """NixlConnector's and Mooncake's packages (and Debian's libibverbs1, which Mooncake's engine
    links, where apt-get can install it)."""
    if os.geteuid() == 0 and subprocess.run(["which", "apt-get"], capture_output=True).returncode == 0:
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                       "--no-install-recommends libibverbs1", shell=True, check=False)  # fmt: skip
    py = sys.executable
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "nixl==1.5.1", "nixl-cu13==1.5.1"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "mooncake-transfer-engine-non-cuda"], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--setup", action="store_true")
    ap.add_argument("--only", nargs="*", default=["single", "pdflow", "nixl", "mooncake", "transfer"])
    args = ap.parse_args()
    if args.setup:
        setup()
    model = REPO / "target" / "vllm-models" / "seed"
    desc = make_model.make(str(model), "seed")
    logs = REPO / "target" / "vllm-bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = {"model": desc, "prompt_tokens": 1000, "block_size": BLOCK, "requests": args.requests, "rows": []}
    runs = {
        "single": run_single,
        "pdflow": run_pdflow,
        "pdflow-layerwise": lambda m, lg, n: run_pdflow(m, lg, n, layerwise=True),
        "nixl": run_nixl,
        "mooncake": run_mooncake,
    }
    for name in args.only:
        if name == "transfer":
            report["bench_transfer"] = bench_transfer()
            continue
        got = runs[name](model, logs, args.requests)
        for row in got if isinstance(got, list) else [got]:
            report["rows"].append(row)
            if "ttft" not in row:  # measured rows were printed as they finished
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
