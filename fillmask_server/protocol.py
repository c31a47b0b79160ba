"""The wire protocol of protocol.md, as pure functions: frame in, request or error out; values in, frame out.

Nothing here touches a socket, an event loop, a thread or torch, so every rule of protocol.md §3, §5
and §7 is unit-tested directly (tests/test_protocol.py). Invariants:

- ``parse_frame`` never raises: any ``str`` or ``bytes`` gives a request or a ``ProtocolError``.
- ``invalid_json`` means the frame is not JSON (RFC 8259) or nests deeper than orjson's 1024 levels,
  not merely that orjson cannot hold a value: a lone surrogate escape or a number past a double's
  range is valid JSON, so such a frame (and only such a frame: the common garbage is not parsed twice)
  is read again by the standard library, its numbers as orjson reads them, and gets the field's own
  error, under its id when that id is valid.
- A ``ProtocolError`` carries the frame's id only when that id is itself valid (§7).
- Every ``encode_*`` function returns the bytes of one JSON object, sent as a text frame.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from fillmask_client.wire import JSON_INTEGERS, MAX_SAFE_INTEGER, OVERLOADED_REASONS, PROTOCOL_VERSION

#: Every ``error`` code the server sends (§7's table); ``encode_error`` refuses any other.
ERROR_CODES = frozenset({
    "invalid_json", "not_an_object", "binary_frame", "missing_field", "unknown_type", "invalid_id", "duplicate_id",
    "invalid_field", "text_too_long", "no_mask", "too_many_masks", "invalid_top_k", "invalid_targets",
    "invalid_deadline", "too_many_inflight", "result_too_large", "internal_error",
})
# ``OVERLOADED_REASONS`` (every reason with its status, §6; ``encode_overloaded`` refuses any other pair),
# ``PROTOCOL_VERSION`` and ``MAX_SAFE_INTEGER`` are the client's too: declared once, in fillmask_client.wire.
#: ``subscribe_stats`` intervals (§13), announced in ``hello.stats``.
STATS_INTERVAL_MS = {"min": 250, "max": 10_000, "default": 1000}
CLIENT_FRAME_TYPES = ("fill_mask", "cancel", "subscribe_stats", "unsubscribe_stats")
#: The reasons of the two 1008 closes (§12), quoted there word for word (a close reason fits in 123 bytes).
SLOW_READER_REASON = "too many unread messages; read the server's messages as they come"
RESENDER_REASON = ("too many requests sent before their retry_after_ms; wait as overloaded answers say before "
                   "sending again")

#: RFC 6455's bound on a close frame's reason, in bytes of UTF-8.
MAX_CLOSE_REASON_BYTES = 123


def close_reason(code: int, reason: str, max_frame_bytes: int, max_fragments: int = 4096,
                 ping_timeout_s: float = 20.0) -> str:
    """The reason the server's close frame gives when the WebSocket library under it fails a connection
    (§8's table), in this protocol's words: what was wrong and what to do, keeping the library's detail
    where it says which rule a frame broke. ``reason`` is the library's; ``max_fragments`` and
    ``ping_timeout_s`` are the library's settings; a close of another code or reason, and this server's
    own closes (1001, 1008), keep theirs. At most ``MAX_CLOSE_REASON_BYTES``."""
    if code == 1009:
        words = (f"a message in more than {max_fragments:,} fragments: send each message in fewer frames"
                 if reason == "too many fragments" else
                 f"a message larger than limits.max_frame_bytes ({max_frame_bytes} bytes): send shorter texts")
    elif code == 1007:  # (a text message's bytes, or a close frame's reason)
        where = reason.replace(" at position ", " at byte ")
        words = f"text that is not valid UTF-8 ({where}): send text messages and close reasons as UTF-8"
    elif code == 1002 and reason == "incomplete fragmented message":  # (the library's rule, not RFC 6455's)
        words = "a close frame in the middle of a fragmented message: finish or drop the message before closing"
    elif code == 1002:
        words = f"a frame that breaks RFC 6455 ({reason}): a bug in the client or its WebSocket library"
    elif code == 1011 and reason == "keepalive ping timeout":
        words = (f"no pong within {ping_timeout_s:g} s of the server's ping: keep reading so that your library "
                 "answers pings")
    else:
        return reason
    data = words.encode()
    if len(data) <= MAX_CLOSE_REASON_BYTES:
        return words
    return data[:MAX_CLOSE_REASON_BYTES - 3].decode(errors="ignore") + "..."


RequestId = int | str
#: A target not scored as given (§4 ``result.targets``): what the client sent, and the token the pipeline
#: scored instead as its ``token_str`` reads, or None when the target is no token at all (ignored).
TargetNote = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class Limits:
    """The request limits in force, as announced in ``hello.limits`` (protocol.md §2)."""

    mask_token: str
    max_text_chars: int = 2000
    max_masks: int = 8
    top_k_min: int = 1
    top_k_max: int = 100
    top_k_default: int = 5
    max_targets: int = 100
    max_target_chars: int = 100
    max_id_chars: int = 128
    max_deadline_ms: int = 600_000


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class FillMaskRequest:
    """A validated ``fill_mask`` frame (§3). ``targets`` is None when the client sent none."""

    id: RequestId
    text: str
    top_k: int
    targets: tuple[str, ...] | None = None
    deadline_ms: float | None = None


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class CancelRequest:
    """A validated ``cancel`` frame (§5)."""

    id: RequestId


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class StatsSubscription:
    """A validated ``subscribe_stats`` (``interval_ms`` set) or ``unsubscribe_stats`` (None) frame (§13)."""

    interval_ms: int | None


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class ProtocolError:
    """A frame that must be answered with one ``error`` frame (§7)."""

    code: str
    message: str
    id: RequestId | None = None


Parsed = FillMaskRequest | CancelRequest | StatsSubscription | ProtocolError


def _is_valid_id(value: Any, limits: Limits) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER
    if isinstance(value, str):
        return 1 <= len(value) <= limits.max_id_chars and _encodable(value)
    return False


def _encodable(text: str) -> bool:
    """False for strings holding lone surrogates, which cannot be echoed as UTF-8 JSON."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NOT_JSON = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: What orjson says of valid JSON it cannot hold ("no low surrogate in string", "number is infinity when
#: parsed as double"...): only such a frame is parsed again.
_VALID_BUT_UNHELD = ("surrogate", "infinity")


def _orjsons_integer(digits: str) -> int | float:
    """An integer literal as orjson reads it: an int within 64 bits, else a float (``inf`` past a
    double's range, never an error, whatever its length)."""
    if len(digits) <= 21:  # (longer ones are outside it: no int() of thousands of digits)
        value = int(digits)
        if value in JSON_INTEGERS:
            return value
    return float(digits)


#: The deepest nesting of arrays and objects a frame may have (orjson's own limit, §7 ``invalid_json``).
MAX_NESTING = 1024
#: Room for the frames of whoever calls the parser, above the nesting (the interpreter's default limit).
_CALLERS_DEPTH = 1000
_RECURSION_LIMIT = threading.Lock()


def _nesting(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest, brackets inside strings left out; one pass, so its
    time is linear in the frame's size whatever the frame holds (a regular expression for strings took
    seconds on an unclosed string of escaped quotes). An upper bound for text that is not JSON."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _loads_what_orjson_cannot_hold(data: str | bytes, refusal: Exception) -> Any:
    """The frame as the standard library reads it (lone surrogates kept, numbers as orjson reads them,
    ``1e400`` as infinity, which the field checks then refuse), or ``_NOT_JSON`` when it is not JSON
    orjson merely cannot hold (``NaN`` and ``Infinity`` are not JSON either), or nests deeper than
    ``MAX_NESTING``, as orjson would have said. The standard library parses nesting by recursion, so
    it runs with room for ``MAX_NESTING`` levels above wherever it is called from."""
    if not any(word in str(refusal) for word in _VALID_BUT_UNHELD):
        return _NOT_JSON
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if _nesting(raw) > MAX_NESTING:
        return _NOT_JSON
    with _RECURSION_LIMIT:  # process-wide: servers on several threads must not restore each other's
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, MAX_NESTING + _CALLERS_DEPTH))
        try:
            return json.loads(data, parse_constant=_reject_constant, parse_int=_orjsons_integer)
        except (ValueError, TypeError, RecursionError):
            return _NOT_JSON
        finally:
            sys.setrecursionlimit(limit)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


