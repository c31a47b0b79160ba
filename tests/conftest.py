"""Shared fixtures: the offline tiny model, a running server on an ephemeral port, a reference pipeline.

Servers run in the test process on the session's event loop, on a real socket (127.0.0.1, port 0),
with their real engine thread; nothing is mocked. ``server.engine.paused()`` holds the engine
between batches so that tests can make "queued" states deterministic.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs three workers and their servers' torch teams on two cores (-n auto, below): an OpenMP
# worker left spinning after a pass (the runtime's default) burns a core another process is waiting for,
# and a team waits at its barriers for a thread so preempted. Sleeping at once instead took a fifth off the
# time and the CPU of the files that start servers (docs/test-suite-history.md, the twenty-ninth
# session). Set here, before torch loads, for this process and every one the tests start; the speed
# of the server's own default is the benchmarks' business (bench/), not the tests'.
if not os.environ.get("OMP_WAIT_POLICY"):  # (an empty one, libgomp warns of on every process's stderr)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The checkout's client package (clients/python), like the checkout's server package above, comes before
# any installed copy, here and in the subprocesses tests start (servers, the command line).
CLIENT_DIR = ROOT / "clients" / "python"
sys.path.insert(0, str(CLIENT_DIR))
os.environ["PYTHONPATH"] = os.pathsep.join([str(CLIENT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])

from fillmask_server.calibration import Calibration  # noqa: E402
from fillmask_server.checkpoint import is_checkpoint, write_checkpoint  # noqa: E402
from fillmask_server.config import Config  # noqa: E402
from fillmask_server.loading import load_model  # noqa: E402
from fillmask_server.model import FillMaskModel  # noqa: E402
from fillmask_server.server import FillMaskServer  # noqa: E402
from tests.contract import WireMonitor  # noqa: E402

TINY_DIR = ROOT / "models" / "tiny"
#: When this process (the controller, a worker) read this file: after the controller's session start.
PROCESS_STARTED = time.time()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The offline random-weight tiny BERT (made on first use; scripts/setup.sh also makes it)."""
    if not is_checkpoint(TINY_DIR):
        write_checkpoint("tiny", TINY_DIR)
    return TINY_DIR


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir: Path) -> Config:
    return Config(model=str(tiny_model_dir), host="127.0.0.1", port=0, shutdown_timeout=5.0)


#: Loaded models no running server holds, by what ``load_model`` was given (see ``running_server``).
_IDLE_MODELS: dict[tuple[str, str, str, str], list[FillMaskModel]] = collections.defaultdict(list)


@contextlib.asynccontextmanager
async def running_server(config: Config, calibration: Calibration | None = None) -> AsyncIterator[FillMaskServer]:
    """A started server with its own engine (and ``calibration``, where given: what a start-up measured);
    drained (closed with 1001) on exit.

    Its model is its own while it runs: one no other running server holds, loaded with the same
    arguments by an earlier server of this process that has ended, else loaded now. Serving leaves a
    model as it was loaded (the engine sets only the torch thread count, which each server calibrates
    again), and a load takes seconds on these machines: a hundred of them were a third of the suite's
    time. A model goes back to the idle ones only once every thread of its engine has returned.
    (Serving fills a model's caches, e.g. of ``targets``, with what loading would give.)"""
    key = (config.model, config.device, config.dtype, config.forward)
    idle = _IDLE_MODELS[key]
    model = idle.pop() if idle else load_model(config.model, config.device, config.dtype, forward=config.forward)
    server = FillMaskServer(config, model, calibration)
    await server.start()
    try:
        yield server
    finally:
        await server.drain(timeout=2.0)
        if server.engine.ended:
            idle.append(model)
    assert server.double_answers == 0  # after the drain every outcome has been delivered: none was a second


@pytest.fixture(scope="session")
async def server(tiny_config: Config) -> AsyncIterator[FillMaskServer]:
    """One shared server with the default limits. Tests must leave it unpaused and idle."""
    async with running_server(tiny_config) as srv:
        yield srv


