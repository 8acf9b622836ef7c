#!/usr/bin/env bash
# `pdflow demo` across topologies: P and D tensor-parallel sizes in {1,2,4}², 2 KV heads at tp 4
# (replicated heads), pipeline stages, and a DeepSeek-V3-shaped MLA cache. One line per cell:
# name, verified, KV bytes moved, D ranks checked, problems. PDFLOW_BIN picks the binary.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${PDFLOW_BIN:-target/release/pdflow}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
run() {
  local name=$1
  shift
  if timeout 600 "$bin" demo --max-tokens 8 --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1; then
    python3 -c "import json; r = json.load(open('$out/$name.json')); print('$name', r['verified'], r['kv_bytes'], len(r['rank_checks']), r['problems'])"
  else
    echo "$name did not run: $(tail -3 "$out/$name.log")"
    status=1
  fi
}
for p in 1 2 4; do
  for d in 1 2 4; do run "tp$p-to-tp$d" --prefill-tp "$p" --decode-tp "$d"; done
done
run "2heads-tp4-to-tp1" --kv-shape 36,2,128,16 --prefill-tp 4 --decode-tp 1
run "2heads-tp1-to-tp4" --kv-shape 36,2,128,16 --prefill-tp 1 --decode-tp 4
run "2heads-tp4-to-tp2" --kv-shape 36,2,128,16 --prefill-tp 4 --decode-tp 2
run "pp2-to-pp1" --prefill-pp 2
run "pp2-to-tp2" --prefill-pp 2 --decode-tp 2
run "tp2-to-pp2" --prefill-tp 2 --decode-pp 2
run "mla-tp1-to-tp1" --mla
run "mla-tp4-to-tp2" --mla --prefill-tp 4 --decode-tp 2
run "mla-tp2-to-tp4" --mla --prefill-tp 2 --decode-tp 4
exit $status
