"""What the packed projection's row counts cost: memory kept for each count met, and time at a rounded-up one.

    .venv/bin/python bench/row_counts.py                       # models/tiny, counts 1 to 512
    .venv/bin/python bench/row_counts.py --model models/base --counts 256

In-process, no server. oneDNN keeps a compiled kernel for each row count its packed product meets
(``projection.RowCounts``). Two fresh child processes each load the model and run one batch at every
mask count from 1 to ``--counts`` (texts of up to 8 masks, as ``--max-masks`` allows), one with the
server's rule and one that runs every count as it is; each prints its resident and malloc'd memory
before and after, and how many counts its kernel met. Then, in one process, the forward pass of a
batch at a count above ``EXACT_ROWS`` against the same batch rounded up (``rounded_up``), each the
fastest of ``--repeats`` taken in turn. Nothing here runs with the packed kernel off: where the load
keeps torch's own kernel (no oneDNN, or it measured slower) the script says so and stops.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.server_proc import rss_mb  # noqa: E402
from fillmask_server import projection  # noqa: E402
from fillmask_server.items import Item  # noqa: E402
from fillmask_server.loading import load_model  # noqa: E402

TIMED = (33, 65, 129, 257)  # counts that round up (``rounded_up``): 34, 68, 136, 272


def memory_mib() -> tuple[float, float]:
    """(resident, malloc's in use) of this process, in MiB."""
    resident = rss_mb(os.getpid())

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return resident, (info.uordblks + info.hblkhd) / 2**20


def batch(model: Any, masks: int) -> list[Item]:
    """Texts of up to 8 masks each, ``masks`` in all."""
    words = model.tokenize(["the cat sat on the mat and looked"])[0]
    items = []
    while masks > 0:
        n = min(8, masks)
        items.append(Item([*words[:-1], *[model.mask_token_id] * n, words[-1]], 5))
        masks -= n
    return items


def child(model_dir: str, counts: int, rule: bool) -> dict[str, float]:
    model = load_model(model_dir, threads=1)
    if model.projection_kernel != "onednn-packed":
        return {"packed": 0}
    model._row_counts = projection.RowCounts() if rule else projection.RowCounts(free=sys.maxsize)
    for n in (1, 2, 3):  # (the first passes' own allocations)
        model.forward(batch(model, n))
    before = memory_mib()
    for n in range(1, counts + 1):
        model.forward(batch(model, n))
    after = memory_mib()
    return {"packed": 1, "resident": after[0] - before[0], "in_use": after[1] - before[1],
            "met": len(model._row_counts.met)}


def timed(model_dir: str, repeats: int) -> list[tuple[int, float, float]]:
    model = load_model(model_dir, threads=1)
    out = []
    for n in TIMED:
        items = batch(model, n)
        rules = (projection.RowCounts(free=sys.maxsize), projection.RowCounts(free=0))  # as it is, rounded up
        best = [float("inf")] * len(rules)
        for repeat in range(repeats + 1):  # in turn (a neighbour's burst weighs on both alike); the first: warm-up
            for k, rule in enumerate(rules):
                model._row_counts = rule
                start = time.perf_counter()
                model.forward(items)
                if repeat:
                    best[k] = min(best[k], time.perf_counter() - start)
        out.append((n, best[0], best[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"), help="a checkpoint directory or id")
    parser.add_argument("--counts", type=int, default=512,
                        help="one batch at each mask count from 1 to this, each way (tiny at 512: about a minute)")
    parser.add_argument("--repeats", type=int, default=20,
                        help=f"the timing's passes per count ({', '.join(map(str, TIMED))} masks, whatever "
                             "--counts; a few give noise)")
    parser.add_argument("--child", choices=("rule", "exact"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.counts, args.child == "rule")))
        return 0
    results = {}
    for kind in ("exact", "rule"):
        line = subprocess.run([sys.executable, __file__, "--model", args.model, "--counts", str(args.counts),
                               "--child", kind], check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        results[kind] = json.loads(line)
        if not results[kind]["packed"]:
            print(f"{args.model}: the load keeps torch's own projection kernel here; nothing to measure")
            return 0
    print(f"{args.model}, one batch at each count of masks from 1 to {args.counts}, in a fresh process:")
    for kind, label in (("exact", "every count as it is"), ("rule", "the server's rule (RowCounts)")):
        r = results[kind]
        print(f"  {label:32} resident +{r['resident']:6.1f} MiB, malloc in use +{r['in_use']:6.1f} MiB, "
              f"{r['met']:.0f} counts met")
    print(f"forward pass of one batch, fastest of {args.repeats} (as it is -> rounded up):")
    for n, exact, rounded in timed(args.model, args.repeats):
        print(f"  {n:4} masks -> {projection.rounded_up(n):4} rows: {exact * 1e3:7.2f} ms -> {rounded * 1e3:7.2f} ms "
              f"({rounded / exact:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
