"""Three replicas behind a real HAProxy (issue 11): spread, rolling restart under load, drain, all down.

Everything is real and local: three ``python ws_server.py --model models/tiny`` processes on loopback
ports, Debian's ``haproxy`` running ``deploy/haproxy.cfg`` (the replicas' addresses in its environment),
and the pooled ``FillMaskClient`` in this process. Replicas are stopped as an orchestrator stops them
(SIGTERM: ``/readyz`` 503 for ``--drain-delay``, then ``going_away``, then 1001, exit 0; protocol.md §10)
and started again on the same port. The balancer's view comes from its own status page (``/stats;csv``).

Exactly one answer per call is counted: each call appends its one result (or its one error) to a list.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import os
import random
import shutil
import signal
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from fillmask_client import ConnectError, FillMaskClient, FillMaskError
from tests.wire import wait_until

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Paris is the [MASK] of France."
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
#: Long enough for the balancer's checks (every 250 ms, 2 failures) to take a draining replica out,
#: with room for a loaded machine, while it still serves (deploy/haproxy.cfg explains the numbers).
DRAIN_DELAY_S = 4.0  # the balancer sees the 503 within ~1 s; the rest is room for a slow machine
START_TIMEOUT_S = 90.0

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (bash scripts/setup.sh --test "
                                                        "installs Debian's package)")


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports with nothing listening (held together while chosen, so all differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.headers.get("Content-Type", ""), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read()


class Replica:
    """One ``ws_server.py`` process on a fixed port, started and stopped as an orchestrator would."""

    def __init__(self, name: str, port: int, log_dir: Path) -> None:
        self.name = name
        self.port = port
        self.log_path = log_dir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Start the process and wait for its ``ready:`` line (it listens only once its model is loaded)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "ws_server.py", "--model", "models/tiny", "--host", "127.0.0.1",
                "--port", str(self.port), "--drain-delay", str(DRAIN_DELAY_S), "--shutdown-timeout", "10",
                "--torch-threads", "1", "--calibration-s", "0", "--log-level", "warning",
                cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), START_TIMEOUT_S)
        assert line.startswith(b"ready: "), f"{self.name} did not start: {line!r}; see {self.log_path}"

    async def terminate(self, signum: int = signal.SIGTERM) -> int:
        """SIGTERM (the orchestrator's stop: drain after the delay), or SIGINT (drain now); the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        return await asyncio.wait_for(self.proc.wait(), DRAIN_DELAY_S + 30)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: the drain without the delay
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    async def open_connections(self) -> int:
        """The replica's own ``fillmask_open_connections`` gauge (§11), read directly from it."""
        status, _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.port}/metrics")
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith("fillmask_open_connections "):
                return int(float(line.split()[1]))
        raise AssertionError("no fillmask_open_connections in /metrics")


class Balancer:
    """HAProxy running deploy/haproxy.cfg in the foreground, pointed at the replicas by environment."""

    def __init__(self, replicas: list[Replica], port: int, stats_port: int, log_dir: Path) -> None:
        self.replicas = replicas
        self.port = port
        self.stats_port = stats_port
        self.log_path = log_dir / "haproxy.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        assert HAPROXY is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("FILLMASK_")}
        env["FILLMASK_LB_BIND"] = f"127.0.0.1:{self.port}"
        env["FILLMASK_LB_STATS_BIND"] = f"127.0.0.1:{self.stats_port}"
        for number, replica in enumerate(self.replicas, start=1):
            env[f"FILLMASK_REPLICA_{number}"] = f"127.0.0.1:{replica.port}"
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                HAPROXY, "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg"), env=env,
                stdout=log, stderr=log, start_new_session=True)

    async def states(self) -> dict[str, str]:
        """Each replica's state as the balancer sees it: ``UP``, ``DOWN``, ``UP 1/2`` (going down)..."""
        status, _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.stats_port}/stats;csv")
        assert status == 200
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows if row["pxname"] == "replicas"
                and row["svname"] != "BACKEND"}

    async def wait_state(self, replica: Replica, state: str, timeout: float = 30.0) -> None:
        name = f"replica{self.replicas.index(replica) + 1}"
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(OSError):
                    if (await self.states()).get(name) == state:
                        return
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Cluster:
    def __init__(self, replicas: list[Replica], balancer: Balancer) -> None:
        self.replicas = replicas
        self.balancer = balancer

    async def all_up(self) -> None:
        """Every replica running and in the balancer's rotation (restarting any a previous test stopped)."""
        stopped = [replica for replica in self.replicas if not replica.running]
        await asyncio.gather(*(replica.start() for replica in stopped))
        for replica in self.replicas:
            await self.balancer.wait_state(replica, "UP")

    async def restart(self, replica: Replica) -> None:
        """SIGTERM, expect exit status 0, start again on the same port, wait until the balancer uses it."""
        code = await replica.terminate()
        assert code == 0, f"{replica.name} exited {code} after SIGTERM; see {replica.log_path}"
        await replica.start()
        await self.balancer.wait_state(replica, "UP")


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cluster")
    ports = free_ports(5)
    replicas = [Replica(f"replica{n}", port, log_dir) for n, port in enumerate(ports[:3], start=1)]
    balancer = Balancer(replicas, ports[3], ports[4], log_dir)
    made = Cluster(replicas, balancer)
    try:
        await balancer.start()
        await made.all_up()
        yield made
    finally:
        await asyncio.gather(*(replica.kill() for replica in replicas))
        await balancer.stop()