#: The mask tokens people most often mix up (``[MASK]``: BERT, ALBERT, DeBERTa, ELECTRA, ModernBERT;
#: ``<mask>``: RoBERTa, XLM-R, ESM): a text with the other one gets a hint naming it.
MASK_TOKENS = ("[MASK]", "<mask>")


def parse_frame(data: str | bytes, limits: Limits) -> Parsed:
    """Turn one incoming WebSocket message into a request, a cancel, or an error (never raises)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return ProtocolError("binary_frame", "binary frames are not accepted; send each request as a JSON text frame")
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, ValueError, TypeError, RecursionError) as refusal:
        obj = _loads_what_orjson_cannot_hold(data, refusal)
        if obj is _NOT_JSON:
            return ProtocolError("invalid_json", "the frame is not valid JSON; send one JSON object per text frame")
    if not isinstance(obj, dict):
        return ProtocolError(
            "not_an_object", f"the frame is {_type_name(obj)}, not a JSON object; send an object with a \"type\" field"
        )
    raw_id = obj.get("id")
    frame_id = raw_id if _is_valid_id(raw_id, limits) else None
    if "type" not in obj:
        return ProtocolError("missing_field", f"the frame has no \"type\"; use {_TYPES}", frame_id)
    kind = obj["type"]
    if kind == "fill_mask":
        return _parse_fill_mask(obj, frame_id, limits)
    if kind == "cancel":
        if "id" not in obj:
            return ProtocolError("missing_field", "a cancel frame needs the \"id\" of the request to cancel")
        if frame_id is None:
            return ProtocolError("invalid_id", _id_rule(limits))
        return CancelRequest(frame_id)
    if kind == "subscribe_stats":
        interval = obj.get("interval_ms")
        if interval is None:  # left out or null, as for any optional field (§3)
            interval = STATS_INTERVAL_MS["default"]
        if (isinstance(interval, bool) or not isinstance(interval, int)
                or not STATS_INTERVAL_MS["min"] <= interval <= STATS_INTERVAL_MS["max"]):
            # Not a request (§13): an id it holds is ignored, so its error never reads as a request's answer.
            return ProtocolError("invalid_field", f"\"interval_ms\" must be an integer from {STATS_INTERVAL_MS['min']} "
                                 f"to {STATS_INTERVAL_MS['max']}")
        return StatsSubscription(interval)
    if kind == "unsubscribe_stats":
        return StatsSubscription(None)
    if not isinstance(kind, str):
        return ProtocolError("unknown_type", f"\"type\" is {_type_name(kind)}, not a string; use {_TYPES}", frame_id)
    shown = repr(kind if len(kind) <= 32 else kind[:32] + "…")
    return ProtocolError("unknown_type", f"unknown frame type {shown}; use {_TYPES}", frame_id)


_TYPES = ", ".join(f'"{kind}"' for kind in CLIENT_FRAME_TYPES[:-1]) + f' or "{CLIENT_FRAME_TYPES[-1]}"'



def _id_rule(limits: Limits) -> str:
    return (f"\"id\" must be a string of 1 to {limits.max_id_chars} characters "
            f"or an integer between -{MAX_SAFE_INTEGER} and {MAX_SAFE_INTEGER}")


def _parse_fill_mask(obj: dict[str, Any], frame_id: RequestId | None, limits: Limits) -> Parsed:
    if "id" not in obj:
        return ProtocolError("missing_field", "a fill_mask frame needs an \"id\" (a string or an integer you choose)")
    if frame_id is None:
        return ProtocolError("invalid_id", _id_rule(limits))
    text = obj.get("text")
    if "text" not in obj:
        return ProtocolError("missing_field", "a fill_mask frame needs a \"text\" containing "
                             f"{limits.mask_token}", frame_id)
    if not isinstance(text, str):
        return ProtocolError("invalid_field", f"\"text\" must be a string, not {_type_name(text)}", frame_id)
    if len(text) > limits.max_text_chars:
        return ProtocolError("text_too_long", f"\"text\" has {len(text)} characters; the limit is "
                             f"{limits.max_text_chars}; shorten it", frame_id)
    if not _encodable(text):
        return ProtocolError("invalid_field", "\"text\" holds an unpaired surrogate; send valid Unicode", frame_id)
    masks = text.count(limits.mask_token)
    if masks == 0:
        folded = text.lower()
        if limits.mask_token.lower() in folded:
            hint = " (it is case-sensitive)"
        else:  # BERT's [MASK] sent to RoBERTa, or the other way round
            other = next((token for token in MASK_TOKENS if token.lower() in folded), None)
            hint = f" (this model's mask token; {other} is another model family's)" if other else ""
        return ProtocolError("no_mask", f"the text has no {limits.mask_token} token; put {limits.mask_token}"
                             f"{hint} where the missing word goes", frame_id)
    if masks > limits.max_masks:
        return ProtocolError("too_many_masks", f"the text has {masks} {limits.mask_token} tokens; the limit is "
                             f"{limits.max_masks} per request: remove some, or split the text over several "
                             "requests", frame_id)

    top_k = obj.get("top_k")
    if top_k is None:
        top_k = limits.top_k_default
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or not limits.top_k_min <= top_k <= limits.top_k_max:
        return ProtocolError("invalid_top_k", f"\"top_k\" must be an integer from {limits.top_k_min} to "
                             f"{limits.top_k_max}", frame_id)

    targets = obj.get("targets")
    if targets is not None:
        targets = _parse_targets(targets, limits)
        if isinstance(targets, str):
            return ProtocolError("invalid_targets", targets, frame_id)

    deadline = obj.get("deadline_ms")
    if deadline is not None:
        if (isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline)
                or not 0 < deadline <= limits.max_deadline_ms):
            return ProtocolError("invalid_deadline", "\"deadline_ms\" must be a number of milliseconds greater than "
                                 f"0 and at most {limits.max_deadline_ms}", frame_id)
        deadline = float(deadline)
    return FillMaskRequest(frame_id, text, top_k, targets, deadline)


def _parse_targets(value: Any, limits: Limits) -> tuple[str, ...] | str:
    """Return the targets as a tuple, or a message (a str) saying what is wrong with them."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return f"\"targets\" must be a string or a list of strings, not {_type_name(value)}"
    if not 1 <= len(value) <= limits.max_targets:
        return f"\"targets\" must hold 1 to {limits.max_targets} strings; it holds {len(value)}"
    # Each message names the target (its place, counted from 1) and the rule it breaks: with up to
    # max_targets of them, "every target must be ..." left the client to find which (an inputs trial).
    for n, item in enumerate(value, start=1):
        if not isinstance(item, str):
            return f"every target must be a string; target {n} is {_type_name(item)}"
        if not 1 <= len(item) <= limits.max_target_chars:
            return (f"target {n} is {len(item)} characters long; a target must be 1 to {limits.max_target_chars} "
                    "characters")
        if not item.strip():
            return f"target {n} is only whitespace; a target must hold a word"
        if not _encodable(item):
            return f"target {n} holds an unpaired surrogate; send valid Unicode"
    return tuple(value)


