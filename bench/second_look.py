"""The layout each start chose, and the second look at it on the first busy second (``fillmask_server/layout.py``).

    .venv/bin/python bench/second_look.py                        # models/tiny, 10 starts, about 2 min
    .venv/bin/python bench/second_look.py --model models/base --starts 3 --window-s 8

Starts the server ``--starts`` times on the quiet machine, one after the other. Each start serves
``--windows`` closed-loop windows (32 clients x 4 in flight, the short corpus) and prints one row:
the layout the calibration chose (its start-up line), what the second look measured (the CPU a
request took beside the forward pass while serving) and chose, the layout in use after the windows
(``/metrics``), and each window's throughput. The summary compares the starts whose calibration
chose one pass with those that chose parts: on a machine where the parts serve more under load, a
start that the calibration put in one pass should be as fast as the others from its first window.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.corpus import make_short_corpus  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402
from bench.thread_tuning import layout_in_use, layout_words, window  # noqa: E402

CHOSEN = re.compile(r"calibrated in [\d.]+ s: torch threads (\d+)(?: in (\d+) parts)?")
TIMED = re.compile(r"\(calibration: ([^;)]*)")
LOOK = re.compile(r"(?:layout kept|layout chosen again) after a second look: a request took (\d+) us of CPU "
                  r".*torch threads (?:[\d ]+(?:in \d+ parts )?-> )?(\d+)(?: in (\d+) parts)? "
                  r"(?:serve|is the one layout)")


def timed(log: str) -> str:
    """The calibration's timings in its start-up line, shortened: ``1: 7.0, 2: 5.1, 2/2: 5.4`` (ms)."""
    found = TIMED.search(log)
    if found is None:
        return "?"
    return ", ".join(entry.replace(" in ", "/").replace(" parts", "").replace(" -> ", ": ").removesuffix(" ms")
                     for entry in found[1].split(", "))


def logged(log: str) -> tuple[tuple[int, int] | None, int | None, tuple[int, int] | None]:
    """(the calibration's layout, the second look's measured us a request, the look's layout) in a log."""
    chosen = CHOSEN.search(log)
    look = LOOK.search(log)
    return (None if chosen is None else (int(chosen[1]), int(chosen[2] or 1)),
            None if look is None else int(look[1]),
            None if look is None else (int(look[2]), int(look[3] or 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    texts = make_short_corpus()
    rows = []
    print("start | calibration timed (ms) | calibration chose | look measured | look chose | in use after | "
          "req/s per window")
    for start in range(args.starts):
        with ServerProcess(Path(args.model), ["--log-level", "info"]) as server:
            rates = [window(server, texts, args.window_s) for _ in range(args.windows)]
            after = layout_in_use(server.port)
            log = Path(server.log_path).read_text()
            chosen, measured_us, looked = logged(log)
        rows.append((chosen, looked, rates))
        print(f"{start + 1:5d} | {timed(log):24s} | {layout_words(chosen) if chosen else '?':17s} | "
              f"{f'{measured_us} us a request' if measured_us is not None else 'no look':13s} | "
              f"{layout_words(looked) if looked else '-':10s} | {layout_words(after):12s} | "
              + ", ".join(f"{rate:.0f}" for rate in rates), flush=True)
    for name, test in (("one pass", lambda layout: layout is not None and layout[1] == 1),
                       ("parts", lambda layout: layout is not None and layout[1] > 1)):
        first = [rates[0] for chosen, _, rates in rows if test(chosen)]
        if first:
            print(f"calibration chose {name}: {len(first)} starts, first window median {statistics.median(first):.0f} "
                  f"req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
