"""CUDA KV tensors through the bridge: P's and D's worker connectors over torch CUDA
tensors in two processes, driven through ``pdflow._native`` as vLLM's scheduler and model runner
would drive them (no vLLM is needed: the GPU machine has none). P's prefilled blocks reach D's
tensors by ``cuda-ipc`` (P's kernel writes D's memory under D's fence) or, with
``gpu_path: staged``, by ``cuda-staged`` (tcp through pinned host buffers, the cross-host path);
D's blocks are compared byte for byte with P's, and step 29's span names the path taken.

The GPU cases skip, saying why, unless torch sees a CUDA GPU and the wheel was built with
``--features cuda`` (``scripts/device/gpu_kv.sh`` runs them on the device machine);
``PDFLOW_TEST_GPUS=P,D`` chooses the GPUs (default ``0,0``; ``0,1`` on a machine with two). The
same drive over host tensors (``tcp``) runs everywhere, so the hand-played hooks stay right.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest
from pdflow.traces import read_spans

LAYERS, HEADS, BLOCK, HEAD_DIM, NUM_BLOCKS = 4, 2, 16, 64, 64
DEADLINE_S = 60


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    from pdflow import _native

    if not _native.GPU_KV:
        return "this pdflow wheel was built without --features cuda"
    return None


def _gpus() -> tuple[int, int]:
    p, d = os.environ.get("PDFLOW_TEST_GPUS", "0,0").split(",")
    return int(p), int(d)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pattern(torch, layer: int, block_ids: list[int], salt: int, device: str):
    """P's prefill: a value per (layer, block, head, slot, element), exact in bf16."""
    b = torch.tensor(block_ids, device=device).view(-1, 1, 1, 1)
    h = torch.arange(HEADS, device=device).view(1, -1, 1, 1)
    s = torch.arange(BLOCK, device=device).view(1, 1, -1, 1)
    e = torch.arange(2 * HEAD_DIM, device=device).view(1, 1, 1, -1)
    return ((b * 7 + h * 13 + s * 3 + e + layer * 31 + salt) % 251).to(torch.bfloat16)


def _digest(torch, kv: dict, block_ids: list[int]) -> str:
    h = hashlib.sha256()
    idx = torch.tensor(block_ids, dtype=torch.long, device=next(iter(kv.values())).device)
    for t in kv.values():
        h.update(t.index_select(0, idx).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()


def _engine(role: str, conn, engine_id: str, extra: dict, gpu: int, env: dict) -> None:
    os.environ.update(env)
    try:
        _serve(role, conn, engine_id, extra, gpu)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        raise


def _serve(role: str, conn, engine_id: str, extra: dict, gpu: int) -> None:
    import torch

    from pdflow import _native
    from pdflow.kv_regions import regions_of

    device = "cpu" if gpu is None else f"cuda:{gpu}"
    _native.install_trace_export()
    kv = {f"layer.{i}": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16, device=device) for i in range(LAYERS)}
    sched = _native.SchedulerConnector(engine_id, role)
    worker = _native.WorkerConnector(engine_id, role, json.dumps(extra))
    r = regions_of(kv)
    assert r.device == gpu, r.device
    info = worker.register_kv_caches(r.regions, r.geometry, r.owners, r.device)
    conn.send({"ready": True, "info": info})

    def step(meta_frame):
        if meta_frame:
            worker.start_load_kv(meta_frame)

    def wait_results(req: str, want: str) -> dict:
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            sending, recving, failed = worker.get_transfer_results()
            done = sending if want == "sent" else recving
            if req in done:
                return {"failed": req in failed, "errors": worker.get_block_ids_with_load_errors()}
            time.sleep(0.005)
        raise TimeoutError(f"{req}: not {want} within {DEADLINE_S} s")

    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            worker.shutdown()
            sched.shutdown()
            _native.flush_traces()
            conn.send({"stopped": True})
            return
        if cmd == "prefill":  # P: seed steps 11-13, 15 (the model writes KV), 23, 26
            req, xfer, n, blocks, salt = arg
            params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": xfer}
            assert sched.on_new_request(req, n, params) is None
            assert sched.get_num_new_matched_tokens(req, n, 0, params) == (0, False), "P computes its prompt"
            sched.update_state_after_alloc(req, n, params, blocks, 0)
            step(sched.build_connector_meta())
            for i, t in enumerate(kv.values()):
                t[blocks] = _pattern(torch, i, blocks, salt, device)
            if gpu is not None:
                torch.cuda.synchronize(gpu)
            delay, out = sched.request_finished(req, n, params, "FINISHED_LENGTH_CAPPED", blocks)
            assert delay, "P keeps the blocks until D has them"
            step(sched.build_connector_meta())
            conn.send({"digest": _digest(torch, kv, blocks), "params": out})
        elif cmd == "wait_sent":  # P: steps 32-33
            req = arg
            got = wait_results(req, "sent")
            sched.update_connector_output(finished_sending=[req])
            conn.send(got)
        elif cmd == "pull":  # D: steps 16-19, then 35-36
            req, xfer, n, blocks, bootstrap, p_engine = arg
            params = {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": xfer,
                "remote_bootstrap_addr": bootstrap,
                "remote_engine_id": p_engine,
            }
            assert sched.on_new_request(req, n, params) is None
            count, load_async = sched.get_num_new_matched_tokens(req, n, 0, params)
            assert load_async and count > 0, (count, load_async)
            sched.update_state_after_alloc(req, n, params, blocks, count)
            step(sched.build_connector_meta())
            got = wait_results(req, "recving")
            sched.update_connector_output(finished_recving=[req], failed_recving=[req] if got["failed"] else [])
            if gpu is not None:
                torch.cuda.synchronize(gpu)
            got["digest"] = _digest(torch, kv, blocks)
            conn.send(got)
        else:
            conn.send({"error": f"unknown command {cmd!r}"})


