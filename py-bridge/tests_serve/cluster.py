"""Real processes for the real-vLLM tests: `vllm serve` (the CPU build) with or without
PdflowConnector, `pdflow proxy` in front, and the HTTP calls a client makes. Every wait has a
deadline; a process that dies while it is awaited fails the wait with the tail of its log.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "pdflow-tiny"
#: A server loads the tiny model in ~60 s on one core; two loading beside a build take longer.
READY_DEADLINE_S = float(os.environ.get("PDFLOW_VLLM_READY_DEADLINE_S", "420"))
REQUEST_DEADLINE_S = 120.0


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a server that binds it later (a `vllm serve` takes a minute to): taken
    below the kernel's ephemeral range, so that no socket bound to port 0 or connecting out in the
    meantime (vLLM's own, pdflow's) can be given it first; never the same one twice."""
    high = min(_ephemeral_low(), 32768)
    for _ in range(500):
        port = random.randrange(20000, high) if high > 20001 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def prompt_of(length: int, seed: int) -> list[int]:
    """A token-id prompt (ids 3.. avoid the tokenizer's specials), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(length)]


def vllm_bin() -> Path:
    """The `vllm` console script of the environment running the tests."""
    return Path(sys.executable).parent / "vllm"


def pdflow_bin() -> Path:
    return Path(os.environ.get("PDFLOW_BIN", REPO / "target" / "debug" / "pdflow"))


def connector_config(
    role: str, *, policy: Optional[str] = None, extra: Optional[dict] = None, engine_id: Optional[str] = None
) -> str:
    """`--kv-transfer-config` for PdflowConnector."""
    cfg: dict[str, Any] = {
        "kv_connector": "PdflowConnector",
        "kv_connector_module_path": "pdflow.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra or {},
    }
    if policy:
        cfg["kv_load_failure_policy"] = policy
    if engine_id:
        cfg["engine_id"] = engine_id
    return json.dumps(cfg)


class Process:
    """A child process in a session of its own (its children are stopped with it), its output in a
    log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def notable_lines(self, lines: int = 25) -> str:
        """The last of its lines a failure is explained by: pdflow's own, warnings and errors
        (without vLLM's start-up chatter)."""
        keep = re.compile(r"pdflow|WARN|ERROR|Traceback|Error:")
        chatter = re.compile(r"launcher\.py|non-default args|Initializing a V1 LLM engine|LD_PRELOAD|Triton")
        picked = [l for l in self.log_text().splitlines() if keep.search(l) and not chatter.search(l)]
        return f"--- {self.name} ({self.log_path})\n" + "\n".join(l[:300] for l in picked[-lines:])

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole process group: a crash, nothing flushed."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # whatever of the group is left
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def explain(*procs: "Process") -> str:
    """What each process logged that explains a failure, for an assertion's message."""
    return "\n".join(p.notable_lines() for p in procs if p is not None)


