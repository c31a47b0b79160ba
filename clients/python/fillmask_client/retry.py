"""When to resend: the backoff for ``overloaded`` answers and for reconnecting, as pure arithmetic.

No sleeping happens here; the client asks a policy for a delay and sleeps itself, so the rules can be
checked with plain numbers. Which failures to open a connection are worth trying again at all is
``errors.transient_connect_failure`` (``ConnectError.transient``); these policies only say when.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass

from .errors import UsageError
from .wire import wait_hint_ms


@dataclass(frozen=True)
class RetryPolicy:
    """Resend a request the server answered 503 ``queue_full`` or 429 ``queue_share`` (§6), waiting a
    little longer each time.

    - ``attempts``: tries in all, the first included (so 5 means at most 4 resends).
    - The wait before try ``n + 1`` is ``base_delay * 2**(n - 1)`` seconds capped at ``max_delay``, but
      **never shorter than the server's** ``retry_after_ms``: the server's estimate is a floor, and
      ``max_delay`` caps only the client's own doubling. Jitter only lengthens a wait (up to
      ``jitter`` times it), so that many clients told the same ``retry_after_ms`` do not come back at once.
    - A request with ``deadline_ms`` is not resent once the wait would use up what is left of it; the
      last ``OverloadedError`` is raised instead, and a resend carries only the remaining milliseconds.

    Only ``queue_full`` and ``queue_share`` are retried by this policy (``RETRYABLE_REASONS``); since a
    resend never comes sooner than ``retry_after_ms``, the server never closes such a client (§12).
    504 ``deadline_exceeded`` means the caller's time
    is spent; 503 ``shutting_down`` and ``engine_stopped`` mean this server will not do the work at all,
    which is the client's ``reconnect`` option's business.
    """

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, numbers.Integral) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise UsageError(f"RetryPolicy.attempts must be an integer of at least 1, not {self.attempts!r}")
        if not all(_finite(value) for value in (self.base_delay, self.max_delay, self.jitter)):
            raise UsageError("RetryPolicy delays and jitter must be finite numbers >= 0")

    def delay(self, attempt: int, retry_after_ms: float | None, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after try number ``attempt`` (1-based) was answered ``overloaded``."""
        backoff = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        floor = (wait_hint_ms(retry_after_ms) or 0.0) / 1000.0  # at most WAIT_HINT_CAP_MS, whatever it says
        return max(floor, backoff) * (1.0 + self.jitter * rand())


@dataclass(frozen=True)
class ReconnectBackoff:
    """How long to wait before each attempt to reopen a connection: exponential backoff, full jitter.

    Attempt ``n`` (0 for the first dial after the connection went away) waits a uniformly random time
    between 0 and ``min(cap, base * 2**n)`` seconds ("full jitter"): a fleet of clients cut off at the
    same moment, as a restarting replica cuts off all of its clients, spreads its reconnects over the
    whole window instead of arriving in one burst at each doubling. When the server announced the
    loss with a window of its own (``going_away``'s ``reconnect_within_ms``, §10, or the
    ``retry_after_ms`` of an ``engine_stopped`` answer, §6), the first attempt is spread over that
    window instead.

    The number of attempts is not bounded here: a server that restarts refuses handshakes (503) while it
    drains and is unreachable while it loads, for as long as that takes. Calls waiting for a connection
    give up after the client's ``reconnect_timeout``; the dialling goes on in the background at most
    every ``cap`` seconds while the client is open.
    """

    base: float = 0.05
    cap: float = 2.0

    def __post_init__(self) -> None:
        if not (_finite(self.base) and _finite(self.cap)):
            raise UsageError("ReconnectBackoff delays must be finite numbers of seconds >= 0")

    def window(self, attempt: int, first_window: float | None = None) -> float:
        """The upper bound of the wait before attempt number ``attempt`` (0-based), in seconds."""
        if attempt == 0 and first_window is not None:
            return (wait_hint_ms(first_window * 1000.0) or 0.0) / 1000.0  # at most WAIT_HINT_CAP_MS
        return min(self.cap, self.base * 2.0 ** min(attempt, 60))  # 2**60 already exceeds any cap

    def delay(self, attempt: int, first_window: float | None = None,
              rand: Callable[[], float] = random.random) -> float:
        """A random wait in ``[0, window(attempt, first_window))``: full jitter."""
        return self.window(attempt, first_window) * rand()


def _finite(value: float) -> bool:
    """A finite number >= 0, not a boolean (false for NaN, which ``value < 0`` lets through)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)
