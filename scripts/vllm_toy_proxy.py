"""Fetches vLLM's example P/D proxy, `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`
(the proxy vLLM's MooncakeConnector and NixlConnector guides start), out of vLLM's source
distribution on PyPI, checked against the sha256 the index gives, and prints the path it wrote.

It is not in vLLM's wheel, and its code is not pdflow's to commit: the real-`vllm serve` tests run
it in front of pdflow-connected engines from this copy (PDFLOW_VLLM_TOY_PROXY). Reused when the
copy is already there.

    python3 scripts/vllm_toy_proxy.py [VERSION] [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import html.parser
import io
import os
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

MEMBER = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
DEADLINE_S = 120


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _index() -> str:
    base = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    return f"{base}/vllm/"


def _get(url: str) -> bytes:
    last = None
    for attempt in range(4):
        try:
            with urllib.request.urlopen(url, timeout=DEADLINE_S) as r:
                return r.read()
        except OSError as e:  # a cut download or a refused connection: try again
            last = e
            time.sleep(5 * (attempt + 1))
    raise SystemExit(f"could not download {url}: {last}")


def fetch(version: str, out_dir: Path) -> Path:
    out = out_dir / f"vllm-{version}" / "toy_proxy_server.py"
    if out.exists():
        return out
    sdist = f"vllm-{version}.tar.gz"
    links = _Links()
    links.feed(_get(_index()).decode())
    found = [h for h in links.hrefs if h.split("#")[0].endswith("/" + sdist)]
    if not found:
        raise SystemExit(f"{_index()} lists no {sdist}")
    url, _, fragment = urllib.parse.urljoin(_index(), found[0]).partition("#")
    data = _get(url)
    if fragment.startswith("sha256="):
        digest = hashlib.sha256(data).hexdigest()
        if digest != fragment.removeprefix("sha256="):
            raise SystemExit(f"{sdist}: sha256 {digest} is not the index's {fragment}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(f"vllm-{version}/{MEMBER}")
        if member is None:
            raise SystemExit(f"{sdist} holds no {MEMBER}")
        text = member.read()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(text)
    tmp.replace(out)
    return out


if __name__ == "__main__":
    version = sys.argv[1] if len(sys.argv) > 1 else "0.33.0"
    out_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("target/vllm-sources")
    print(fetch(version, out_dir))
