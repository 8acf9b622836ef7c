"""Reading the trace files pdflow writes inside vLLM's processes (no vLLM import).

With ``PDFLOW_TRACE_FILE=DIR/NAME.json`` each process of a vLLM server that runs pdflow's actors
(engine core, workers) writes its own Jaeger JSON file, ``DIR/NAME.<pid>.json``, rewritten while
it runs. `trace_files` lists them; `read_spans` merges their spans, each as a plain dict.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

__all__ = ["trace_files", "read_spans"]


def trace_files(path: str) -> list[str]:
    """The per-process files written for ``PDFLOW_TRACE_FILE=path``, oldest first."""
    root, ext = os.path.splitext(path)
    pattern = re.compile(re.escape(os.path.basename(root)) + r"\.\d+" + re.escape(ext) + "$")
    found = [p for p in glob.glob(glob.escape(root) + ".*" + ext) if pattern.match(os.path.basename(p))]
    return sorted(found, key=os.path.getmtime)


def read_spans(path: str) -> list[dict[str, Any]]:
    """Every span of every per-process file of ``path``: ``trace_id``, ``span_id``, ``name``,
    ``step`` (0 for a span that is not a step), ``service``, ``start_us``, ``duration_us``, ``tags``
    (a dict) and ``file``."""
    spans = []
    for file in trace_files(path):
        with open(file) as f:
            doc = json.load(f)
        for trace in doc.get("data", []):
            services = {pid: p.get("serviceName", "") for pid, p in trace.get("processes", {}).items()}
            for span in trace.get("spans", []):
                name = span.get("operationName", "")
                m = re.match(r"step\.(\d+)\.", name)
                spans.append(
                    {
                        "trace_id": span.get("traceID"),
                        "span_id": span.get("spanID"),
                        "name": name,
                        "step": int(m.group(1)) if m else 0,
                        "service": services.get(span.get("processID"), ""),
                        "start_us": span.get("startTime", 0),
                        "duration_us": span.get("duration", 0),
                        "tags": {t["key"]: t["value"] for t in span.get("tags", [])},
                        "file": file,
                    }
                )
    return spans
