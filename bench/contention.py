"""One batch's forward pass in-process, alone and beside what competes for the CPU in a server.

    .venv/bin/python bench/contention.py --model models/tiny --rows 64 --width 15

It times ``model.forward`` on one batch (median of ``--passes``) with 2 and 1 torch threads: alone,
beside a process busy on one core (``stress-ng --cpu 1``), beside one busy 30% of a core, and beside
a Python thread that never sleeps (it holds the GIL whenever the model thread lets go of it; the
switch interval is the server's for the thread count, ``tuning.switch_interval_s``: 1 ms at one thread
since it follows the count, 0.2 ms in bench/results/issue17*.md). Issue 17 item 3: why a tiny
model's batch takes longer in the server than alone, while base's does not.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextmanager
def busy_process(load: int) -> Iterator[None]:
    """``stress-ng --cpu 1 --cpu-load LOAD`` for the block (one core, LOAD percent of it)."""
    if shutil.which("stress-ng") is None:
        raise SystemExit("stress-ng is not installed (bash scripts/setup.sh --test installs it)")
    hog = subprocess.Popen(["stress-ng", "--cpu", "1", "--cpu-load", str(load), "--timeout", "60"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


@contextmanager
def python_spinner() -> Iterator[None]:
    """A thread that runs Python without pause for the block."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=15)
    parser.add_argument("--passes", type=int, default=40)
    args = parser.parse_args(argv)

    import torch

    from fillmask_server.calibration import batch_items
    from fillmask_server.loading import load_model
    from fillmask_server.tuning import switch_interval_s

    print(f"{args.model}, one batch of {args.rows} x {args.width} tokens, median of {args.passes} passes, ms")
    print("| torch threads | alone | beside a process busy on one core | beside one busy 30% of a core | "
          "beside a Python thread that never sleeps |")
    print("|---|---|---|---|---|")
    for threads in (2, 1):
        torch.set_num_threads(threads)
        sys.setswitchinterval(switch_interval_s(threads, "cpu"))
        model = load_model(args.model, threads=threads)
        items = batch_items(model, args.rows, args.width)

        def median_ms(forward: Callable[[], object] = lambda: model.forward(items)) -> float:
            for _ in range(3):
                forward()
            times = []
            for _ in range(args.passes):
                start = time.perf_counter()
                forward()
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2] * 1000

        alone = median_ms()
        with busy_process(100):
            core = median_ms()
        with busy_process(30):
            part = median_ms()
        with python_spinner():
            gil = median_ms()
        print(f"| {threads} | {alone:.1f} | {core:.1f} | {part:.1f} | {gil:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
