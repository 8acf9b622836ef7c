"""The seed's request through two processes — P and D, each vLLM's real Scheduler with
PdflowConnector and its worker role over CPU KV tensors of the seed's model — with the KV moving
through pdflow's actors and the tcp transfer engine. D's blocks are checked byte for byte (sha256
against P's blocks as handed to the worker, and every prompt slot against the model's pattern),
and D's 128 tokens, derived from the KV in its blocks, must equal the reference derived from P's.
"""

import multiprocessing as mp
import socket
import time

import pytest
from pdflow.traces import read_spans

import engine_process
from vllm_harness import SEED_PROMPT, d_params, p_params

SEED_BYTES = 148_635_648
READY_DEADLINE_S = 240
REQUEST_DEADLINE_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Engine:
    def __init__(self, ctx, role: str, extra: dict, engine_id: str, env: dict):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_process.main, args=(role, child, extra, engine_id, env), daemon=True)
        self.proc.start()
        self.ready = None
        self.stopped = False
        self.trace_file = env.get("PDFLOW_TRACE_FILE")

    def wait_ready(self, deadline: float) -> dict:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("engine process not ready in time")
        msg = self.conn.recv()
        assert "error" not in msg, msg.get("error")
        self.ready = msg
        return msg

    def call(self, cmd: str, arg=None, timeout: float = 30.0) -> dict:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine did not answer {cmd!r} within {timeout} s")
        msg = self.conn.recv()
        assert "error" not in msg, msg.get("error")
        return msg

    def wait(self, pred, what: str, timeout: float = REQUEST_DEADLINE_S) -> dict:
        end = time.monotonic() + timeout
        while True:
            st = self.call("status")
            if pred(st):
                return st
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not reached within {timeout} s; last status {st}")
            time.sleep(0.05)

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        try:
            self.call("stop", timeout=30)
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    ctx = mp.get_context("spawn")
    port = free_port()
    traces = tmp_path_factory.mktemp("traces")
    p = Engine(ctx, "kv_producer", {"bootstrap_port": port, "transport": "tcp"}, "p-engine-datapath", {"PDFLOW_TRACE_FILE": str(traces / "p.json")})
    d = Engine(ctx, "kv_consumer", {"transport": "tcp"}, "d-engine-datapath", {"PDFLOW_TRACE_FILE": str(traces / "d.json")})
    try:
        deadline = time.monotonic() + READY_DEADLINE_S
        p.wait_ready(deadline)
        d.wait_ready(deadline)
        yield p, d, f"http://127.0.0.1:{port}"
    finally:
        for e in (p, d):
            try:
                e.stop()
            except Exception:
                e.proc.kill()


def run_request(p, d, bootstrap, n: int, prompt_len: int, max_tokens: int, salt=None):
    """Proxy's order (seed steps 9-10): P first with max_tokens=1, then D with P's address."""
    salt = n if salt is None else salt
    transfer_id = f"xfer-datapath-{n}"
    rid = f"dp-{n}"
    p.call("add", {"request_id": f"{rid}-p", "prompt_len": prompt_len, "salt": salt, "max_tokens": 1, "params": p_params(transfer_id)})
    p.wait(lambda st: f"{rid}-p" in st["finished"], "P's prefill")
    d.call("add", {
        "request_id": f"{rid}-d",
        "prompt_len": prompt_len,
        "salt": salt,
        "max_tokens": max_tokens,
        "params": d_params(transfer_id, bootstrap, p.ready["engine_id"]),
    })
    return f"{rid}-p", f"{rid}-d"


def test_seed_request_kv_moves_p_to_d_byte_for_byte_through_the_actors(engines):
    p, d, bootstrap = engines
    p_id, d_id = run_request(p, d, bootstrap, 1, SEED_PROMPT, 128)
    dst = d.wait(lambda st: d_id in st["finished"], "D's 128 tokens")
    pst = p.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "P frees after finished_sending")
    got = dst["received"][d_id]
    assert got["blocks"] == 63 and got["loaded_blocks"] == 63 and got["bytes"] == SEED_BYTES
    assert got["pattern_ok"], "every prompt slot on D holds P's KV"
    assert got["digest"] == pst["sent_digest"][p_id], "D's blocks equal P's, byte for byte"
    assert dst["finished"][d_id] == pst["expected_tokens"][p_id][:128], "D's 128 tokens come from P's KV"
    d.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "D frees after finishing")


def test_concurrent_requests_each_get_their_own_kv(engines):
    p, d, bootstrap = engines
    ids = [run_request(p, d, bootstrap, 10 + i, 100 + 250 * i, 8) for i in range(4)]
    dst = d.wait(lambda st: all(did in st["finished"] for _, did in ids), "D finishes all four")
    pst = p.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "P frees all four")
    digests = set()
    for pid, did in ids:
        got = dst["received"][did]
        assert got["pattern_ok"] and got["digest"] == pst["sent_digest"][pid]
        assert dst["finished"][did] == pst["expected_tokens"][pid][:8]
        digests.add(got["digest"])
    assert len(digests) == 4, "four different prompts, four different KVs"
    assert not dst["failed"]
    d.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "D frees all four")


def test_a_prompt_d_has_cached_loads_only_the_rest(engines):
    p, d, bootstrap = engines
    first = run_request(p, d, bootstrap, 20, 600, 2, salt=77)
    d.wait(lambda st: first[1] in st["finished"], "the first request")
    p.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "P frees the first")
    # Same prompt again: D's prefix cache holds its full blocks, so it pulls only the last one and
    # P sends the tail of its blocks.
    p_id, d_id = run_request(p, d, bootstrap, 21, 600, 8, salt=77)
    dst = d.wait(lambda st: d_id in st["finished"], "the second request")
    pst = p.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "P frees the second")
    got = dst["received"][d_id]
    assert got["loaded_blocks"] < got["blocks"] == 38, got
    assert got["pattern_ok"] and got["digest"] == pst["sent_digest"][p_id]
    assert dst["finished"][d_id] == pst["expected_tokens"][p_id][:8]
    d.wait(lambda st: st["free_blocks"] == st["baseline"] and not st["busy"], "D frees")


def spans_by_step(path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for span in read_spans(path):
        if span["step"]:
            out.setdefault(span["step"], []).append(span["tags"])
    return out


def test_zz_the_actors_step_spans_are_exported_from_the_engine_processes(engines):
    """Runs last: stops both engines (their connectors flush PDFLOW_TRACE_FILE on shutdown)."""
    p, d, _ = engines
    p.stop()
    d.stop()
    p_steps, d_steps = spans_by_step(p.trace_file), spans_by_step(d.trace_file)
    # P: registration, the pending send, the blocks to send, the plan, the write, the report.
    assert {4, 13, 26, 28, 29, 32} <= set(p_steps), sorted(p_steps)
    # D: the pull in the metadata, the load started, its result, the report.
    assert {18, 19, 34, 35} <= set(d_steps), sorted(d_steps)
    seed_writes = [t for t in p_steps[29] if t.get("pd.transfer_id") == "xfer-datapath-1"]
    assert seed_writes and int(seed_writes[0]["pd.bytes"]) == SEED_BYTES, p_steps[29][:2]
