"""The machine-readable contract (issue 12 item 1): protocol/asyncapi.yaml and protocol/schemas.

- The AsyncAPI document passes the official parser (npm ``@asyncapi/parser``), which resolves and
  checks the JSON Schemas it references; a broken copy does not.
- The JSON Schemas are valid draft 2020-12, and their examples (AsyncAPI's and protocol.md's) fit them.
- The schemas and the server's own frame parser agree on client frames (a table of edge cases and a
  property test), and every server frame type, produced by a real server, fits its closed schema
  (via the wire monitor of tests/conftest.py, which checks every frame of the whole suite).
- The monitor's compiled first look (tests/contract.py) gives the Python validator's verdict: where
  the two validators differ, on what the compiled one cannot take, and on random client and server
  frames.
- protocol.md §14's statements for client writers: frame size bounds, integers as written, characters
  as code points, keepalive timings, no compression, no subprotocol.
- A JavaScript client written from the AsyncAPI document alone (examples/js-client) completes hello, a
  request, a cancel and an overload against a real server.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from websockets.asyncio.client import connect

from fillmask_client import FillMaskClient, SyncFillMaskClient
from fillmask_server.config import Config
from fillmask_server.protocol import (
    ERROR_CODES,
    OVERLOADED_REASONS,
    Limits,
    ProtocolError,
    encode_error,
    encode_hello,
    encode_overloaded,
    encode_result,
    encode_stats,
    parse_frame,
    targets_field,
)
from fillmask_server.server import FillMaskServer
from fillmask_server.stats import MAX_BATCHES_PER_FRAME
from tests.contract import (
    CLIENT_SCHEMAS,
    FORM_CODES,
    SCHEMA_DIR,
    SERVER_SCHEMAS,
    Contract,
    WireMonitor,
    bind,
    raw_schemas,
)
from tests.wire import recv, send, session, wait_until

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL_DIR = ROOT / "protocol"
JS_CLIENT = ROOT / "examples" / "js-client"
TEXT = "Paris is the [MASK] of France."
ENVELOPE_MAX = 1024  # protocol.md §14: a result frame is at most max_result_bytes plus this
OTHER_FRAMES_MAX = 16 * 1024  # protocol.md §14: every frame but a result is under this
MAX_SAFE = 2**53 - 1


def _node_or_skip(needs: Path) -> str:
    """The node binary, when it and the packages under ``needs`` are installed (skip, or fail in CI)."""
    node = shutil.which("node")
    problem = ("Node.js is not installed" if node is None else
               f"{needs.relative_to(ROOT)} is not installed" if not needs.is_dir() else None)
    if problem:
        message = f"{problem}; run `bash scripts/setup.sh --test` (needs Node.js 20 or later)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert node is not None
    return node


def parse_asyncapi(document: Path) -> dict[str, Any]:
    node = _node_or_skip(PROTOCOL_DIR / "node_modules" / "@asyncapi" / "parser")
    run = subprocess.run([node, str(PROTOCOL_DIR / "validate.mjs"), str(document)], capture_output=True,
                         text=True, timeout=60, cwd=PROTOCOL_DIR)
    assert run.stdout, run.stderr
    return json.loads(run.stdout)


def default_hello(**limits: Any) -> dict[str, Any]:
    """The hello a server with default settings (and ``limits``' Limits fields) sends for a model of
    BERT's 512 positions, from its encoder and ``Config``'s defaults."""
    config = Config()
    return orjson.loads(encode_hello("fillmask-server/0.1.0", "tiny", True, Limits("[MASK]", **limits), {
        "max_batch_size": config.max_batch_size, "max_batch_tokens": config.max_batch_tokens,
        "max_queue": config.max_queue, "max_tokens": 512, "max_frame_bytes": config.max_frame_bytes,
        "max_result_bytes": config.max_result_bytes,
        "max_inflight_per_connection": config.max_inflight_per_connection},
        {"forward": "traced", "head": "masks", "layout": "packed", "device": "cpu", "dtype": "float32"}))


_CONTRACT = Contract(default_hello())  # one for the tests that only read it (building one takes a while)


# --- the documents themselves ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def asyncapi() -> dict[str, Any]:
    return parse_asyncapi(PROTOCOL_DIR / "asyncapi.yaml")


def test_the_asyncapi_parser_accepts_the_document(asyncapi: dict[str, Any]) -> None:
    assert asyncapi["valid"], asyncapi["diagnostics"]
    # Only advice is allowed: the document says 3.0.0, the most widely supported version of AsyncAPI 3.
    assert [d for d in asyncapi["diagnostics"] if d["code"] != "asyncapi-latest-version"] == []
    # The parser resolved every payload to its JSON Schema file (the required fields come from there).
    schemas = raw_schemas()
    assert {name: message["required"] for name, message in asyncapi["messages"].items()} == {
        kind: schemas[file]["required"] for kind, file in {**CLIENT_SCHEMAS, **SERVER_SCHEMAS}.items()}
    operations = asyncapi["operations"]
    received = {m for op in operations.values() if op["action"] == "receive" for m in op["messages"]}
    sent = {m for op in operations.values() if op["action"] == "send" for m in op["messages"]}
    assert received == set(CLIENT_SCHEMAS) and sent == set(SERVER_SCHEMAS)
    assert set(operations["receiveFillMask"]["reply"]) == {"result", "error", "overloaded", "cancelled"}


def test_the_asyncapi_parser_refuses_a_broken_schema(tmp_path: Path) -> None:
    """The check above can fail: a type misspelt in one referenced schema file is an error."""
    copy = tmp_path / "protocol"
    shutil.copytree(PROTOCOL_DIR, copy, ignore=shutil.ignore_patterns("node_modules"))
    broken = copy / "schemas" / "overloaded.json"
    broken.write_text(broken.read_text().replace('"type": "integer", "minimum": 0}', '"type": "intger", "minimum": 0}'))
    report = parse_asyncapi(copy / "asyncapi.yaml")
    assert not report["valid"]
    assert any("retry_after_ms" in d["path"] and d["severity"] == "error" for d in report["diagnostics"])


def test_the_schemas_are_draft_2020_12_and_open_to_new_fields() -> None:
    hello = default_hello()
    for name, schema in raw_schemas().items():
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
        Draft202012Validator.check_schema(schema)
        for node in _nodes(schema):
            # §1: fields not named are ignored, so later versions can add some; every object says so.
            if node.get("type") == "object":
                assert node.get("additionalProperties") is True, (name, node.get("title", node.get("description")))
            for keyword, path in node.get("x-limit", {}).items():
                assert keyword in {"maxLength", "maxItems", "minimum", "maximum"}, (name, keyword)
                assert path.split(".")[0] in hello and _lookup(hello, path) is not None, (name, path)
    assert set(raw_schemas()) == {*CLIENT_SCHEMAS.values(), *SERVER_SCHEMAS.values(), "defs.json", "limits.json",
                                  "client_frame.json", "server_frame.json"}


def test_the_schemas_name_every_code_and_reason_the_server_has() -> None:
    defs = raw_schemas()["defs.json"]["$defs"]
    upcoming = {"result_too_large"}  # issue 10: comes with hello.limits.max_result_bytes
    assert set(_known(defs["error_code"])) == ERROR_CODES | upcoming
    overloaded = raw_schemas()["overloaded.json"]
    pairs = {(branch["properties"]["status"]["const"], reason) for branch in _this_versions(overloaded["oneOf"])
             for reason in branch["properties"]["reason"].get("enum", [branch["properties"]["reason"].get("const")])}
    assert pairs == {(status, reason) for reason, status in OVERLOADED_REASONS.items()} | {(429, "queue_share")}
    assert {reason for _, reason in pairs} == set(_known(overloaded["properties"]["reason"]))
    (later,) = [branch for branch in overloaded["oneOf"] if branch.get("x-later") is True]  # (a review)
    assert set(later["properties"]["reason"]["not"]["enum"]) == set(_known(overloaded["properties"]["reason"]))
    assert _known(raw_schemas()["going_away.json"]["properties"]["reason"]) == ["shutting_down"]


def _this_versions(branches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An ``anyOf``/``oneOf``'s branches less the one for what a later version may add (``x-later``)."""
    return [branch for branch in branches if branch.get("x-later") is not True]


def _known(schema: dict[str, Any]) -> list[Any]:
    """The values this version sends of an open list: the ``enum`` beside its ``x-later`` branch."""
    (known,) = _this_versions(schema["anyOf"])
    return list(known["enum"])


#: Frames a later version of the server may send (protocol.md §14 says what a client does with each),
#: each beside the same frame as this version sends it.
LATER_FRAMES = [
    ({"type": "error", "id": 7, "code": "quota_exceeded", "message": "Too many requests today."},
     {"type": "error", "id": 7, "code": "internal_error", "message": "The model failed."}),
    ({"type": "overloaded", "id": 7, "status": 503, "reason": "maintenance", "retry_after_ms": 1000},
     {"type": "overloaded", "id": 7, "status": 503, "reason": "queue_full", "retry_after_ms": 1000}),
    ({"type": "going_away", "reason": "rebalancing", "reconnect_within_ms": 1000},
     {"type": "going_away", "reason": "shutting_down", "reconnect_within_ms": 1000}),
    ({"type": "progress", "id": 7}, {"type": "cancelled", "id": 7}),
]


def test_what_a_later_version_may_send_passes_the_schemas_but_not_the_servers_closed_contract() -> None:
    """A docs review: protocol.md §14 tells clients to take an unknown error code as the request's
    failure, an unknown overloaded reason like queue_full, an unknown going_away reason like
    shutting_down and to ignore an unknown frame type, while the schemas (which §14 offers client
    writers to validate with) refused each: a validating client would have failed on a later server.
    Each now has an ``x-later`` branch; the suite's own contract drops those, so our server still
    sends only the values listed."""
    from referencing import Registry, Resource

    registry = Registry().with_resources((name, Resource.from_contents(s)) for name, s in raw_schemas().items())
    any_frame = Draft202012Validator({"$ref": "server_frame.json"}, registry=registry)
    closed = Contract(default_hello())
    for later, known in LATER_FRAMES:
        assert any_frame.is_valid(later), later
        assert closed.problems(later, SERVER_SCHEMAS) != [], later
        assert any_frame.is_valid(known) and closed.problems(known, SERVER_SCHEMAS) == [], known
    # The union of server frames, closed as the contract closes it, refuses a type it does not list
    # (``Contract.problems`` refuses one before any schema: a review).
    from referencing.jsonschema import DRAFT202012

    bound = Registry().with_resources((name, DRAFT202012.create_resource(bind(schema, None, closed=True)))
                                      for name, schema in raw_schemas().items())
    closed_union = Draft202012Validator({"$ref": "server_frame.json"}, registry=bound)
    assert not closed_union.is_valid({"type": "progress", "id": 7}) and closed_union.is_valid(
        {"type": "cancelled", "id": 7})
    # Every x-later mark is a branch of an anyOf or oneOf, the only place the closed contract drops it.
    branches = {id(branch) for schema in raw_schemas().values() for node in _nodes(schema)
                for keyword in ("anyOf", "oneOf") for branch in node.get(keyword, [])}
    marked = [node for schema in raw_schemas().values() for node in _nodes(schema) if "x-later" in node]
    assert len(marked) == 5 and all(node["x-later"] is True and id(node) in branches for node in marked)


def test_the_examples_fit_the_schemas(asyncapi: dict[str, Any]) -> None:
    """AsyncAPI's examples and every frame in protocol.md's JSON examples, against the closed schemas."""
    defaults = default_hello()
    contract = Contract(defaults)
    examples = [(name, example) for name, message in asyncapi["messages"].items() for example in message["examples"]]
    assert {name for name, _ in examples} == set(CLIENT_SCHEMAS) | set(SERVER_SCHEMAS)
    spec = (ROOT / "protocol.md").read_text()
    for block in re.findall(r"```json\n(.*?)```", spec, re.S):
        frames = [orjson.loads(block)] if block.lstrip().startswith("{") and block.count('"type"') == 1 else [
            orjson.loads(line) for line in block.strip().splitlines()]
        examples += [("protocol.md", frame) for frame in frames]
    assert sum(1 for name, _ in examples if name == "protocol.md") >= 9
    for name, frame in examples:
        kinds = CLIENT_SCHEMAS if frame["type"] in CLIENT_SCHEMAS else SERVER_SCHEMAS
        assert contract.problems(frame, kinds) == [], (name, frame)
    # The hellos shown are a default server's (for BERT): they said max_batch_size 32 for five days
    # after the default became 64 (a reader's trial).
    hellos = [(name, frame) for name, frame in examples if frame["type"] == "hello"]
    assert {name for name, _ in hellos} == {"protocol.md", "hello"}, hellos
    for name, frame in hellos:
        assert frame["limits"] == defaults["limits"], (name, frame["limits"])


def test_the_frame_unions_dispatch_on_type() -> None:
    """client_frame.json and server_frame.json hold each type's schema exactly once."""
    from referencing import Registry, Resource

    registry = Registry().with_resources((name, Resource.from_contents(s)) for name, s in raw_schemas().items())
    server = Draft202012Validator({"$ref": "server_frame.json"}, registry=registry)
    client = Draft202012Validator({"$ref": "client_frame.json"}, registry=registry)
    assert server.is_valid({"type": "cancelled", "id": 7}) and not server.is_valid({"type": "cancelled"})
    assert client.is_valid({"type": "cancel", "id": 7}) and not client.is_valid({"type": "cancelled", "id": 7})
    assert not server.is_valid({"type": "stats"})
    # A type the server does not send today is one a later version may add (ignored, §14): the union
    # takes it, and only in its own branch (not, say, as "cancel" misread as "cancelled").
    later = next(branch for branch in raw_schemas()["server_frame.json"]["oneOf"] if branch.get("x-later"))
    assert server.is_valid({"type": "cancel", "id": 7})
    assert set(later["properties"]["type"]["not"]["enum"]) == set(SERVER_SCHEMAS)


# --- the schemas agree with the server's parser ------------------------------------------------------


# What JSON Schema cannot express (fill_mask.json says so): how many times the text holds the mask token.
BEYOND_THE_SCHEMA = {"no_mask", "too_many_masks"}


def _agree(raw: str, limits: Limits | None = None) -> tuple[bool, bool, Any]:
    """(schema accepts, server's parser accepts its form, the parser's answer) for one client frame's JSON
    text; a refusal for what no schema can check (``BEYOND_THE_SCHEMA``) says nothing either way."""
    limits = limits or Limits("[MASK]")
    frame = json.loads(raw)  # (not orjson: a valid JSON 1e400 or lone surrogate is read, as the server reads it)
    schema_ok = _CONTRACT.problems(frame, CLIENT_SCHEMAS) == []
    parsed = parse_frame(raw, limits)
    if isinstance(parsed, ProtocolError) and parsed.code in BEYOND_THE_SCHEMA:
        return schema_ok, schema_ok, parsed  # nothing for the schema to agree or disagree with
    return schema_ok, not isinstance(parsed, ProtocolError), parsed


EDGE_CASES = [
    # ids: a string of 1..128 code points, or an integer |n| <= 2^53-1 written as digits (§3, §14)
    '{"type":"fill_mask","id":7,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":-9007199254740991,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":9007199254740992,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":7.0,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":1e1,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":-0,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":18446744073709551616,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":true,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":null,"text":"a [MASK]"}',
    '{"type":"fill_mask","id":"","text":"a [MASK]"}',
    '{"type":"fill_mask","id":"' + "x" * 128 + '","text":"a [MASK]"}',
    '{"type":"fill_mask","id":"' + "x" * 129 + '","text":"a [MASK]"}',
    '{"type":"fill_mask","id":"' + "🗼" * 128 + '","text":"a [MASK]"}',  # 128 code points, 256 UTF-16 units
    '{"type":"fill_mask","id":"' + "🗼" * 129 + '","text":"a [MASK]"}',
    '{"type":"fill_mask","id":[7],"text":"a [MASK]"}',
    '{"type":"fill_mask","text":"a [MASK]"}',
    # text: 1..max_text_chars code points
    '{"type":"fill_mask","id":1}',
    '{"type":"fill_mask","id":1,"text":7}',
    '{"type":"fill_mask","id":1,"text":null}',
    '{"type":"fill_mask","id":1,"text":"' + "🗼" * 1994 + '[MASK]"}',
    '{"type":"fill_mask","id":1,"text":"' + "🗼" * 1995 + '[MASK]"}',
    # top_k: an integer in range, written as digits; null is the same as absent
    *(f'{{"type":"fill_mask","id":1,"text":"a [MASK]","top_k":{v}}}'
      for v in ("0", "1", "100", "101", "5.0", "1e1", '"5"', "true", "null", "-1", "[5]")),
    # targets: a non-blank string, or a list of 1..100 of them, each at most 100 characters
    *(f'{{"type":"fill_mask","id":1,"text":"a [MASK]","targets":{v}}}'
      for v in ('"paris"', '""', '" "', '"\\u001c"', '"\\u00a0"', "[]", '["a"]', '["a",7]', "null", "7",
                json.dumps(["a"] * 100), json.dumps(["a"] * 101), json.dumps(["a" * 100]), json.dumps(["a" * 101]),
                json.dumps(["🗼" * 100]), '{"a":1}')),
    # deadline_ms: a number in (0, 600000]
    *(f'{{"type":"fill_mask","id":1,"text":"a [MASK]","deadline_ms":{v}}}'
      for v in ("0", "-1", "0.001", "600000", "600000.5", "1e3", '"5"', "true", "null", "1e400")),
    # cancel
    '{"type":"cancel","id":3}', '{"type":"cancel","id":3.0}', '{"type":"cancel"}', '{"type":"cancel","id":""}',
    # live figures: interval_ms an integer in [250, 10000]; null is the same as absent
    *(f'{{"type":"subscribe_stats","interval_ms":{v}}}'
      for v in ("250", "249", "10000", "10001", "1000.0", "null", '"1000"', "true")),
    '{"type":"subscribe_stats"}', '{"type":"unsubscribe_stats"}', '{"type":"unsubscribe_stats","interval_ms":"x"}',
    # fields not named are ignored
    '{"type":"fill_mask","id":1,"text":"a [MASK]","future":{"x":[1,2]}}',
]


@pytest.mark.parametrize("raw", EDGE_CASES, ids=lambda raw: raw[:70])
def test_schema_and_server_agree_on_a_client_frame(raw: str) -> None:
    schema_ok, server_ok, parsed = _agree(raw)
    assert schema_ok == server_ok, parsed


_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.sampled_from([MAX_SAFE, -MAX_SAFE, MAX_SAFE + 1, 0, 1, 250, 10_000]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([7.0, 1e1, 0.5, 600000.0]),
    st.booleans(), st.none(), st.text(max_size=5), st.sampled_from(["", " ", "x" * 128, "x" * 129]),
    st.lists(st.sampled_from(["a", "", " ", 1, "b" * 101]), max_size=3),
    st.dictionaries(st.text(max_size=2), st.none()),
)
_TEXTS = st.one_of(st.builds(lambda a, b: f"{a}[MASK]{b}", st.text(max_size=20), st.text(max_size=20)).filter(
    lambda t: t.count("[MASK]") == 1), _VALUES)
_CLIENT_KINDS = st.sampled_from([*CLIENT_SCHEMAS, "fill_mask", "fill_mask"])
_CLIENT_FIELDS = st.fixed_dictionaries({}, optional={"id": _VALUES, "text": _TEXTS, "top_k": _VALUES,
                                                     "targets": _VALUES, "deadline_ms": _VALUES,
                                                     "interval_ms": _VALUES})


@settings(max_examples=400, deadline=None)
@given(kind=_CLIENT_KINDS, fields=_CLIENT_FIELDS)
def test_schema_and_server_agree_on_random_client_frames(kind: str, fields: dict[str, Any]) -> None:
    raw = orjson.dumps({"type": kind, **fields}).decode()
    schema_ok, server_ok, parsed = _agree(raw)
    assert schema_ok == server_ok, (raw, parsed)


# --- the wire monitor's compiled first look agrees with the Python validator ----------------------------

_RESULT = {"type": "result", "id": "r-1", "queue_ms": 1.25, "inference_ms": 2.5, "batch_size": 3, "batch_tokens": 30,
           "batch_id": 7, "predictions": [{"score": 0.25, "token": 5, "token_str": "x", "sequence": "a x"}]}
_ERROR = {"type": "error", "id": "r-1", "code": "invalid_field", "message": "text must be a string"}
# Where the two validators differ: a zero-fraction float as an integer (the compiled one accepts it). (A
# blank target was one too while defs.json said \\s, which ECMAScript reads otherwise; it lists them now.)
_WHERE_THEY_DIFFER = [
    ({"type": "fill_mask", "id": 1, "text": "a [MASK]", "top_k": 5.0}, CLIENT_SCHEMAS),
    ({**_RESULT, "batch_size": 3.0}, SERVER_SCHEMAS),
]


def _same_verdict(frame: dict[str, Any], kinds: dict[str, str]) -> None:
    assert (_CONTRACT.problems(frame, kinds) == []) == (_CONTRACT.python_problems(frame, kinds) == []), frame


def test_a_blank_target_is_the_same_to_the_schema_in_python_and_in_javascript_as_to_the_server() -> None:
    """A spec trial's JavaScript client (ajv): defs.json's ``"pattern": "\\S"`` let U+001C..U+001F and
    U+0085 pass as non-blank, which the server refuses, and refused U+FEFF, which it takes, because
    ECMAScript's ``\\s`` is not Python's. The pattern now lists the server's whitespace
    (``str.isspace``), and both dialects read it alike over every code point."""
    pattern = orjson.loads((SCHEMA_DIR / "defs.json").read_bytes())["$defs"]["target"]["pattern"]
    blank = [c for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert [c for c in range(sys.maxunicode + 1) if not re.search(pattern, chr(c))] == blank
    script = ("const p = new RegExp(process.argv[1], 'u'); const out = [];"
              "for (let c = 0; c <= 0x10ffff; c++) { if (c >= 0xd800 && c <= 0xdfff) continue;"
              " if (!p.test(String.fromCodePoint(c))) out.push(c); } console.log(JSON.stringify(out));")
    ran = subprocess.run([_node_or_skip(ROOT), "-e", script, pattern], capture_output=True, text=True, timeout=60,
                         check=True)
    assert orjson.loads(ran.stdout) == blank


#: §14's recipe for loading the schemas with ajv, as a client writer would follow it.
AJV_RECIPE = """
const fs = require('fs'), path = require('path');
const Ajv2020 = require('ajv/dist/2020').default;
const [dir, frames] = [process.argv[1], JSON.parse(process.argv[2])];
const ajv = new Ajv2020();  // strict, ajv's default
ajv.addKeyword('x-limit'); ajv.addKeyword('x-later');
for (const name of fs.readdirSync(dir).filter((n) => n.endsWith('.json')))
  ajv.addSchema(JSON.parse(fs.readFileSync(path.join(dir, name), 'utf8')), name);
console.log(JSON.stringify(frames.map(([schema, frame]) => ajv.getSchema(schema)(frame))));
"""


def test_the_schemas_load_in_ajv_as_section_14_says() -> None:
    """A spec trial's JavaScript client: ajv's defaults refused the schemas (an unknown keyword,
    ``x-limit``), and one compiled alone could not resolve ``defs.json``; §14 said nothing of either.
    It now gives the recipe, which this runs with the ajv that the contract's Node packages bring."""
    modules = ROOT / "protocol" / "node_modules"
    node = _node_or_skip(modules / "ajv")
    frames = [("server_frame.json", _RESULT), ("server_frame.json", {**_ERROR, "code": "a_later_code"}),
              ("client_frame.json", {"type": "fill_mask", "id": 1, "text": "a [MASK]", "targets": ["cat"]}),
              ("client_frame.json", {"type": "fill_mask", "id": 1, "text": "a [MASK]", "targets": ["\x1c"]}),
              ("server_frame.json", {**_RESULT, "batch_size": "3"})]
    ran = subprocess.run([node, "-e", AJV_RECIPE, str(SCHEMA_DIR), json.dumps(frames)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "NODE_PATH": str(modules)})
    assert ran.returncode == 0, ran.stderr
    assert orjson.loads(ran.stdout) == [True, True, True, False, False]
    assert "ajv.addKeyword(\"x-limit\")" in (ROOT / "protocol.md").read_text()


@pytest.mark.parametrize(("frame", "kinds"), _WHERE_THEY_DIFFER, ids=lambda v: str(v)[:60])
def test_the_compiled_first_look_is_not_trusted_where_the_two_validators_differ(
        frame: dict[str, Any], kinds: dict[str, str]) -> None:
    python_says = _CONTRACT.python_problems(frame, kinds) == []
    assert _CONTRACT._fast[frame["type"]].is_valid(frame) != python_says  # the difference is real...
    assert (_CONTRACT.problems(frame, kinds) == []) == python_says  # ...and the monitor goes by the Python one


@pytest.mark.parametrize("message", ["one line\n", "two\nlines", "a\rb", "\n"])
def test_an_error_message_of_more_than_one_line_breaks_the_schema_for_both_validators(message: str) -> None:
    """error.json says "no CR or LF" without ``$``, which Python's re also matches before a final newline."""
    frame = {**_ERROR, "message": message}
    assert _CONTRACT.python_problems(frame, SERVER_SCHEMAS) != []
    assert not _CONTRACT._fast["error"].is_valid(frame)


def test_a_plain_valid_frame_is_settled_by_the_compiled_validator_alone() -> None:
    contract = Contract(default_hello())
    for frame, kinds in [(_RESULT, SERVER_SCHEMAS), (_ERROR, SERVER_SCHEMAS),
                         ({"type": "fill_mask", "id": "a", "text": "a [MASK]", "top_k": 3}, CLIENT_SCHEMAS)]:
        assert contract.python_problems(frame, kinds) == []
        before = contract.fast_accepted
        assert contract.problems(frame, kinds) == []
        assert contract.fast_accepted == before + 1


_DEEP: Any = 1
for _ in range(40):
    _DEEP = [_DEEP]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2**70, _DEEP],
                         ids=["inf", "-inf", "nan", "2^70", "deep"])
