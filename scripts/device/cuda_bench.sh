#!/usr/bin/env bash
# The one device call for the cuda transfer bench (nvidia-h200-x2). Builds nothing: runs
# binaries built on the dev machine and carried:
#   cargo build --release --features cuda --bin pdflow          -> stripped copy in target/cuda-carry/pdflow
#   cargo test -p pdflow-{kv,transfer,sim-engine} --features cuda --lib --no-run -> target/cuda-carry/cuda-tests/ (stripped copies)
# (carry: target/cuda-carry)
# Every step has its own timeout; together they stay under the device tool's 10-minute call.
# Writes its log and JSON under $OUT (default: target/device-results/<UTC time>_cuda_bench/).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(cd "$(dirname "$0")/../.." && pwd)/target/device-results/$(date -u +%Y-%m-%dT%H%M)_cuda_bench}; mkdir -p "$OUT"
PDFLOW=${PDFLOW:-target/cuda-carry/pdflow}
T0=$SECONDS
elapsed() { echo "-- $1 done at +$((SECONDS - T0)) s"; }
TESTS=${TESTS:-target/cuda-carry/cuda-tests}
{
  echo "== machine"; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  . "$(dirname "$0")/nvrtc_env.sh"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ldd "$PDFLOW" | grep -i 'not found' && echo "missing shared libraries"
  echo "== cuda tests (GPU)"
  for t in "$TESTS"/*; do
    timeout 90 "$t" cuda --nocapture; rc=$?; echo "tests $(basename "$t") rc=$rc"
  done; elapsed tests
  echo "== pdflow bench transfer --device cuda (one process, separate processes over CUDA IPC, staged tcp)"
  timeout 420 "$PDFLOW" bench transfer --device cuda --runs 20 --json "$OUT/cuda_bench.json"; echo "bench rc=$?"; elapsed bench
  echo "== torch cross-check of the peer-copy ceiling"
  timeout 40 python3 - <<'PY'
import torch
n = torch.cuda.device_count(); print("torch sees", n, "GPUs")
if n >= 2:
    a = torch.empty(148635648, dtype=torch.uint8, device="cuda:0"); b = torch.empty_like(a, device="cuda:1")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); t = []
    for i in range(23):
        s.record(); b.copy_(a, non_blocking=True); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    t = sorted(t[3:]); print("torch peer copy median ms %.3f" % t[len(t)//2])
PY
} 2>&1 | tee "$OUT/cuda_bench.txt"
