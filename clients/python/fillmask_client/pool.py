"""The client's connections: which one a call goes on, and replacing those that go away.

A pool has a fixed number of *slots* (``connections`` per URL: several to one URL behind a load
balancer, or one or more to each of a list of servers). Each slot has at most one connection that takes
new calls; a connection the server is shutting down (``going_away``, §10; an ``overloaded`` 503
``shutting_down``/``engine_stopped`` answer, §6; a close with 1001/1012) takes no new calls but keeps
the calls already sent on it until the server answers them, then is closed. With ``reconnect`` the slot
dials a replacement in the background, after a random delay (``ReconnectBackoff``: full jitter, first
spread over the server's ``reconnect_within_ms``), while the other slots carry the calls.

The choice (``least_loaded``) is pure: the usable connection with the fewest requests in flight, ties
taken in turn, so that idle calls rotate over the slots and a slow server gets fewer new calls.

Invariants:

- ``pick`` only returns a connection that is ``usable`` at that moment; a caller sends on it with no
  ``await`` in between (``Connection.exchange`` checks again after any wait of its own).
- A slot has at most one dialer task; it ends when it installs a usable connection, when the failure is
  final (not ``ConnectError.transient``: a wrong token or path, TLS against a plain server, a peer that
  is not a fill-mask server do not change by waiting), or when the pool closes.
- At most ``MAX_OPENING`` connections of a pool are being opened at once (``open`` and the redials
  together), whatever its number of slots.
- Every connection the pool ever installed is in exactly one place until it has ended: its slot's
  ``conn`` or that slot's ``retired`` set; so ``close`` reaches them all, and ``in_flight`` counts them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .connection import RECONNECT_CODES, REDIAL_CODES, Connection, redact
from .errors import ConnectError, ConnectionLostError, FillMaskError, OverloadedError, UsageError
from .retry import ReconnectBackoff
from .state import ConnState

log = logging.getLogger("fillmask_client")

#: ``opener(url, on_change)``: open one connection to ``url`` (``ConnectError`` on any failure).
Opener = Callable[[str, Callable[[Connection], None]], Awaitable[Connection]]


def least_loaded(loads: Sequence[int | None], start: int = 0) -> int | None:
    """Index of the smallest load (``None``: that slot cannot take a call), or ``None`` if none can.

    Ties go to the first candidate at or after ``start``, going round: a caller that moves ``start``
    past each choice spreads equal loads over all slots in turn.
    """
    best: int | None = None
    count = len(loads)
    for offset in range(count):
        index = (start + offset) % count
        load = loads[index]
        if load is not None and (best is None or load < loads[best]):  # type: ignore[operator]
            best = index
    return best


def _copy(error: ConnectError) -> ConnectError:
    """A fresh exception with the same meaning, so that several callers never share one traceback."""
    return ConnectError(error.message, url=error.url, http_status=error.http_status, kind=error.kind)


@dataclass(eq=False)
class Slot:
    """One place in the pool: a URL and the connection now serving it, plus those it replaced."""

    url: str
    conn: Connection | None = None
    retired: set[Connection] = field(default_factory=set)
    dialer: asyncio.Task[None] | None = None
    failure: ConnectError | None = None  # why the latest dial failed; cleared by a success
    final: bool = False  # the latest failure was one that waiting will not change (not ``transient``)
    installed_at: float | None = None  # loop time its connection was installed
    dialled_at_step: int = 0  # the backoff step of the dial that opened its connection


#: The most connections one pool has in its opening handshake at once (TCP, TLS, WebSocket upgrade and
#: ``hello``); the rest wait their turn. A server holds a bounded number of unfinished handshakes (256 by
#: default, against clients that open connections they never use) and may reset the ones beyond it (this
#: project's server lets a burst past it up to its ``--max-connections``; older ones did not), so a pool
#: that dialled its up to ``MAX_CONNECTIONS`` at once lost those past the server's bound. Well below that
#: bound, so that a few such clients opening at once still fit.
MAX_OPENING = 64

#: A connection that lasted this long (seconds) starts its slot's next redial from the first backoff
#: step; one lost sooner, without the server announcing it, carries on from where the previous
#: redial's backoff was, so a server that closes every connection at once (1011 each time, say) is
#: not redialled dozens of times a second.
LASTED_S = 5.0


class Pool:
    """The slots of one client; see the module docstring. Bound to the event loop it is used on."""

    def __init__(self, urls: Sequence[str], per_url: int, opener: Opener, *, reconnect: bool,
                 backoff: ReconnectBackoff) -> None:
        if not urls:
            raise ValueError("give at least one server URL")
        if per_url < 1:
            raise ValueError(f"connections must be at least 1, not {per_url!r}")
        self.slots = [Slot(url) for url in urls for _ in range(per_url)]
        self.reconnect = reconnect
        self.backoff = backoff
        self.hello: dict[str, object] | None = None  # of the connection installed last
        self.opened = False
        self.closed = False
        #: Set by ``close``: wakes calls sleeping before a resend, which then fail at once.
        self.closed_event = asyncio.Event()
        self._opening: set[asyncio.Future[Connection]] = set()  # ``open``'s dials under way
        self._opener = opener
        #: Held for each connection being opened (``open`` and the redials): at most ``MAX_OPENING`` at once.
        self._opening_places = asyncio.Semaphore(MAX_OPENING)
        self._unreachable: ConnectError | None = None  # ``open``'s first timeout before any opened
        self._reached = False  # one of ``open``'s connections opened
        self._turn = 0
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_failure: ConnectError | None = None  # of the latest dial, until a connection is installed
        #: Calls in ``acquire`` waiting for a connection to be (re)opened.
        self.waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop ``open`` first ran on

    def check_loop(self) -> None:
        """``UsageError`` unless called on the event loop the pool opened on (or before it opened): on
        another loop its connections' readers never run, and a call would wait for ever. A closed pool
        says it is closed, whichever the loop: that is the cause to fix."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            if self.closed:
                raise self.closed_error()
            raise UsageError("this client was connected on another event loop, and a client works only on the "
                             "loop it connected on: make a client on this loop (with pytest-asyncio, give a "
                             "client fixture the same loop_scope as the tests that use it), or use "
                             "SyncFillMaskClient from threads")

    # --- the choice ------------------------------------------------------------------------------

    def pick(self) -> Connection | None:
        """The usable connection with the fewest requests in flight (ties in turn), or None. A connection
        the server told to wait (``not_before``, §6) is chosen only when every usable one was told so."""
        conns = [slot.conn if slot.conn is not None and slot.conn.usable else None for slot in self.slots]
        now = asyncio.get_running_loop().time()
        if any(conn is not None and conn.not_before <= now for conn in conns):
            conns = [conn if conn is not None and conn.not_before <= now else None for conn in conns]
        index = least_loaded([conn.load if conn is not None else None for conn in conns], self._turn)
        if index is None:
            return None
        self._turn = (index + 1) % len(self.slots)
        return conns[index]

    @property
    def usable(self) -> int:
        """How many connections take new calls now."""
        return sum(1 for slot in self.slots if slot.conn is not None and slot.conn.usable)

    def may_resend(self, lost: ConnectionLostError | None) -> bool:
        """Whether a call that ended without an answer (``lost``, or ``None`` for a ``shutting_down`` or
        ``engine_stopped`` answer) should be sent again: only where another attempt can succeed."""
        if self.closed:
            return False
        if lost is not None and lost.code not in RECONNECT_CODES:
            return False  # this client broke a rule (1008, 1009...) or the server failed (1011): not elsewhere
        return self.reconnect or self.pick() is not None

    async def acquire(self, timeout: float) -> Connection:
        """A connection to send on, waiting (with ``reconnect``) up to ``timeout`` s for one to be usable.

        Raises why none is usable: the server's ``shutting_down``/``engine_stopped`` (as
        ``OverloadedError``) for a connection that is going away, ``ConnectionLostError`` for one that
        is lost, the final refusal of a redial, or ``ConnectError`` once ``timeout`` has passed.
        """
        self.check_loop()
        loop = asyncio.get_running_loop()
        give_up: float | None = None
        while True:
            if self.closed:
                raise self.closed_error()
            conn = self.pick()
            if conn is not None:
                return conn
            closing = [slot.conn.reader for slot in self.slots
                       if slot.conn is not None and slot.conn.closing and slot.conn.reader is not None]
            if closing:
                # Closing: let the readers finish (within websockets' close_timeout) so that how each
                # connection ended is settled before deciding whether to redial or to fail.
                await asyncio.wait(closing)
                continue
            if not self.reconnect:
                raise self._why_none()
            self._dial_where_needed()
            if all(slot.dialer is None for slot in self.slots):
                raise self._why_none()  # nothing will change: final refusals, or losses not worth a redial
            if give_up is None:
                give_up = loop.time() + timeout
            remaining = give_up - loop.time()
            if remaining <= 0:
                raise self._timed_out(timeout)
            changed = self._changed
            self.waiting += 1
            try:
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
            finally:
                self.waiting -= 1

    def closed_error(self, when: str = "") -> ConnectionLostError:
        """A fresh ``the client for URL was closed`` (``when``: e.g. `` while it connected``)."""
        url = redact(self.slots[0].url)
        return ConnectionLostError(f"the client for {url} was closed{when}", url=url)

    def lost_for_good(self) -> ConnectionLostError | OverloadedError | None:
        """Once opened: why no connection takes calls and none will be opened again (without
        ``reconnect``), or None (one is usable, or may be redialled)."""
        if not self.opened or self.reconnect or self.usable:
            return None
        return self._why_none()

    def _why_none(self) -> ConnectionLostError | OverloadedError:
        """The most telling reason why no connection takes calls, as a fresh exception."""
        for slot in self.slots:
            if slot.final and slot.failure is not None:
                return _copy(slot.failure)
        for slot in self.slots:
            if slot.conn is not None and slot.conn.state is ConnState.DRAINING:
                return slot.conn.gone_error()  # going away: what the server said
        for slot in self.slots:
            if slot.conn is not None:
                lost = slot.conn.lost_error()
                if self.reconnect or lost.code == 1000:  # redialling, or closed by this client
                    return lost
                return ConnectionLostError(f"{lost.message}; this client does not open a new connection: pass "
                                           "reconnect=True to FillMaskClient, or make a new client",
                                           url=lost.url, code=lost.code, reason=lost.reason)
        for slot in self.slots:
            if slot.failure is not None:
                return _copy(slot.failure)
        if not self.opened and not self.closed:
            return self.not_connected_error()
        url = redact(self.slots[0].url)
        return ConnectionLostError(f"no connection to {url}", url=url)

    def not_connected_error(self) -> ConnectionLostError:
        """A fresh ``not connected``: what a call (or ``hello``) before ``connect()`` raises."""
        url = redact(self.slots[0].url)
        return ConnectionLostError(f"not connected to {url}: await client.connect() first, or use "
                                   "'async with FillMaskClient(url) as client'", url=url)

    def unopened(self) -> ConnectionLostError | None:
        """Why no call could be sent at all, or None: the client was closed, or never connected."""
        if self.closed:
            return self.closed_error()
        return None if self.opened else self.not_connected_error()

    def hopeless(self) -> FillMaskError | None:
        """Why no call could be answered now or later, or None: ``unopened``, every connection lost
        without ``reconnect`` (``lost_for_good``), or, with it, every redial refused for good (a wrong
        token, TLS against a plain server: ``final``)."""
        unopened = self.unopened()
        if unopened is not None:
            return unopened
        if self.reconnect and not self.usable and all(slot.final for slot in self.slots):
            return self._why_none()
        return self.lost_for_good()

    @property
    def last_failure(self) -> ConnectError | None:
        """Why the latest attempt to open a connection failed, if none has been installed since."""
        return self._last_failure

    def _timed_out(self, timeout: float) -> ConnectError:
        last = self._last_failure
        url = redact(self.slots[0].url)
        if last is None:
            return ConnectError(f"could not reconnect to {url} within {timeout:g} s", url=url, kind="timeout")
        return ConnectError(f"could not reconnect within {timeout:g} s: {last.message}", url=last.url,
                            http_status=last.http_status, kind=last.kind)

    # --- opening, replacing, closing -----------------------------------------------------------------

    async def open(self) -> None:
        """Open every slot's connection, at most ``MAX_OPENING`` handshakes at once. Raises the first
        failure when none opened; otherwise the failed slots are dialled again in the background (with
        ``reconnect``) or stay empty."""
        self.check_loop()
        self._unreachable, self._reached = None, False
        tasks = [asyncio.ensure_future(self._open_one(slot, first=True)) for slot in self.slots]
        self._opening.update(tasks)  # close() cancels them
        try:
            await asyncio.wait(tasks)
            if self.closed:  # close() came while these connected: nothing here may stay open
                raise self.closed_error(" while it connected")
        except BaseException:  # cancelled or closed: close whatever did open
            for task in tasks:
                task.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in done if isinstance(c, Connection)))
            raise
        finally:
            self._opening.difference_update(tasks)
        failures: list[BaseException] = []
        for slot, task in zip(self.slots, tasks, strict=True):
            error = task.exception()
            if error is None:
                self._install(slot, task.result())
            elif isinstance(error, ConnectError):
                self._failed(slot, error)
                failures.append(error)
            else:
                failures.append(error)
        unexpected = [e for e in failures if not isinstance(e, ConnectError)]
        if unexpected or len(failures) == len(self.slots):
            # Not opened: put the slots back as they were (so that ``open`` may be tried again later).
            opened = [slot.conn for slot in self.slots if slot.conn is not None]
            for slot in self.slots:
                slot.conn, slot.failure, slot.final = None, None, False
            self.hello = None
            await asyncio.gather(*(conn.close() for conn in opened))
            raise (unexpected or failures)[0]
        self.opened = True
        self._loop = asyncio.get_running_loop()
        if failures:
            log.warning("%d of %d connections could not be opened: %s", len(failures), len(self.slots),
                        failures[0])
        self._dial_where_needed()

    async def _open_one(self, slot: Slot, first: bool = False) -> Connection:
        """Open a connection for ``slot`` once one of the ``MAX_OPENING`` places is free (the opener's
        ``ConnectError`` on failure); the place is held until its ``hello`` came or it failed.

        ``first``: one of ``open``'s. Once one of those timed out before any opened (a server that
        accepts and never answers), those still waiting for a place fail with it at once: otherwise
        each group of ``MAX_OPENING`` waited out its own ``open_timeout``, and ``open`` took as many
        times it as there are groups."""
        async with self._opening_places:
            if first and self._unreachable is not None:
                raise self._unreachable
            try:
                conn = await self._opener(slot.url, functools.partial(self._on_change, slot))
            except ConnectError as exc:
                if first and exc.kind == "timeout" and not self._reached:
                    self._unreachable = exc
                raise
            self._reached = self._reached or first
            return conn

    def _install(self, slot: Slot, conn: Connection) -> None:
        """Make ``conn`` the slot's connection; the one it replaces keeps only the answers it still owes."""
        old = slot.conn
        if old is not None and old.state is not ConnState.CLOSED:
            slot.retired.add(old)
            if not old.pending:
                self._spawn(old.close())
        slot.conn, slot.failure, slot.final = conn, None, False
        slot.installed_at, slot.dialled_at_step = asyncio.get_running_loop().time(), 0
        self.hello = conn.hello
        self._last_failure = None
        self._notify()

    def _failed(self, slot: Slot, error: ConnectError) -> None:
        slot.failure, slot.final = error, not error.transient
        self._last_failure = error
        self._notify()

    def _on_change(self, slot: Slot, conn: Connection) -> None:
        """A connection went away, was refused work, was lost, or answered its last owed request."""
        if conn in slot.retired:
            if conn.state is ConnState.CLOSED:
                slot.retired.discard(conn)
            elif not conn.pending:
                self._spawn(conn.close())  # answered everything it owed: nothing more will come on it
        self._dial_where_needed()
        self._notify()

    def _wants_dial(self, slot: Slot) -> bool:
        if slot.dialer is not None or slot.final or self.closed or not self.reconnect:
            return False
        conn = slot.conn
        if conn is None:
            return self.opened  # its first dial failed (once connect() is past)
        match conn.state:
            case ConnState.DRAINING:  # the server takes no more work there: dial now
                return True
            case ConnState.CLOSED:  # worth a redial if the server went away or the loss is one §14 redials
                return conn.went_away or (conn.lost is not None and conn.lost.code in REDIAL_CODES)
            case _:  # open (usable, or its socket closing: wait for how it ended); connecting is never installed
                return False

    def _dial_where_needed(self) -> None:
        for slot in self.slots:
            if self._wants_dial(slot):
                window = slot.conn.reconnect_window if slot.conn is not None else None
                slot.dialer = asyncio.create_task(self._dial(slot, window),
                                                  name=f"fillmask-client-dial {redact(slot.url)}")

    async def _dial(self, slot: Slot, first_window: float | None) -> None:
        """Reopen the slot's connection, with backoff and full jitter, until one is usable (see invariants)."""
        now = asyncio.get_running_loop().time()
        # A loss the server announced (going_away, engine_stopped: ``first_window``) starts from step 0,
        # spread over the window it gave; an unannounced one soon after the last install carries on.
        lasted = slot.installed_at is None or now - slot.installed_at >= LASTED_S
        attempt = 0 if lasted or first_window is not None else slot.dialled_at_step + 1
        try:
            while not self.closed:
                await asyncio.sleep(self.backoff.delay(attempt, first_window))
                step, attempt = attempt, attempt + 1
                try:
                    conn = await self._open_one(slot)
                except ConnectError as exc:
                    log.debug("redial of %s failed: %s", redact(slot.url), exc)
                    self._failed(slot, exc)
                    if slot.final:
                        return
                    continue
                except Exception as exc:  # not foreseen: final (kind "other"), never a redial in a tight loop
                    url = redact(slot.url)
                    self._failed(slot, ConnectError(f"cannot connect to {url}: {exc!r}", url=url))
                    return
                if self.closed:
                    await conn.close()
                    return
                if not conn.usable:  # gone again before it could be used: not installed, never counted
                    if conn.state is not ConnState.CLOSED:
                        self._spawn(conn.close())
                    continue
                log.info("reconnected to %s", redact(slot.url))
                slot.dialer = None  # before installing: a change seen from now on may start a new dial
                self._install(slot, conn)
                slot.dialled_at_step = step
                return
        finally:
            if slot.dialer is asyncio.current_task():
                slot.dialer = None
            self._notify()

    def connections(self) -> list[Connection]:
        """Every connection that has not ended: the slots' current ones and those still owing answers."""
        found: list[Connection] = []
        for slot in self.slots:
            if slot.conn is not None:
                found.append(slot.conn)
            found.extend(slot.retired)
        return found

    async def close(self) -> None:
        """Stop dialling and close every connection; calls still waiting fail promptly."""
        if self.closed and self._loop is not None and asyncio.get_running_loop() is not self._loop:
            return  # closed already, on the loop it ran on: nothing is left to close from here
        self.check_loop()
        self.closed = True
        self.closed_event.set()
        for opening in self._opening:  # a connect() under way: it raises "closed while it connected"
            opening.cancel()
        dialers = [slot.dialer for slot in self.slots if slot.dialer is not None]
        for dialer in dialers:
            dialer.cancel()
        await asyncio.gather(*dialers, return_exceptions=True)
        await asyncio.gather(*(conn.close() for conn in self.connections()))
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._notify()

    def _notify(self) -> None:
        """Wake every call waiting in ``acquire``; later waiters wait for the next change."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