def test_what_the_compiled_validator_cannot_take_goes_to_the_python_one(value: Any) -> None:
    """Values JSON cannot carry to it, or nested deeper than the plain check looks: never an exception,
    and the Python validator's verdict."""
    for frame, kinds in [({**_RESULT, "queue_ms": value}, SERVER_SCHEMAS),
                         ({"type": "fill_mask", "id": 1, "text": "a [MASK]", "extra": value}, CLIENT_SCHEMAS)]:
        before = _CONTRACT.fast_accepted
        assert _CONTRACT.problems(frame, kinds) == _CONTRACT.python_problems(frame, kinds)
        assert _CONTRACT.fast_accepted == before


@settings(max_examples=300, deadline=None)
@given(kind=_CLIENT_KINDS, fields=_CLIENT_FIELDS)
def test_both_validators_agree_on_random_client_frames(kind: str, fields: dict[str, Any]) -> None:
    _same_verdict({"type": kind, **fields}, CLIENT_SCHEMAS)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from([_RESULT, _ERROR]),
       changes=st.dictionaries(st.sampled_from(["id", "queue_ms", "batch_size", "batch_id", "message", "code",
                                                "predictions", "extra"]),
                               st.one_of(_VALUES, st.text(max_size=8), st.lists(st.fixed_dictionaries(
                                   {"score": _VALUES, "token": _VALUES, "token_str": _VALUES, "sequence": _VALUES}),
                                   max_size=2)), max_size=3))