# --- frames the server sends -------------------------------------------------------------------


def encode_hello(server: str, model: str, random_weights: bool, limits: Limits,
                 extra_limits: dict[str, Any], engine: dict[str, Any]) -> bytes:
    """The first frame on every connection (§2); ``engine`` says which path the model runs
    (``FillMaskModel.engine_facts``)."""
    announced = {
        **extra_limits,
        "max_text_chars": limits.max_text_chars,
        "max_masks": limits.max_masks,
        "top_k": {"min": limits.top_k_min, "max": limits.top_k_max, "default": limits.top_k_default},
        "max_targets": limits.max_targets,
        "max_target_chars": limits.max_target_chars,
        "max_id_chars": limits.max_id_chars,
        "max_deadline_ms": limits.max_deadline_ms,
    }
    return orjson.dumps({"type": "hello", "protocol": PROTOCOL_VERSION, "server": server, "model": model,
                         "random_weights": random_weights, "mask_token": limits.mask_token, "limits": announced,
                         "stats": {f"{key}_interval_ms": value for key, value in STATS_INTERVAL_MS.items()},
                         "engine": engine})


def targets_field(notes: Sequence[TargetNote]) -> bytes:
    """The ``"targets"`` member of a result (§4) as JSON, with its leading comma; empty without notes.
    Its length counts against ``max_result_bytes`` (intake.check), so the rest of the frame stays
    within its 1 KiB envelope (§14)."""
    if not notes:
        return b""
    return b',"targets":' + orjson.dumps([{"given": given, "scored": scored} for given, scored in notes])


