"""Hostile input to the pure frame parser (protocol.md §3, §5, §7), and the spec matching the code.

Property tests with hypothesis: whatever a client sends, ``parse_frame`` gives a request, a cancel or
one error, never an exception, and what it accepts obeys every rule of §3.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fillmask_server.config import Config
from fillmask_server.protocol import (
    ERROR_CODES,
    MAX_SAFE_INTEGER,
    OVERLOADED_REASONS,
    STATS_INTERVAL_MS,
    CancelRequest,
    FillMaskRequest,
    Limits,
    ProtocolError,
    StatsSubscription,
    encode_error,
    encode_overloaded,
    parse_frame,
)

ROOT = Path(__file__).resolve().parent.parent
SPEC = (ROOT / "protocol.md").read_text()
LIMITS = Limits(mask_token="[MASK]", max_text_chars=200, max_masks=3, top_k_max=20, max_targets=4,
                max_id_chars=16, max_deadline_ms=10_000)


def spec_section(number: int) -> str:
    start = SPEC.index(f"## §{number} ")
    following = SPEC.find("\n## §", start + 1)
    return SPEC[start: following if following != -1 else len(SPEC)]


SPEC_ERROR_CODES = set(re.findall(r"^\| `([a-z_]+)` \|", spec_section(7), re.MULTILINE))

settings.register_profile("hardening", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
FAST = settings.get_profile("hardening")

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
ids = st.one_of(st.integers(), st.text(max_size=20), st.floats(), st.booleans(), st.none(), st.lists(st.integers()))
mask_texts = st.lists(st.sampled_from(["[MASK]", "word", " ", "é", "\u200b", "[MASK", "MASK]", "\n"]),
                      max_size=40).map("".join)


@st.composite
def request_like(draw: st.DrawFn) -> dict[str, Any]:
    """Objects shaped like fill_mask or cancel frames, each field present or not, valid or not."""
    frame: dict[str, Any] = {}
    if draw(st.booleans()):
        frame["type"] = draw(st.one_of(st.sampled_from(["fill_mask", "cancel", "FILL_MASK", ""]), json_scalars))
    for name, values in (("id", ids), ("text", st.one_of(mask_texts, json_values)),
                         ("top_k", st.one_of(st.integers(-5, 30), json_values)),
                         ("targets", st.one_of(st.lists(st.text(max_size=6), max_size=6), json_values)),
                         ("deadline_ms", st.one_of(st.floats(-1, 20_000), st.integers(-1, 20_000), json_values)),
                         ("extra", json_values)):
        if draw(st.booleans()):
            frame[name] = draw(values)
    return frame


def valid_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= MAX_SAFE_INTEGER
    return isinstance(value, str) and 1 <= len(value) <= LIMITS.max_id_chars


def check_parsed(parsed: Any, sent: Any) -> None:
    """The invariants of §3/§5/§7/§13 for one parse result of the object ``sent`` (None when not an object).

    Hypothesis also draws the string constants of the code it tests, so a stats frame type comes up too."""
    assert isinstance(parsed, (FillMaskRequest, CancelRequest, StatsSubscription, ProtocolError))
    if isinstance(parsed, ProtocolError):
        assert parsed.code in SPEC_ERROR_CODES, parsed
        assert parsed.message and "\n" not in parsed.message and "Traceback" not in parsed.message
        if parsed.id is not None:
            assert valid_id(parsed.id) and isinstance(sent, dict) and sent.get("id") == parsed.id
        frame = orjson.loads(encode_error(parsed.id, parsed.code, parsed.message))
        assert frame["type"] == "error" and frame["id"] == parsed.id
        return
    if isinstance(parsed, StatsSubscription):
        assert isinstance(sent, dict)
        if sent.get("type") == "unsubscribe_stats":
            assert parsed.interval_ms is None
        else:
            assert sent.get("type") == "subscribe_stats"
            assert parsed.interval_ms == sent.get("interval_ms", STATS_INTERVAL_MS["default"])
            assert STATS_INTERVAL_MS["min"] <= parsed.interval_ms <= STATS_INTERVAL_MS["max"]
        return
    assert isinstance(sent, dict) and valid_id(parsed.id) and sent["id"] == parsed.id
    assert type(sent["id"]) is type(parsed.id)  # echoed with its JSON type (§3)
    if isinstance(parsed, CancelRequest):
        assert sent.get("type") == "cancel"
        return
    assert sent.get("type") == "fill_mask"
    assert 1 <= parsed.text.count("[MASK]") <= LIMITS.max_masks and len(parsed.text) <= LIMITS.max_text_chars
    assert LIMITS.top_k_min <= parsed.top_k <= LIMITS.top_k_max and not isinstance(parsed.top_k, bool)
    if parsed.targets is not None:
        assert 1 <= len(parsed.targets) <= LIMITS.max_targets
        assert all(isinstance(t, str) and t.strip() and len(t) <= LIMITS.max_target_chars for t in parsed.targets)
    if parsed.deadline_ms is not None:
        assert 0 < parsed.deadline_ms <= LIMITS.max_deadline_ms


@FAST
@given(st.text(max_size=300))
def test_any_text_gives_a_request_or_one_error(text: str) -> None:
    try:
        sent = orjson.loads(text)
    except orjson.JSONDecodeError:
        sent = None
    check_parsed(parse_frame(text, LIMITS), sent)


@FAST
@given(st.binary(max_size=300))
def test_any_bytes_give_the_binary_frame_error(data: bytes) -> None:
    parsed = parse_frame(data, LIMITS)
    assert isinstance(parsed, ProtocolError) and parsed.code == "binary_frame" and parsed.id is None


@FAST
@given(json_values)
def test_any_json_value_gives_a_request_or_one_error(value: Any) -> None:
    check_parsed(parse_frame(json.dumps(value), LIMITS), value)


@FAST
@given(request_like())
def test_request_shaped_objects_obey_every_rule_of_section_3(frame: dict[str, Any]) -> None:
    check_parsed(parse_frame(json.dumps(frame), LIMITS), frame)


@FAST
@given(st.integers(0xD800, 0xDFFF), st.sampled_from(["id", "text", "targets", "type"]))
def test_escaped_lone_surrogates_anywhere_are_plain_errors(code_point: int, field: str) -> None:
    frame = {"type": "fill_mask", "id": "x", "text": "a [MASK]", "targets": ["t"]}
    marker = "SURROGATE"
    frame[field] = [marker] if field == "targets" else (marker + " [MASK]" if field == "text" else marker)
    raw = orjson.dumps(frame).decode().replace(marker, f"\\u{code_point:04x}")
    parsed = parse_frame(raw, LIMITS)
    assert isinstance(parsed, ProtocolError), parsed
    assert parsed.code in SPEC_ERROR_CODES


@pytest.mark.parametrize("raw", [
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 50_000 + "1" + "}" * 50_000,
    '{"type":"fill_mask","id":1,"text":' + "[" * 5000 + "]" * 5000 + "}",
    "1e999999", "-1e400", "123456789012345678901234567890123456789",
    '{"type":"fill_mask","id":123456789012345678901234567890,"text":"[MASK]"}',
    '{"type":"fill_mask","id":"\\ud800","text":"[MASK]"}',
    '{"type":"fill_mask","id":1,"text":"\\udfff [MASK]"}',
    '{"type":"fill_mask","id":7,"text":"a [MASK]","x":"\\ud800","deadline_ms":1' + "0" * 400 + "}",
    '{"type":"fill_mask","id":7,"text":"a [MASK]","x":"\\ud800","deadline_ms":-1' + "0" * 5000 + "}",
    '"\\u0000"', "\x00", "",
])
def test_deep_nesting_huge_numbers_and_lone_surrogates_are_plain_errors(raw: str) -> None:
    parsed = parse_frame(raw, LIMITS)
    assert isinstance(parsed, ProtocolError), parsed
    assert parsed.code in SPEC_ERROR_CODES


# --- the spec matches the code ---------------------------------------------------------------------


def test_the_error_codes_of_the_code_are_the_spec_tables() -> None:
    """§7: ``encode_error`` refuses any code outside ``ERROR_CODES``, which is exactly the spec's table."""
    assert SPEC_ERROR_CODES == ERROR_CODES
    with pytest.raises(AssertionError):
        encode_error(1, "made_up", "x")


def test_the_overloaded_reasons_of_the_code_are_the_spec_ones() -> None:
    """§6 and §11 name every reason ``encode_overloaded`` accepts, with its status."""
    for reason, status in OVERLOADED_REASONS.items():
        assert f'"status": {status}, "reason": "{reason}"' in spec_section(6), reason
        assert f"`{reason}`" in spec_section(11)
    with pytest.raises(AssertionError):
        encode_overloaded(1, 503, "deadline_exceeded", 5)


def test_every_hardening_flag_is_named_in_the_spec() -> None:
    for name in ("max_connections", "max_send_buffer_bytes", "send_timeout", "allowed_origins", "token",
                 "certfile", "keyfile"):
        assert name in Config.__dataclass_fields__
        assert "--" + name.replace("_", "-") in spec_section(12), name
    assert '"max_inflight_per_connection"' in spec_section(2)


