#!/usr/bin/env bash
# Whether libfabric's software tcp provider takes CUDA device memory for one-sided writes
# (FI_HMEM_CUDA), in a verbs NIC's registration modes: `build` on the development machine (needs
# libfabric-dev) makes target/rdma-gpu-probe/ (the probe and the libfabric it links, with its
# libraries); `run` on the GPU machine runs it from there and prints its RESULT lines.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/rdma-gpu-probe
case "${1:-}" in
  build)
    mkdir -p "$out/lib"
    gcc -O1 scripts/device/rdma_gpu_probe.c -o "$out/gpu_probe" -lfabric -lpthread -ldl
    lib=$(ldconfig -p | awk '/libfabric.so.1 /{print $NF; exit}')
    cp -L "$lib" "$out/lib/"
    for dep in $(ldd "$lib" | awk '/=>/{print $3}' | grep -v 'libc.so'); do cp -L "$dep" "$out/lib/"; done
    echo "built $out: carry it to the GPU machine and run: scripts/device/rdma_gpu_probe.sh run"
    ;;
  run)
    LD_LIBRARY_PATH="$PWD/$out/lib" "$out/gpu_probe"
    ;;
  *)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
