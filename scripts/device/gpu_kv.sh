#!/usr/bin/env bash
# GPU-resident KV on the device machine, in one call (one GPU is enough; with two, P's KV
# is on GPU 0 and D's on GPU 1). Builds nothing: runs binaries built on the dev machine and carried
# (scripts/device/build_carry.sh builds them all):
#   cargo build --release --features cuda --bin pdflow          -> target/cuda-carry/pdflow (stripped copy)
#   cargo test -p pdflow-{kv,transfer,sim-engine} --features cuda --lib --no-run -> target/cuda-carry/cuda-tests/ (stripped copies)
#   cargo test -p pdflow-tests --test it --no-run  -> target/cuda-carry/gpu-kv-processes (stripped copy; its gpu_kv_processes module runs)
#   maturin build --release --features cuda (in py-bridge/)     -> target/cuda-carry/wheels/pdflow-*.whl
#   pip download pytest (pure-Python wheels)                    -> target/cuda-carry/wheels/
# (carry: target/cuda-carry). Writes its log, the demo's report and trace under $OUT
# (default: target/device-results/<UTC time>_gpu_kv/).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(cd "$(dirname "$0")/../.." && pwd)/target/device-results/$(date -u +%Y-%m-%dT%H%M)_gpu_kv}; mkdir -p "$OUT"
CARRY=${CARRY:-target/cuda-carry}
T0=$SECONDS
elapsed() { echo "-- $1 done at +$((SECONDS - T0)) s"; }
{
  echo "== machine"; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  . "$(dirname "$0")/nvrtc_env.sh"
  echo "== cuda tests (GPU)"
  for t in "$CARRY"/cuda-tests/*; do
    timeout 150 "$t" cuda --nocapture --test-threads 1; rc=$?; echo "tests $(basename "$t") rc=$rc"
  done; elapsed tests
  echo "== GPU KV with P and D as separate pdflow serve processes (cuda-ipc)"
  GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  PDFLOW_TEST_GPUS=$([ "$GPUS" -ge 2 ] && echo 0,1 || echo 0,0) PDFLOW_BIN="$PWD/$CARRY/pdflow" PDFLOW_TEST_LOG=1 \
    timeout 200 "$CARRY/gpu-kv-processes" gpu_kv_processes --nocapture --test-threads 1; echo "processes rc=$?"; elapsed processes
  echo "== pdflow demo --device cuda"
  timeout 150 "$CARRY/pdflow" demo --device cuda --json "$OUT/demo_cuda.json" --trace-file "$OUT/demo_cuda_trace.json"; echo "demo rc=$?"; elapsed demo
  echo "== pdflow demo --device cuda --gpu-path staged (the cross-host path, on loopback)"
  timeout 150 "$CARRY/pdflow" demo --device cuda --gpu-path staged --json "$OUT/demo_cuda_staged.json"; echo "demo staged rc=$?"; elapsed "demo staged"
  echo "== the vLLM bridge over CUDA KV tensors (torch, no vLLM)"
  if ls "$CARRY"/wheels/pdflow-*.whl >/dev/null 2>&1; then
    rm -rf /tmp/pyextra && python3 -m pip install -q --no-index --no-deps --target /tmp/pyextra "$CARRY"/wheels/*.whl 2>&1 | tail -3
    PYTHONPATH=/tmp/pyextra PDFLOW_TEST_GPUS=$([ "$GPUS" -ge 2 ] && echo 0,1 || echo 0,0) \
      timeout 300 python3 -m pytest -q -rs -p no:cacheprovider py-bridge/tests/test_cuda_tensors.py; echo "bridge rc=$?"
  else
    echo "no pdflow wheel carried: skipped"
  fi
  elapsed bridge
  echo "== pdflow demo (host KV, same machine, for comparison)"
  timeout 150 "$CARRY/pdflow" demo --json "$OUT/demo_host.json"; echo "demo host rc=$?"; elapsed "demo host"
  for extra in "$@"; do echo "== $extra"; timeout 200 bash -c "$extra"; echo "rc=$?"; elapsed "$extra"; done
} 2>&1 | tee "$OUT/gpu_kv.txt"
