"""A stand-in vLLM engine in its own process, for the data-path test: vLLM's real Scheduler with
PdflowConnector (scheduler role), PdflowConnector's worker role over CPU torch tensors shaped as
vLLM 0.33 allocates them for the seed's model (LBHNC: 36 × [num_blocks, 8, 16, 256] bf16), and a
model runner that calls the worker connector as vLLM's does (bind metadata, start_load_kv,
wait_for_save, get_transfer_results, get_block_ids_with_load_errors, clear metadata).

The "model" writes a deterministic KV pattern for every prompt token it computes (P's prefill),
and D derives its tokens from the KV in its blocks, so a wrong byte changes D's output.
The test talks to it over a multiprocessing Pipe: add, status, stop.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from typing import Any

NUM_BLOCKS = 160


def kv_pattern(torch, token_ids, positions, layer: int):
    """The KV of (token, position) in `layer`: `[n, heads, 2*head_dim]`, exact in bf16."""
    h = torch.arange(8).view(1, 8, 1)
    d = torch.arange(256).view(1, 1, 256)
    v = (token_ids.view(-1, 1, 1) * 31 + positions.view(-1, 1, 1) * 7 + layer * 131 + h * 17 + d) % 251
    return v.to(torch.bfloat16)


def blocks_digest(torch, kv: dict, block_ids: list[int]) -> str:
    """sha256 of the blocks' bytes, layer-major (the order P's plan reads them)."""
    h = hashlib.sha256()
    idx = torch.tensor(block_ids, dtype=torch.long)
    for t in kv.values():
        h.update(t.index_select(0, idx).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def tokens_from_kv(torch, kv: dict, block_ids: list[int], n: int, count: int) -> list[int]:
    """D's stand-in sampler: a token stream seeded by the prompt's KV as it sits in D's blocks."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    seed = 0
    for t in kv.values():
        seed = (seed * 1_000_003 + int(t.index_select(0, idx).view(torch.int16).to(torch.int64).sum())) % (1 << 61)
    return [100 + (seed + i * 7919) % 50000 for i in range(count)]


def main(role: str, conn, extra: dict[str, Any], engine_id: str, env: dict[str, str] | None = None) -> None:
    import os

    os.environ.update(env or {})
    try:
        _serve(role, conn, extra, engine_id)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        raise