@pytest.fixture
def make_server(tiny_config: Config) -> Callable[..., contextlib.AbstractAsyncContextManager[FillMaskServer]]:
    """``async with make_server(max_queue=2) as srv:`` — a private server with Config overrides (and
    ``calibration=``, what its start-up would have measured)."""

    def factory(calibration: Calibration | None = None,
                **overrides: Any) -> contextlib.AbstractAsyncContextManager[FillMaskServer]:
        return running_server(replace(tiny_config, **overrides), calibration)

    return factory


@pytest.fixture(scope="session")
def reference_pipeline(tiny_model_dir: Path) -> Any:
    """``transformers.pipeline("fill-mask")`` on the same checkpoint: the oracle for results."""
    from transformers import pipeline

    return pipeline("fill-mask", model=str(tiny_model_dir), device="cpu")


@pytest.fixture
def make_server_for(tiny_config: Config) -> Callable[..., contextlib.AbstractAsyncContextManager[FillMaskServer]]:
    """``async with make_server_for(model, max_queue=2) as srv:`` — a private server around a given model.

    For fault injection: ``model`` is typically a test subclass of ``FillMaskModel`` that fails on purpose.
    """

    @contextlib.asynccontextmanager
    async def factory(model: Any, **overrides: Any) -> AsyncIterator[FillMaskServer]:
        server = FillMaskServer(replace(tiny_config, **overrides), model)
        await server.start()
        try:
            yield server
        finally:
            await server.drain(timeout=2.0)
        assert server.double_answers == 0

    return factory


# --- how pytest-xdist shares the tests out (pyproject.toml: -n auto --dist loadfile) ------------------

#: Files whose tests the workers may take one by one: each test starts processes of its own and shares
#: no fixture, so the file's long waits (model loads, drains) overlap with the other worker's. Every
#: other file runs whole on one worker, so that its module fixtures (a cluster, a browser) start once
#: (checked at the end of every run: ``pytest_sessionfinish``).
SPREAD_FILES = {"test_process.py"}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the test alone in ``SPREAD_FILES``."""
    path = nodeid.split("::", 1)[0]
    return nodeid if Path(path).name in SPREAD_FILES else path


#: Seconds each test file took in a full run (``tests/suite_seconds.json``), to hand the longest units of
#: work out first. ``FILLMASK_TEST_SUITE_SECONDS=write`` on a full, passing run with workers writes it again.
SECONDS_FILE = Path(__file__).with_name("suite_seconds.json")
#: A file the table does not know (a new one) is taken to be this many seconds a test.
UNKNOWN_SECONDS_PER_TEST = 0.5


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests by unit of work (``work_unit``), the longest first (by ``SECONDS_FILE``); within a
    unit, the files' own order. With the workers taking units as they finish, the last units to start
    are short, so neither worker is left alone with a long file at the end (xdist's own order, by number
    of tests, started the cluster and the browser sessions last). Every process sorts the same way."""
    try:
        seconds: dict[str, float] = json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        seconds = {}
    counts = collections.Counter(Path(item.nodeid.split("::", 1)[0]).name for item in items)

    def weight(item: pytest.Item) -> float:
        name = Path(item.nodeid.split("::", 1)[0]).name
        total = seconds.get(name, UNKNOWN_SECONDS_PER_TEST * counts[name])
        return total / counts[name] if name in SPREAD_FILES else total

    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (-weight(item), item.nodeid.split("::", 1)[0], order[id(item)]))


#: Workers at most (``pytest_xdist_auto_num_workers``): each imports torch, and past the longest file
#: (the cluster) more cannot shorten the run.
MAX_WORKERS = 6


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml): one worker more than the CPUs this process may run on (its affinity:
    ``taskset`` counts), up to ``MAX_WORKERS``. On two cores three: the third uses the time the others
    spend waiting on server starts, drains and the browser; pinned to one core, two."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cpus + 1, MAX_WORKERS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with ``SPREAD_FILES`` spread test by test, in the collection's order
    (``pytest_collection_modifyitems``: the longest units first). (Marks read by ``--dist loadgroup``
    cannot do it under pytest 9.2: xdist 3.8 renames a node by a field pytest no longer reads, so every
    file was spread test by test and a module fixture started once per worker.) Another ``--dist``
    asked for on the command line is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # (xdist's default reorders the units by number of tests)

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileScheduling(config, log)


# --- every frame against the contract (protocol/schemas; tests/contract.py) ---------------------------

