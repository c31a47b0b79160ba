#!/usr/bin/env bash
# Issue 17 item 6 on a lent GPU machine, as one call: install the carried wheels, then bench/gpu.py.
#
# The machine has torch with CUDA, transformers and most of what the server needs, but not websockets
# or orjson, and nothing can be fetched there. On this machine, first (Python 3.12 wheels of the versions
# in .venv, else those below, into .whl/, which git ignores through .git/info/exclude):
#
#   bash bench/gpu_device.sh --fetch-wheels
#
# then call the device tool's run with command "bash bench/gpu_device.sh", carry [".whl"], and a
# timeout_s above GPU_BENCH_S (default 450 s). Everything lands in $OUT: machine.txt, gpu.md, gpu.json,
# gpu.log and, when a server failed, server-logs.txt. Arguments go to bench/gpu.py (e.g. --dtypes float32).
# A smoke run here: GPU_WHEELS=0 PYTHON=.venv/bin/python OUT=/tmp/g bash bench/gpu_device.sh --device cpu \
#   --model models/tiny --dtypes float32 --texts 20 --timed-texts 64 --seconds 1
set -u
cd "$(dirname "$0")/.." || exit 2
WHEELS="websockets==17.4 orjson==3.13.0 transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 kernels==0.19.1 tomlkit==0.15.3 regex==2026.11.19"
if [ "${1:-}" = --fetch-wheels ]; then
    if [ -x .venv/bin/python ]; then  # the versions this checkout's suite runs on, where it has a venv
        WHEELS=$(.venv/bin/python - $WHEELS <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name = spec.split("==")[0]
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(spec)
PY
        )
    fi
    mkdir -p "$(git rev-parse --git-dir)/info"
    grep -qx /.whl/ "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo /.whl/ >>"$(git rev-parse --git-dir)/info/exclude"
    # shellcheck disable=SC2086
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl $WHEELS
fi
out=${OUT:-/tmp/gpu-out}
py=${PYTHON:-python3}
mkdir -p "$out"
if [ "${GPU_WHEELS:-1}" = 1 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the carried wheels did not install: is .whl in carry?"; exit 3; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/clients/python:$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
    echo "cpus: $(nproc)"
    "$py" -c "import torch, transformers, websockets, orjson; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'websockets', websockets.__version__)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
rm -f /tmp/fillmask-bench-server-*.log
set -o pipefail
timeout -k 20 "${GPU_BENCH_S:-450}" "$py" bench/gpu.py --seconds 4 --out "$out" "$@" 2>&1 \
    | { grep --line-buffered -v "^Loading weights" || true; } | tee "$out/gpu.log"
status=$?
# ServerProcess keeps a server's log only when something went wrong: bring those back in one file.
for log in /tmp/fillmask-bench-server-*.log; do
    [ -e "$log" ] && { echo "== $log"; tail -n 60 "$log"; } >>"$out/server-logs.txt"
done
exit "$status"
