"""The wire's fixed vocabulary (``protocol.md``), declared once for the client and the server.

The server (``fillmask_server.protocol``, ``.session``, ``.server``) imports these names from here, so
that a reason, a close code or the protocol version cannot mean one thing to the server and another
to the client. Only the standard library is used: this module is importable without the server's
dependencies (torch, transformers).

Invariants:

- ``RETRYABLE_REASONS``, ``SERVER_GONE_REASONS`` and ``{"deadline_exceeded"}`` partition the keys of
  ``OVERLOADED_REASONS``: each ``overloaded`` reason is handled one way by a client (checked at import).
- ``TERMINAL_TYPES`` are the frame types that end a request (§8), and the only ones that carry a
  request's ``id`` from the server.
"""

from __future__ import annotations

#: ``hello.protocol`` (§2): a client refuses a server that speaks another version.
PROTOCOL_VERSION = 1
#: The largest integer id a browser echoes exactly (§3): ids are integers within ±this, or strings.
MAX_SAFE_INTEGER = 2**53 - 1
#: The integers the JSON codec (orjson) holds as integers: a signed or unsigned 64-bit one. The client
#: cannot send one outside it; the server reads one outside it as a float, as orjson does.
JSON_INTEGERS = range(-(2**63), 2**64)

#: Every ``overloaded`` reason with its HTTP-like status (§6).
OVERLOADED_REASONS: dict[str, int] = {
    "queue_full": 503, "queue_share": 429, "shutting_down": 503, "engine_stopped": 503, "deadline_exceeded": 504,
}
#: ``overloaded`` reasons that mean "this server, a little later" (§6): the request did not run, and the
#: same request may be sent again here after ``retry_after_ms``.
RETRYABLE_REASONS = frozenset({"queue_full", "queue_share"})
#: The longest wait a client takes from a server's hint (``retry_after_ms``, ``reconnect_within_ms``),
#: in milliseconds: twice the most this server ever asks (§6: 30 s). A larger or stranger value from a
#: server that is not this one must not put a call or a redial to sleep for days.
WAIT_HINT_CAP_MS = 60_000
#: ``overloaded`` reasons that mean "this server will not do it" (§6, §10): the request did not run; it
#: may be sent elsewhere (another connection, or one opened after a reconnect), never here again.
SERVER_GONE_REASONS = frozenset({"shutting_down", "engine_stopped"})

#: Frame types that end a request (§8). An ``error`` with code ``duplicate_id`` is about the rejected
#: frame only: the request in flight under that id still gets its own terminal frame (§7).
TERMINAL_TYPES = frozenset({"result", "error", "overloaded", "cancelled"})

# WebSocket close codes the client acts on: those the server sends (§1, §10, §12), and 1012 and 1013,
# which this server never sends but a proxy or another implementation in front of one may.
#: The server is shutting down (§10), after its ``going_away`` frame.
CLOSE_GOING_AWAY = 1001
#: The client broke a rule of §12 (too many early resends, or it does not read its answers).
CLOSE_POLICY_VIOLATION = 1008
#: A frame over ``limits.max_frame_bytes`` (§1).
CLOSE_MESSAGE_TOO_BIG = 1009
#: A proxy or an orchestrator restarts the service (RFC 6455 registry); like 1001 for a client.
CLOSE_SERVICE_RESTART = 1012
#: Try again later (RFC 6455 registry).
CLOSE_TRY_AGAIN_LATER = 1013

_handled = [RETRYABLE_REASONS, SERVER_GONE_REASONS, frozenset({"deadline_exceeded"})]
if sorted(r for group in _handled for r in group) != sorted(OVERLOADED_REASONS):
    raise AssertionError("every overloaded reason must be handled exactly one way (fillmask_client.wire)")
del _handled


def retryable(reason: object) -> bool:
    """Whether an ``overloaded`` answer with ``reason`` means "try again after ``retry_after_ms``":
    ``queue_full``, ``queue_share``, and (§14) any reason this client does not know, a malformed one
    included."""
    return reason in RETRYABLE_REASONS if isinstance(reason, str) and reason in OVERLOADED_REASONS else True


def wait_hint_ms(value: object) -> float | None:
    """A server's wait hint in milliseconds, as a client may use it: a finite number >= 0, at most
    ``WAIT_HINT_CAP_MS``; ``None`` for anything else (missing, negative, NaN, a string...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return value if value <= WAIT_HINT_CAP_MS else WAIT_HINT_CAP_MS
