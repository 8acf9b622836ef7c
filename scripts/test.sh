#!/usr/bin/env bash
# Runs every pdflow test on a fresh machine: installs what the tests need, builds the `pdflow`
# binary (the process-level tests start it), then runs the workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is required (https://rustup.rs); this machine's image ships it" >&2
  exit 1
fi

# The process-level tests run target/debug/pdflow.
cargo build --locked --bin pdflow
cargo test --locked --workspace -- --test-threads="${PDFLOW_TEST_THREADS:-2}"