def test_both_validators_agree_on_random_server_frames(base: dict[str, Any], changes: dict[str, Any]) -> None:
    _same_verdict({**base, **changes}, SERVER_SCHEMAS)


# --- frames produced by a real server -----------------------------------------------------------------


def _counts(monitor: WireMonitor) -> dict[str, int]:
    return dict(monitor.counts)


async def test_every_server_frame_type_is_checked_against_its_closed_schema(
        server: FillMaskServer, make_server: Any, wire_contract: WireMonitor) -> None:
    """Each of the 7 server frame types comes from a real server through the wire monitor, which fails the
    test on any frame that breaks its schema (or has a field the schema does not list)."""
    before = _counts(wire_contract)
    async with session(server.url) as (ws, _):
        await send(ws, {"type": "fill_mask", "id": "one", "text": TEXT, "top_k": 100})
        await send(ws, {"type": "fill_mask", "id": 2, "text": "[MASK] " * 8, "top_k": 100, "targets": ["a", "the"]})
        await send(ws, {"type": "fill_mask", "id": 3, "text": "no mask"})
        await ws.send("[1]")  # garbage, answered with id null
        await send(ws, {"type": "subscribe_stats", "interval_ms": 250})
        frames: list[dict[str, Any]] = []
        while len([f for f in frames if f["type"] != "stats"]) < 4 or frames[-1]["type"] != "stats":
            frames.append(await recv(ws))
        assert {f["type"] for f in frames} == {"result", "error", "stats"}
        await send(ws, {"type": "unsubscribe_stats"})
    async with make_server(max_queue=1) as srv, session(srv.url) as (ws, _):
        with srv.engine.paused():
            await send(ws, {"type": "fill_mask", "id": 1, "text": TEXT})
            await send(ws, {"type": "fill_mask", "id": 2, "text": TEXT})
            assert (await recv(ws))["reason"] == "queue_full"
            await send(ws, {"type": "cancel", "id": 1})
            assert (await recv(ws))["type"] == "cancelled"
            await send(ws, {"type": "fill_mask", "id": 3, "text": TEXT, "deadline_ms": 1})
            assert (await recv(ws))["reason"] == "deadline_exceeded"
        reader = asyncio.create_task(_read_all(ws))
        await srv.drain(timeout=2.0)  # going_away, then close 1001 (the fixture's drain finds nothing left)
        assert [f["type"] for f in await reader] == ["going_away"]
    after = _counts(wire_contract)
    for kind in SERVER_SCHEMAS:
        assert after.get(f"received {kind}", 0) > before.get(f"received {kind}", 0), kind


