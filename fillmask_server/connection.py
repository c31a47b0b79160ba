"""The socket side of one WebSocket connection: an ordered, byte-counted outbox and its writer task.

Every frame for the client goes through ``send`` and leaves in order, the frames waiting together in
one write to the socket. The server routes the answers of one engine hand-over with ``send(...,
defer=True)`` and then calls ``flush``, which writes them at once when the writer task is idle and the
socket has taken everything before (the common case: no task switch per connection per batch);
otherwise, and for every other frame, the connection's writer task hands them to websockets and
waits for its flow control.
The protocol decisions (what to answer, when) are the connection's ``Session``'s; this class only
moves bytes and reports how the client keeps up:

- ``pending_bytes`` counts the frames queued and not yet handed to the socket; ``congested`` is True
  while it exceeds ``max_send_buffer`` (the server then reads nothing more from this client), and
  ``on_congested`` is called each time it becomes True.
- ``backlogged`` is True while anything waits to be written (outbox or transport); ``on_backlog`` is
  called, unless a watchdog is running, when the writer task starts writing (its writes wait for the
  client) and when a write leaves bytes in the transport (the kernel's send buffer is full), so
  that a client that stops reading is noticed even when its answers stay
  within the bound (the engine starts its requests only while their answers fit, so the outbox may
  never pass it).
- ``last_progress`` is the last time the client was seen taking bytes: a frame's write finished (its
  bytes went below websockets' write buffer limit), or the transport's unsent buffer shrank between
  two looks (``note_progress``). A client that reads, however slowly, keeps moving it; one that reads
  nothing does not, whatever the size of the frame it is stuck on (protocol.md §12). The socket shows
  reading only as the client's kernel reopens its TCP window, a segment (its MSS) at a time: a client
  that reads less than that within ``--send-timeout`` cannot be told from one that reads nothing.
- Answers about requests are counted in the metrics when they are handed to the socket; answers still
  in the outbox when it is dropped (the connection closed, or the server gave up on it) are counted as
  ``dropped``. So every answer is counted once, as what happened to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from .metrics import Metrics
from .stats import Mark

WRITE_BATCH_BYTES = 64 * 1024  # most bytes of frames handed to websockets in one write
CLOSE_GRACE_S = 5.0  # how long a close may wait for a client to take the close frame before the socket is cut
DRAIN_LOOK_S = 0.05  # how often a draining connection looks whether its client took its answers

Label = tuple[str, str] | None  # (outcome, code) of an answer about a request; None for other frames


def kernel_unsent(transport: Any) -> int:
    """Bytes in the socket's kernel send queue not yet taken by the peer (Linux ``SIOCOUTQ``); 0 where
    the platform or the socket cannot say."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


class UnsentBytes:
    """The bytes of answers queued and not yet handed to a socket, over every connection of a server.

    Written on the event loop only (each ``Connection`` adds and subtracts its own), read by the engine's
    stage threads to keep answers within ``--max-answer-bytes``: a single integer, so a read is atomic.
    """

    def __init__(self) -> None:
        self.total = 0


