"""A server inside another program (README, "Embedding the server"): ``load_server``, ``async with``,
and what a program that embeds it may rely on. Found by an embedder's trial: a fault watch that
fired on every clean stop, a failed start that left the engine's threads running, a switch interval
put back wrong by two servers, a ``Config`` never checked, a second drain that said ``going_away``
twice."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from fillmask_client import FillMaskClient
from fillmask_server import server as server_module
from fillmask_server.config import Config
from fillmask_server.launch import load_server
from fillmask_server.server import ENGINE_WATCH_S, FillMaskServer
from tests.wire import free_port, recv, send, session, wait_until

ROOT = Path(__file__).resolve().parent.parent


def running_threads(server: FillMaskServer) -> list[str]:
    """The server's engine threads still running (the suite's other servers in this process have theirs)."""
    return [thread.name for thread in server.engine._threads if thread.is_alive()]


def microseconds(seconds: float) -> Any:
    """A switch interval as the interpreter keeps it: whole microseconds, rounded down as it is set
    (``setswitchinterval(getswitchinterval())`` may lose one: 0.000199 comes back as 0.000198)."""
    return pytest.approx(seconds, abs=1.5e-6)


@pytest.fixture(autouse=True)
def only_these_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch interval as held by this test's servers alone: the suite's shared server, in the same
    process, holds the process's (the last server to stop puts it back)."""
    monkeypatch.setattr(server_module, "_SWITCH_INTERVAL", server_module._SwitchInterval())


async def test_load_server_and_async_with_serve_once_and_leave_nothing_running(tiny_config: Config) -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0042)  # the embedding program's own
    try:
        config = replace(tiny_config, calibration_s=0)
        server = await asyncio.to_thread(load_server, config)
        fault = asyncio.ensure_future(server.engine_stopped())
        async with server:
            async with FillMaskClient(server.url) as client:
                assert client.hello["model"] == "tiny"  # the model it runs (Config.model names it too)
                assert (await client.fill_mask("Paris is the [MASK] of France."))[0]
            assert running_threads(server) and sys.getswitchinterval() != 0.0042
        # Drained: nothing left running, the process's setting back, the port still known for a log line.
        assert running_threads(server) == [] and sys.getswitchinterval() == microseconds(0.0042)
        assert server.url.endswith(f":{server.port}/")
        # A clean stop is no fault: the watch still waits (two looks of it later).
        await asyncio.sleep(2 * ENGINE_WATCH_S)
        assert not fault.done()
        fault.cancel()
        await server.drain()  # again: nothing to do
        with pytest.raises(RuntimeError, match="starts once"):
            await server.start()
    finally:
        sys.setswitchinterval(before)