async def _read_all(ws: Any) -> list[dict[str, Any]]:
    return [orjson.loads(message) async for message in ws]


async def test_the_monitor_sees_the_tests_and_the_client_library(server: FillMaskServer,
                                                                 wire_contract: WireMonitor) -> None:
    """Frames of wire.py's helpers, of the async client library and of the sync client's own thread all
    pass through the monitor (tests/conftest.py), and requests' answers are matched with the schema."""
    before = _counts(wire_contract)
    async with session(server.url) as (ws, _):
        await send(ws, {"type": "fill_mask", "id": 1, "text": TEXT})
        assert (await recv(ws))["type"] == "result"
    async with FillMaskClient(server.url) as client:
        await client.fill_mask(TEXT)
    sync = await asyncio.to_thread(SyncFillMaskClient, server.url)
    try:
        await asyncio.to_thread(sync.fill_mask, TEXT)
    finally:
        await asyncio.to_thread(sync.close)
    after = _counts(wire_contract)
    assert after["received hello"] - before.get("received hello", 0) == 3
    assert after["received result"] - before.get("received result", 0) == 3
    assert after["sent_valid"] - before.get("sent_valid", 0) == 3
    assert after["answers_checked"] - before.get("answers_checked", 0) == 3


class _Socket:
    """Stands in for a client connection in the monitor's unit tests (it only keeps state on it)."""


