#!/usr/bin/env bash
# Builds, on the dev machine, what scripts/device/gpu_kv.sh runs on the device machine (which has
# no Rust toolchain), into target/cuda-carry (carry it: `carry: ["target/cuda-carry"]`):
#   pdflow            the `pdflow` binary with `--features cuda` (release, stripped)
#   cuda-tests/       the unit tests of pdflow-kv, pdflow-transfer and pdflow-sim-engine with
#                     `--features cuda` (release, stripped; each runs its `cuda` tests)
#   gpu-kv-processes  the separate-process GPU KV tests (stripped)
#   wheels/           the `pdflow` Python wheel with `--features cuda`, and pytest's pure-Python
#                     wheels (the device machine's python3 has torch, not pytest)
# Needs the venv of scripts/test.sh (.venv, with maturin) for the wheel; without it the wheel is
# left out and gpu_kv.sh skips the bridge, saying so.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=target/cuda-carry
mkdir -p "$CARRY/wheels"
# The test executable cargo built for target $1, from its JSON messages on stdin.
executable_of() {
  python3 -c 'import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]]
print(exes[-1])' "$1"
}

cargo build --locked --release --features cuda --bin pdflow
strip -o "$CARRY/pdflow" target/release/pdflow

mkdir -p "$CARRY/cuda-tests"
for crate in kv transfer sim-engine; do
  exe=$(cargo test --locked --release -p "pdflow-$crate" --features cuda --lib --no-run --message-format=json \
    | executable_of "pdflow_${crate//-/_}")
  strip -o "$CARRY/cuda-tests/$crate" "$exe"
done

# The integration tests' binary (it); gpu_kv.sh runs its gpu_kv_processes module.
exe=$(cargo test --locked -p pdflow-tests --test it --no-run --message-format=json | executable_of it)
strip -o "$CARRY/gpu-kv-processes" "$exe"

if [ -x .venv/bin/maturin ]; then
  rm -f "$CARRY"/wheels/pdflow-*.whl
  (cd py-bridge && PATH="$PWD/../.venv/bin:$PATH" ../.venv/bin/maturin build --release --features cuda -o "../$CARRY/wheels")
  if ! ls "$CARRY"/wheels/pytest-*.whl >/dev/null 2>&1; then
    .venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d "$CARRY/wheels" \
      pytest pluggy iniconfig packaging pygments
  fi
else
  echo "note: no .venv/bin/maturin (run ./scripts/test.sh once): the wheel is not built" >&2
fi
du -sh "$CARRY"/*
