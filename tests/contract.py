"""The machine-readable contract (protocol/schemas, draft 2020-12) as validators, and the wire monitor
that checks every frame the test suite exchanges with a server against it (tests/conftest.py).

Three things make the schemas exact for tests, beyond what a generic validator does:

- **Integers as the server reads them.** JSON Schema's ``integer`` is a number with a zero fraction,
  so ``7.0`` passes; the server (orjson) reads ``7.0`` and ``1e1`` as floats and refuses them. Here
  frames are parsed with orjson too, and ``integer`` means a JSON integer literal (a Python ``int``).
- **Limits bound from hello.** A field bounded by a value of ``hello`` carries ``x-limit`` (keyword →
  dotted path into hello); ``Contract(hello)`` writes those values in, so ``text`` gets
  ``maxLength: limits.max_text_chars`` of that very server.
- **Closed server frames.** Schemas say ``additionalProperties: true`` (later versions may add fields;
  clients ignore them), and an ``anyOf``/``oneOf`` branch marked ``"x-later": true`` admits what a later
  version may add (an error code, a reason, a frame type; protocol.md §14 says what a client does with
  it). For frames our server sends, ``closed=True`` turns each of those objects ``false`` and drops each
  such branch: every field and value the server sends today must be listed in the schema.

Invariant: ``Contract`` never raises on a frame; ``problems`` returns what is wrong, empty when valid.

**A compiled first look.** The suite checks tens of thousands of frames, and the Python validator
takes most of a millisecond for a result. ``Contract`` first asks a compiled validator
(``jsonschema_rs``, the same schemas with every ``$ref`` written in place) and trusts it only where both
must agree: a frame that it accepts and that is ``_plain`` (no float with a zero fraction, which the
stock ``integer`` accepts; no string outside printable ASCII, where ECMAScript's ``\\s`` differs from
Python's; no integer beyond 2**53 and no float that is not finite, which JSON cannot carry to it;
not deeply nested). Every other frame, and every frame it refuses, goes to the Python validator,
which alone writes the problems.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson
from jsonschema import Draft202012Validator
from jsonschema.validators import extend
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "protocol" / "schemas"
CLIENT_SCHEMAS = {"fill_mask": "fill_mask.json", "cancel": "cancel.json", "subscribe_stats": "subscribe_stats.json",
                  "unsubscribe_stats": "unsubscribe_stats.json"}
SERVER_SCHEMAS = {"hello": "hello.json", "result": "result.json", "error": "error.json",
                  "overloaded": "overloaded.json", "cancelled": "cancelled.json", "going_away": "going_away.json",
                  "stats": "stats.json"}
TERMINAL_TYPES = frozenset({"result", "error", "overloaded", "cancelled"})
#: Error codes about a frame's form alone (types, ranges, required fields), decided when the frame is
#: read and never by the tokenizer: a frame the bound schema accepts must never get one of these.
FORM_CODES = frozenset({"invalid_json", "not_an_object", "missing_field", "unknown_type", "invalid_id",
                        "invalid_field", "invalid_top_k", "invalid_deadline"})


def _is_json_integer(checker: Any, instance: Any) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


WireValidator = extend(Draft202012Validator,
                       type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_json_integer))


@functools.cache
def raw_schemas() -> dict[str, dict[str, Any]]:
    """Every schema file by name, as written."""
    return {path.name: orjson.loads(path.read_bytes()) for path in sorted(SCHEMA_DIR.glob("*.json"))}


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _lookup(hello: dict[str, Any], path: str) -> Any:
    value: Any = hello
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def bind(schema: dict[str, Any], hello: dict[str, Any] | None, closed: bool) -> dict[str, Any]:
    """A copy of ``schema`` with its ``x-limit`` values taken from ``hello`` and, when ``closed``, every
    explicitly open object (``additionalProperties: true``) closed and every ``x-later`` branch dropped."""
    schema = copy.deepcopy(schema)
    # Without "$schema", a $ref keeps our validator class: jsonschema switches to the stock class of a
    # dialect a referenced resource names, whose "integer" accepts 7.0 (the registry says 2020-12 instead).
    schema.pop("$schema", None)
    for node in _walk(schema):
        if hello is not None and isinstance(node.get("x-limit"), dict):
            for keyword, path in node["x-limit"].items():
                value = _lookup(hello, path)
                if isinstance(value, int) and not isinstance(value, bool):
                    node[keyword] = value
        if closed and node.get("additionalProperties") is True:
            node["additionalProperties"] = False
        for keyword in ("anyOf", "oneOf") if closed else ():
            if isinstance(node.get(keyword), list):
                node[keyword] = [branch for branch in node[keyword]
                                 if not (isinstance(branch, dict) and branch.get("x-later") is True)]
    return schema


def inline_refs(schemas: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """``schemas[name]`` with every ``$ref`` (``file.json#/json/pointer`` or ``#/pointer``) replaced by
    what it points to, and ``$defs`` dropped: one self-contained schema (the schemas have no cycles). A
    ``$ref`` beside other keywords applies in addition to them (2020-12), so it becomes an ``allOf``."""

    def target(ref: str, base: str) -> tuple[Any, str]:
        file, _, pointer = ref.partition("#")
        node: Any = schemas[file or base]
        for part in filter(None, pointer.split("/")):
            node = node[part]
        return node, file or base

    def walk(node: Any, base: str) -> Any:
        if isinstance(node, list):
            return [walk(value, base) for value in node]
        if not isinstance(node, dict):
            return node
        out = {key: walk(value, base) for key, value in node.items() if key not in ("$ref", "$defs")}
        if "$ref" not in node:
            return out
        pointed = walk(*target(node["$ref"], base))
        if not out:
            return pointed
        out["allOf"] = [*out.get("allOf", []), pointed]
        return out

    return walk(schemas[name], name)


_PLAIN_DEPTH = 32
_MAX_EXACT_INT = 2**53


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether the compiled validator's verdict on ``value`` is the Python validator's (module doc)."""
    if isinstance(value, str):
        return value.isascii() and value.isprintable()
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return -_MAX_EXACT_INT <= value <= _MAX_EXACT_INT
    if isinstance(value, float):
        return math.isfinite(value) and not value.is_integer()
    if depth >= _PLAIN_DEPTH:
        return False
    if isinstance(value, dict):
        return all(_plain(key, depth + 1) and _plain(item, depth + 1) for key, item in value.items())
    if isinstance(value, list):
        return all(_plain(item, depth + 1) for item in value)
    return False


class Contract:
    """Validators for one server's frames: limits bound from its ``hello`` (when given); server frames
    closed (``closed``), client frames open as the schemas say (the server ignores unknown fields)."""

    def __init__(self, hello: dict[str, Any] | None = None, closed: bool = True) -> None:
        self.bound = hello is not None

        bound = {close: {name: bind(schema, hello, close) for name, schema in raw_schemas().items()}
                 for close in {False, closed}}

        def registry(close: bool) -> Registry:
            return Registry().with_resources((name, DRAFT202012.create_resource(schema))
                                             for name, schema in bound[close].items())

        # Each validator's "integer" is a JSON integer literal (WireValidator).
        client, server = registry(False), registry(closed)
        self.fast_accepted = 0  # frames the compiled validator settled alone (read by tests)
        self._fast: dict[str, Any] = {
            kind: jsonschema_rs.Draft202012Validator(inline_refs(bound[close], name))
            for close, kinds in ((False, CLIENT_SCHEMAS), (closed, SERVER_SCHEMAS)) for kind, name in kinds.items()}
        self._validators = {
            **{kind: WireValidator({"$ref": name}, registry=client) for kind, name in CLIENT_SCHEMAS.items()},
            **{kind: WireValidator({"$ref": name}, registry=server) for kind, name in SERVER_SCHEMAS.items()},
        }

    def problems(self, frame: Any, kinds: dict[str, str]) -> list[str]:
        """What is wrong with ``frame`` as one of ``kinds`` (CLIENT_SCHEMAS or SERVER_SCHEMAS); [] when valid.
        The same answer as ``python_problems``, sooner for a plain valid frame (module doc)."""
        if isinstance(frame, dict) and frame.get("type") in kinds and _plain(frame) \
                and self._fast_accepts(frame):
            self.fast_accepted += 1
            return []
        return self.python_problems(frame, kinds)

    def _fast_accepts(self, frame: dict[str, Any]) -> bool:
        try:
            return bool(self._fast[frame["type"]].is_valid(frame))
        except Exception:  # anything it cannot take is the Python validator's to judge
            return False

    def python_problems(self, frame: Any, kinds: dict[str, str]) -> list[str]:
        """``problems`` as the Python validator alone finds them: the authority."""
        if not isinstance(frame, dict) or frame.get("type") not in kinds:
            shown = frame.get("type") if isinstance(frame, dict) else type(frame).__name__
            return [f"not a frame of a known type: {shown!r}"]
        validator = self._validators[frame["type"]]
        try:
            if validator.is_valid(frame):
                return []
            return [f"{'/'.join(map(str, error.absolute_path)) or '(frame)'}: {error.message}"
                    for error in validator.iter_errors(frame)]
        except RecursionError:  # a fuzzed value nested a thousand deep: its message cannot even be written
            return ["a value is nested too deeply to check (or to show)"]


@functools.lru_cache(maxsize=32)
def contract_for(hello_json: bytes | None) -> Contract:
    """One ``Contract`` per distinct hello (servers of a test session differ only in a few limits)."""
    return Contract(None if hello_json is None else orjson.loads(hello_json))


# --- the wire monitor ----------------------------------------------------------------------------


@dataclass
class _Expectation:
    """What the schema said about a fill_mask frame that is waiting for its answer."""

    valid: bool
    bound: bool
    frame: str
    problems: list[str]


@dataclass
class _ConnectionState:
    hello: dict[str, Any] | None = None
    contract: Contract = field(default_factory=lambda: contract_for(None))  # bound once hello is read
    awaiting: dict[bytes, deque[_Expectation]] = field(default_factory=dict)  # by the id's JSON text


class WireMonitor:
    """Checks frames on client connections to our server (see tests/conftest.py for which ones).

    - Every text frame **received** must be one JSON object valid against the closed schema of its
      ``type`` (limits bound from that connection's hello): the first must be ``hello``.
    - Every text frame **sent** that parses as an object of a client ``type`` is validated against its
      schema. Valid or not, a ``fill_mask`` with a valid id waits for the server's answer under that
      id, which must agree with the schema: one the schema refuses must be answered ``error`` (the
      server refused it too); one the bound schema accepts must not be refused for its form
      (``FORM_CODES``). Frames sent that are not JSON objects of a client type are the tests'
      deliberate garbage: not validated (the server's answers to them are).

    Problems are collected, not raised (frames also pass through the client library's reader task
    and the sync client's thread); the fixture fails the test that was running.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def take_problems(self) -> list[str]:
        with self._lock:
            problems, self.problems = self.problems, []
        return problems

    @staticmethod
    def _state(ws: Any) -> _ConnectionState:
        state = ws.__dict__.get("_contract_state")
        if state is None:
            state = ws.__dict__["_contract_state"] = _ConnectionState()
        return state

    def sent(self, ws: Any, message: Any, text: bool | None) -> None:
        is_text = isinstance(message, str) or (text is True and isinstance(message, (bytes, bytearray)))
        if not is_text:
            return
        try:
            frame = orjson.loads(message)
        except orjson.JSONDecodeError:
            return
        if not isinstance(frame, dict) or frame.get("type") not in CLIENT_SCHEMAS:
            return
        state = self._state(ws)
        contract = state.contract
        problems = contract.problems(frame, CLIENT_SCHEMAS)
        self._count("sent_valid" if not problems else "sent_refused_by_schema")
        if frame["type"] != "fill_mask" or "id" not in frame:
            return
        if contract.problems({"type": "cancel", "id": frame["id"]}, CLIENT_SCHEMAS):
            return  # no valid id: the answer comes with id null and cannot be told apart
        shown = (message if isinstance(message, str) else bytes(message).decode("utf-8", "replace"))[:300]
        expectation = _Expectation(not problems, contract.bound, shown, problems)
        state.awaiting.setdefault(orjson.dumps(frame["id"]), deque()).append(expectation)

    def received(self, ws: Any, message: Any) -> None:
        if isinstance(message, (bytes, bytearray, memoryview)):
            try:
                text = bytes(message).decode("utf-8")
            except UnicodeDecodeError:
                self._problem(f"the server sent a frame that is not UTF-8: {bytes(message)[:100]!r}")
                return
        else:
            text = message
        try:
            frame = orjson.loads(text)
        except orjson.JSONDecodeError:
            self._problem(f"the server sent a frame that is not JSON: {text[:200]!r}")
            return
        state = self._state(ws)
        if state.hello is None and not (isinstance(frame, dict) and frame.get("type") == "hello"):
            self._problem(f"the first frame from the server is not hello: {text[:200]}")
        if isinstance(frame, dict) and frame.get("type") == "hello" and state.hello is None:
            state.hello = frame
            state.contract = contract_for(orjson.dumps(frame))
        problems = state.contract.problems(frame, SERVER_SCHEMAS)
        self._count("received")
        self._count(f"received {frame.get('type') if isinstance(frame, dict) else '?'}")
        if problems:
            self._problem(f"server frame {text[:300]} breaks the schema: {'; '.join(problems)}")
            return
        self._settle(state, frame)

    def _settle(self, state: _ConnectionState, frame: dict[str, Any]) -> None:
        """Match a terminal frame with the fill_mask it answers and check that the schema agreed."""
        if frame["type"] not in TERMINAL_TYPES or frame.get("id") is None:
            return
        queue = state.awaiting.get(orjson.dumps(frame["id"]))
        if not queue:
            return
        # A duplicate_id answers the frame just rejected (the newest); any other terminal frame answers
        # the oldest, the request in flight (a duplicate is answered before its original can be).
        duplicate = frame["type"] == "error" and frame["code"] == "duplicate_id"
        expectation = queue.pop() if duplicate else queue.popleft()
        if duplicate:
            return
        if not expectation.valid and frame["type"] != "error":
            self._problem(f"the schema refuses {expectation.frame} ({'; '.join(expectation.problems)}), "
                          f"but the server answered it {frame['type']}")
        elif expectation.valid and expectation.bound and frame["type"] == "error" and frame["code"] in FORM_CODES:
            self._problem(f"the schema accepts {expectation.frame}, but the server refused it: "
                          f"{frame['code']}: {frame['message']}")
        else:
            self._count("answers_checked")