def _serve(role: str, conn, extra: dict[str, Any], engine_id: str) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    import vllm_harness as H
    from pdflow.vllm import PdflowConnector

    config = H.vllm_config(role, extra=extra, engine_id=engine_id)
    s = H.scheduler(config, num_blocks=NUM_BLOCKS)
    worker = PdflowConnector(config, KVConnectorRole.WORKER, H.kv_cache_config(NUM_BLOCKS))
    kv = {name: torch.zeros(NUM_BLOCKS, H.NUM_KV_HEADS, H.BLOCK_SIZE, 2 * H.HEAD_DIM, dtype=torch.bfloat16) for name in H.LAYER_NAMES}
    worker.register_kv_caches(kv)
    baseline = H.free_blocks(s)
    conn.send({"ready": True, "engine_id": engine_id, "info": worker._work().info(), "baseline": baseline})

    finished: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}  # tokens streamed so far, per request
    expected_tokens: dict[str, list[int]] = {}  # P: the stream D must produce from these blocks
    sent_digest: dict[str, str] = {}  # P: digest of the blocks handed to the worker to send
    recv_blocks: dict[str, list[int]] = {}  # D: the blocks each pull fills
    prompt_blocks: dict[str, list[int]] = {}  # D: all the prompt's blocks, once its KV is complete
    received: dict[str, dict[str, Any]] = {}  # D: what arrived, checked at finished_recving
    d_tokens: dict[str, list[int]] = {}
    failed: set[str] = set()
    stop = False

    def compute_prompt_kv(req, start: int, end: int) -> None:
        block_ids = s.kv_cache_manager.get_block_ids(req.request_id)[0]
        pos = torch.arange(start, end)
        tok = torch.tensor(req.prompt_token_ids[start:end], dtype=torch.long)
        b_idx = torch.tensor([block_ids[p // H.BLOCK_SIZE] for p in range(start, end)], dtype=torch.long)
        s_idx = pos % H.BLOCK_SIZE
        for layer, t in enumerate(kv.values()):
            t[b_idx, :, s_idx, :] = kv_pattern(torch, tok, pos, layer)

    def check_received(req_id: str) -> None:
        """At finished_recving: the request's blocks on D (any prefix D had cached plus what was
        loaded) against the model's pattern, and their digest, for the test to compare with P's."""
        req = s.requests[req_id]
        blocks = s.kv_cache_manager.get_block_ids(req_id)[0][: -(-req.num_prompt_tokens // H.BLOCK_SIZE)]
        n = req.num_prompt_tokens
        pos = torch.arange(n)
        tok = torch.tensor(req.prompt_token_ids[:n], dtype=torch.long)
        b_idx = torch.tensor([blocks[p // H.BLOCK_SIZE] for p in range(n)], dtype=torch.long)
        pattern_ok = all(torch.equal(t[b_idx, :, pos % H.BLOCK_SIZE, :], kv_pattern(torch, tok, pos, layer)) for layer, t in enumerate(kv.values()))
        block_bytes = sum(t[0].numel() * t.element_size() for t in kv.values())
        loaded = recv_blocks[req_id]
        received[req_id] = {
            "pattern_ok": pattern_ok,
            "digest": blocks_digest(torch, kv, blocks),
            "bytes": len(loaded) * block_bytes,
            "blocks": len(blocks),
            "loaded_blocks": len(loaded),
        }
        prompt_blocks[req_id] = blocks

    def step() -> None:
        out = s.schedule()
        meta = out.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        for req_id, (_, blocks) in meta.reqs_to_send.items():
            if blocks:
                sent_digest[req_id] = blocks_digest(torch, kv, blocks)
                expected_tokens[req_id] = tokens_from_kv(torch, kv, blocks, 0, 256)
        for pulls in meta.reqs_to_recv.values():
            for req_id, pull in pulls.items():
                recv_blocks[req_id] = pull["local_block_ids"]
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            req = s.requests[req_id]
            start = req.num_computed_tokens - n
            if start < req.num_prompt_tokens:
                compute_prompt_kv(req, start, min(req.num_computed_tokens, req.num_prompt_tokens))
            req_ids.append(req_id)
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])
                continue
            if role == "kv_consumer" and req_id in prompt_blocks:
                stream = d_tokens.setdefault(req_id, tokens_from_kv(torch, kv, prompt_blocks[req_id], req.num_prompt_tokens, 4096))
                sampled.append([stream[len(req.output_token_ids)]])
            else:
                sampled.append([7])
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        failed.update(results.failed_recving)
        for req_id in results.finished_recving - results.failed_recving:
            check_received(req_id)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
        )
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled, kv_connector_output=kv_out)
        for eco in s.update_from_output(out, mro).values():
            for o in eco.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = outputs.pop(o.request_id)

    while not stop:
        busy = s.has_requests()
        if conn.poll(0 if busy else 0.01):
            cmd, arg = conn.recv()
            if cmd == "add":
                params = arg.get("params")
                req = H.request(params, prompt_len=arg["prompt_len"], max_tokens=arg["max_tokens"], request_id=arg["request_id"], salt=arg["salt"])
                s.add_request(req)
                conn.send({"added": req.request_id})
            elif cmd == "status":
                conn.send({
                    "finished": finished,
                    "free_blocks": H.free_blocks(s),
                    "baseline": baseline,
                    "sent_digest": sent_digest,
                    "expected_tokens": expected_tokens,
                    "received": received,
                    "failed": sorted(failed),
                    "busy": s.has_requests(),
                })
            elif cmd == "stop":
                stop = True
        if s.has_requests():
            step()
        elif role == "kv_producer":
            # P answers pulls between steps; keep collecting finished_sending while idle.
            time.sleep(0.001)
    worker.shutdown()
    s.connector.shutdown()
    conn.send({"stopped": True})