def _monitor_after(*events: tuple[str, Any]) -> list[str]:
    monitor, ws = WireMonitor(), _Socket()
    monitor.received(ws, orjson.dumps(default_hello()).decode())
    for direction, frame in events:
        text = frame if isinstance(frame, str) else orjson.dumps(frame).decode()
        if direction == "sent":
            monitor.sent(ws, text, None)
        else:
            monitor.received(ws, text)
    return monitor.take_problems()


RESULT = {"type": "result", "id": 1, "predictions": [{"score": 0.5, "token": 3, "token_str": "a", "sequence": "b"}],
          "queue_ms": 0.1, "inference_ms": 1.0, "batch_size": 1, "batch_tokens": 5, "batch_id": 9}


def test_the_monitor_fails_on_drift() -> None:
    """The monitor's checks can fail: each of these is a problem it reports."""
    assert _monitor_after(("received", RESULT)) == []
    assert _monitor_after(("received", {**RESULT, "extra": 1}))  # a field the schema does not list
    assert _monitor_after(("received", {k: v for k, v in RESULT.items() if k != "batch_id"}))
    assert _monitor_after(("received", '{"type":"cancelled","id":7.0}'))  # an integer written as a float
    assert _monitor_after(("received", {**RESULT, "predictions": [[RESULT["predictions"][0]]]}))  # one list of one
    assert _monitor_after(("received", {"type": "error", "id": None, "code": "nope", "message": "x"}))
    assert _monitor_after(("received", {"type": "error", "id": None, "code": "invalid_json", "message": "a\nb"}))
    assert _monitor_after(("received", {"type": "overloaded", "id": 1, "status": 504, "reason": "queue_full",
                                        "retry_after_ms": 5}))
    assert _monitor_after(("received", {"type": "surprise"}))
    # The schema refuses a frame that the server accepted, or accepts one the server refused for its form.
    assert _monitor_after(("sent", {"type": "fill_mask", "id": 1, "text": "a [MASK]", "top_k": 0}),
                          ("received", RESULT))
    assert _monitor_after(("sent", {"type": "fill_mask", "id": 1, "text": "a [MASK]", "top_k": 5}),
                          ("received", {"type": "error", "id": 1, "code": "invalid_top_k", "message": "x"}))
    # ... but not when they agree, nor for a duplicate rejected while its original is in flight.
    assert _monitor_after(("sent", {"type": "fill_mask", "id": 1, "text": "a [MASK]"}),
                          ("sent", {"type": "fill_mask", "id": 1, "text": "a [MASK]", "top_k": 0}),
                          ("received", {"type": "error", "id": 1, "code": "duplicate_id", "message": "x"}),
                          ("received", RESULT)) == []
    monitor, ws = WireMonitor(), _Socket()
    monitor.received(ws, orjson.dumps(RESULT).decode())
    assert any("not hello" in problem for problem in monitor.take_problems())