def encode_result(request_id: RequestId, predictions_json: bytes, queue_ms: float, inference_ms: float,
                  batch_size: int, batch_tokens: int, batch_id: int, targets: Sequence[TargetNote] = ()) -> bytes:
    """A request's result (§4). ``predictions_json`` is the predictions already serialized (by the
    decode stage, off the event loop); only the small envelope is encoded here, with ``targets`` when
    some target was not scored as given."""
    tail = orjson.dumps({"queue_ms": round(queue_ms, 3), "inference_ms": round(inference_ms, 3),
                         "batch_size": batch_size, "batch_tokens": batch_tokens, "batch_id": batch_id})
    return b"".join((b'{"type":"result","id":', orjson.dumps(request_id), b',"predictions":', predictions_json,
                     targets_field(targets), b",", tail[1:]))


def encode_error(request_id: RequestId | None, code: str, message: str) -> bytes:
    """An error frame (§7)."""
    assert code in ERROR_CODES, code
    return orjson.dumps({"type": "error", "id": request_id, "code": code, "message": message})


def encode_overloaded(request_id: RequestId, status: int, reason: str, retry_after_ms: int,
                      queue_ms: float | None = None) -> bytes:
    """An ``overloaded`` answer (§6): 429 ``queue_share``, 503 or 504."""
    assert OVERLOADED_REASONS.get(reason) == status, (reason, status)
    frame: dict[str, Any] = {"type": "overloaded", "id": request_id, "status": status, "reason": reason,
                             "retry_after_ms": retry_after_ms}
    if queue_ms is not None:
        frame["queue_ms"] = round(queue_ms, 3)
    return orjson.dumps(frame)


def encode_going_away(reason: str, reconnect_within_ms: int) -> bytes:
    """The drain's notice on every open connection (§10): accepted requests still get their answers."""
    return orjson.dumps({"type": "going_away", "reason": reason, "reconnect_within_ms": reconnect_within_ms})


def encode_stats(fields: dict[str, Any]) -> bytes:
    """A live-figures frame for a subscriber (§13); ``fields`` come from ``stats.LiveStats.snapshot``."""
    return orjson.dumps({"type": "stats", **fields})


def encode_cancelled(request_id: RequestId) -> bytes:
    """The answer to a cancel that removed a queued request (§5)."""
    return orjson.dumps({"type": "cancelled", "id": request_id})