@pytest.fixture
def client_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The client's warnings: a terminal frame for an id not in flight would mean a double answer."""
    caplog.set_level(logging.WARNING, logger="fillmask_client")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name.startswith("fillmask_client") and r.levelno >= logging.WARNING]


async def test_30_connections_spread_evenly_over_three_replicas(cluster: Cluster) -> None:
    await cluster.all_up()
    async with FillMaskClient(cluster.balancer.url, connections=30) as client:
        assert client.usable_connections == 30
        counts = [await replica.open_connections() for replica in cluster.replicas]
        assert sum(counts) == 30 and all(9 <= count <= 11 for count in counts), counts  # leastconn
        answers = await client.fill_mask_many([TEXT] * 60, top_k=2)
        assert [len(answer) for answer in answers] == [2] * 60


async def test_http_paths_work_through_the_balancer(cluster: Cluster) -> None:
    await cluster.all_up()
    base = cluster.balancer.http_url
    for path, status, body_has in [("/healthz", 200, b'"ok"'), ("/readyz", 200, b'"ready"'),
                                   ("/metrics", 200, b"fillmask_open_connections"), ("/", 200, b"<html"),
                                   ("/nope", 404, b"not found")]:
        got_status, _, body = await asyncio.to_thread(http_get, base + path)
        assert (got_status, body_has in body) == (status, True), (path, got_status, body[:200])


async def test_the_balancers_log_keeps_the_path_but_never_the_token(cluster: Cluster) -> None:
    """A browser can pass the token only as ``?token=`` (§12); httplog wrote the whole request line, the
    secret with it, into the balancer's log (found by an operator's review)."""
    await cluster.all_up()
    secret = "s3cr3t-" + os.urandom(6).hex()
    got_status, _, _ = await asyncio.to_thread(http_get, f"{cluster.balancer.http_url}/readyz?token={secret}")
    assert got_status == 200
    async with asyncio.timeout(10):
        while not (lines := [line for line in cluster.balancer.log_path.read_text(errors="replace").splitlines()
                             if "GET /readyz" in line]):
            await asyncio.sleep(0.05)
    assert lines[-1].endswith('"GET /readyz HTTP/1.1"') and secret not in lines[-1], lines[-1]


MIN_CALLS = 1500  # answered calls, at least, across the rolling restart


