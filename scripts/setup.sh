#!/usr/bin/env bash
# Set up everything the server and its tests need, idempotently, in ./.venv:
#   bash scripts/setup.sh          # server: venv, torch, the package, the offline tiny model
#   bash scripts/setup.sh --test   # also the test tools (and the browser for the demo-page test)
#
# torch: if the venv has no torch yet, this installs TORCH_SPEC (default torch==2.13.0, the CPU wheel
# this machine keeps on disk). Elsewhere, install the torch you want into .venv first (or set
# TORCH_SPEC, e.g. TORCH_SPEC=torch) and this script leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown option '$arg'; usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  "${PIP[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
fi

# Both packages, editable: the client (clients/python: websockets and orjson only) and the server, which
# depends on it. Named in one command, pip takes the client from this checkout, never from an index.
if [ "$want_test" = 1 ]; then
  "${PIP[@]}" install -e ./clients/python -e ".[test]"
else
  "${PIP[@]}" install -e ./clients/python -e .
fi
# A venv set up before the client was its own package has a server install that owned the fillmask-client
# script; replacing that install removes the script the client had just written, so write it again.
[ -x .venv/bin/fillmask-client ] || "${PIP[@]}" install --no-deps --force-reinstall -e ./clients/python

# The offline random-weight model the quick start and the tests use (hubs may be unreachable).
.venv/bin/python -m fillmask_server.checkpoint tiny models/tiny
# The tests' tiny model of each family (models/families/: BERT, RoBERTa, ESM, ...): written here once, not
# by whichever test workers need one first (each would train the same tokenizers at once); kept where
# present and of this version.
if [ "$want_test" = 1 ]; then
  .venv/bin/python -c "from pathlib import Path; from fillmask_server.checkpoint import FAMILIES, ensure_family
for family in FAMILIES: ensure_family(family, Path('models/families'))"
fi

# --- system tools for the tests ---
# Debian's Chromium for the demo-page test (issue 4), driven by Playwright's Python package pointed at
# /usr/bin/chromium (Playwright's own browser download needs hosts that may be unreachable, so it is
# never used); Debian's HAProxy for the many-replicas test (issue 11, deploy/haproxy.cfg); stress-ng for
# scripts/hostile.sh (the suite beside a busy core, issue 15); iproute2's ss (a listening socket's
# backlog). Where they
# cannot be installed those tests skip and say why; in CI (CI set) a failed install stops set-up.
if [ "$want_test" = 1 ]; then
  missing=()
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  command -v stress-ng >/dev/null || missing+=(stress-ng)  # scripts/hostile.sh: the suite beside a busy core
  command -v ss >/dev/null || missing+=(iproute2)  # ss: the listen backlog's test reads it
  if [ "${#missing[@]}" -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    echo "setup: installing Debian's ${missing[*]} for the tests"
    if ! { command -v apt-get >/dev/null && { [ -z "$SUDO" ] || command -v sudo >/dev/null; } \
           && $SUDO apt-get update -q >/dev/null \
           && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >/dev/null; }; then
      echo "setup: could not install ${missing[*]}; install them (or set FILLMASK_CHROMIUM to a Chromium binary)" >&2
      [ -z "${CI:-}" ] || exit 1
    fi
  fi
  if ! .venv/bin/python -c "import playwright" 2>/dev/null; then
    echo "setup: installing playwright (the Python driver for the demo-page test)"
    "${PIP[@]}" install "playwright>=1.45"
  fi
fi
# --- end system tools ---

# --- Node.js for the protocol contract (issue 12) ---
# The AsyncAPI parser that checks protocol/asyncapi.yaml, and the `ws` package of the JavaScript example
# client (examples/js-client), each from its package-lock.json into its own node_modules (git-ignored).
# Without Node.js (20 or later) the tests that need it skip and say why; in CI a failure stops set-up.
if [ "$want_test" = 1 ]; then
  if command -v npm >/dev/null; then
    for dir in protocol examples/js-client; do
      if ! npm install --prefix "$dir" --no-audit --no-fund --loglevel=error >/dev/null; then
        echo "setup: npm install in $dir failed" >&2
        [ -z "${CI:-}" ] || exit 1
      fi
    done
  else
    echo "setup: no npm found; install Node.js 20 or later for the protocol contract tests" >&2
    [ -z "${CI:-}" ] || exit 1
  fi
fi
# --- end Node.js ---
echo "setup: ready (.venv, models/tiny$( [ "$want_test" = 1 ] && echo ", models/families"))"