class VllmServer(Process):
    """`vllm serve MODEL` on 127.0.0.1, pinned to one core.

    float32 by default: on CPUs with AMX, vLLM 0.32's CPU attention picks its AMX kernel for bf16
    at block sizes that are multiples of 32, and that kernel dies with SIGILL when a request
    resumes mid-block after an external KV load (any P/D connector's D, whose first step computes
    the prompt's last token); float32 runs the portable kernel.

    `eager=False` lets vLLM compile the model (slower to start): its warm-up run is what allocates
    the buffer a later pipeline stage receives activations in, so pipeline parallelism needs it.
    `port`: the one to serve on, when its URL must be known before (default: a free one)."""

    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        *,
        core: int,
        block_size: int,
        dtype: str = "float32",
        kv_transfer_config: Optional[str] = None,
        env: Optional[dict[str, str]] = None,
        extra_args: Optional[list[str]] = None,
        eager: bool = True,
        port: Optional[int] = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.block_size = block_size
        argv = [
            str(vllm_bin()), "serve", str(model),
            "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(block_size),
            "--max-model-len", "2048",
            "--max-num-seqs", "32",
            *(["--enforce-eager"] if eager else []),
            "--dtype", dtype,
            "--shutdown-timeout", "5",
        ]  # fmt: skip
        if kv_transfer_config:
            argv += ["--kv-transfer-config", kv_transfer_config]
        argv += extra_args or []
        full_env = dict(os.environ)
        full_env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_LOGGING_LEVEL": "INFO",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        full_env.update(env or {})
        super().__init__(name, argv, full_env, log_dir)

    def wait_ready(self, deadline: float) -> None:
        while True:
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready within its deadline:\n{self.log_tail()}")
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics, `name{labels}` → value."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name` over the series whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.match(r"^([^{]+)(?:\{(.*)\})?$", key)
            if not m or m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += value
        return total


class PdflowProxy(Process):
    """`pdflow proxy` with vLLM's proxy arguments; its ready line gives its address."""

    def __init__(
        self,
        name: str,
        prefill: list[tuple[str, int]],
        decode: list[str],
        log_dir: Path,
        env: Optional[dict] = None,
        extra_args: Optional[list[str]] = None,
    ):
        argv = [str(pdflow_bin()), "proxy", "--port", "0"]
        for url, bootstrap_port in prefill:
            argv += ["--prefill", url, str(bootstrap_port)]
        for url in decode:
            argv += ["--decode", url]
        argv += extra_args or []
        full_env = dict(os.environ)
        full_env.update(env or {})
        super().__init__(name, argv, full_env, log_dir)
        self.url = ""

    def wait_ready(self, deadline: float) -> None:
        """The ready line gives the address once the proxy listens; its `/health` answers 200 once
        every P has an engine id and every D answered (the first probe round), as a user would wait."""
        while time.monotonic() < deadline:
            if not self.url:
                for line in self.log_text().splitlines():
                    if line.startswith("{") and '"ready"' in line:
                        self.url = "http://" + json.loads(line)["addr"]
            if self.url:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            if not self.alive():
                raise AssertionError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready in time (url {self.url or 'not printed'}):\n{self.log_tail()}")


#: Deadlines of the sharded servers' tests. Two ranks on one core make P's forward slow, its first
#: most of all (24 s for MLA at TP 2 on this machine, past 30 s on a slower one), so P waits for
#: its prefill longer than vLLM's default 30 s, and D's pull (which P's answer ends) longer still.
SHARDED_P_READY_S = 120
SHARDED_D_PULL_S = 180


def sharded_server(
    name: str,
    model: Path,
    log_dir: Path,
    role: str,
    *,
    core: int,
    block_size: int,
    parallel_flag: str,
    size: int,
    eager: bool = True,
    extra: Optional[dict] = None,
    args: Optional[list[str]] = None,
) -> VllmServer:
    """A P (`kv_producer`), D (`kv_consumer`) or both (`kv_both`) `vllm serve` with pdflow's
    connector at `size` ranks of one kind (`parallel_flag`: `--tensor-parallel-size`,
    `--pipeline-parallel-size`), `verify_checksums` on, D failing a load it cannot make. Every rank
    shares the server's core: with a rank on the other server's core, the prefill was not served
    within D's deadline (docs/vllm-cpu.md). `extra` adds to the connector's extra config (P's
    `bootstrap_port`); `args` adds to `vllm serve`'s arguments."""
    deadline: dict[str, Any] = {}
    if role in ("kv_producer", "kv_both"):
        deadline["abort_request_timeout_s"] = SHARDED_P_READY_S
    if role in ("kv_consumer", "kv_both"):
        deadline["pull_timeout_s"] = SHARDED_D_PULL_S
    cfg = connector_config(role, policy=None if role == "kv_producer" else "fail",
                           extra={"verify_checksums": True, **deadline, **(extra or {})}, engine_id=name)  # fmt: skip
    sharded = size > 1
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join([str(core)] * size)} if sharded else None
    flags = [parallel_flag, str(size), "--distributed-executor-backend", "mp"] if sharded else []
    flags += args or []
    return VllmServer(name, model, log_dir, core=core, block_size=block_size, kv_transfer_config=cfg,
                      env=env, extra_args=flags, eager=eager)  # fmt: skip


