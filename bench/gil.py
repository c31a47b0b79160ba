"""The GIL's cost to the model thread (issue 9 item 4): a forward pass while another thread runs Python.

    .venv/bin/python bench/gil.py                    # tiny model, 1 and 2 torch threads, about a minute
    .venv/bin/python bench/gil.py --model models/base --repeats 5

In eager PyTorch every operator releases the GIL and takes it back; while another thread of the process
runs Python (the server's event loop, its decode stage), the model thread waits for the GIL after
every operator, up to the interpreter's switch interval each time. This measures one batch of 32 short
texts through ``FillMaskModel.forward``, alone and while a second thread runs pure Python, for the
eager and the traced forward pass, at Python's default switch interval (5 ms) and at the server's
(``tuning.switch_interval_s`` for the thread count: 1 ms at one thread since the interval follows the
count, 0.2 ms before, as in bench/results/issue17*.md). Each configuration runs in a fresh child
process (the thread count and the switch interval are process-wide).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = "the old farmer bought a red [MASK] near the river."


def child(model_dir: str, forward: str, threads: int, switch: float, repeats: int) -> str:
    """One configuration: 'alone_ms busy_ms' (mean forward time without and with a busy Python thread)."""
    sys.setswitchinterval(switch)
    from fillmask_server.items import Item
    from fillmask_server.loading import load_model

    model = load_model(model_dir, "cpu", threads=threads, forward=forward)
    items = [Item(ids, 5) for ids in model.tokenize([TEXT] * 32)]

    def timed() -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            model.forward(items)
        return (time.perf_counter() - started) / repeats * 1000

    for _ in range(3):
        model.forward(items)
    alone = timed()
    stop = threading.Event()

    def spin() -> None:  # Python work that never blocks, like a busy event loop or decode stage
        while not stop.is_set():
            sum(i * i for i in range(200))

    neighbour = threading.Thread(target=spin)
    neighbour.start()
    try:
        busy = timed()
    finally:
        stop.set()
        neighbour.join()
    return f"{alone:.2f} {busy:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"), help="checkpoint (default models/tiny)")
    parser.add_argument("--repeats", type=int, default=30, help="forward passes per measurement")
    parser.add_argument("--child", nargs=4, metavar=("FORWARD", "THREADS", "SWITCH", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        forward, threads, switch, repeats = args.child
        print(child(args.model, forward, int(threads), float(switch), int(repeats)))
        return 0
    from fillmask_server.tuning import switch_interval_s

    print(f"model {args.model}: mean ms per forward pass of 32 texts, alone -> with a busy Python thread")
    print("| torch threads | switch interval | eager | traced |")
    print("|---|---|---|---|")
    for threads in (1, 2):
        for switch in (0.005, switch_interval_s(threads, "cpu")):
            cells = []
            for forward in ("eager", "traced"):
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", forward,
                                      str(threads), str(switch), str(args.repeats)],
                                     capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
                cells.append(f"{out[-2]} → {out[-1]}")
            print(f"| {threads} | {switch * 1000:g} ms | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
