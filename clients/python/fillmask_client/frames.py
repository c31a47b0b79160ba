"""The client's side of the wire, without I/O: build request frames, read server frames.

Everything here is a pure function of its arguments, so the mapping from a server frame to a result
or an exception can be read (and tested) without a socket or an event loop. The sections cited are
those of ``protocol.md``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import orjson

from .errors import DeadlineExceededError, FillMaskError, OverloadedError, RequestError, UsageError
from .wire import JSON_INTEGERS, PROTOCOL_VERSION, TERMINAL_TYPES, wait_hint_ms


class Prediction(TypedDict):
    """One candidate for one mask, exactly as the ``fill-mask`` pipeline returns it (§4)."""

    score: float
    token: int
    token_str: str
    sequence: str


#: A text with one mask gets a list of candidates; a text with several masks gets one list per mask.
Predictions = list[Prediction] | list[list[Prediction]]


class ScoredTarget(TypedDict):
    """A target that is not one vocabulary token, and the token that was scored for it (§4 ``targets``):
    like the pipeline, the server scores its first sub-token; ``None`` when the target has no token at
    all, and so was ignored (as the pipeline ignores it)."""

    given: str
    scored: str | None


@dataclass(frozen=True)
class FillMaskResult:
    """A ``result`` frame (§4): the predictions plus the server's timings for the request.

    ``frame`` is the raw frame as received (what ``--json`` prints); the other fields are read from it.
    ``targets`` lists the request's targets that were not scored as given (empty when all were, or
    when the request had none), in request order.
    """

    predictions: Predictions
    queue_ms: float | None
    inference_ms: float | None
    batch_size: int | None
    batch_tokens: int | None
    batch_id: int | None
    frame: dict[str, Any]
    targets: tuple[ScoredTarget, ...] = ()

    @property
    def mask_count(self) -> int:
        """How many masks the text had (one list of predictions each)."""
        preds = self.predictions
        return len(preds) if preds and isinstance(preds[0], list) else 1

    def per_mask(self) -> list[list[Prediction]]:
        """The predictions as one list per mask, whether the text had one mask or several."""
        preds = self.predictions
        if preds and isinstance(preds[0], list):
            return cast("list[list[Prediction]]", list(preds))
        return [cast("list[Prediction]", preds)]


def plain_number(value: Any) -> Any:
    """A number of another library's type (numpy's ``int64``, ``float32``...) as the ``int`` or ``float``
    JSON writes, which the encoder would refuse; a ``bool`` and anything that is not a number as given
    (the server judges them, §7)."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def encode_fill_mask(
    request_id: int,
    text: str,
    *,
    top_k: int | None = None,
    targets: str | Sequence[str] | None = None,
    deadline_ms: float | None = None,
) -> bytes:
    """The ``fill_mask`` frame (§3) as UTF-8 JSON; fields left as ``None`` are omitted (server defaults).

    Values are not checked here: the server is the one authority on what is valid and answers with a
    precise ``error`` (§7). Only ``targets`` is normalised from any sequence to a JSON list, and other
    libraries' numbers to Python's (``plain_number``). What JSON cannot carry as given is refused
    (``check_sendable``), never sent as something else.
    """
    top_k, deadline_ms = plain_number(top_k), plain_number(deadline_ms)
    check_sendable(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
    frame: dict[str, Any] = {"type": "fill_mask", "id": request_id, "text": text}
    if top_k is not None:
        frame["top_k"] = top_k
    if targets is not None:
        frame["targets"] = targets if isinstance(targets, str) else list(targets)
    if deadline_ms is not None:
        frame["deadline_ms"] = deadline_ms
    return orjson.dumps(frame)


def check_sendable(
    text: Any,
    *,
    top_k: Any = None,
    targets: Any = None,
    deadline_ms: Any = None,
) -> None:
    """``UsageError`` when a ``fill_mask`` frame with these values cannot carry them as given.

    Only a text that is not a ``str`` and what the encoding itself would break are refused; everything
    else is the server's to judge.
    A string with a lone surrogate is not valid Unicode and has no UTF-8 form (the JSON encoder would
    fail on it with a ``TypeError`` from deep inside the send). A NaN or infinite
    number has no JSON form: the encoder would write ``null``, which the server reads as the field left
    out (§3), so ``deadline_ms=float("nan")`` would silently run without a deadline. Nor has a value of a
    type the encoder does not know (a set; numpy's ``bool``). Its callers give other libraries' numbers
    as Python's (``plain_number``).
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise UsageError("text must be a str, not bytes: decode it first (UTF-8)")
    if not isinstance(text, str):  # the one field whose type never depends on the server
        raise UsageError(f"text must be a str, not {type(text).__name__}")
    if isinstance(targets, (bytes, bytearray, memoryview)):  # (else sent as a list of numbers, one a byte)
        raise UsageError("targets must be a str or a list of str, not bytes: decode it first (UTF-8)")
    strings = [("text", text)]
    if isinstance(targets, str):
        strings.append(("targets", targets))
    elif isinstance(targets, Sequence):
        strings.extend((f"targets[{index}]", target) for index, target in enumerate(targets))
    for name, value in strings:
        if isinstance(value, (bytes, bytearray, memoryview)):
            raise UsageError(f"{name} must be a str, not bytes: decode it first (UTF-8)")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise UsageError(
                    f"{name} is not valid Unicode: it has a lone surrogate {value[exc.start]!r} at character "
                    f"{exc.start}, which has no UTF-8 form; remove it or decode the text correctly"
                ) from None
    fields = [("top_k", top_k, "an integer, or None for the server's default"),
              ("deadline_ms", deadline_ms, "milliseconds > 0, or None for no deadline")]
    for name, number, hint in fields:
        if isinstance(number, float) and not math.isfinite(number):
            raise UsageError(f"{name}={number!r} is not a finite number, which JSON cannot carry: give {hint}")
        if isinstance(number, int) and not isinstance(number, bool) and number not in JSON_INTEGERS:
            raise UsageError(f"{name}={number} is beyond 64 bits, which the JSON encoder cannot write: give {hint}")
    if isinstance(targets, Sequence) and not isinstance(targets, str):
        fields.extend((f"targets[{index}]", target, "a str") for index, target in enumerate(targets))
    for name, value, hint in fields:  # anything else the encoder has no form for (a set, numpy's bool...)
        try:
            orjson.dumps(value)
        except TypeError:
            raise UsageError(f"{name} of type {_type_name(value)} has no JSON form: give {hint}") from None


def _type_name(value: Any) -> str:
    """``set``, ``numpy.bool``: the type's name, with its module unless it is a built-in."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def encode_cancel(request_id: int) -> bytes:
    """The ``cancel`` frame (§5) for a request in flight."""
    return orjson.dumps({"type": "cancel", "id": request_id})


def decode_frame(data: bytes | str) -> dict[str, Any]:
    """Parse one server frame; ``ValueError`` when it is not a JSON object with a string ``type``."""
    value = orjson.loads(data)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("server frame is not a JSON object with a string 'type'")
    return value


def check_hello(frame: dict[str, Any]) -> str | None:
    """Return why ``frame`` is not an acceptable first frame (§2), or ``None`` when it is."""
    if frame.get("type") != "hello":
        return f"expected a 'hello' frame first, got {frame.get('type')!r}"
    if "protocol" not in frame:
        return "the server's hello has no protocol field: is it a fill-mask server?"
    if type(frame.get("protocol")) is not int or frame.get("protocol") != PROTOCOL_VERSION:  # not true, not 1.0
        return f"server speaks protocol {frame.get('protocol')!r}, this client speaks {PROTOCOL_VERSION}"
    return None


def terminal_id(frame: dict[str, Any]) -> int | None:
    """The request id a frame ends, or ``None`` when it ends none of this client's requests.

    This client only sends positive integer ids, so anything else (``null`` on an unattributable
    ``error``, a string, a boolean, which ``==`` would confuse with 0 and 1) is not one of ours.
    """
    if frame["type"] not in TERMINAL_TYPES:
        return None
    # ``duplicate_id`` is about the rejected frame only (§7). (``too_many_inflight`` also answers the
    # rejected frame only, but that frame was the request: not accepted, so it is its one answer.)
    if frame["type"] == "error" and frame.get("code") == "duplicate_id":
        return None
    request_id = frame.get("id")
    return request_id if type(request_id) is int else None


def scored_targets(value: Any) -> tuple[ScoredTarget, ...]:
    """The well-formed entries of a result's ``targets`` (§4); anything else is ignored, not fatal."""
    if not isinstance(value, list):
        return ()
    return tuple(ScoredTarget(given=entry["given"], scored=entry["scored"]) for entry in value
                 if isinstance(entry, dict) and isinstance(entry.get("given"), str)
                 and (entry.get("scored") is None or isinstance(entry.get("scored"), str)))


def predictions_problem(value: Any) -> str | None:
    """Why a result's ``predictions`` is not §4's shape (a non-empty list of candidates, or one such
    list per mask, each candidate an object with a numeric ``score``, a string ``token_str`` and a
    string ``sequence``); ``None`` when it is."""
    if not isinstance(value, list) or not value:
        return "predictions is not a non-empty list"
    per_mask = value if isinstance(value[0], list) else [value]
    for candidates in per_mask:
        if not isinstance(candidates, list) or not candidates:
            return "a mask's candidates are not a non-empty list"
        for candidate in candidates:
            if not (isinstance(candidate, dict) and isinstance(candidate.get("score"), (int, float))
                    and not isinstance(candidate.get("score"), bool) and isinstance(candidate.get("token_str"), str)
                    and isinstance(candidate.get("sequence"), str)):
                return "a candidate is not an object with a numeric score, a token_str and a sequence"
    return None


def outcome(frame: dict[str, Any]) -> FillMaskResult | FillMaskError:
    """Map a terminal frame to what the caller gets: a ``FillMaskResult`` or the exception to raise."""
    kind = frame["type"]
    if kind == "result":
        problem = predictions_problem(frame.get("predictions"))
        if problem is not None:
            return FillMaskError(f"the server's result for request {frame.get('id')} is malformed ({problem})",
                                 frame=frame)
        return FillMaskResult(
            predictions=frame.get("predictions", []),
            queue_ms=frame.get("queue_ms"),
            inference_ms=frame.get("inference_ms"),
            batch_size=frame.get("batch_size"),
            batch_tokens=frame.get("batch_tokens"),
            batch_id=frame.get("batch_id"),
            frame=frame,
            targets=scored_targets(frame.get("targets")),
        )
    if kind == "error":
        return RequestError(str(frame.get("code")), str(frame.get("message", "")), frame=frame)
    if kind == "overloaded":  # read defensively: a number that is not one must not become a TypeError
        status = frame.get("status")
        reason = frame.get("reason")
        reason = reason if isinstance(reason, str) else str(reason or "")
        retry_after_ms = wait_hint_ms(frame.get("retry_after_ms"))
        if status == 504:
            queue_ms = frame.get("queue_ms")
            queue_ms = queue_ms if isinstance(queue_ms, (int, float)) and not isinstance(queue_ms, bool) else None
            return DeadlineExceededError(retry_after_ms, queue_ms, reason=reason, frame=frame)
        status = status if type(status) is int else 503
        return OverloadedError(status, reason, retry_after_ms, frame=frame)
    if kind == "cancelled":
        # This client sends `cancel` only after the caller gave up, so a caller never sees this frame;
        # should a future server cancel on its own, the request still fails loudly rather than hangs.
        return FillMaskError(f"the server cancelled request {frame.get('id')!r}", frame=frame)
    return FillMaskError(f"unexpected terminal frame type {kind!r}", frame=frame)
