"""Unit tests of the pure frame parser and encoders (protocol.md §3, §5, §7). No sockets, no torch."""

from __future__ import annotations

import dataclasses
import json
import sys

import orjson
import pytest

from fillmask_server.protocol import (
    MAX_CLOSE_REASON_BYTES,
    MAX_SAFE_INTEGER,
    CancelRequest,
    FillMaskRequest,
    Limits,
    ProtocolError,
    close_reason,
    encode_error,
    encode_hello,
    encode_overloaded,
    encode_result,
    parse_frame,
    targets_field,
)

LIMITS = Limits(mask_token="[MASK]", max_text_chars=50, max_masks=2, top_k_max=10, max_targets=3)


def parse(obj: object) -> object:
    return parse_frame(orjson.dumps(obj).decode(), LIMITS)


def test_valid_request_with_defaults() -> None:
    assert parse({"type": "fill_mask", "id": 7, "text": "a [MASK] b"}) == FillMaskRequest(7, "a [MASK] b", 5)


def test_valid_request_with_every_field() -> None:
    got = parse({"type": "fill_mask", "id": "x", "text": "[MASK]", "top_k": 10, "targets": ["a", "b"],
                 "deadline_ms": 2.5, "unknown_field": [1]})
    assert got == FillMaskRequest("x", "[MASK]", 10, ("a", "b"), 2.5)


def test_single_string_target_is_a_list_of_one() -> None:
    got = parse({"type": "fill_mask", "id": 1, "text": "[MASK]", "targets": "paris"})
    assert isinstance(got, FillMaskRequest) and got.targets == ("paris",)


@pytest.mark.parametrize("frame_id", [0, -1, MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, "a", "é" * 128])
def test_ids_accepted_with_their_type(frame_id: object) -> None:
    got = parse({"type": "fill_mask", "id": frame_id, "text": "[MASK]"})
    assert isinstance(got, FillMaskRequest) and got.id == frame_id and type(got.id) is type(frame_id)


@pytest.mark.parametrize("frame_id", [True, False, 1.0, 1.5, None, [], {}, "", "x" * 129, MAX_SAFE_INTEGER + 1])
def test_invalid_ids(frame_id: object) -> None:
    got = parse({"type": "fill_mask", "id": frame_id, "text": "[MASK]"})
    assert isinstance(got, ProtocolError) and got.code == "invalid_id" and got.id is None


def test_a_key_given_twice_takes_its_last_value_and_minus_zero_is_the_id_0() -> None:
    """§1 and §14, where JSON leaves the reader to choose (found by a conformance review)."""
    twice = '{"type": "fill_mask", "id": 14, "text": "a [MASK]", "type": "cancel"}'
    assert parse_frame(twice, LIMITS) == CancelRequest(14)
    got = parse_frame('{"type": "fill_mask", "id": -0, "text": "[MASK]"}', LIMITS)
    assert isinstance(got, FillMaskRequest) and got.id == 0 and type(got.id) is int
    assert orjson.loads(encode_error(got.id, "no_mask", "x"))["id"] == 0


def test_cancel() -> None:
    assert parse({"type": "cancel", "id": "r1"}) == CancelRequest("r1")
    missing = parse({"type": "cancel"})
    assert isinstance(missing, ProtocolError) and missing.code == "missing_field"
    bad = parse({"type": "cancel", "id": 2.5})
    assert isinstance(bad, ProtocolError) and bad.code == "invalid_id"


