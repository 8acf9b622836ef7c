#!/usr/bin/env bash
# Issue 7: the one device call for the cuda transfer bench (nvidia-h200-x2). Builds nothing: runs
# binaries built on the dev machine and carried:
#   cargo build --release --features cuda --bin pdflow-cuda-bench --bin pdflow-cuda-ipc-bench --bin pdflow-cuda-staged-bench
#       -> target/release/pdflow-cuda-bench, target/release/pdflow-cuda-ipc-bench, target/release/pdflow-cuda-staged-bench
#   cargo test -p pdflow-runtime --features cuda --lib --no-run       -> stripped copy in target/cuda-carry/runtime-tests
# (carry: target/release/pdflow-cuda-bench, target/release/pdflow-cuda-ipc-bench,
#  target/release/pdflow-cuda-staged-bench, target/cuda-carry)
# Every step has its own timeout; together they stay under the device tool's 10-minute call.
# Writes its log and JSON under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/cuda-bench-out}; mkdir -p "$OUT"
BENCH=${BENCH:-target/release/pdflow-cuda-bench}
IPC_BENCH=${IPC_BENCH:-target/release/pdflow-cuda-ipc-bench}
STAGED_BENCH=${STAGED_BENCH:-target/release/pdflow-cuda-staged-bench}
T0=$SECONDS
elapsed() { echo "-- $1 done at +$((SECONDS - T0)) s"; }
TESTS=${TESTS:-target/cuda-carry/runtime-tests}
{
  echo "== machine"; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  echo "== nvrtc"
  NVRTC=$( (ls /usr/local/cuda/lib64/libnvrtc.so* 2>/dev/null; find / -xdev -name 'libnvrtc.so*' 2>/dev/null) | grep -v builtins | head -1)
  echo "found: ${NVRTC:-none}"
  if [ -n "$NVRTC" ]; then
    export LD_LIBRARY_PATH="$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # cudarc opens libnvrtc.so or libnvrtc.so.<major>: make sure one of those names exists.
    [ -e "$(dirname "$NVRTC")/libnvrtc.so" ] || { mkdir -p /tmp/nvrtc && ln -sf "$NVRTC" /tmp/nvrtc/libnvrtc.so && export LD_LIBRARY_PATH="/tmp/nvrtc:$LD_LIBRARY_PATH"; }
  fi
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ldd "$BENCH" | grep -i 'not found' && echo "missing shared libraries"
  echo "== cuda tests (GPU)"
  timeout 90 "$TESTS" transfer::cuda --nocapture; echo "tests rc=$?"; elapsed tests
  echo "== bench, one process"
  timeout 120 "$BENCH" --runs 20 --json "$OUT/cuda_bench.json"; echo "bench rc=$?"; elapsed bench
  echo "== bench, P and D in separate processes (CUDA IPC)"
  timeout 150 "$IPC_BENCH" --runs 30 --json "$OUT/cuda_ipc_bench.json"; echo "ipc bench rc=$?"; elapsed "ipc bench"
  echo "== cross-host path: tcp with pinned host staging on 127.0.0.1 (P GPU0, D GPU1) vs loopback TCP"
  timeout 180 "$STAGED_BENCH" --runs 20 --json "$OUT/cuda_staged_bench.json"; echo "staged bench rc=$?"; elapsed "staged bench"
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
