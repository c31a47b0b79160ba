#!/usr/bin/env bash
# The test suite on a hostile machine (issue 15): beside a busy core, and pinned to one core.
#   bash scripts/hostile.sh busy      # one core kept busy by another process while the suite runs
#   bash scripts/hostile.sh pinned    # the whole suite on one core (taskset -c 0)
#   bash scripts/hostile.sh           # both, one after the other
# Extra arguments after the mode go to pytest (e.g. `bash scripts/hostile.sh busy tests/test_server.py`).
# The busy core is Debian's stress-ng (installed by `scripts/setup.sh --test`), or a Python spinner
# where stress-ng is missing. Exits non-zero if any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-both}
[ $# -gt 0 ] && shift
case "$mode" in busy|pinned|both) ;; *) echo "usage: bash scripts/hostile.sh [busy|pinned|both] [pytest args]" >&2; exit 2 ;; esac

busy() {
  local spinner
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu 1 --timeout 1800s >/dev/null 2>&1 &
  else
    .venv/bin/python -c "while True: pass" &
  fi
  spinner=$!
  echo "hostile: one core busy (pid $spinner)"
  local status=0
  .venv/bin/python -m pytest "$@" || status=$?
  kill "$spinner" 2>/dev/null || true
  wait "$spinner" 2>/dev/null || true
  return "$status"
}

pinned() {
  echo "hostile: pinned to core 0"
  taskset -c 0 .venv/bin/python -m pytest "$@"
}

status=0
if [ "$mode" = busy ] || [ "$mode" = both ]; then busy "$@" || status=1; fi
if [ "$mode" = pinned ] || [ "$mode" = both ]; then pinned "$@" || status=1; fi
exit "$status"
