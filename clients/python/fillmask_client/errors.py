"""The exceptions the client raises, one class per way a request can end without a result.

    FillMaskError                 base: every error the client raises
    ├── UsageError                a value the caller gave can never work (also a ``ValueError``); nothing sent
    ├── RequestError              the server answered ``error`` (§7): ``code``, ``message``
    ├── OverloadedError           the server answered ``overloaded`` (§6): ``status``, ``reason``, ``retry_after_ms``
    │   └── DeadlineExceededError the 504 case: ``deadline_ms`` passed while the request was queued
    └── ConnectionLostError       the connection closed before the request's terminal frame (§8)
        └── ConnectError          the connection could not be opened (or reopened) at all: ``kind``,
                                  ``http_status``, ``transient`` (whether waiting may fix it)

``DeadlineExceededError`` is a subclass of ``OverloadedError`` because that is what it is on the wire:
an ``overloaded`` frame with status 504. ``except OverloadedError`` therefore catches both; catch
``DeadlineExceededError`` first when the two need different handling. Automatic retry (see
``RetryPolicy``) only ever resends 503 ``queue_full`` and 429 ``queue_share`` answers, never 504s: the
caller's deadline is spent.
The other 503 reasons, ``shutting_down`` and ``engine_stopped``, say that this server did not and will
not do the work: the client sends such a call again on another connection (another of its pool, or one
that ``reconnect`` opens), and raises them only when there is none. Without ``reconnect``, a connection
whose server announced ``going_away`` (§10) makes later calls raise the same ``OverloadedError`` 503
``shutting_down`` at once, without sending (its ``frame`` is then the ``going_away`` frame).

``UsageError`` is raised where the value is given (constructing the client, or calling it), before
anything is sent: a malformed server URL, a text that is not valid Unicode, a number JSON cannot carry
(NaN, infinity), a duration that is not a finite number of seconds. It is never retried or resent.

Every exception raised because of a server frame keeps that frame in ``frame`` (``None`` otherwise),
so a program can log or forward exactly what the server said.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class FillMaskError(Exception):
    """Base class of every error the client raises: a request (or the connection carrying it) ended
    without a ``result``, or (``UsageError``) it could not be made at all.

    ``message`` is one line for a person; ``frame`` is the server frame that caused it, if any.
    """

    def __init__(self, message: str, *, frame: dict[str, Any] | None = None) -> None:
        message = one_line(message)
        super().__init__(message)
        self.message = message
        self.frame = frame


#: The longest message an error keeps (a server's text may be any length).
MESSAGE_LIMIT = 1000


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` as one line of at most ``limit`` characters: line breaks (and other control characters)
    become spaces, and a longer text is cut with an ellipsis. For what a server says (an error's
    message, a close reason, a refusal's body), which may hold anything."""
    flat = "".join(" " if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029" else c for c in text)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class UsageError(FillMaskError, ValueError):
    """A value the caller gave can never work; ``message`` says which and what a valid one looks like.

    Raised before anything is sent (see the module docstring). It is also a ``ValueError``, the
    exception Python raises for a bad argument, so ``except ValueError`` keeps catching the client's
    argument checks.
    """


def check_seconds(name: str, value: float, *, zero_ok: bool = True) -> float:
    """``value`` when it is a finite number of seconds (> 0, or >= 0 with ``zero_ok``); else ``UsageError``.

    NaN compares false with everything, so a bare ``value <= 0`` lets it through, and a wait of NaN or
    infinity never ends: both are refused here, as is a boolean.
    """
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # (numpy's numbers too)
    if not (number and math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        least = ">= 0" if zero_ok else "> 0"
        raise UsageError(f"{name} must be a finite number of seconds {least}, not {value!r}")
    return value


class RequestError(FillMaskError):
    """The server rejected or failed the request with an ``error`` frame (§7).

    ``code`` is the stable machine-readable code (``no_mask``, ``invalid_top_k``, ``internal_error``, ...),
    ``message`` the server's one-line explanation. The client itself raises one code of its own,
    ``frame_too_large``, without sending anything: a frame over ``limits.max_frame_bytes`` would make the
    server close the whole connection (§1) and fail every other request on it.
    """

    def __init__(self, code: str, message: str, *, frame: dict[str, Any] | None = None) -> None:
        code, message = one_line(code, 100), one_line(message)
        super().__init__(f"{code}: {message}", frame=frame)
        self.code = code
        self.message = message


#: How a person reads the ``overloaded`` reasons that mean the server is going (``SERVER_GONE_REASONS``).
_GONE_WORDS = {"shutting_down": "server shutting down", "engine_stopped": "the server's model worker stopped"}


class OverloadedError(FillMaskError):
    """The server answered ``overloaded`` (§6): it could not take or finish the request in time.

    ``status`` is 503 (``reason`` ``queue_full``, ``shutting_down`` or ``engine_stopped``), 429 (``queue_share``:
    this connection holds its share of a busy queue) or 504 (see the subclass
    ``DeadlineExceededError``). ``retry_after_ms`` is the server's estimate of when trying again makes sense.
    """

    def __init__(
        self,
        status: int,
        reason: str,
        retry_after_ms: float | None,
        *,
        frame: dict[str, Any] | None = None,
    ) -> None:
        reason = one_line(reason, 100)
        hint = f", retry after {retry_after_ms:g} ms" if isinstance(retry_after_ms, (int, float)) else ""
        what = _GONE_WORDS.get(reason, "server overloaded")  # §6's frame, but a drain is no overload
        super().__init__(f"{what} ({status} {reason}{hint})", frame=frame)
        self.status = status
        self.reason = reason
        self.retry_after_ms = retry_after_ms


class DeadlineExceededError(OverloadedError):
    """The request's ``deadline_ms`` passed while it waited in the server's queue (§6, status 504).

    The request never reached the model. ``queue_ms`` is how long it waited, when the server said.
    """

    def __init__(
        self,
        retry_after_ms: float | None,
        queue_ms: float | None,
        *,
        reason: str = "deadline_exceeded",
        frame: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(504, reason, retry_after_ms, frame=frame)
        self.queue_ms = queue_ms
        waited = f" after {queue_ms:g} ms in the queue" if isinstance(queue_ms, (int, float)) else ""
        self.message = f"deadline exceeded{waited} (504 {self.reason})"
        self.args = (self.message,)

    @classmethod
    def before_sending(cls, why: str) -> DeadlineExceededError:
        """The call's ``deadline_ms`` passed, or would pass, before it could be sent; ``why`` says what
        held it back. Nothing was sent."""
        error = cls(None, None)
        error.message = f"deadline exceeded before the request was sent: {why}; nothing was sent"
        error.args = (error.message,)
        return error


class ConnectionLostError(FillMaskError):
    """The connection closed (or was never usable) before the request got its terminal frame.

    ``code`` and ``reason`` are the WebSocket close code and reason when known (1001 when the server
    shut down, 1006 when the TCP connection dropped, 1009 when a frame was too big, ...).
    """

    def __init__(self, message: str, *, url: str, code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.code = code
        self.reason = reason


class ConnectError(ConnectionLostError):
    """The connection could not be opened: refused, timed out, rejected by the server, or the peer did
    not greet with a protocol-1 ``hello``.

    ``http_status`` is set when the server answered the handshake with another status than 101 (§9):
    401 missing or wrong token, 403 origin not allowed, 404 wrong path, 503 draining, model worker
    stopped, at ``--max-connections``, or (from a load balancer) no replica ready; the message then
    carries the server's one-line explanation. ``kind`` names how it failed (a key of
    ``CONNECT_FAILURES``, or ``"http"`` for a refusal with ``http_status``), and ``transient`` says
    whether trying again later may work (``transient_connect_failure``: the status decides when there
    is one).
    """

    def __init__(self, message: str, *, url: str, http_status: int | None = None, kind: str | None = None) -> None:
        super().__init__(message, url=url)
        self.http_status = http_status
        self.kind = kind or ("http" if http_status is not None else "other")

    @property
    def transient(self) -> bool:
        """Whether waiting may fix this failure: ``transient_connect_failure(kind, http_status)``."""
        return transient_connect_failure(self.kind, self.http_status)


#: How a connection can fail to open (``ConnectError.kind``), each with whether waiting may fix it.
CONNECT_FAILURES: dict[str, bool] = {
    "refused": True,  # nothing listens there yet: a server opens its port once its model is loaded (§9)
    "reset": True,  # reset or closed during the TCP, TLS or HTTP handshake: a proxy whose backend is not up
    "timeout": True,  # the handshake did not finish within open_timeout: a host still starting, a busy proxy
    "unreachable": True,  # no route to the host yet: a machine or a container that is still starting
    "unresolved": True,  # the host name does not resolve (yet): a container's name exists only while it
    # runs (Docker); a typo gives the same, and the first "waiting for the server" line says which name
    "gone_before_hello": True,  # closed before the hello with 1001/1006/1012/1013/1014: a restart, a proxy
    "no_hello": True,  # connected, but no hello within open_timeout: a server just started and still busy
    "tls": False,  # the TLS handshake failed: most often a plain server reached with wss://
    "tls_expected": False,  # a ws:// handshake closed without an answer, and the port answers TLS: use wss://
    "certificate": False,  # the server's TLS certificate is not trusted
    "not_websocket": False,  # an HTTP server answered, but not with a WebSocket upgrade
    "not_http": False,  # the answer was not HTTP at all: another protocol, a TLS port's alert (ws:// to TLS)
    "bad_hello": False,  # the first frame was not a protocol-1 hello (§2): another server, or another version
    "closed_before_hello": False,  # the peer closed the WebSocket before any hello, with another code
    "other": False,  # anything else: not foreseen, so not waited for
}
#: Handshake refusals that a starting server or a load balancer gives while no replica is ready.
TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 502, 503, 504})


def transient_connect_failure(kind: str, http_status: int | None = None) -> bool:
    """Whether a connection that could not be opened may open if tried again a little later.

    This is the one rule behind ``FillMaskClient.connect(wait=...)`` (the command's ``--timeout``) and
    behind the redials of ``reconnect``: a transient failure is tried again until the time allowed is
    spent; any other is raised at once (``connect``) or ends the redials of that connection (the pool).

    The rule: transient is what a server that is starting or restarting, or a load balancer or proxy
    with no replica ready, gives: refused, reset (or closed) during the handshake, a handshake or a
    ``hello`` that does not come within ``open_timeout`` (a server that just started may be busy; a
    silent peer that is not a fill-mask server costs one such wait, which with ``wait <= open_timeout``
    is the only attempt), a host not reachable yet, a host name that does not resolve yet (a
    container's name while it is down), a close with a "going away" code before the ``hello``, and the
    HTTP statuses 408, 429, 502, 503, 504 (``TRANSIENT_HTTP_STATUSES``). Everything else gives the same
    answer every time and is final: TLS against a plain server or an untrusted certificate, a server
    that is not a WebSocket server, a first frame that is not a protocol-1 ``hello`` (another server,
    or another protocol version), every other HTTP status (401 token, 403 origin, 404 path, 421 host,
    500...), and any failure not foreseen here (``"other"``).
    """
    if http_status is not None:
        return http_status in TRANSIENT_HTTP_STATUSES
    return CONNECT_FAILURES.get(kind, False)
