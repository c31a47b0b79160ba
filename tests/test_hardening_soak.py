"""The soak scripts, short: scripts/soak.py (5x capacity) and scripts/churn_soak.py (connections that come and
go with every kind of frame) against a subprocess server, every check passing; and churn's checks alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def test_soak_at_five_times_capacity_keeps_every_promise(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/soak.py", "--model", str(tiny_model_dir), "--duration", "4", "--overload", "5",
         "--connections", "4", "--max-queue", "128",
         # Generous for a shared CI machine, whose stalls are not the server's; still well under the 4 s a
         # request starved for the whole run would take.
         "--latency-slack", "5"],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for figure in ("capacity", "offered", "throughput", "unanswered", "result latency", "server RSS", "/readyz"):
        assert figure in out, out
    assert "503 queue_full" in out or "429 queue_share" in out, out
    assert "0 unanswered" in out and "soak: OK" in out


def _churn() -> ModuleType:
    """scripts/churn_soak.py as a module (scripts/ is not a package: its files are commands)."""
    spec = importlib.util.spec_from_file_location("churn_soak", ROOT / "scripts" / "churn_soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["churn_soak"] = module  # (its dataclasses look their module up while it runs)
    spec.loader.exec_module(module)
    return module


churn = _churn()


def test_churn_keeps_every_promise_through_connections_that_come_and_go(tiny_model_dir: Path) -> None:
    """Two short waves of visitors (every kind of frame, every way out) and two quiet spells, against a
    real server: every check of scripts/churn_soak.py holds (``Ledger`` and ``quiet_failures`` below show that
    each can fail)."""
    result = subprocess.run(
        [sys.executable, "scripts/churn_soak.py", "--model", str(tiny_model_dir), "--waves", "2", "--wave-s", "1",
         "--quiet-s", "0.5", "--visitors", "8", "--server-flags", "--calibration-s 0"],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "wave   2:" in out and "churn soak: OK" in out, out
    for figure in ("visitors", "frames", "answers", "/metrics counted"):
        assert figure in out, out
    # The first visitor of each place leaves as its seed says: some wait for every answer, others cut.
    assert " wait" in out and (" reset" in out or " close" in out or " half-close" in out), out


def test_the_churn_ledger_counts_one_answer_per_frame_and_names_what_broke() -> None:
    ledger = churn.Ledger()
    ledger.request(1)
    ledger.request("two")
    ledger.refused(3, "no_mask")
    ledger.refused(None, "binary_frame")
    assert sorted(map(str, ledger.outstanding())) == ["error binary_frame with id null", "id 'two' (request)",
                                                      "id 1 (request)", "id 3 (no_mask)"]
    ledger.received({"type": "result", "id": 1})
    ledger.received({"type": "overloaded", "id": "two", "status": 504, "reason": "deadline_exceeded"})
    ledger.received({"type": "error", "id": 3, "code": "no_mask"})
    ledger.received({"type": "error", "id": None, "code": "binary_frame"})
    ledger.received({"type": "stats"})
    assert ledger.problems == [] and ledger.outstanding() == []
    assert (ledger.sent, ledger.answers) == (4, 4)
    ledger.received({"type": "result", "id": 1})  # a second answer
    ledger.received({"type": "error", "id": None, "code": "invalid_json"})  # an error nothing provoked
    ledger.request(4)
    ledger.received({"type": "error", "id": 4, "code": "internal_error", "message": "x"})  # a request failed
    ledger.request(5)
    ledger.received({"type": "cancelled", "id": 5})  # cancelled, and no cancel named it
    ledger.refused(6, "invalid_top_k")
    ledger.received({"type": "error", "id": 6, "code": "invalid_field"})  # the wrong code
    ledger.received({"type": "going_away"})
    assert len(ledger.problems) == 6, ledger.problems
    assert "was not in flight" in ledger.problems[0] and "id null" in ledger.problems[1]


def test_the_churn_ledger_takes_an_id_sent_again_as_a_duplicate_or_a_request_of_its_own() -> None:
    ledger = churn.Ledger()
    ledger.request(7)
    ledger.duplicate(7)
    ledger.received({"type": "error", "id": 7, "code": "duplicate_id"})  # read while 7 was in flight
    ledger.received({"type": "result", "id": 7})
    ledger.request(8)
    ledger.duplicate(8)
    ledger.received({"type": "result", "id": 8})  # answered before the server read the frame sent again...
    assert ledger.outstanding() == ["id 8 (again)"]
    ledger.received({"type": "result", "id": 8})  # ...which was then a request of its own
    ledger.request(9)
    ledger.cancel(9)
    ledger.received({"type": "cancelled", "id": 9})
    assert ledger.problems == [] and ledger.outstanding() == []
    ledger.received({"type": "result", "id": 8})  # a third answer for two frames
    ledger.request(10)
    ledger.duplicate(10)
    ledger.received({"type": "result", "id": 10})
    ledger.received({"type": "error", "id": 10, "code": "no_mask", "message": "x"})  # the second frame was valid
    assert len(ledger.problems) == 2, ledger.problems


def test_the_churn_quiet_spells_must_match_the_first() -> None:
    first = {"in_flight": 0, "queue_depth": 0, "connections": 1, "rss_mb": 500.0, "threads": 7, "fds": 9}
    assert churn.quiet_failures([first, {**first, "rss_mb": 640.0}], rss_bound_mb=150) == []
    failures = churn.quiet_failures([first, {**first, "threads": 8}, {**first, "fds": 10},
                                     {**first, "rss_mb": 651.0}, {**first, "in_flight": 1, "connections": 2}],
                                    rss_bound_mb=150)
    assert [failure.split(":")[0] for failure in failures] == [f"quiet spell {n}" for n in (2, 3, 4, 5)], failures
