"""The engine's cost model replayed on the batches a GPU run recorded, with no GPU.

    .venv/bin/python bench/cost_replay.py bench/results/gpu-h200-fourteenth.json

``bench/gpu.py`` keeps each closed loop's batches (rows, padded tokens, measured milliseconds; the
first 300 that its recorder saw, in no particular order). This script feeds them to this checkout's
``costmodel.CostModel``, starting from the server's start-up calibration (``hello.engine.calibration``),
and prints, per dtype, corpus and load, the relative error |predicted - measured| / measured (median
/ p90) of:

- **online**: each batch predicted before the model observes it (from the 51st on), which is what the
  batch choice uses;
- **final**: every batch predicted by the fit after all of them, as ``bench/gpu.py`` reports it;
- **final, repeated shapes** and **floor**: over the batches whose shape ran three times or more
  (``gpu.noise_floor``), the final fit's error and that of each shape's median time as the
  prediction, about the best that any price of a batch's shape can do.

So a change to the cost model can be measured against recorded GPU timings on any machine: run this
before and after it. The server's own order and its earlier corpora are not replayed, so the figures
are near, not equal to, those of the run itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu import median_p90, noise_floor  # noqa: E402
from fillmask_server.costmodel import Coefficients, CostModel  # noqa: E402

WARM = 50  # batches observed before the online error counts


def pair(values: list[float] | None) -> str:
    """``gpu.median_p90``'s two figures as "median / p90", or "-" for none."""
    return f"{values[0]:.3f} / {values[1]:.3f}" if values else "-"


def replay(calibration: dict[str, float], runs: list[list[float]]) -> tuple[list[float], list[float], CostModel]:
    """The online and final errors of a ``CostModel`` from ``calibration`` over ``runs``, and the model."""
    prior = Coefficients(calibration["overhead_ms"] / 1e3, calibration["per_token_us"] / 1e6,
                         calibration["per_row_us"] / 1e6, calibration["per_output_kb_us"] / 1e6 / 1024)
    model = CostModel(prior)
    online = []
    for n, (rows, tokens, ms, _) in enumerate(runs):
        if n >= WARM:
            online.append(abs(model.forward_s(int(rows), int(tokens)) * 1e3 - ms) / ms)
        model.observe_forward(int(rows), int(tokens), ms / 1e3)
    final = [abs(model.forward_s(int(rows), int(tokens)) * 1e3 - ms) / ms for rows, tokens, ms, _ in runs]
    return online, final, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="gpu.json files written by bench/gpu.py")
    args = parser.parse_args(argv)
    print("| file | dtype | corpus | load | batches | online | final | final, repeated shapes | floor (shape's "
          "median) | fitted: overhead ms, us per token, us per row |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.runs:
        for run in json.loads(path.read_text())["runs"]:
            if "error" in run:
                continue
            calibration = run["server"]["engine"]["calibration"]["cost_model"]
            for corpus in run["corpora"]:
                for load in ("closed_32x1", "closed_32x4"):
                    runs = run["server"][corpus][load]["prediction_error"].get("runs", [])
                    if not runs:
                        continue
                    online, final, model = replay(calibration, runs)
                    replayed = [[rows, tokens, ms, model.forward_s(int(rows), int(tokens)) * 1e3]
                                for rows, tokens, ms, _ in runs]
                    floor = noise_floor(replayed)
                    c = model.coefficients
                    print(f"| {path.name} | {run['dtype']} | {corpus} | {load.removeprefix('closed_')} | {len(runs)} | "
                          f"{pair(median_p90(online) if online else None)} | {pair(median_p90(final))} | "
                          f"{pair(floor.get('cost_model'))} | {pair(floor.get('shape_median'))} | "
                          f"{c.overhead_s * 1e3:.2f}, {c.token_s * 1e6:.3f}, {c.row_s * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
