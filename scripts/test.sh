#!/usr/bin/env bash
# Runs every pdflow test on a fresh machine: installs what the tests need, builds the `pdflow`
# binary (the process-level tests start it), then runs the workspace's tests and prints one
# closing line with the totals.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is required (https://rustup.rs); this machine's image ships it" >&2
  exit 1
fi

# Headless Chromium for the timeline screenshot test (it skips, saying so, when this fails).
if ! command -v chromium >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) >/dev/null 2>&1 \
    || echo "note: could not install chromium; the timeline screenshot test will skip" >&2
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT

# The process-level tests run target/debug/pdflow.
cargo build --locked --bin pdflow
status=0
cargo test --locked --workspace -- --test-threads="${PDFLOW_TEST_THREADS:-2}" 2>&1 | tee "$log" || status=$?

# The `cuda` feature builds everywhere (the driver is loaded at run time); without a GPU its tests
# skip, saying why.
cargo test --locked -p pdflow-runtime --features cuda --lib transfer::cuda -- --nocapture 2>&1 | tee -a "$log" || status=$?

passed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
echo
echo "tests: ${passed} passed, ${failed} failed"
exit "$status"
