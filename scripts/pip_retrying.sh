# Sourced by the set-up scripts: `pip_retrying PYTHON ARGS...` runs `PYTHON -m pip install ARGS`,
# quiet and without pip's cache, and tries a whole run that fails again after a pause.
#
# The registry's downloads are sometimes cut mid-file (vLLM's wheel is 336 MB, torch's larger): pip
# resumes within one run where it can (--resume-retries). Nothing is kept in pip's cache: it would
# hold another copy of every wheel beside the installed environment, and a full disk has failed
# this step in CI; a retry fetches again instead.
pip_retrying() {
  local py=$1 attempt resume=()
  shift
  if "$py" -m pip install --help 2>/dev/null | grep -q -- --resume-retries; then
    resume=(--resume-retries 20)
  fi
  for attempt in 1 2 3 4 5 6; do
    "$py" -m pip install -q --no-cache-dir --retries 10 "${resume[@]}" "$@" && return 0
    [ "$attempt" = 6 ] && break
    echo "pip install $* failed (attempt $attempt of 6; $(df -h . 2>/dev/null | awk 'NR == 2 {print $4}') free); trying again in $((attempt * 20)) s" >&2
    sleep $((attempt * 20))
  done
  return 1
}