@pytest.mark.parametrize(
    ("frame", "code", "echoed"),
    [
        ({"type": "fill_mask", "text": "[MASK]"}, "missing_field", None),
        ({"id": 3, "text": "[MASK]"}, "missing_field", 3),
        ({"type": "fill_mask", "id": 3}, "missing_field", 3),
        ({"type": "fill_mask", "id": 3, "text": 5}, "invalid_field", 3),
        ({"type": "fill_mask", "id": 3, "text": ["[MASK]"]}, "invalid_field", 3),
        ({"type": "fill_mask", "id": 3, "text": "no mask here"}, "no_mask", 3),
        ({"type": "fill_mask", "id": 3, "text": ""}, "no_mask", 3),
        ({"type": "fill_mask", "id": 3, "text": "[mask] lower case"}, "no_mask", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK] [MASK] [MASK]"}, "too_many_masks", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]" + "x" * 50}, "text_too_long", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "top_k": 0}, "invalid_top_k", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "top_k": 11}, "invalid_top_k", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "top_k": 2.0}, "invalid_top_k", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "top_k": "5"}, "invalid_top_k", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "top_k": True}, "invalid_top_k", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": []}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": [1]}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": [""]}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": ["  "]}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": ["a"] * 4}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": {"a": 1}}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "targets": ["x" * 101]}, "invalid_targets", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "deadline_ms": 0}, "invalid_deadline", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "deadline_ms": -5}, "invalid_deadline", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "deadline_ms": "10"}, "invalid_deadline", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "deadline_ms": 600_001}, "invalid_deadline", 3),
        ({"type": "fill_mask", "id": 3, "text": "[MASK]", "deadline_ms": False}, "invalid_deadline", 3),
        ({"type": "predict", "id": 3}, "unknown_type", 3),
        ({"type": 5, "id": "q"}, "unknown_type", "q"),
        ({"type": None, "id": "q"}, "unknown_type", "q"),
        ({"type": "fill_mask", "id": 3, "text": None}, "invalid_field", 3),
        ({"type": "fill_mask", "id": True, "text": "[MASK]"}, "invalid_id", None),
    ],
)
def test_errors_name_the_problem_and_echo_valid_ids(frame: dict, code: str, echoed: object) -> None:
    got = parse(frame)
    assert isinstance(got, ProtocolError), got
    assert (got.code, got.id) == (code, echoed)
    assert got.message and "\n" not in got.message and "Traceback" not in got.message


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("not json", "invalid_json"),
        ("{\"type\": ", "invalid_json"),
        ("", "invalid_json"),
        ("[1, 2]", "not_an_object"),
        ("\"fill_mask\"", "not_an_object"),
        ("null", "not_an_object"),
        ("12", "not_an_object"),
        ("[" * 5000 + "]" * 5000, "invalid_json"),
        ("{\"type\":\"fill_mask\",\"id\":1,\"text\":\"\\ud800[MASK]\"}", None),
        (b"{\"type\": \"fill_mask\"}", "binary_frame"),
        (b"\xff\xfe", "binary_frame"),
    ],
)
def test_malformed_frames(data: str | bytes, code: str | None) -> None:
    got = parse_frame(data, LIMITS)
    assert isinstance(got, ProtocolError)
    if code:
        assert got.code == code


@pytest.mark.parametrize(
    ("data", "code", "echoed"),
    [
        ('{"type":"fill_mask","id":7,"text":"\\ud800 [MASK]"}', "invalid_field", 7),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","targets":["\\udfff"]}', "invalid_targets", 7),
        ('{"type":"fill_mask","id":"\\ud800","text":"a [MASK]"}', "invalid_id", None),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","deadline_ms":1e400}', "invalid_deadline", 7),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","top_k":-1e400}', "invalid_top_k", 7),
        ('{"type":"fill_mask","id":1e400,"text":"a [MASK]"}', "invalid_id", None),
        # A lone surrogate makes the frame go to the standard library, whose integers are exact: they
        # are read as orjson reads them (past 64 bits, a float), never raised over (math.isfinite).
        ('{"type":"fill_mask","id":7,"text":"\\ud800 [MASK]","deadline_ms":1' + "0" * 400 + "}", "invalid_field", 7),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","x":"\\ud800","deadline_ms":-1' + "0" * 400 + "}",
         "invalid_deadline", 7),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","x":"\\ud800","top_k":1' + "0" * 5000 + "}",
         "invalid_top_k", 7),
        ('{"type":"fill_mask","id":18446744073709551616,"text":"a [MASK]","x":"\\ud800"}', "invalid_id", None),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","deadline_ms":1' + "0" * 400 + "}", "invalid_deadline", 7),
        ('{"type":"subscribe_stats","id":7,"interval_ms":1e999}', "invalid_field", None),  # no request: no id
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","deadline_ms":NaN}', "invalid_json", None),
        ('{"type":"fill_mask","id":7,"text":"a [MASK]","deadline_ms":Infinity}', "invalid_json", None),
    ],
)
def test_valid_json_orjson_cannot_hold_gets_the_fields_own_error_under_its_id(
        data: str, code: str, echoed: object) -> None:
    """Lone surrogate escapes and numbers past a double's range are JSON (RFC 8259), so they are not
    ``invalid_json``: the field that holds one is refused under the frame's id (§7, §14)."""
    got = parse_frame(data, LIMITS)
    assert isinstance(got, ProtocolError), got
    assert (got.code, got.id) == (code, echoed)