# --- protocol.md §14 --------------------------------------------------------------------------------


def test_a_result_envelope_is_at_most_1024_bytes() -> None:
    """§14: a result frame is its predictions plus at most 1,024 bytes: the worst id (128 characters
    that JSON escapes to 6 bytes each), the longest numbers orjson writes."""
    predictions = b'[{"score":0.5,"token":1,"token_str":"a","sequence":"a"}]'
    worst_id = "\x01" * 128
    frame = encode_result(worst_id, predictions, 1.2345678901234567e300, 1.2345678901234567e300,
                          2**64 - 1, 2**64 - 1, 2**64 - 1)
    assert len(frame) - len(predictions) <= ENVELOPE_MAX
    assert len(frame) - len(predictions) > ENVELOPE_MAX - 100  # the bound is tight, not a guess
    assert Contract(default_hello()).problems(orjson.loads(frame), SERVER_SCHEMAS) == []


def test_a_result_with_target_notes_keeps_the_same_envelope() -> None:
    """§14 with §4 ``targets``: the notes count against max_result_bytes with the predictions (intake.check
    adds ``len(targets_field(notes))`` to the bound), so the rest of the frame keeps its 1,024 bytes."""
    predictions = b'[{"score":0.5,"token":1,"token_str":"a","sequence":"a"}]'
    notes = [("\x01" * 100, "\x01" * 50)] * 100  # the most targets, the longest, each escaped to 6 bytes
    frame = encode_result("\x01" * 128, predictions, 1.2345678901234567e300, 1.2345678901234567e300,
                          2**64 - 1, 2**64 - 1, 2**64 - 1, notes)
    assert len(frame) - len(predictions) - len(targets_field(notes)) <= ENVELOPE_MAX
    assert Contract(default_hello()).problems(orjson.loads(frame), SERVER_SCHEMAS) == []


