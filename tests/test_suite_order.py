"""How the suite's own plumbing (``tests/conftest.py``) shares out and counts the tests.

- ``pytest_collection_modifyitems`` hands the units of work out longest first, by the seconds each file
  took (``suite_seconds.json``), a file the table does not know counting ``UNKNOWN_SECONDS_PER_TEST`` a
  test, a spread file (``SPREAD_FILES``) its tests one by one at its average; a file's own order is kept.
- ``pytest_xdist_auto_num_workers`` (``-n auto``) gives one worker more than the CPUs the run may use,
  up to ``MAX_WORKERS``.
- ``pytest_runtest_logstart`` counts a test in its own file, whatever the location pytest gives it (a
  hypothesis state machine's is hypothesis's ``stateful.py``): otherwise a full run looks partial and the
  checks at its end (the contract's frame count, the seconds table) are skipped.
- ``rewrite_test_modules_ahead`` (the controller, at the session's start) writes pytest's rewritten
  bytecode of every test module (and of the conftest and plugin modules it rewrote itself) once, so
  that no worker rewrites them all again where Python may not write bytecode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import conftest
import pytest


@dataclass
class Item:
    """What ``pytest_collection_modifyitems`` reads of a test."""

    nodeid: str


def test_units_are_handed_out_longest_first_keeping_each_files_order(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "suite_seconds.json"
    table.write_text(json.dumps({"test_long.py": 60.0, "test_short.py": 2.0, "test_process.py": 30.0}))
    monkeypatch.setattr(conftest, "SECONDS_FILE", table)
    monkeypatch.setattr(conftest, "SPREAD_FILES", {"test_process.py"})
    items = [Item("tests/test_short.py::b"), Item("tests/test_short.py::a"),
             Item("tests/test_new.py::x"), Item("tests/test_new.py::y"),  # unknown: 2 tests × 0.5 s
             Item("tests/test_process.py::p2"), Item("tests/test_process.py::p1"),  # spread: one by one,
             Item("tests/test_process.py::p3"),  # 10 s each (three tests share the file's 30 s)
             Item("tests/test_long.py::z"), Item("tests/test_long.py::c")]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.nodeid.split("/")[1] for item in items] == [
        "test_long.py::z", "test_long.py::c",  # 60 s, its own order
        "test_process.py::p2", "test_process.py::p1", "test_process.py::p3",  # 10 s each, the file's order
        "test_short.py::b", "test_short.py::a",  # 2 s
        "test_new.py::x", "test_new.py::y",  # 1 s
    ]


def test_without_a_table_the_files_with_more_tests_go_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "SECONDS_FILE", tmp_path / "missing.json")
    items = [Item("tests/test_a.py::one"), Item("tests/test_b.py::one"), Item("tests/test_b.py::two")]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == ["tests/test_b.py::one", "tests/test_b.py::two", "tests/test_a.py::one"]


def test_a_state_machines_test_is_counted_in_its_own_file(request: pytest.FixtureRequest,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    machine = "tests/test_core_properties.py::TestCoreMachine::runTest"
    ran: set[str] = set()
    monkeypatch.setattr(conftest, "RAN_FILES", ran)
    conftest.pytest_runtest_logstart(machine, ("../hypothesis/stateful.py", 100, "TestCoreMachine.runTest"))
    assert ran == {"test_core_properties.py"}


def test_the_seconds_table_names_only_test_files_that_exist() -> None:
    """(A renamed or removed file's entry would only mislead the order: written again, it goes.)"""
    table = json.loads(conftest.SECONDS_FILE.read_text())
    assert set(table) <= conftest.EVERY_FILE, sorted(set(table) - conftest.EVERY_FILE)
    assert all(isinstance(seconds, (int, float)) and seconds >= 0 for seconds in table.values()), table


def test_every_variable_the_tests_read_is_one_a_server_they_start_takes_quietly() -> None:
    """The tests' own ``FILLMASK_*`` variables (replays, longer runs by hand) reach every server process
    they start (``{**os.environ, ...}``), which warns of a ``FILLMASK_*`` name that is no setting: a test
    of its stderr would then fail. So they are settings, or start with one of ``OTHER_VARIABLES``
    (``FILLMASK_TEST_``)."""
    import re

    from fillmask_server.config import unknown_variables

    read = {name for path in Path(__file__).parent.glob("*.py")
            for name in re.findall(r"environ(?:\.get\(|\[)\s*\"(FILLMASK_[A-Z0-9_]+)\"", path.read_text())}
    assert read, "no variable found: the pattern no longer matches how the tests read them"
    assert unknown_variables(dict.fromkeys(read, "1")) == []


@pytest.mark.parametrize(("cpus", "workers"), [(1, 2), (2, 3), (4, 5), (64, conftest.MAX_WORKERS)])
def test_auto_is_one_worker_more_than_the_cpus_this_run_may_use(cpus: int, workers: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == workers  # type: ignore[arg-type]


def test_the_controller_writes_each_test_modules_rewritten_bytecode_once(tmp_path: Path,
                                                                         pytestconfig: pytest.Config) -> None:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc

    module = tmp_path / "test_sample.py"
    module.write_text("def test_sum():\n    total = 1 + 1\n    assert total == 3\n")
    pyc = tmp_path / "__pycache__" / ("test_sample" + PYC_TAIL)
    assert conftest.rewrite_test_modules_ahead(pytestconfig, [module]) == 1
    code = _read_pyc(module, pyc)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(code, namespace)
    with pytest.raises(AssertionError, match=r"assert 2 == 3"):  # rewritten: the failure shows the values
        namespace["test_sum"]()  # type: ignore[operator]
    assert conftest.rewrite_test_modules_ahead(pytestconfig, [module]) == 0  # up to date: left alone
    module.write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    assert conftest.rewrite_test_modules_ahead(pytestconfig, [module]) == 1  # changed: written again
    # And this run's own: the controller wrote them before this process started (a module edited since
    # is left out: it is rewritten at the next run's start).
    stale = [path.name for path in sorted(Path(conftest.__file__).parent.glob("test_*.py"))
             if path.stat().st_mtime < conftest.PROCESS_STARTED
             and _read_pyc(path, path.parent / "__pycache__" / (path.name[:-3] + PYC_TAIL)) is None]
    assert not stale
