"""The life of one accepted request: its states, the one table of legal moves, and how it can end.

A ``Job`` is created when a connection accepts a ``fill_mask`` frame (protocol.md §3) and then moves
through the stages, each with one owner::

    TOKENIZING --checked--> QUEUED --batched--> RUNNING --forwarded--> DECODING --decoded--> DONE
        |                     |                   |                       |
        +--rejected--> DONE   +--withdrawn--> DONE +--failed--> DONE       +--failed--> DONE
        +--withdrawn--> DONE  +--expired--> DONE
        +--failed--> DONE

``advance`` is the only function that changes ``Job.state``; it looks the move up in ``TRANSITIONS``
and raises ``IllegalTransition`` for anything else (as h11 does for its connection states). Callers
hold the engine's lock around the check and the move, so two threads can never both move one job:
whoever moves a job to DONE is the one that produces its ``Outcome`` (or, for a withdrawn job, its
answer: core.py says who), and a job reaches DONE once.
That is how "exactly one terminal frame" (§8) holds by construction; the connection's ``Session``
checks it once more when the frame is written.

``withdrawn`` is every removal decided outside the stages (cancel, deadline timer, closed connection,
drain timeout, a stopped engine): it is legal only before the model has the job, which is exactly the
protocol's rule that a request whose batch has started is never cut short (§5, §6).

VALUES: the outcomes here, like the parsed frames (``protocol``), the tokenizer stage's verdicts
(``intake``), the session's answers and the model's ``Item``, are values: made once, never changed
after. They are plain slotted dataclasses, not frozen ones, because several are made for every
request and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) takes several
times as long; ``unsafe_hash`` keeps them hashable by value, as frozen ones were.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .protocol import FillMaskRequest, TargetNote


class State(enum.Enum):
    # Members are singletons compared by identity: hash them as objects, in C. Enum's own __hash__ is
    # Python code, and every move (``can``, ``advance``) hashes a state and an event.
    __hash__ = object.__hash__

    TOKENIZING = "tokenizing"  # accepted, waiting for (or in) the tokenizer stage
    QUEUED = "queued"  # tokenized and checked: runnable, waiting for a batch
    RUNNING = "running"  # in a batch on the model
    DECODING = "decoding"  # the model is done; its top-k waits to become predictions
    DONE = "done"  # its outcome exists (or its connection is gone)


class Event(enum.Enum):
    __hash__ = object.__hash__  # as State's

    CHECKED = "checked"
    REJECTED = "rejected"
    BATCHED = "batched"
    FORWARDED = "forwarded"
    DECODED = "decoded"
    FAILED = "failed"
    EXPIRED = "expired"
    WITHDRAWN = "withdrawn"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.TOKENIZING, Event.CHECKED): State.QUEUED,
    (State.TOKENIZING, Event.REJECTED): State.DONE,
    (State.TOKENIZING, Event.FAILED): State.DONE,
    (State.TOKENIZING, Event.WITHDRAWN): State.DONE,
    (State.QUEUED, Event.BATCHED): State.RUNNING,
    (State.QUEUED, Event.EXPIRED): State.DONE,
    (State.QUEUED, Event.WITHDRAWN): State.DONE,
    (State.RUNNING, Event.FORWARDED): State.DECODING,
    (State.RUNNING, Event.FAILED): State.DONE,
    (State.DECODING, Event.DECODED): State.DONE,
    (State.DECODING, Event.FAILED): State.DONE,
}


class IllegalTransition(RuntimeError):
    """A move that ``TRANSITIONS`` does not allow: a bug, never a client's doing."""


@dataclass(eq=False, slots=True)
class Job:
    """One accepted request on its way through the stages. ``owner`` is its connection, opaque here.

    Written by the tokenizer stage before the job is QUEUED (``input_ids``, ``n_tokens``, ``masks``,
    ``target_ids``, ``result_bytes``); read-only afterwards, but for ``reserved``, ``missed`` and
    ``started`` (the engine core, under the engine's lock; ``started`` before the job is handed to
    the decode stage, which reads it after taking the hand-over under the same lock). ``state`` is
    written by ``advance`` only.
    """

    request: FillMaskRequest
    owner: Any
    arrival: float
    deadline: float | None = None
    state: State = State.TOKENIZING
    input_ids: list[int] = field(default_factory=list)
    n_tokens: int = 0
    masks: int = 0
    target_ids: tuple[int, ...] | None = None
    target_notes: tuple[TargetNote, ...] = ()  # targets not scored as given (§4 result.targets), from intake
    result_bytes: int = 0  # an upper bound on its predictions' and target notes' JSON (intake.check)
    reserved: int = 0  # answer memory reserved for it while its answer is being computed (engine)
    started: float = 0.0  # when its batch started on the model (set by the core once the batch ran)
    missed: int = 0  # batches the fixed band left it out of while it was queued (batching.py's tail bound)


def can(job: Job, event: Event) -> bool:
    """Whether ``event`` is a legal move for ``job`` now (read under the same lock as ``advance``)."""
    return (job.state, event) in TRANSITIONS


def advance(job: Job, event: Event) -> None:
    """Move ``job`` by ``event``; the one place a job's state changes."""
    try:
        job.state = TRANSITIONS[(job.state, event)]
    except KeyError:
        raise IllegalTransition(f"{event.value} is not a legal move from {job.state.value}") from None


# --- how a job ends: the typed outcomes the stages hand to the server (never wire bytes) ----------


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Result:
    """The request ran: its predictions, already serialized as JSON by the decode stage."""

    job: Job
    predictions_json: bytes
    queue_ms: float
    inference_ms: float
    batch_size: int
    batch_tokens: int
    batch_id: int


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Rejected:
    """A check of §3 that needs the tokenizer failed (``text_too_long``, ``no_mask``, ...)."""

    job: Job
    code: str
    message: str


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Expired:
    """Its deadline passed while it waited (§6, 504)."""

    job: Job
    queue_ms: float
    retry_after_ms: int


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Failed:
    """The server failed on this request alone (§7 ``internal_error``)."""

    job: Job
    message: str


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Stopped:
    """It will not run here: the engine stopped (``engine_stopped``) or the drain ran out of time
    (``shutting_down``); §6, 503. Sending it to another server is safe."""

    job: Job
    reason: str
    retry_after_ms: int


Outcome = Result | Rejected | Expired | Failed | Stopped