async def test_a_start_that_cannot_listen_leaves_nothing_running(tiny_config: Config, make_server: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = sys.getswitchinterval()
        async with make_server() as model_holder:  # (a loaded model, from the suite's pool)
            model = model_holder.model
        server = FillMaskServer(replace(tiny_config, port=taken.getsockname()[1]), model)
        with pytest.raises(OSError):
            await server.start()
        assert running_threads(server) == [] and sys.getswitchinterval() == microseconds(before)
        with pytest.raises(RuntimeError, match="no port yet"):
            _ = server.port
        await asyncio.wait_for(server.drain(), 1)  # nothing to drain


@pytest.mark.parametrize("first_to_stop", ["first started", "last started"])
async def test_two_servers_stopped_in_either_order_put_the_switch_interval_back(
        make_server: Any, first_to_stop: str) -> None:
    """While one serves it has its own switch interval, whichever stopped; once both stopped, the
    program's (the first form put back, per server, what that server had found)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0042)
    try:
        a_context, b_context = make_server(gil_switch_ms=3.0), make_server(gil_switch_ms=5.0)
        a = await a_context.__aenter__()
        b = await b_context.__aenter__()
        assert sys.getswitchinterval() == microseconds(0.005)
        (stops, stays), context = ((a, b), a_context) if first_to_stop == "first started" else ((b, a), b_context)
        await context.__aexit__(None, None, None)
        assert sys.getswitchinterval() == microseconds(stays.config.gil_switch_ms / 1000) and stops.engine.ended
        async with session(stays.url) as (ws, _):
            await send(ws, {"type": "fill_mask", "id": 1, "text": "a [MASK]"})
            assert (await recv(ws))["type"] == "result"
        await (b_context if stays is b else a_context).__aexit__(None, None, None)
        assert sys.getswitchinterval() == microseconds(0.0042)
    finally:
        sys.setswitchinterval(before)


async def test_the_first_batch_of_an_earlier_server_leaves_the_latest_servers_switch_interval(
        make_server: Any) -> None:
    """A review's find: once an untuned server's model thread set its count at its first batch, it also
    set the switch interval for it, over that of a server started later (README: the latest started of
    those still serving holds it)."""
    async with make_server(torch_threads=1, calibration_s=0) as first, \
            make_server(torch_threads=2, calibration_s=0):
        latest = sys.getswitchinterval()
        async with session(first.url) as (ws, _):
            await send(ws, {"type": "fill_mask", "id": 1, "text": "a [MASK]"})
            assert (await recv(ws))["type"] == "result"
        assert sys.getswitchinterval() == latest


async def test_a_drain_during_start_waits_for_it_then_closes_the_port(tiny_config: Config, make_server: Any) -> None:
    """A review: a drain while start() awaited its listening socket found none to close, and the port
    then listened for good, with the engine stopped."""
    async with make_server() as holder:
        model = holder.model
    for way in ("one drain", "two drains", "a cancelled drain, then another"):
        server = FillMaskServer(tiny_config, model)
        starting = asyncio.ensure_future(server.start())
        await asyncio.sleep(0)
        first = asyncio.ensure_future(server.drain(timeout=1))
        await asyncio.sleep(0)
        if way == "a cancelled drain, then another":
            first.cancel()
        drains = [server.drain(timeout=1)] if way != "one drain" else []
        await asyncio.gather(first, *drains, return_exceptions=True)
        await starting
        with pytest.raises(OSError):  # (a second drain closed no listener: the start had not made it yet)
            await asyncio.open_connection("127.0.0.1", server.port)
        assert running_threads(server) == [], way
    # A start cancelled at any of its awaits leaves nothing listening or running (a review: cancelled
    # just after asyncio's server began accepting, it left that listener behind).
    port = free_port()
    for steps in range(12):
        server = FillMaskServer(replace(tiny_config, port=port), model)
        starting = asyncio.ensure_future(server.start())
        for _ in range(steps):
            await asyncio.sleep(0)
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        else:  # started before the cancel came: drained as any other
            await server.drain(timeout=1)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        assert running_threads(server) == [], steps
    never = FillMaskServer(tiny_config, model)
    await never.drain()  # before start: nothing to do, and no start after it
    with pytest.raises(RuntimeError, match="starts once"):
        await never.start()


@pytest.mark.parametrize(("change", "problem"), [
    ({"max_queue": 0}, "--max-queue must be at least 1"),
    ({"token": "has space"}, "--token must be printable ASCII"),
    ({"forward": "bogus"}, "--forward must be one of traced, eager"),
    ({"keyfile": "key.pem"}, "--keyfile needs --certfile"),
])
async def test_a_config_built_in_code_is_checked_as_the_command_line_is(
        tiny_config: Config, make_server: Any, change: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_server(replace(tiny_config, **change))  # before loading anything
    async with make_server() as running:
        with pytest.raises(ValueError, match=problem):
            FillMaskServer(replace(tiny_config, **change), running.model)


async def test_a_drain_called_again_after_one_was_cancelled_says_going_away_once(make_server: Any) -> None:
    async with make_server() as srv, session(srv.url) as (ws, _):
        with srv.engine.paused():  # its request stays queued: the drain waits for it
            await send(ws, {"type": "fill_mask", "id": "kept", "text": "a [MASK]"})
            await wait_until(lambda: srv.in_flight() == 1)
            first = asyncio.ensure_future(srv.drain(timeout=30))
            assert (await recv(ws))["type"] == "going_away"
            first.cancel()
        await srv.drain(timeout=30)
        frames = []
        with pytest.raises(ConnectionClosed):
            for _ in range(10):  # (bounded: the drain closes the connection after the answer)
                frames.append(await recv(ws))
        assert [(frame["type"], frame.get("id")) for frame in frames] == [("result", "kept")], frames
        assert ws.close_code == 1001


async def test_the_readmes_embedding_example_serves(tiny_config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's example as written, its model the suite's tiny one and its own work one request."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Embedding the server in your own program"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    work = "        await asyncio.sleep(60)  # your program's own work\n"
    assert work in code.group(1) and '"models/tiny"' in code.group(1)
    # Run as a script it must call main (a trial's copy of an earlier form did nothing, exit status 0);
    # exec'd here, __name__ is not "__main__", and this test awaits main on its own loop instead.
    assert code.group(1).endswith('\n\nif __name__ == "__main__":\n    asyncio.run(main())\n')
    source = code.group(1).replace('"models/tiny"', repr(tiny_config.model)).replace(work, (
        "        async with FillMaskClient(server.url) as client:\n"
        "            print(len(await client.fill_mask('Paris is the [MASK] of France.')))\n"))
    source = source.replace("        print(\"serving on\", server.url)\n",
                            "        print(\"serving on\", server.url)\n        served.append(server)\n")
    served: list[FillMaskServer] = []
    namespace: dict[str, Any] = {"FillMaskClient": FillMaskClient, "served": served}
    exec(compile(source, "README.md", "exec"), namespace)
    await namespace["main"]()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("serving on ws://127.0.0.1:") and printed[1] == "5", printed
    assert len(served) == 1 and running_threads(served[0]) == []


async def test_a_hand_built_server_runs_its_passes_on_the_torch_threads_its_config_names(make_server: Any) -> None:
    """Left alone for sessions: ``FillMaskServer(Config(torch_threads=1), model)`` said 1 in ``hello``
    and ran its passes on the process's count (torch's default: one per core). The model thread now
    takes the count its layout names before its first pass; this thread's count is left as it was."""
    import torch

    process = torch.get_num_threads()
    try:
        for wanted in (1, 2):
            torch.set_num_threads(3 - wanted)  # the embedding program's own count: another one
            async with make_server(torch_threads=wanted, calibration_s=0) as server:
                seen: list[int] = []
                model = server.model
                own = model.forward

                def counted(items: Any, own: Any = own, seen: list[int] = seen) -> Any:
                    seen.append(torch.get_num_threads())  # (on the model thread, in its pass)
                    return own(items)

                model.forward = counted
                try:
                    async with FillMaskClient(server.url) as client:
                        assert client.hello["engine"]["torch_threads"] == wanted
                        await client.fill_mask("Paris is the [MASK] of France.")
                finally:
                    del model.forward  # (the instance's own attribute: the class's method again)
                assert seen == [wanted], seen
            assert torch.get_num_threads() == 3 - wanted  # (this thread's: the model thread set its own)
    finally:
        torch.set_num_threads(process)