def test_every_other_frame_is_under_16_kib() -> None:
    worst_id = "\x01" * 128
    big, huge = 2**64 - 1, 1.2345678901234567e300
    batches = [{"batch_id": big, "size": big, "tokens": big, "inference_ms": huge}] * MAX_BATCHES_PER_FRAME
    frames = [
        encode_stats({"window_s": huge, "queue_depth": big, "in_flight": big, "connections": big,
                      "requests_per_s": huge, "latency_ms": {"p50": huge, "p99": huge},
                      "batch_size": {"mean": huge, "max": big}, "engine_busy": 1.0, "batches": batches}),
        encode_error(worst_id, "too_many_inflight", "\x01" * 300),  # messages stay under 300 characters
        encode_overloaded(worst_id, 504, "deadline_exceeded", big, huge),
        encode_hello("fillmask-server/0.1.0", "é" * 127, True, Limits("[MASK]" * 10, *([big] * 9)),
                     {name: big for name in ("max_batch_size", "max_batch_tokens", "max_queue", "max_tokens",
                                             "max_frame_bytes", "max_result_bytes",
                                             "max_inflight_per_connection")},
                     {"forward": "eager", "head": "full", "device": "cuda:0", "dtype": "bfloat16"}),
    ]
    assert max(map(len, frames)) < OTHER_FRAMES_MAX, [len(f) for f in frames]


INTEGERS_AS_FLOATS = [
    ('{"type":"fill_mask","id":7.0,"text":"a [MASK]"}', "invalid_id", None),
    ('{"type":"fill_mask","id":1e1,"text":"a [MASK]"}', "invalid_id", None),
    ('{"type":"fill_mask","id":7,"text":"a [MASK]","top_k":5.0}', "invalid_top_k", 7),
    ('{"type":"fill_mask","id":7,"text":"a [MASK]","top_k":1e1}', "invalid_top_k", 7),
    ('{"type":"subscribe_stats","interval_ms":1000.0}', "invalid_field", None),
    ('{"type":"fill_mask","id":9007199254740992,"text":"a [MASK]"}', "invalid_id", None),
]