class _Engine:
    def __init__(self, ctx, role: str, engine_id: str, extra: dict, gpu: int, env: dict):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(role, child, engine_id, extra, gpu, env), daemon=True)
        self.proc.start()
        self.ready = self._answer(DEADLINE_S * 2)

    def _answer(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError("the engine process did not answer in time")
        msg = self.conn.recv()
        assert "error" not in msg, msg["error"]
        return msg

    def call(self, cmd: str, arg=None) -> dict:
        self.conn.send((cmd, arg))
        return self._answer(DEADLINE_S + 10)

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def _step_29_backends(path: str) -> list[str]:
    return [s["tags"].get("pd.backend") for s in read_spans(path) if s["step"] == 29]


@pytest.mark.parametrize("gpu_path, backend", [("host", "tcp"), ("auto", "cuda-ipc"), ("staged", "cuda-staged")])
def test_kv_tensors_move_between_two_worker_processes(tmp_path, gpu_path, backend):
    if gpu_path == "host":
        pytest.importorskip("torch")
        p_gpu = d_gpu = None
        extra = {"transport": "tcp"}
    else:
        reason = _skip_reason()
        if reason:
            pytest.skip(f"CUDA KV tensors through the bridge: {reason}")
        p_gpu, d_gpu = _gpus()
        extra = {"gpu_path": gpu_path}
    ctx = mp.get_context("spawn")
    port = _free_port()
    token = {"auth_token": "bridge-gpu-secret"}
    p_trace = str(tmp_path / "p.json")
    p = _Engine(ctx, "kv_producer", f"p-{gpu_path}", {"bootstrap_port": port, **extra, **token}, p_gpu, {"PDFLOW_TRACE_FILE": p_trace})
    d = _Engine(ctx, "kv_consumer", f"d-{gpu_path}", dict(token), d_gpu, {})
    stopped = False
    try:
        memory = (lambda g: "host" if g is None else f"cuda:{g}")
        assert p.ready["info"]["kv_memory"] == memory(p_gpu), p.ready
        assert d.ready["info"]["kv_memory"] == memory(d_gpu), d.ready
        bootstrap = p.ready["info"]["bootstrap_url"]
        # Two requests, the second into other and scattered blocks on both sides.
        for i, (p_blocks, d_blocks) in enumerate([(list(range(0, 10)), list(range(20, 30))), ([3, 40, 7, 63, 12], [50, 1, 33, 9, 60])]):
            n = len(p_blocks) * BLOCK - 5
            xfer = f"xfer-{gpu_path}-{i}"
            sent = p.call("prefill", (f"p-req-{i}", xfer, n, p_blocks, 17 + i))
            got = d.call("pull", (f"d-req-{i}", xfer, n, d_blocks, bootstrap, f"p-{gpu_path}"))
            assert not got["failed"] and not got["errors"], got
            assert got["digest"] == sent["digest"], f"request {i}: D's blocks differ from P's"
            assert not p.call("wait_sent", f"p-req-{i}")["failed"]
        p.stop()
        d.stop()
        stopped = True
        backends = _step_29_backends(p_trace)
        assert backends == [backend, backend], f"step 29 went by {backends}, expected {backend} twice"
    finally:
        if not stopped:
            for e in (p, d):
                if e.proc.is_alive():
                    e.proc.kill()
