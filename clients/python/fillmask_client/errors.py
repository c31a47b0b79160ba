"""The exceptions the client raises, one class per way a request can end without a result.

    FillMaskError                 base: every error the client raises
    ├── UsageError                a value the caller gave can never work (also a ``ValueError``); nothing sent
    ├── RequestError              the server answered ``error`` (§7): ``code``, ``message``
    ├── OverloadedError           the server answered ``overloaded`` (§6): ``status``, ``reason``, ``retry_after_ms``
    │   └── DeadlineExceededError the 504 case: ``deadline_ms`` passed while the request was queued
    └── ConnectionLostError       the connection closed before the request's terminal frame (§8)
        └── ConnectError          the connection could not be opened (or reopened) at all

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
        super().__init__(message)
        self.message = message
        self.frame = frame


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
        super().__init__(f"{code}: {message}", frame=frame)
        self.code = code
        self.message = message


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
        hint = f", retry after {retry_after_ms:g} ms" if retry_after_ms is not None else ""
        super().__init__(f"server overloaded ({status} {reason}{hint})", frame=frame)
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
        waited = f" after {queue_ms:g} ms in the queue" if queue_ms is not None else ""
        self.message = f"deadline exceeded{waited} (504 {reason})"
        self.args = (self.message,)


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

    ``http_status`` is set when the server refused the handshake (§9): 401 missing or wrong token, 403
    origin not allowed, 404 wrong path, 503 draining, model worker stopped, at ``--max-connections``, or
    (from a load balancer) no replica ready; the message then carries the server's one-line explanation.
    """

    def __init__(self, message: str, *, url: str, http_status: int | None = None) -> None:
        super().__init__(message, url=url)
        self.http_status = http_status