WIRE = WireMonitor()
#: A full run exchanges far more frames than this; fewer means the monitor has stopped seeing them.
MIN_FRAMES_IN_FULL_RUN = 5000


def _ours(ws: ClientConnection) -> bool:
    """A connection to this project's server (fake servers in tests send other frames on purpose)."""
    response = getattr(ws, "response", None)
    return response is not None and response.headers.get("Server", "").startswith("fillmask-server/")


@pytest.fixture(scope="session", autouse=True)
def wire_contract(request: pytest.FixtureRequest) -> Iterator[WireMonitor]:
    """For the whole session, every frame a websockets client connection (the tests' raw sockets, the
    Python client library, the sync client's thread) exchanges with our server passes ``WIRE``: frames
    received are validated against the server-frame schemas; frames sent, when they are JSON objects of
    a client type, against the client-frame schemas, and the server's answer must agree (see
    ``WireMonitor``). Garbage the tests send on purpose is not validated. At the end of a full, passing
    run, the number of frames validated is checked, so the monitor cannot silently stop seeing them."""
    send, recv = ClientConnection.send, ClientConnection.recv

    async def checked_send(self: ClientConnection, message: Any, *args: Any, **kwargs: Any) -> None:
        if _ours(self):
            WIRE.sent(self, message, kwargs.get("text"))
        await send(self, message, *args, **kwargs)

    async def checked_recv(self: ClientConnection, *args: Any, **kwargs: Any) -> Any:
        message = await recv(self, *args, **kwargs)  # __aiter__ reads through recv too
        if _ours(self):
            WIRE.received(self, message)
        return message

    ClientConnection.send, ClientConnection.recv = checked_send, checked_recv  # type: ignore[method-assign]
    try:
        yield WIRE
    finally:
        ClientConnection.send, ClientConnection.recv = send, recv  # type: ignore[method-assign]
    validated = WIRE.counts["received"] + WIRE.counts["sent_valid"]
    workeroutput = getattr(request.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller adds up every worker's share
        workeroutput["wire_frames"] = validated
        workeroutput["wire_files"] = sorted(RAN_FILES)
        workeroutput["wire_failed"] = request.session.testsfailed
        return
    if not request.session.testsfailed and RAN_FILES == EVERY_FILE:
        assert validated > MIN_FRAMES_IN_FULL_RUN, f"only {validated} frames checked against the contract"


#: The test files, and those of which this process ran a test (a full run has run them all).
EVERY_FILE = {path.name for path in Path(__file__).parent.glob("test_*.py")}
RAN_FILES: set[str] = set()
_WORKERS = {"frames": 0, "failed": 0}  # pytest-xdist's controller: every worker's share
_FILES_BY_WORKER: dict[str, set[str]] = {}  # the same: each worker's files


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # (By the node's id: a hypothesis state machine's location is hypothesis's own stateful.py, which
    # made a full run look partial, and the checks at its end were skipped.)
    RAN_FILES.add(Path(nodeid.split("::", 1)[0]).name)


_SECONDS_TAKEN: collections.Counter[str] = collections.Counter()  # file -> seconds (set-up, call, tear-down)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS_TAKEN[Path(report.nodeid.split("::", 1)[0]).name] += report.duration


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller: a worker finished; add its share of the contract's frame count."""
    output = getattr(node, "workeroutput", {})
    _WORKERS["frames"] += output.get("wire_frames", 0)
    _WORKERS["failed"] += output.get("wire_failed", 0) + (1 if error else 0)
    _FILES_BY_WORKER[node.gateway.id] = set(output.get("wire_files", ()))


#: The project's own packages, which the suite's subprocesses import (servers, command lines, scripts).
BYTECODE_DIRS = (ROOT / "fillmask_server", CLIENT_DIR / "fillmask_client", ROOT / "bench", ROOT / "scripts")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's own modules to bytecode once, before any test (the controller of a run
    with workers, or the run without): where the environment tells Python not to write bytecode
    (``PYTHONDONTWRITEBYTECODE``; these machines do), each of the suite's subprocesses compiled them
    again at its start, a fifth of a second of CPU in each of well over a hundred. Only what changed
    since the last run is compiled again (into the ``__pycache__`` folders git ignores); an installed
    package's bytecode is its installer's."""
    if getattr(session.config, "workerinput", None) is None:
        import compileall

        for directory in BYTECODE_DIRS:
            compileall.compile_dir(directory, quiet=2)
        compileall.compile_file(ROOT / "ws_server.py", quiet=2)  # (a module too: some tests' scripts import it)
        rewrite_test_modules_ahead(session.config, [*sorted(Path(__file__).parent.glob("test_*.py")),
                                                    *rewritten_here(session.config)])


def rewritten_here(config: pytest.Config) -> list[Path]:
    """The modules pytest rewrote in this process so far: the conftest files and the plugins' own
    modules (hypothesis, anyio, pytest-asyncio, ...), which each worker imports, and rewrites, too."""
    try:
        from _pytest.assertion.rewrite import assertstate_key

        hook = config.stash[assertstate_key].hook
        return sorted(set(getattr(hook, "_rewritten_names", {}).values()))
    except (ImportError, KeyError, AttributeError):
        return []


def rewrite_test_modules_ahead(config: pytest.Config, paths: list[Path]) -> int:
    """Write pytest's assertion-rewritten bytecode of ``paths`` (test modules) to its cache, once, in the
    controller: where Python may not write bytecode (``PYTHONDONTWRITEBYTECODE``), pytest rewrites every
    test module again in every process that imports it, and each worker imports them all at its start
    (a third of its collection's CPU, on cores the other workers share). A module whose cached copy
    matches its source is left alone; the workers read the cache as pytest always does (it checks the
    source's hash). Uses pytest's own (private) rewriting functions: where those are missing or changed,
    nothing is written and the run is only slower. Returns how many modules it wrote."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
            try_makedirs,
        )

        state = config.stash.get(assertstate_key, None)
        if state is None:  # (--assert=plain: nothing is rewritten)
            return 0
    except (ImportError, AttributeError):
        return 0
    written = 0
    for path in paths:
        cache = get_cache_dir(path)
        pyc = cache / (path.name[:-3] + PYC_TAIL)
        try:
            if _read_pyc(path, pyc) is None and try_makedirs(cache):
                source_hash, code = _rewrite_test(path, config)
                written += _write_pyc(state, code, source_hash, pyc)
        except (TypeError, ValueError, SyntaxError, OSError):
            continue  # (a module that does not compile is reported by its own collection; the others go on)
    return written


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """pytest-xdist's controller: fail the run if a file outside ``SPREAD_FILES`` ran on more than one
    worker; and the check of ``wire_contract`` runs here, on every worker's frames together."""
    ran = set().union(*_FILES_BY_WORKER.values())
    if getattr(session.config, "workerinput", None) is not None or not ran:
        return  # a worker, or a run without workers (the fixture checked it)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    runs = collections.Counter(name for files in _FILES_BY_WORKER.values() for name in files)
    split = sorted(name for name, workers in runs.items() if workers > 1 and name not in SPREAD_FILES) \
        if session.config.getvalue("dist") == "loadfile" else []
    if split:  # each worker started the file's module fixtures: twice the time, and twice the servers at once
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"test files run on more than one worker: {', '.join(split)} (tests/conftest.py "
                                "pytest_xdist_make_scheduler should keep each file on one)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if exitstatus == 0 and not _WORKERS["failed"] and ran == EVERY_FILE \
            and _WORKERS["frames"] <= MIN_FRAMES_IN_FULL_RUN:
        if reporter is not None:
            reporter.write_line(f"only {_WORKERS['frames']} frames checked against the contract "
                                "(tests/conftest.py wire_contract)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if os.environ.get("FILLMASK_TEST_SUITE_SECONDS") == "write" and session.exitstatus == 0 and ran == EVERY_FILE:
        SECONDS_FILE.write_text(json.dumps({name: round(seconds, 1) for name, seconds in
                                            sorted(_SECONDS_TAKEN.items(), key=lambda item: -item[1])}, indent=0)
                                + "\n")


@pytest.fixture(autouse=True)
def wire_contract_problems(wire_contract: WireMonitor) -> Iterator[None]:
    """Fail the test during which a frame broke the contract (or the next test, for a frame that a
    shared fixture exchanged between tests)."""
    yield
    problems = wire_contract.take_problems()
    assert not problems, "frames that break protocol/schemas:\n" + "\n".join(problems[:20])