async def test_rolling_restart_under_load_loses_no_call(
    cluster: Cluster, client_warnings: Callable[[], list[str]]
) -> None:
    await cluster.all_up()
    answered: list[int] = []  # one entry per call that got its result (its top_k, checked on arrival)
    failed: list[BaseException] = []  # one entry per call that raised
    restarted = asyncio.Event()
    pace = random.Random(11)

    async def caller(client: FillMaskClient, worker: int) -> None:
        calls = 0
        while not (restarted.is_set() and len(answered) >= MIN_CALLS):
            # About 45 calls a second in all, in uneven bursts: load on every replica all the time (each
            # call is a forward pass of its own or nearly), and CPU left on a 2-core machine (one of them
            # perhaps busy with something else) for the restarted replicas to load their model.
            await asyncio.sleep(pace.uniform(0.0, 0.5))
            calls += 1
            top_k = 1 + (worker + calls) % 4
            try:
                answer = await client.fill_mask(TEXT, top_k=top_k)
            except FillMaskError as exc:
                failed.append(exc)
                return
            assert len(answer) == top_k  # its own answer, not another call's
            answered.append(top_k)

    async with FillMaskClient(cluster.balancer.url, connections=6, reconnect=True, reconnect_timeout=30) as client:
        callers = [asyncio.create_task(caller(client, n)) for n in range(12)]
        try:
            for replica in cluster.replicas:  # one at a time, as a Deployment's rolling update does
                before = len(answered)  # calls flowing again first
                await wait_until(lambda before=before: len(answered) >= before + 40 or bool(failed), timeout=30)
                await cluster.restart(replica)
            restarted.set()
            await asyncio.wait_for(asyncio.gather(*callers), 60)
        finally:
            restarted.set()
            for task in callers:
                task.cancel()
        assert failed == [], failed[:3]
        assert client.in_flight == 0
    assert len(answered) >= MIN_CALLS
    assert not client_warnings()  # no answer arrived for a call that was not waiting for it


async def test_a_draining_replica_gets_no_new_connection_once_the_balancer_saw_its_503(cluster: Cluster) -> None:
    await cluster.all_up()
    draining, others = cluster.replicas[0], cluster.replicas[1:]
    # A client connected to it directly: it keeps serving through its --drain-delay (§10).
    async with FillMaskClient(draining.url) as direct:
        before = [await replica.open_connections() for replica in cluster.replicas]
        assert before[0] == 1
        draining.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        stopped = asyncio.create_task(draining.proc.wait())  # type: ignore[union-attr]
        await cluster.balancer.wait_state(draining, "DOWN", timeout=DRAIN_DELAY_S / 2)
        async with FillMaskClient(cluster.balancer.url, connections=12) as through:
            assert through.usable_connections == 12
            after = [await replica.open_connections() for replica in cluster.replicas]
            # Still within its delay, the replica would take connections (the direct one still works)...
            assert len(await direct.fill_mask(TEXT, top_k=3)) == 3
            assert not stopped.done()
        # ...but none of the twelve reached it: the balancer had taken it out of rotation.
        assert after[0] == before[0], (before, after)
        assert sum(after[1:]) == sum(before[1:]) + 12
    assert await asyncio.wait_for(stopped, 30) == 0
    assert all(replica.running for replica in others)


async def test_with_every_replica_down_clients_get_a_clear_503_not_a_hang(cluster: Cluster) -> None:
    running = [replica for replica in cluster.replicas if replica.running]
    assert running, "the cluster has no replica left to stop"
    await asyncio.gather(*(cluster.balancer.wait_state(replica, "UP") for replica in running))
    async with FillMaskClient(cluster.balancer.url, connections=3, reconnect=True, reconnect_timeout=1.5) as client:
        assert len(await client.fill_mask(TEXT, top_k=1)) == 1
        # Stopped with SIGINT, which drains at once: how they go down does not matter here, only that
        # none is left (the drain-delay path is the rolling restart's and the draining test's).
        codes = await asyncio.gather(*(replica.terminate(signal.SIGINT) for replica in running))
        assert codes == [0] * len(running)
        for replica in cluster.replicas:
            await cluster.balancer.wait_state(replica, "DOWN")

        # A new WebSocket handshake: 503 with a JSON body saying what to do.
        with pytest.raises(InvalidStatus) as refused:
            await connect(cluster.balancer.url, open_timeout=5)
        assert refused.value.response.status_code == 503
        body = refused.value.response.body
        assert "no fill-mask replica is ready" in orjson.loads(body)["error"] and body.endswith(b"}\n"), body
        status, content_type, body = await asyncio.to_thread(http_get, cluster.balancer.http_url + "/healthz")
        assert (status, content_type) == (503, "application/json") and b"retry" in body

        # The pooled client: a clear error within its reconnect_timeout, and a new client is refused at once.
        with pytest.raises(ConnectError) as down:
            await asyncio.wait_for(client.fill_mask(TEXT), 20)
        assert down.value.http_status == 503 and "no fill-mask replica is ready" in str(down.value)
    with pytest.raises(ConnectError) as fresh:
        await asyncio.wait_for(FillMaskClient(cluster.balancer.url, connections=2).connect(), 10)
    assert fresh.value.http_status == 503 and "HTTP 503" in str(fresh.value)