class BothWays:
    """Two `kv_both` servers of one model at different sizes (`big` on core 0, `small` on core
    1), each with its own bootstrap, started once for a module's tests: a test takes them as P → D
    either way (`big` → `small` or `small` → `big`), behind a `pdflow proxy` of its own. One
    start-up serves both directions, where a P and a D per direction took two."""

    def __init__(self, tag: str, model: Path, log_dir: Path, *, block_size: int, parallel_flag: str, big: int,
                 small: int = 1, eager: bool = True, args: Optional[list[str]] = None):  # fmt: skip
        self.log_dir = log_dir
        self.tag = tag
        self.ports: dict[int, int] = {}
        self.servers: dict[int, VllmServer] = {}
        for size, core in ((big, 0), (small, 1)):
            port = free_port()
            self.ports[size] = port
            self.servers[size] = sharded_server(f"{tag}{size}", model, log_dir, "kv_both", core=core,
                                                block_size=block_size, parallel_flag=parallel_flag, size=size,
                                                eager=eager, extra={"bootstrap_port": port}, args=args)  # fmt: skip

    def start(self) -> "BothWays":
        """Waits for both servers and warms each up; stops both if either fails."""
        try:
            start_all(list(self.servers.values()))
            warm_up(*self.servers.values())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()

    @contextmanager
    def p_to_d(self, p_size: int, d_size: int) -> Iterator[tuple[VllmServer, VllmServer, PdflowProxy]]:
        """P (the server of `p_size`) and D (of `d_size`) behind a new `pdflow proxy`; stopped on
        the way out."""
        assert p_size != d_size, "one server is not both P and D of a request here"
        p, d = self.servers[p_size], self.servers[d_size]
        proxy = PdflowProxy(f"proxy-{self.tag}{p_size}{d_size}", [(p.url, self.ports[p_size])], [d.url], self.log_dir)
        try:
            proxy.wait_ready(time.monotonic() + 60)
            yield p, d, proxy
        finally:
            proxy.stop()


def greedy_body(prompt: list[int], max_tokens: int, **extra: Any) -> dict:
    """A greedy `/v1/completions` body with a token-id prompt that returns the token ids."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def warm_up(*servers: "VllmServer") -> None:
    """One short request to each server alone: a server's first forward pays one-time costs
    (kernel set-up, tens of seconds with two ranks on one core), here rather than inside the
    deadlines of the requests a test checks."""
    for s in servers:
        status, body = post(s.url + "/v1/completions", greedy_body(prompt_of(8, seed=1), 2))
        assert status == 200, f"{s.name}: warm-up: HTTP {status}: {body}\n{explain(s)}"


@contextmanager
def p_and_d_behind_proxy(
    p: VllmServer, d: VllmServer, bootstrap_port: int, log_dir: Path, name: str, *, stop_p: bool = True
) -> Iterator[PdflowProxy]:
    """Waits for P and D, warms each up, starts `pdflow proxy` in front of them and yields it once
    ready; stops all three on the way out, whatever happened (P not with `stop_p=False`: a server
    its fixture owns)."""
    proxy = None
    try:
        start_all([p, d])
        warm_up(p, d)
        proxy = PdflowProxy(name, [(p.url, bootstrap_port)], [d.url], log_dir)
        proxy.wait_ready(time.monotonic() + 60)
        yield proxy
    finally:
        if proxy:
            proxy.stop()
        for s in (d, p) if stop_p else (d,):
            s.stop()


def start_all(servers: list, deadline_s: float = READY_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    for s in servers:
        s.wait_ready(deadline)


# ------------------------------------------------------------------------------------ HTTP calls


def post(url: str, body: dict, timeout: float = REQUEST_DEADLINE_S, headers: Optional[dict] = None) -> tuple[int, Any]:
    """POSTs JSON; returns (status, parsed body or text)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


def stream(url: str, body: dict, timeout: float = REQUEST_DEADLINE_S) -> Iterator[dict]:
    """POSTs with `stream: true`; yields each server-sent event's JSON until `[DONE]`."""
    req = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def completion_tokens(base: str, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    """Greedy token ids of a `/v1/completions` request with a token-id prompt."""
    status, body = post(base + "/v1/completions", greedy_body(prompt, max_tokens, **extra))
    assert status == 200, f"{base}: HTTP {status}: {body}"
    return list(body["choices"][0]["token_ids"])


def completion_text(base: str, prompt: Any, max_tokens: int, *, streamed: bool = False) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if streamed:
        return "".join(ev["choices"][0].get("text", "") for ev in stream(base + "/v1/completions", body) if ev.get("choices"))
    status, out = post(base + "/v1/completions", body)
    assert status == 200, f"{base}: HTTP {status}: {out}"
    return out["choices"][0]["text"]


def chat_text(base: str, messages: list[dict], max_tokens: int, *, streamed: bool = False) -> str:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if streamed:
        out = []
        for ev in stream(base + "/v1/chat/completions", body):
            for choice in ev.get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
        return "".join(out)
    status, out = post(base + "/v1/chat/completions", body)
    assert status == 200, f"{base}: HTTP {status}: {out}"
    return out["choices"][0]["message"]["content"]


def wait_until(pred, what: str, timeout: float = 60.0, every: float = 0.25):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last!r})")
