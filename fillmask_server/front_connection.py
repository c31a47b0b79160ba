"""websockets' server connection as this server runs it (``FrontConnection``): the HTTP front's JSON answers
to requests too broken to reach its hooks, a request held unparsed-after until it is answered, reading held
while the socket is backed up, and whole text messages handed over as soon as they are parsed.

``http.HttpFront`` decides what each request gets; this connection is where websockets' parsing meets
the socket. Its class docstring states each change against websockets' own behaviour and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from websockets.asyncio.messages import MAX_FRAGMENTS
from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from .connection import cut
from .protocol import close_reason

if TYPE_CHECKING:
    from .http import HttpFront

TLS_HANDSHAKE = b"\x16"  # the first byte of any TLS record that opens a connection (a handshake record)
#: How many of a connection's first bytes are kept (``FrontConnection.opening``): enough for ``HEAD ``.
OPENING_BYTES = 5


class FrontConnection(ServerConnection):
    """websockets' server connection, with these changes: a request it refuses while parsing, before any
    hook runs (request line or headers too long, not HTTP at all), is answered with the front's JSON
    instead of the library's plain text (``websockets.server.ServerProtocol.parse`` writes that answer
    and ends the stream; ``send_data`` is where its bytes would reach the socket); and the frames queued
    in one send context reach the socket in one write.

    The rest is websockets' own behaviour: a request that parsed has ``self.request`` set before any
    refusal can be made, and those refusals go through the hooks instead.

    Two more. websockets parses whatever follows a request as WebSocket frames at once, before the
    request is answered: a second, pipelined request (or a stray CRLF) then failed as a frame, ended
    the stream, and the answer to the first found it ended (no answer, and a traceback); and a client
    that half-closed its side after sending its request (``shutdown(SHUT_WR)``, ``nc -N``) lost its
    answer, since websockets closes the socket at the end of the stream. So from the moment a request
    has been read until it is answered (``_held``), this connection parses nothing after the request
    (``hold_frames_until_answered``) and, on plain TCP, reads nothing more (so the end of the stream
    is read only once the answer is out); once the answer is written it reads and parses as before
    (``_release``): frames a client sent before its 101 are then handled as usual, and what follows a
    refused request or a page is discarded (every answer is ``Connection: close``, so a pipelining
    client sends the rest again). Over TLS reading goes on (asyncio's TLS layer does not take a
    pause or an end of stream kept open well): a TLS client that ends its side before the answer
    loses it, as it did before.

    And: the reasons of the closes websockets makes itself (1009, 1007, 1002, a missing pong's 1011) are
    said in the protocol's words, with what to do (``protocol.close_reason``): its own read "frame with
    2000000 bytes exceeds limit of 65536 bytes", "incorrect masking".

    And: websockets answers each ping with a pong written straight to the socket, past the
    server's outbox and its bound (protocol.md §12). A client that sends pings and never reads would
    make those pongs pile up in memory without end. So once the socket holds more than
    ``--max-send-buffer-bytes`` unsent (``backed_up``), this connection reads nothing more until the
    client has taken enough of it (the transport's flow control says so: ``resume_writing``), and
    ``on_backed_up`` (the server's) treats it as a client that does not read its answers (until
    ``on_drained``). Reading is also paused while websockets' own message queue is full; it resumes
    only when neither holds it.
    """

    front: HttpFront
    _answered_early = False
    # Set by the server once its handler runs: each whole, valid UTF-8 text message goes to it as soon as
    # it is parsed (``process_event``). None: every message goes through websockets' queue to ``recv``.
    on_message: Callable[[str], None] | None = None
    queued = 0  # messages put in websockets' queue and not yet taken by the handler (``taken``)
    _fragmented = False  # a fragmented message is being put in that queue
    backed_up = False  # the socket holds more than the send buffer's bound unsent: reading is held
    _held = False  # a request was read and is not answered yet: nothing after it parsed (on TCP: nor read)
    _unhold: Callable[[], None] | None = None  # puts the parser's own reading back (``hold_frames_until_answered``)
    on_backed_up: Callable[[], None] | None = None  # set by the server: called each time ``backed_up`` turns True
    on_drained: Callable[[], None] | None = None  # ... and each time it turns False again
    on_close_frame: Callable[[], None] | None = None  # set by the server: called when the client's close frame comes
    _unfinished = False  # counted in the front's ``unfinished`` (until ``finished``)
    # The connection's first bytes after any empty lines, up to OPENING_BYTES: a request that cannot be
    # parsed is a HEAD request if they are ``HEAD `` (its refusal then has no body). The connection's very
    # first byte is ``TLS_HANDSHAKE`` for a TLS handshake.
    opening = b""
    _read_any = False  # a byte has been read

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._unhold = hold_frames_until_answered(self.protocol)
        self.recv_messages.resume = self._resume_reading  # (websockets' queue resumes through the same rule)
        bound = self.front.config.max_send_buffer_bytes
        if bound < self.write_limit_high:  # so that a socket backed up past the bound always gets resume_writing
            transport.set_write_buffer_limits(bound)
        if self.front.admit_unfinished(self):
            self._unfinished = True
        fail, bound, ping_timeout = self.protocol.fail, self.front.config.max_frame_bytes, self.ping_timeout

        def fail_in_the_protocols_words(code: int, reason: str = "") -> None:
            fail(code, close_reason(code, reason, bound, MAX_FRAGMENTS, ping_timeout or 0.0))

        self.protocol.fail = fail_in_the_protocols_words  # type: ignore[method-assign]

    @property
    def read_any(self) -> bool:
        """Whether a byte has been read from the connection (its request, or part of one)."""
        return self._read_any

    def finished(self) -> None:
        """The handshake is done (the server's handler runs) or the connection ended: it no longer counts
        in the front's ``unfinished``. Idempotent."""
        if self._unfinished:
            self._unfinished = False
            self.front.unfinished_ended(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.finished()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        """The client ended its side without its close frame. A WebSocket then ends at once (protocol.md
        §8): with answers still unsent, the connection is cut (``connection.cut``: a reset, the kernel's
        buffer dropped too). After its close frame, what was sent before the echo is still written.
        (asyncio's own close, which follows, would write them first, and once written it ends the
        connection without marking the transport lost, so websockets' abort at the handler's end
        failed with a traceback in the log: CPython's ``_write_ready``.)"""
        upgraded = self.protocol.state in (State.OPEN, State.CLOSING)  # (the end of the stream closes it)
        closed_by_client = self.protocol.close_rcvd is not None
        super().eof_received()
        if upgraded and not closed_by_client and self.transport.get_write_buffer_size():
            cut(self.transport)

    def data_received(self, data: bytes) -> None:
        if len(self.opening) < OPENING_BYTES:
            first, self._read_any = not self._read_any, True
            # (the empty lines a client may send before its request line are not part of it: RFC 9112 §2.2;
            # websockets refuses them, so this holds where they arrive with ``HEAD``, in one read)
            self.opening += (data if self.opening else data.lstrip(b"\r\n"))[:OPENING_BYTES - len(self.opening)]
            if first and data[:1] == TLS_HANDSHAKE and not self.front.tls:
                self.front.refuse_tls(self)
                return
        super().data_received(data)
        if self._unfinished:
            self.front.read_from(self)
        transport = self.transport
        if not self._held and self.request is not None and unanswered(self.protocol):
            self._held = True
            if transport.can_write_eof():  # plain TCP (module docstring: not over TLS)
                transport.pause_reading()
        if (not self.backed_up and not transport.is_closing()
                and transport.get_write_buffer_size() > self.front.config.max_send_buffer_bytes):
            self.backed_up = True
            transport.pause_reading()
            if self.on_backed_up is not None:
                self.on_backed_up()

    def _release(self) -> None:
        """The request held reading was answered: read again, and parse what arrived after it. A refused
        request's stream was already set to be discarded (websockets does so when it writes the refusal);
        after a 101, frames the client sent early are handled like any others."""
        self._held = False
        if self._unhold is not None:
            self._unhold()
            self._unhold = None
        if self.transport.is_closing():
            return
        self._resume_reading()
        reader = self.protocol.reader
        if self.protocol.state is State.OPEN and (reader.buffer or reader.eof):
            next(self.protocol.parser)  # as websockets' receive_data does for each read: this one was held
            events = self.protocol.events_received()
            self.send_data()
            for event in events:
                self.process_event(event)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.backed_up:
            self.backed_up = False
            self._resume_reading()
            if self.on_drained is not None:
                self.on_drained()

    def _resume_reading(self) -> None:
        """Read again, unless a request waits for its answer, the socket is still backed up or websockets'
        message queue is full."""
        if (not self._held and not self.backed_up and not self.recv_messages.paused
                and not self.transport.is_closing()):
            self.transport.resume_reading()

    def process_event(self, event: Any) -> None:
        """websockets' ``process_event``, but a whole, valid UTF-8 text message goes straight to
        ``on_message`` when no message read before it waits in the queue (so messages keep their order).
        Everything else takes websockets' way to the handler's ``recv``: the handshake, control frames,
        binary and fragmented messages, invalid UTF-8 (which websockets closes with 1007), and any
        message while ``on_message`` is None or messages wait in the queue."""
        if isinstance(event, Frame) and event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
            deliver = self.on_message
            if (deliver is not None and event.opcode is Opcode.TEXT and event.fin and not self.queued
                    and not self._fragmented):
                try:
                    # (a frame read is bytes: websockets makes memoryviews only of frames it compresses to send)
                    text = event.data.decode()  # type: ignore[union-attr]
                except UnicodeDecodeError:
                    pass
                else:
                    deliver(text)
                    return
            self._fragmented = not event.fin
            if event.fin:
                self.queued += 1
        super().process_event(event)
        if isinstance(event, Frame) and event.opcode is Opcode.CLOSE and self.on_close_frame is not None:
            self.on_close_frame()  # (its TCP connection may stay open for websockets' close timeout)

    def taken(self) -> None:
        """The handler took one message from websockets' queue (``recv``)."""
        self.queued -= 1

    def send_data(self) -> None:
        """websockets' ``send_data``, with the frames waiting joined into one write (one system call for
        the frames a send context queued, instead of one per frame), or the front's early refusal."""
        exc = self.protocol.handshake_exc
        if self.request is not None or exc is None or self._answered_early:
            waiting: list[bytes] = []
            for data in self.protocol.data_to_send():
                if data:
                    waiting.append(data)
                    continue
                if waiting:
                    self.transport.write(b"".join(waiting))
                    waiting = []
                self._end_stream()  # an empty chunk: websockets' end of stream
            if waiting:
                self.transport.write(b"".join(waiting))
            if self._held and not unanswered(self.protocol):
                self.loop.call_soon(self._release)
            return
        self._answered_early = True
        self.protocol.data_to_send()  # websockets' plain-text answer (if any) and its end of stream: replaced
        answer = self.front.early_refusal(self, exc)
        if answer is not None:
            self.transport.write(answer.serialize())
        self._end_stream()

    def _end_stream(self) -> None:
        """End the stream as websockets does: half-close where the transport can (plain TCP), else close."""
        if self.transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):  # as websockets: write_eof documents no errors
                self.transport.write_eof()
        else:
            self.transport.close()


def unanswered(protocol: ServerProtocol) -> bool:
    """Whether ``protocol`` has not yet answered its request: neither a 101 (OPEN) nor a refusal (which
    ends its stream) was written."""
    return protocol.state is State.CONNECTING and not protocol.eof_sent


def hold_frames_until_answered(protocol: ServerProtocol) -> Callable[[], None]:
    """Make ``protocol`` parse nothing after its request until it has answered it (``FrontConnection``);
    returns the call that puts the reader's own methods back (once answered: every frame after that
    is read without the extra check).

    websockets' server protocol parses a request with its reader's ``read_line`` and then frames at once,
    with ``at_eof`` and ``read_exact``; those two wait here while the protocol is still CONNECTING and
    has not ended its stream (that is, until it wrote a 101 or a refusal). The parser yields as if no
    bytes had come, and ``FrontConnection._release`` steps it again."""
    reader = protocol.reader
    at_eof, read_exact = reader.at_eof, reader.read_exact

    def held_at_eof() -> Generator[None, None, bool]:
        while unanswered(protocol):
            yield
        return (yield from at_eof())

    def held_read_exact(n: int) -> Generator[None, None, bytearray]:
        while unanswered(protocol):
            yield
        return (yield from read_exact(n))

    reader.at_eof, reader.read_exact = held_at_eof, held_read_exact  # type: ignore[method-assign]

    def unhold() -> None:  # (a parser waiting in a wrapper goes on with the method it closed over)
        del reader.at_eof, reader.read_exact

    return unhold
