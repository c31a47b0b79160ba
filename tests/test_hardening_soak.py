"""The soak scripts, short: scripts/soak.py (5x capacity) and scripts/churn_soak.py (connections that come and
go with every kind of frame) against a subprocess server, every check passing; and churn's checks alone."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from collections import Counter
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
    real server: every check of scripts/churn_soak.py holds (the tests below show that each can fail)."""
    result = subprocess.run(
        [sys.executable, "scripts/churn_soak.py", "--model", str(tiny_model_dir), "--waves", "2", "--wave-s", "1",
         "--quiet-s", "0.5", "--visitors", "8", "--start-timeout", "60", "--server-flags", "--calibration-s 0"],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "wave   2:" in out and "churn soak: OK" in out, out
    for figure in ("visitors", "frames", "/metrics counted"):
        assert figure in out, out
    answers = next(line for line in out.splitlines() if line.startswith("answers"))
    assert " result" in answers and " error " in answers, answers  # requests served, refused frames refused
    # The first visitor of each place leaves as its seed says: some wait for every answer, others cut.
    assert " wait" in out and (" reset" in out or " close" in out or " half-close" in out), out


LIMITS = {"max_tokens": 512, "max_text_chars": 2000, "max_frame_bytes": 65536, "max_masks": 8,
          "max_result_bytes": 1_048_576, "max_targets": 100, "top_k": {"max": 100}}


def test_the_churn_ledger_counts_one_answer_per_frame_and_names_what_broke() -> None:
    ledger = churn.Ledger()
    ledger.request(1)
    ledger.request("two", churn.Terms(deadline=True))
    ledger.refused(3, "no_mask")
    ledger.refused(None, "binary_frame")
    assert sorted(map(str, ledger.outstanding())) == ["error binary_frame with id null", "id 'two' (request)",
                                                      "id 1 (request)", "id 3 (no_mask)"]
    ledger.take({"type": "result", "id": 1, "predictions": []})
    ledger.take({"type": "overloaded", "id": "two", "status": 504, "reason": "deadline_exceeded",
                 "retry_after_ms": 12})
    ledger.take({"type": "error", "id": 3, "code": "no_mask"})
    ledger.take({"type": "error", "id": None, "code": "binary_frame"})
    ledger.take({"type": "stats"})
    assert ledger.problems == [] and ledger.outstanding() == []
    assert ledger.sent == 4 and ledger.received == {("result", ""): 1, ("overloaded", "deadline_exceeded"): 1,
                                                     ("error", "no_mask"): 1, ("error", "binary_frame"): 1}
    broken = [
        {"type": "result", "id": 1, "predictions": []},  # a second answer
        {"type": "error", "id": None, "code": "invalid_json"},  # an error nothing provoked
        {"type": "error", "id": 4, "code": "internal_error", "message": "x"},  # a request failed
        {"type": "cancelled", "id": 5},  # cancelled, and no cancel named it
        {"type": "error", "id": 6, "code": "invalid_field"},  # not the code the frame was sent to provoke
        {"type": "overloaded", "id": 7, "status": 504, "reason": "deadline_exceeded",
         "retry_after_ms": 5},  # and it had no deadline
        {"type": "overloaded", "id": 8, "status": 503, "reason": "shutting_down",
         "retry_after_ms": 1000},  # and the server is not draining
        {"type": "overloaded", "id": 9, "status": 503, "reason": "queue_full"},  # no retry_after_ms
        {"type": "error", "id": 10, "code": "text_too_long", "message": "x"},  # no limit allows it
        {"type": "going_away"},
    ]
    for request_id in (4, 5, 7, 8, 9, 10):
        ledger.request(request_id)
    ledger.refused(6, "invalid_top_k")
    for frame in broken:
        ledger.take(frame)
    assert [problem.split(" ")[:3] for problem in ledger.problems] == [
        ["a", "result", "for"], ["an", "error", "with"], ["request", "4", "got"], ["request", "5", "was"],
        ["a", "frame", "sent"], ["request", "7", "got"], ["request", "8", "got"], ["request", "9", "got"],
        ["request", "10", "got"], ["an", "unexpected", "'going_away'"]], ledger.problems
    fine = churn.Ledger()
    fine.request(11, churn.Terms(refusals=frozenset({"text_too_long"})))
    fine.take({"type": "error", "id": 11, "code": "text_too_long", "message": "x"})
    fine.request(12)
    fine.take({"type": "overloaded", "id": 12, "status": 429, "reason": "queue_share", "retry_after_ms": 40})
    assert fine.problems == []


def test_the_churn_ledger_takes_an_id_sent_again_as_a_duplicate_or_a_request_of_its_own() -> None:
    ledger = churn.Ledger()
    ledger.request(7)
    ledger.duplicate(7)
    ledger.take({"type": "error", "id": 7, "code": "duplicate_id"})  # read while 7 was in flight
    ledger.take({"type": "result", "id": 7, "predictions": []})
    ledger.request(8)
    ledger.duplicate(8)
    ledger.take({"type": "result", "id": 8, "predictions": []})  # answered before the frame sent again was read...
    assert ledger.outstanding() == ["id 8 (again)"] and ledger.in_flight() == [8]
    ledger.take({"type": "result", "id": 8, "predictions": []})  # ...which was then a request of its own
    ledger.request(9)
    ledger.cancel(9)
    ledger.take({"type": "cancelled", "id": 9})
    assert ledger.problems == [] and ledger.outstanding() == []
    ledger.take({"type": "result", "id": 8, "predictions": []})  # a third answer for two frames
    ledger.request(10)
    ledger.duplicate(10)
    ledger.take({"type": "result", "id": 10, "predictions": []})
    ledger.take({"type": "error", "id": 10, "code": "no_mask", "message": "x"})  # the second frame was valid
    ledger.request(13)
    ledger.duplicate(13)
    ledger.take({"type": "result", "id": 13, "predictions": []})
    ledger.take({"type": "cancelled", "id": 13})  # and no cancel named it
    assert [problem.split(" ")[:3] for problem in ledger.problems] == [
        ["a", "result", "for"], ["request", "10", "got"], ["request", "13", "was"]], ledger.problems


def test_the_churn_refusals_stay_within_the_limits_hello_gives() -> None:
    assert churn.refusable("A " * 60 + "[MASK].", 3, 50, None, LIMITS) == frozenset()  # (BERT's, the defaults)
    assert churn.refusable("A " * 60 + "[MASK].", 3, 50, None, {**LIMITS, "max_tokens": 64}) == {"text_too_long"}
    assert churn.refusable("Short [MASK].", 1, 5, ["a"], {**LIMITS, "max_result_bytes": 1000}) == {"result_too_large"}
    assert len(churn.possible_refusals("[MASK]", LIMITS)) == 16
    narrow = churn.possible_refusals("[MASK]", {**LIMITS, "max_text_chars": 70000, "max_masks": 12000})
    assert "text_too_long" not in narrow and "too_many_masks" not in narrow  # (1009 and a text too long instead)
    rng = random.Random(3)
    for _ in range(200):
        frame, _, _, terms = churn.frame_for(rng, "request", 1, "<mask>", {**LIMITS, "max_masks": 1,
                                                                              "max_targets": 1, "top_k": {"max": 4}})
        request = json.loads(frame)
        assert request["text"].count("<mask>") == 1 and len(request.get("targets", [])) <= 1
        assert 1 <= request["top_k"] <= 4 and terms.deadline == ("deadline_ms" in request)
    for kind in churn.REFUSALS:
        frame, *_ = churn.frame_for(rng, kind, 2, "[MASK]", LIMITS)
        if kind == "text_too_long":
            assert len(json.loads(frame)["text"]) == LIMITS["max_text_chars"] + 1
        if kind == "too_many_masks":
            assert json.loads(frame)["text"].count("[MASK]") == LIMITS["max_masks"] + 1


def test_the_churn_quiet_spells_must_match_the_first() -> None:
    one = {"torch_threads": 2.0, "forward_parts": 1.0}
    first = {"in_flight": 0, "queue_depth": 0, "connections": 1, "rss_mb": 500.0, "threads": 7, "fds": 9,
             "layout": one}
    retuned = {**first, "threads": 9, "layout": {"torch_threads": 4.0, "forward_parts": 2.0}}
    assert churn.quiet_failures([first, {**first, "rss_mb": 640.0}, retuned, retuned], rss_bound_mb=150) == []
    failures = churn.quiet_failures([first, {**first, "threads": 8}, {**first, "fds": 10},
                                     {**first, "rss_mb": 651.0}, {**first, "in_flight": 1, "connections": 2}],
                                    rss_bound_mb=150)
    assert [failure.split(":")[0] for failure in failures] == [f"quiet spell {n}" for n in (2, 3, 4, 5)], failures


def test_the_churn_end_checks_metrics_readiness_log_and_exit() -> None:
    received = Counter({("result", ""): 10, ("error", "no_mask"): 2})
    counted = Counter({("result", ""): 10, ("error", "no_mask"): 2, ("dropped", ""): 3})
    assert churn.final_failures(received, counted, 15, 200, ["INFO fine"], 0) == []
    assert len(churn.final_failures(received, counted, 14, 200, [], 0)) == 1  # more counted than sent
    dropped_instead = Counter({("result", ""): 9, ("error", "no_mask"): 2, ("dropped", ""): 4})
    assert len(churn.final_failures(received, dropped_instead, 15, 200, [], 0)) == 1  # a result counted dropped
    failures = churn.final_failures(received, counted, 15, 503, ["x WARNING y", "Traceback (most recent"], 1)
    assert [failure.split(" ")[0] for failure in failures] == ["/readyz", "the", "the", "the"], failures