def test_a_drain_on_another_event_loop_says_how_and_after_its_own_loop_closed_leaves_nothing_running(
        tiny_config: Config) -> None:
    """A program that started the server in one ``asyncio.run`` and drained it in a second got asyncio's
    "Event loop is closed" and kept the engine's threads and the listening port. A drain on another loop
    now says where to run it while the server's own loop still runs (and changes nothing), and once
    that loop has closed, stops the listener and the threads and says what was not done."""
    import threading

    server = load_server(replace(tiny_config, calibration_s=0))
    own = asyncio.new_event_loop()
    thread = threading.Thread(target=own.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), own).result(30)
        with pytest.raises(RuntimeError, match=r"run it there \(asyncio\.run_coroutine_threadsafe\("):
            asyncio.run(server.drain())
        assert running_threads(server)
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()  # still listening
        asyncio.run_coroutine_threadsafe(server.drain(), own).result(30)  # on its own loop: drained
        assert running_threads(server) == []
    finally:
        own.call_soon_threadsafe(own.stop)
        thread.join(10)
        own.close()

    server = load_server(replace(tiny_config, calibration_s=0))  # a loop stopped, not closed (a review: the
    own = asyncio.new_event_loop()  # advice to use run_coroutine_threadsafe would have waited for ever)
    try:
        own.run_until_complete(server.start())
        with pytest.raises(RuntimeError, match=r"run it there \(loop\.run_until_complete\(server\.drain\(\)\)\)"):
            asyncio.run(server.drain())
        own.run_until_complete(server.drain())
        assert running_threads(server) == []
    finally:
        own.close()

    server = load_server(replace(tiny_config, calibration_s=0))
    asyncio.run(server.start())  # (asyncio.run closes its loop on return)
    try:
        with pytest.raises(RuntimeError, match="the event loop this server was started on has closed") as ended:
            asyncio.run(server.drain())
        assert "start and drain a server within one asyncio.run" in str(ended.value)
        assert running_threads(server) == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        asyncio.run(server.drain())  # ended: nothing to do, as after any drain
    finally:
        server.engine.stop()