def test_a_frame_that_is_not_json_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what orjson refuses for a surrogate or an infinity is read again: a client's garbage (up to
    --max-frame-bytes of it) costs one parse, not two."""
    import fillmask_server.protocol as protocol

    def second_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed twice")

    monkeypatch.setattr(protocol.json, "loads", second_parse)
    for garbage in ("x" * 60_000, '{"type":"fill_mask","id":1,' + " " * 60_000, "[" * 2000, '{"a":NaN}'):
        got = parse_frame(garbage, LIMITS)
        assert isinstance(got, ProtocolError) and got.code == "invalid_json"


def test_a_valid_json_frame_with_a_lone_surrogate_in_an_unknown_field_is_accepted() -> None:
    got = parse_frame('{"type":"fill_mask","id":7,"text":"a [MASK]","note":"\\ud800","\\udfff":1}', LIMITS)
    assert got == FillMaskRequest(7, "a [MASK]", LIMITS.top_k_default, None, None)


@pytest.mark.parametrize("unheld", ['"x":1e400', '"note":"\\ud800"'])
def test_nesting_to_1024_is_accepted_however_the_frame_is_parsed(unheld: str) -> None:
    """§7: invalid_json for nesting deeper than 1024 only. A frame the standard library reads again
    (a value orjson cannot hold) was invalid_json from about 960 levels: its parser recursed past
    Python's limit (found by a protocol review). The interpreter's limit is put back."""
    limit = sys.getrecursionlimit()
    for depth, accepted in ((1024, True), (1025, False)):
        for nest in (lambda d: "[" * d + "]" * d, lambda d: '{"a":' * d + "1" + "}" * d):
            junk = nest(depth - 1)  # inside the frame's own object: one level
            frame = '{"type":"fill_mask","id":3,"text":"a [MASK]",' + unheld + ',"junk":' + junk + "}"
            got = parse_frame(frame, LIMITS)
            if accepted:
                assert got == FillMaskRequest(3, "a [MASK]", LIMITS.top_k_default, None, None), (depth, got)
            else:
                assert isinstance(got, ProtocolError) and got.code == "invalid_json", (depth, got)
    assert sys.getrecursionlimit() == limit


def test_an_unclosed_string_of_escaped_quotes_is_refused_at_once() -> None:
    """A review's frame (a lone surrogate first, then a string of escaped quotes never closed, 64 KB)
    held the event loop about 8 s in a regular expression whose time grew with the square of the frame.
    The scan is one pass now; the bound here is two orders of magnitude above what it takes."""
    import time

    frame = '["\\ud800", "' + '\\"' * 32740
    started = time.perf_counter()
    got = parse_frame(frame, LIMITS)
    assert isinstance(got, ProtocolError) and got.code == "invalid_json"
    assert time.perf_counter() - started < 5.0


def test_an_unknown_type_is_quoted_whole_or_cut_with_an_ellipsis() -> None:
    short, long = parse({"type": "fill", "id": 1}), parse({"type": "x" * 500, "id": 1})
    assert isinstance(short, ProtocolError) and short.message.startswith("unknown frame type 'fill';")
    assert isinstance(long, ProtocolError) and long.message.startswith(f"unknown frame type '{'x' * 32}…';")
    # Not a string: said so, not "unknown frame type a number" (a conformance audit's find).
    for kind, said in ((5, "a number"), (None, "null"), ([], "a list")):
        got = parse({"type": kind, "id": 1})
        assert isinstance(got, ProtocolError) and got.code == "unknown_type", got
        assert got.message.startswith(f'"type" is {said}, not a string; use "fill_mask"'), got.message


def test_a_lower_case_mask_gets_a_hint() -> None:
    got = parse({"type": "fill_mask", "id": 1, "text": "a [mask] b"})
    assert isinstance(got, ProtocolError) and got.code == "no_mask" and "case-sensitive" in got.message


def test_another_model_familys_mask_gets_a_hint() -> None:
    """A browser trial: ``<mask>`` sent to BERT got no hint (``[mask]`` did: case-sensitive)."""
    got = parse({"type": "fill_mask", "id": 1, "text": "a <mask> b"})
    assert isinstance(got, ProtocolError) and got.code == "no_mask"
    assert got.message == ("the text has no [MASK] token; put [MASK] (this model's mask token; <mask> is another "
                           "model family's) where the missing word goes")
    roberta = dataclasses.replace(LIMITS, mask_token="<mask>")
    for text in ("a [MASK] b", "a [mask] b"):
        got = parse_frame(orjson.dumps({"type": "fill_mask", "id": 1, "text": text}).decode(), roberta)
        assert isinstance(got, ProtocolError) and "; [MASK] is another model family's" in got.message
    got = parse_frame(orjson.dumps({"type": "fill_mask", "id": 1, "text": "a <MASK> b"}).decode(), roberta)
    assert isinstance(got, ProtocolError) and "case-sensitive" in got.message


def test_huge_integer_is_an_error_not_an_exception() -> None:
    got = parse_frame("{\"type\":\"fill_mask\",\"id\":1" + "0" * 400 + ",\"text\":\"[MASK]\"}", LIMITS)
    assert isinstance(got, ProtocolError)


def test_encoders_make_one_json_object() -> None:
    engine = {"forward": "traced", "head": "masks", "device": "cpu", "dtype": "float32"}
    hello = orjson.loads(encode_hello("s/1", "m", True, LIMITS, {"max_queue": 4}, engine))
    assert hello["engine"] == engine
    assert hello["type"] == "hello" and hello["protocol"] == 1 and hello["mask_token"] == "[MASK]"
    assert hello["random_weights"] is True
    assert hello["limits"]["max_queue"] == 4 and hello["limits"]["top_k"] == {"min": 1, "max": 10, "default": 5}
    assert hello["limits"]["max_target_chars"] == 100
    result = orjson.loads(encode_result("a", orjson.dumps([{"score": 0.5}]), 1.23456, 2.0, 3, 30, 9))
    assert result == {"type": "result", "id": "a", "predictions": [{"score": 0.5}], "queue_ms": 1.235,
                      "inference_ms": 2.0, "batch_size": 3, "batch_tokens": 30, "batch_id": 9}
    assert orjson.loads(encode_error(None, "no_mask", "m")) == {"type": "error", "id": None, "code": "no_mask",
                                                                  "message": "m"}
    assert orjson.loads(encode_overloaded(9, 503, "queue_full", 40)) == {
        "type": "overloaded", "id": 9, "status": 503, "reason": "queue_full", "retry_after_ms": 40}


def test_a_result_names_the_targets_not_scored_as_given_and_only_those() -> None:
    """§4 ``targets``: written only with notes, one object per note in order, ``null`` for an ignored one."""
    notes = [("new york", "new"), ("\u0301", None)]
    frame = orjson.loads(encode_result(1, b"[]", 0.0, 0.0, 1, 1, 1, notes))
    assert frame["targets"] == [{"given": "new york", "scored": "new"}, {"given": "\u0301", "scored": None}]
    assert "targets" not in orjson.loads(encode_result(1, b"[]", 0.0, 0.0, 1, 1, 1))
    assert targets_field(()) == b""


def test_the_libraries_close_reasons_are_said_in_the_protocols_words() -> None:
    """§8: the closes the WebSocket library makes itself went out in its words ("frame with 2000000 bytes
    exceeds limit of 65536 bytes", "incorrect masking"); each now says what was wrong and what to do,
    within RFC 6455's 123 bytes, and keeps the library's detail of which rule a frame broke."""
    said = {
        (1009, "frame with 2000000 bytes exceeds limit of 65536 bytes"):
            "a message larger than limits.max_frame_bytes (65536 bytes): send shorter texts",
        (1009, "too many fragments"): "a message in more than 4,096 fragments: send each message in fewer frames",
        (1007, "invalid start byte at position 35"):  # (also a close frame's reason: a review)
            "text that is not valid UTF-8 (invalid start byte at byte 35): send text messages and close reasons "
            "as UTF-8",
        (1002, "incorrect masking"):
            "a frame that breaks RFC 6455 (incorrect masking): a bug in the client or its WebSocket library",
        (1002, "incomplete fragmented message"):
            "a close frame in the middle of a fragmented message: finish or drop the message before closing",
        (1011, "keepalive ping timeout"):
            "no pong within 20 s of the server's ping: keep reading so that your library answers pings",
    }
    for (code, reason), words in said.items():
        assert close_reason(code, reason, 65536) == words
        assert len(words.encode()) <= MAX_CLOSE_REASON_BYTES, words
    for code, reason in ((1001, "the server is draining"), (1008, "too many unread messages"), (1011, ""),
                         (1000, "")):
        assert close_reason(code, reason, 65536) == reason  # the server's own, and the rest, as they were
    assert close_reason(1009, "too many fragments", 65536, 100).startswith("a message in more than 100 fragments")
    assert close_reason(1011, "keepalive ping timeout", 65536, 4096, 5.0).startswith("no pong within 5 s")
    long = close_reason(1002, "é" * 200, 65536)  # a detail of any length is cut on a character, marked
    assert long.endswith("...") and len(long.encode()) <= MAX_CLOSE_REASON_BYTES and long.encode().decode() == long


@pytest.mark.parametrize(("targets", "said"), [
    (["cat", "x" * 11], "target 2 is 11 characters long; a target must be 1 to 10 characters"),
    (["cat", "dog", " \t"], "target 3 is only whitespace; a target must hold a word"),
    (["", "cat"], "target 1 is 0 characters long"),
    (["cat", 7], "every target must be a string; target 2 is a number"),
    (["cat", "a\ud800"], "target 2 holds an unpaired surrogate"),
])
def test_a_refused_target_is_named_by_its_place_and_the_rule_it_breaks(targets: list[object], said: str) -> None:
    """An inputs trial: with up to ``max_targets`` targets, one message ("every target must be a non-blank
    string of at most 100 characters") for a blank one and a long one left the client to find which."""
    limits = Limits(mask_token="[MASK]", max_target_chars=10)
    frame = json.dumps({"type": "fill_mask", "id": 1, "text": "a [MASK]", "targets": targets})  # (\ud800 escaped)
    error = parse_frame(frame, limits)
    assert isinstance(error, ProtocolError) and error.code == "invalid_targets" and said in error.message, error


def test_a_frame_that_breaks_several_rules_gets_the_first_ones_error_in_the_tables_order() -> None:
    """§3 step 3 (a spec trial asked which error comes back): the fields are checked in the table's
    order, text, top_k, targets, deadline_ms."""
    bad = {"text": "no mask here", "top_k": 0, "targets": [], "deadline_ms": -1}
    codes = []
    for field in ("text", "top_k", "targets", "deadline_ms"):
        error = parse_frame(orjson.dumps({"type": "fill_mask", "id": 1, "text": "a [MASK]", **bad}).decode(), LIMITS)
        assert isinstance(error, ProtocolError)
        codes.append(error.code)
        del bad[field]  # the next field's rule is the first one broken now
    assert codes == ["no_mask", "invalid_top_k", "invalid_targets", "invalid_deadline"]
