"""Hook overhead through the bridge: each scheduler hook of PdflowConnector, called as vLLM's
Scheduler calls it (real Request objects), timed per call; the worker hooks too.

    python py-bridge/bench/hook_overhead.py [--calls N] [--json PATH]

Prints a table (median / p99 / min µs per call) and writes the project's bench JSON
({"rows": [{"name", "backend", "plan", "concurrency", "bytes", "median_ms", "min_ms", "max_ms",
"gbps"}]}). Target: under 20 µs per scheduler hook call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_harness as H  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402


def timed(fn, calls: int) -> list[float]:
    out = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.calls

    p = H.scheduler(H.vllm_config("kv_producer"))
    d = H.scheduler(H.vllm_config("kv_consumer"))
    pc, dc = p.connector, d.connector
    p_reqs = [H.request(H.p_params(f"xfer-b{i}"), prompt_len=64) for i in range(n)]
    d_reqs = [H.request(H.d_params(f"xfer-b{i}"), prompt_len=64, max_tokens=8) for i in range(n)]
    for r in p_reqs:
        r.status = H.RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = KVCacheBlocks(tuple([[]]))
    empty_out = KVConnectorOutput()

    rows: list[tuple[str, list[float]]] = []
    rows.append(("on_new_request (D)", timed(lambda i: dc.on_new_request(d_reqs[i]), n)))
    rows.append(("get_num_new_matched_tokens (D)", timed(lambda i: dc.get_num_new_matched_tokens(d_reqs[i], 0), n)))
    rows.append(("get_num_new_matched_tokens (P)", timed(lambda i: pc.get_num_new_matched_tokens(p_reqs[i], 0), n)))
    rows.append(("update_state_after_alloc (P)", timed(lambda i: pc.update_state_after_alloc(p_reqs[i], blocks, 0), n)))
    rows.append(("update_state_after_alloc (D, 4 blocks)", timed(lambda i: dc.update_state_after_alloc(d_reqs[i], _blocks(d, 4), 64), min(n, 2000))))
    rows.append(("build_connector_meta (empty)", timed(lambda i: pc.build_connector_meta(None), n)))
    rows.append(("request_finished (P, 4 blocks)", timed(lambda i: pc.request_finished(p_reqs[i], [1, 2, 3, 4]), n)))
    rows.append(("build_connector_meta (1 send)", timed(lambda i: (pc.request_finished(p_reqs[i], [1, 2, 3, 4]), pc.build_connector_meta(None)), n)))
    rows.append(("update_connector_output (empty)", timed(lambda i: pc.update_connector_output(empty_out), n)))
    rows.append(("update_connector_output (1 sent)", timed(lambda i: pc.update_connector_output(KVConnectorOutput(finished_sending={p_reqs[i].request_id})), n)))

    print(f"{'hook':44} {'median µs':>10} {'p99 µs':>10} {'min µs':>10}")
    json_rows = []
    for name, samples in rows:
        samples.sort()
        med = statistics.median(samples)
        p99 = samples[int(len(samples) * 0.99) - 1]
        print(f"{name:44} {med:10.2f} {p99:10.2f} {samples[0]:10.2f}")
        json_rows.append({
            "name": f"hook {name}", "backend": "py-bridge", "plan": None, "concurrency": 1, "bytes": None,
            "median_ms": med / 1000.0, "min_ms": samples[0] / 1000.0, "max_ms": samples[-1] / 1000.0, "gbps": None,
            "p99_ms": p99 / 1000.0, "calls": len(samples),
        })
    if args.json:
        args.json.write_text(json.dumps({"rows": json_rows}, indent=2))
    pc.shutdown()
    dc.shutdown()
    return 0


def _blocks(sched, k: int):
    pool = sched.kv_cache_manager.block_pool
    return KVCacheBlocks((pool.blocks[1 : 1 + k],))


if __name__ == "__main__":
    sys.exit(main())