async def test_integers_must_be_written_as_digits(server: FillMaskServer) -> None:
    """§14: 7.0 and 1e1 are floats to the server: refused for id, top_k and interval_ms."""
    async with session(server.url) as (ws, _):
        for raw, code, frame_id in INTEGERS_AS_FLOATS:
            await ws.send(raw)
            answer = await recv(ws)
            assert (answer["type"], answer["code"], answer["id"]) == ("error", code, frame_id), raw


async def test_characters_are_code_points(make_server: Any) -> None:
    """§14: max_text_chars counts Unicode code points: 4 emoji (8 UTF-16 units, 16 UTF-8 bytes) are 4."""
    async with make_server(max_text_chars=10) as srv, session(srv.url) as (ws, _):
        text = "🗼🗼🗼 [MASK]"  # 10 code points
        await send(ws, {"type": "fill_mask", "id": 1, "text": text})
        assert (await recv(ws))["type"] == "result"
        await send(ws, {"type": "fill_mask", "id": 2, "text": "🗼" + text})
        answer = await recv(ws)
        assert (answer["type"], answer["code"]) == ("error", "text_too_long")
        assert "11 characters" in answer["message"]


async def test_keepalive_compression_and_subprotocol_as_stated(server: FillMaskServer) -> None:
    """§14: pings every 20 s, 20 s for the pong, 10 s for the closing handshake; permessage-deflate is
    offered by this client and not accepted; a subprotocol asked for is not selected."""
    async with connect(server.url, subprotocols=["fillmask.v1"], compression="deflate") as ws:
        await recv(ws)
        assert ws.subprotocol is None
        assert "Sec-WebSocket-Extensions" not in ws.response.headers
        assert "Sec-WebSocket-Protocol" not in ws.response.headers
        await wait_until(lambda: len(server.connections) > 0)
        for conn in server.connections:
            assert (conn.ws.ping_interval, conn.ws.ping_timeout, conn.ws.close_timeout) == (20, 20, 10)


# --- the JavaScript client, written from the AsyncAPI document alone -----------------------------------


async def run_js_check(url: str, *steps: str) -> list[dict[str, Any]]:
    node = _node_or_skip(JS_CLIENT / "node_modules" / "ws")
    process = await asyncio.create_subprocess_exec(node, str(JS_CLIENT / "check.mjs"), url, *steps,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    lines = [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]
    assert process.returncode == 0, (lines, stderr.decode()[-2000:])
    assert [line["step"] for line in lines] == [*steps, "close"] and all(line["ok"] for line in lines), lines
    return lines


@pytest.mark.parametrize(("args", "problem"), [
    ((), "the first argument must be a ws:// or wss:// URL (got none)"),
    (("ws://127.0.0.1:9/",), "no step given"),  # it passed before, having checked nothing
    (("ws://127.0.0.1:9/", "hello", "helo"), "unknown step helo"),  # it was reported as the connect step
])
async def test_the_js_check_names_a_usage_mistake_before_connecting(args: tuple[str, ...], problem: str) -> None:
    node = _node_or_skip(JS_CLIENT / "node_modules" / "ws")
    process = await asyncio.create_subprocess_exec(node, str(JS_CLIENT / "check.mjs"), *args,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    lines = stderr.decode().splitlines()
    assert process.returncode == 2 and stdout == b"" and len(lines) == 1, (stdout, lines)
    assert lines[0].startswith(f"check.mjs: {problem}. Usage: node check.mjs ws://HOST:PORT/ STEP...")


Counts = dict[tuple[str, str], float]


def _answers(srv: FillMaskServer) -> Counts:
    return {(s.labels["outcome"], s.labels["code"]): s.value for metric in srv.metrics.requests.collect()
            for s in metric.samples if s.name.endswith("_total")}


def _increase(before: Counts, after: Counts) -> Counts:
    return {key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key, 0)}


async def test_js_client_hello_and_requests(server: FillMaskServer) -> None:
    """hello, then a one-mask and a two-mask request (predictions told apart by their first element)."""
    before = _answers(server)
    lines = await run_js_check(server.url, "hello", "request")
    assert lines[0]["mask_token"] == "[MASK]" and lines[0]["random_weights"] is True
    await wait_until(server.settled)
    assert _increase(before, _answers(server)) == {("result", ""): 3}


async def test_js_client_cancel_overload_and_deadline(make_server: Any) -> None:
    """With the model held and a queue of one: a cancel of a queued request, a 503 queue_full, a 504."""
    async with make_server(max_queue=1) as srv:
        before = _answers(srv)
        with srv.engine.paused():
            await run_js_check(srv.url, "hello", "cancel", "overload", "deadline")
        await wait_until(srv.settled)
        assert _increase(before, _answers(srv)) == {
            ("cancelled", ""): 2, ("overloaded", "queue_full"): 1, ("overloaded", "deadline_exceeded"): 1}


def _nodes(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        found.append(node)
        for value in node.values():
            found += _nodes(value)
    elif isinstance(node, list):
        for value in node:
            found += _nodes(value)
    return found


def _lookup(hello: dict[str, Any], path: str) -> Any:
    value: Any = hello
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def test_schema_dir_is_where_protocol_md_says() -> None:
    spec = (ROOT / "protocol.md").read_text()
    assert "protocol/asyncapi.yaml" in spec and "protocol/schemas/" in spec
    assert SCHEMA_DIR == PROTOCOL_DIR / "schemas"
    assert FORM_CODES <= ERROR_CODES