class Connection:
    """One client socket and its outbox (see the module docstring). ``session`` is its protocol state."""

    def __init__(self, ws: ServerConnection, metrics: Metrics, max_send_buffer: int,
                 on_congested: Callable[[Connection], None], unsent: UnsentBytes | None = None,
                 on_backlog: Callable[[Connection], None] | None = None) -> None:
        self.ws = ws
        self._unsent = unsent or UnsentBytes()
        self.session: Any = None
        self.closed = False
        self.pending_bytes = 0
        self.last_progress = time.monotonic()
        self._metrics = metrics
        self._max_send_buffer = max_send_buffer
        self._on_congested = on_congested
        self._on_backlog = on_backlog
        self._outbox: deque[tuple[bytes, Label]] = deque()
        self._ready = asyncio.Event()
        self._uncongested = asyncio.Event()
        self._uncongested.set()
        self._writer: asyncio.Task[None] | None = None
        self._writing = False  # the writer task is handing frames to websockets (flush must not)
        self._handed = 0  # the outbox's first frames the writer wrote to the transport, before flow control's wait
        self._unsent_seen = 0
        self.closing: asyncio.Task[None] | None = None  # the server's own close, once it decided on one
        self.watchdog: asyncio.Task[None] | None = None  # FillMaskServer._watch_reader, while anything waits
        self.deadline_timer: asyncio.TimerHandle | None = None  # the session's next deadline (server-owned)
        self.stats_task: asyncio.Task[None] | None = None  # sends stats frames while subscribed (server-owned)
        self.stats_interval_ms: int | None = None
        self.stats_mark: Mark | None = None  # where the next stats frame's window begins (server-owned)

    @property
    def backlogged(self) -> bool:
        """Answers wait: in the outbox, or in the transport's buffer (the kernel's is full)."""
        return bool(self._outbox) or self._transport_holds_bytes()

    @property
    def behind(self) -> bool:
        """The client has not read its earlier frames: bytes wait in the transport's buffer (so the
        kernel's fixed one is full), or more than the bound waits at all. A frame that can be left out
        (``stats``, §13) is, rather than add to what waits."""
        return self.congested or self._transport_holds_bytes()

    def _transport_holds_bytes(self) -> bool:
        transport = self.ws.transport
        return transport is not None and transport.get_write_buffer_size() > 0

    @property
    def congested(self) -> bool:
        """More than the bound is unsent: in the outbox, or in the socket (pongs: ``FrontConnection.backed_up``)."""
        return self.pending_bytes > self._max_send_buffer or getattr(self.ws, "backed_up", False)

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop())

    def send(self, frame: bytes, label: Label = None, defer: bool = False) -> None:
        """Queue one frame for the writer task (never blocks); ``label`` counts an answer in the metrics.
        With ``defer`` the writer is not woken: the caller calls ``flush`` once it has queued the rest."""
        if self.closed:
            if label is not None:
                self._metrics.dropped()
            return
        self._outbox.append((frame, label))
        self.pending_bytes += len(frame)
        self._unsent.total += len(frame)
        if self.pending_bytes > self._max_send_buffer and self._uncongested.is_set():
            self._uncongested.clear()
            self._on_congested(self)
        if not defer:
            self._ready.set()

    def socket_backed_up(self) -> None:
        """The socket holds more than the bound unsent (``FrontConnection.backed_up``): congested until
        ``socket_drained``."""
        if self._uncongested.is_set():
            self._uncongested.clear()
            self._on_congested(self)

    def socket_drained(self) -> None:
        if not self.congested:
            self._uncongested.set()

    def flush(self) -> None:
        """Hand the queued frames to the socket now, when nothing stands in the way: the writer task is
        between writes, the connection is open and the socket took everything written before (so
        websockets' flow control would not wait). Otherwise, and for what is left past
        ``WRITE_BATCH_BYTES``, wake the writer task. Same order, same counts as the writer's."""
        if not self._outbox:
            return
        ws = self.ws
        transport = ws.transport
        if (self._writing or self.closed or ws.protocol.state is not State.OPEN or transport is None
                or transport.is_closing() or transport.get_write_buffer_size()):
            self._ready.set()
            return
        count, size = self._next_write()
        for n in range(count):
            ws.protocol.send_text(self._outbox[n][0])
        ws.send_data()
        self._written(count, size)
        if self._outbox:
            self._ready.set()

    def _next_write(self) -> tuple[int, int]:
        """How many of the queued frames go in the next write, and their bytes (at least one frame)."""
        count, size = 0, 0
        for frame, _ in self._outbox:
            if count and size + len(frame) > WRITE_BATCH_BYTES:
                break
            count, size = count + 1, size + len(frame)
        return count, size

    def _written(self, count: int, size: int) -> None:
        """The first ``count`` frames (``size`` bytes) were handed to the socket: out of the outbox and its counts."""
        self.last_progress = time.monotonic()
        self._answered(count, size)
        if not self.congested:
            self._uncongested.set()
        transport = self.ws.transport
        if transport is not None and transport.get_write_buffer_size():  # the kernel took only part
            self._watch_backlog()

    def _answered(self, count: int, size: int) -> None:
        """The first ``count`` frames (``size`` bytes) are in the socket's buffers: each answer among them
        is counted under its outcome (§11), never as dropped, whatever happens to the connection next."""
        self.pending_bytes -= size
        self._unsent.total -= size
        for _ in range(count):
            label = self._outbox.popleft()[1]
            if label is not None:
                self._metrics.answered(*label)

    def _watch_backlog(self) -> None:
        """Have the server watch this connection's backlog (``on_backlog``), unless a watchdog does."""
        if self._on_backlog is not None and (self.watchdog is None or self.watchdog.done()):
            self._on_backlog(self)

    def note_progress(self) -> None:
        """Look at the transport and the kernel: if their unsent bytes together shrank since the last look,
        the client is reading. (The transport's alone misses a slow reader: it shrinks only once the
        kernel's fixed send buffer has room for a good part of it again.)"""
        transport = self.ws.transport
        unsent = transport.get_write_buffer_size() + kernel_unsent(transport) if transport is not None else 0
        if unsent < self._unsent_seen:
            self.last_progress = time.monotonic()
        self._unsent_seen = unsent

    async def _write_loop(self) -> None:
        """Send queued frames in order until the connection closes: the frames waiting (up to
        ``WRITE_BATCH_BYTES``, at least one) in one websockets send context, so in one write, then wait
        for websockets' flow control; they leave the outbox's count once that wait is over."""
        ws = self.ws
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                self._writing = True
                self._watch_backlog()  # the writes below may wait for the client for good
                while self._outbox:
                    count, size = self._next_write()
                    async with ws.send_context():
                        for n in range(count):
                            ws.protocol.send_text(self._outbox[n][0])
                        # The context's exit writes them to the transport, then waits for flow control,
                        # where a close may cancel this task (``stop``) or end it (ConnectionClosed).
                        self._handed = count
                    self._handed = 0
                    self._written(count, size)
                self._writing = False
        except ConnectionClosed:
            self._writing = False
            self._drop_outbox()

    def _drop_outbox(self) -> None:
        """Drop what was never handed to the socket, each answer counted as dropped (§11); frames the
        writer had written to the transport when the connection closed count as sent."""
        handed, self._handed = self._handed, 0
        if handed:
            self._answered(handed, sum(len(frame) for frame, _ in itertools.islice(self._outbox, handed)))
        dropped = sum(1 for _, label in self._outbox if label is not None)
        self._metrics.dropped(dropped)
        self._outbox.clear()
        self._unsent.total -= self.pending_bytes
        self.pending_bytes = 0
        self._uncongested.set()

    async def uncongested(self) -> None:
        """Return once the unsent bytes are back within the bound (or the connection closed)."""
        await self._uncongested.wait()

    async def close_once_read(self, code: int, reason: str, until: float, stall_s: float,
                              barrier_s: float = 0.0) -> None:
        """Close with ``code`` once everything queued has left for the client: the outbox handed to the
        socket and the transport's buffer empty (the close frame then follows the answers through the
        kernel's bounded buffer, which ``_close_socket`` gives its own grace). It waits while the client
        keeps taking bytes: until ``until`` (monotonic), or until it has taken none for ``stall_s``,
        whichever comes first; then it stops sending (dropping what is left) and closes the socket.

        With ``barrier_s``, once all has left it pings the client and waits for the pong, at most
        ``barrier_s``, then for what was queued meanwhile to leave: the pong comes after every frame the
        client sent before it read what was sent (a ``going_away``), so a request sent in the instant
        before that arrived is read, and answered, before the close."""
        if await self._sent(until, stall_s) and barrier_s > 0:
            # (only once all has left: the ping then cannot overtake what was queued, nor wait for room)
            with contextlib.suppress(ConnectionClosed, TimeoutError, RuntimeError):  # (closing, no pong in time)
                async with asyncio.timeout(max(0.0, min(barrier_s, until - time.monotonic()))):  # (the ping too)
                    await (await self.ws.ping())
            await self._sent(until, stall_s)
        self.stop()
        await self._close_socket(code, reason)

    async def _sent(self, until: float, stall_s: float) -> bool:
        """Wait for the outbox and the transport's buffer to empty: True once they have; False where
        ``until`` (monotonic) came first, or the client took no bytes for ``stall_s``, or the connection
        closed (``close_once_read``)."""
        while not self.closed and time.monotonic() < until:
            transport = self.ws.transport
            if not self._outbox and (transport is None or not transport.get_write_buffer_size()):
                return True
            self.note_progress()
            if time.monotonic() - self.last_progress >= stall_s:
                return False
            await asyncio.sleep(DRAIN_LOOK_S)
        return False

    def close_soon(self, code: int, reason: str) -> None:
        """Stop sending at once, dropping the outbox, and close in a task (``closing``); idempotent."""
        if self.closing is None:
            self.stop()
            self.closing = asyncio.create_task(self._close_socket(code, reason))

    async def _close_socket(self, code: int, reason: str) -> None:
        """Send the close frame and wait ``CLOSE_GRACE_S`` for the closing handshake; a client that
        does not take the close frame in that time loses the socket (``cut``: a TCP reset)."""
        try:
            await asyncio.wait_for(self.ws.close(code, reason), CLOSE_GRACE_S)
        except TimeoutError:
            cut(self.ws.transport)

    def stop(self) -> None:
        """Send nothing more: mark closed, stop the writer, drop the outbox (idempotent)."""
        self.closed = True
        if self._writer is not None:
            self._writer.cancel()
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None
        if self.stats_task is not None:
            self.stats_task.cancel()
            self.stats_task = None
        self._drop_outbox()


def cut(transport: asyncio.WriteTransport) -> None:
    """Cut the TCP connection: a reset, and the unsent bytes thrown away (``SO_LINGER`` 0, then abort).

    A bare ``abort`` only closes the descriptor: the kernel then keeps the connection as an orphan with
    its whole send buffer, still trying to deliver it to a client that does not read, for minutes,
    while it no longer counts against ``--max-connections`` (§12's bound on what a client can hold).
    """
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
