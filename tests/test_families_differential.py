"""A randomized differential test: every fill-mask family's server against ``pipeline("fill-mask")``.

For each family of ``fillmask_server.checkpoint.FAMILIES`` (the offline tiny checkpoints under
``models/families/``), one real server on an ephemeral loopback port (``tests.test_families.family_server``)
gets a few dozen random requests that a user could send, all in flight at once on one WebSocket
connection (so that they share batches), then once more in another order with string ids. Each answer
is checked against the spec (protocol.md):

- a request the spec accepts gets a ``result`` whose ``predictions`` are what
  ``pipeline("fill-mask", model=dir)(text, top_k=..., targets=...)`` gives for that text alone (§4): one
  list per mask for several masks, token ids, ``token_str`` and ``sequence`` exactly equal, scores within
  ``tests.test_families.TOLERANCE``; two candidates may come swapped only where the pipeline's own scores
  for them are within ``TIE`` of each other (§4: "the last digits decide their order");
- its ``targets`` notes (§4) list exactly the targets not scored as given, in request order, once each,
  with the token scored in their place as its ``token_str`` reads (``null``: it tokenizes to nothing);
  a request without such targets has no ``targets`` field;
- its ``predictions`` and notes take no more JSON bytes than §3's bound says they can (the bound that
  ``result_too_large`` and §14's read limit rely on), computed here from §3's words;
- a request the spec refuses (§3's table and its checks after tokenizing: no mask, too many masks, too
  many tokens or characters, an empty or non-string text, an escaped lone surrogate in the text or a
  target, ``top_k`` out of range or not an integer, blank/empty/non-string/too long/too many targets,
  targets that map to no token, a bad ``deadline_ms``) gets an ``error`` with that code and a one-line
  message, and is not compared.

Texts mix ASCII words and punctuation with accents (as written, NFC, NFD, NFKC, NFKD), combining marks,
CJK, Hangul, emoji (ZWJ sequences, flags, skin tones), zero-width characters, full-width forms,
non-breaking and other odd spaces, tabs and newlines, right-to-left scripts, control characters, the
family's other special tokens and look-alikes of its mask token; the mask token is glued to letters or
punctuation on either side or spaced, one to eight times; some texts are exactly ``limits.max_tokens``
tokens or ``limits.max_text_chars`` characters long. ``top_k`` is random (or left out, or ``null``), and
``targets`` are random vocabulary tokens (special ones too), words of several tokens, other cases of
vocabulary words, targets with spaces around them, Unicode in any normal form, duplicates and targets
that tokenize to nothing, as a list or a single string.

The run is reproducible: the requests of a family come from ``random.Random(f"{seed}:{family}")``,
where the seed is ``FILLMASK_TEST_DIFF_SEED`` (an integer; ``random`` for a fresh one) or ``DEFAULT_SEED``.
Every failure message names the seed and the command that repeats it; ``FILLMASK_TEST_DIFF_REQUESTS`` asks
for more requests per family for a deeper run by hand (hundreds per family have been run: no
disagreement was found, so this file has no test for a particular bug).
"""

from __future__ import annotations

import os
import random
import unicodedata
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from fillmask_server.checkpoint import FAMILIES
from tests.test_families import TOLERANCE, Family, family_server
from tests.wire import recv_n, send, session

DEFAULT_SEED = 20240611
_SEED_ENV = os.environ.get("FILLMASK_TEST_DIFF_SEED", "").strip()
SEED = random.SystemRandom().randrange(1 << 32) if _SEED_ENV == "random" else int(_SEED_ENV or DEFAULT_SEED)
#: Requests per family (those the spec accepts are sent twice: in the first batch and in the second);
#: ``FILLMASK_TEST_DIFF_REQUESTS`` asks for more, for a deeper run by hand.
REQUESTS = int(os.environ.get("FILLMASK_TEST_DIFF_REQUESTS", "") or 32)
#: Two candidates may come in the other order only where the pipeline's scores for them differ by no more
#: (the server's scores were seen within 4e-7 of the pipeline's on these checkpoints, so a swap needs closer).
TIE = 1e-6

ASCII = ["the", "old", "farmer", "bought", "a", "red", "bicycle", "in", "morning", "Paris", "HELLO", "don't",
         "it's", "U.S.A.", "e-mail", "3.14", "1,000", "co-op", "river", "children", "x", "Q", "##", "ing", "#1"]
UNICODE = ["café", "cafe\u0301", "naïve", "Zürich", "Ångström", "façade", "déjà", "東京", "中文", "日本語です",
           "한국어", "🙂", "👩\u200d💻", "🇫🇷", "👍🏽", "Ωμέγα", "Привет", "مرحبا", "שלום", "हिन्दी",
           "ﬁ", "x²", "ß", "İstanbul", "ＡＢＣ", "１２３", "！", "e\u0301\u0302", "a\u0308\u0323", "…", "—",
           "«", "»", "’", "“", "”", "€", "±", "soft\u00adhyphen", "word\u2060joiner", "\U0001d400", "ǅ", "ﾊﾝｶｸ",
           "\x01", "\x7f", "\x00", "\x1b[0m"]
PUNCT = list(".,;:!?()[]{}'\"-/&%$#@*_~")
SPACES = ["\u200b", "\u200c", "\u200d", "\ufeff", "\u00a0", "\u202f", "\u3000", "\t", "\n", "\r\n", "\r", "  ",
          "\u2028", "\u2029", "\x0b", "\x0c", "\u2009", "\x1c", "\x1f", "\x85", "\u1680", "\u205f", "\u180e", " \u00a0"]
CONTROL = ["\x01", "\x7f", "\x1f", "\x00"]
#: Characters that tokenize to nothing in some families and that Python's ``str.strip`` keeps (non-blank).
NOTHING = ["\u200b", "\u00ad", "\ufeff", "\u200d", "\x00", "\x01", "\u0301", "\u200c", "\x7f", "\ufffd", "\U000e0001"]
AMINO = "ACDEFGHIKLMNPQRSTVWY"


@dataclass
class Case:
    """One request: its fields besides ``type`` and ``id``, and the error code the spec gives it (None:
    a result); ``why`` says what kind of request it is, for failure messages."""

    fields: dict[str, Any]
    code: str | None = None
    why: str = "random"
    notes: list[dict[str, Any]] = field(default_factory=list)
    #: JSON members sent as written after ``type`` and ``id`` instead of ``fields`` (what ``orjson`` cannot
    #: write: an escaped lone surrogate).
    raw: str = ""


def reproduce(name: str) -> str:
    return (f"seed {SEED}, {REQUESTS} requests (family {name}); repeat with FILLMASK_TEST_DIFF_SEED={SEED} "
            f"FILLMASK_TEST_DIFF_REQUESTS={REQUESTS} .venv/bin/python -m pytest -p no:cacheprovider -q -n 0 "
            f"'tests/test_families_differential.py::test_random_requests_get_the_pipelines_answers[{name}]'")


class Generator:
    """Random requests for one family, from a seeded ``random.Random``."""

    def __init__(self, family: Family, rng: random.Random) -> None:
        self.family, self.rng = family, rng
        self.tokenizer = family.pipe.tokenizer
        self.mask = family.mask
        self.limits = family.hello["limits"]
        self.vocab: dict[str, int] = self.tokenizer.get_vocab()
        special = set(self.tokenizer.all_special_tokens)
        self.special = sorted(special & set(self.vocab))
        self.ordinary = sorted(token for token in self.vocab if token not in special)
        self.words = sorted({w for w in (self.tokenizer.decode([self.vocab[t]]).strip() for t in self.ordinary)
                             if w.isalpha() and len(w) > 1})
        self.nothing = [c for c in NOTHING if c.strip() and not self._ids(c)]
        self.protein = family.name == "esm"
        #: Special tokens other than the mask as written, and the mask in other cases or families' spellings.
        self.lookalikes = [t for t in [*self.special, self.mask.lower(), self.mask.upper(), self.mask.title(),
                                       "[MASK]", "<mask>", self.mask[:-1], self.mask[1:]] if self.mask not in t]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    # --- texts -------------------------------------------------------------------------------------

    def fragment(self) -> str:
        rng = self.rng
        if self.protein:
            if rng.random() < 0.8:
                return "".join(rng.choice(AMINO) for _ in range(rng.randint(1, 8)))
            return rng.choice([*UNICODE, *PUNCT, *self.lookalikes, "x", "mk", "B", "Z", "X", "U"])
        if rng.random() < 0.04:
            return rng.choice(self.lookalikes)
        pool = rng.choice([ASCII, ASCII, UNICODE, PUNCT, self.words or ASCII])
        piece = rng.choice(pool)
        if rng.random() < 0.1:
            piece = piece.upper() if rng.random() < 0.5 else piece.title()
        return piece

    def joiner(self) -> str:
        rng = self.rng
        if self.protein:
            return rng.choice(["", "", "", " ", "\n", *SPACES])
        return rng.choice([" ", " ", " ", " ", "", *SPACES, *CONTROL[:1]])

    def glued_mask(self) -> str:
        rng = self.rng
        sides = ["", " ", "a", "Z", "é", "東", ".", ",", "(", ")", "'", "-", "\u00a0", "\u200b", "🙂", "\t"]
        return rng.choice(sides) + self.mask + rng.choice(sides)

    def text(self, masks: int, most: int = 12) -> str:
        rng = self.rng
        parts = [self.fragment() for _ in range(rng.randint(0, most))]
        for _ in range(masks):
            parts.insert(rng.randint(0, len(parts)), self.glued_mask() if rng.random() < 0.6 else self.mask)
        text = rng.choice(["", "", "", " ", "\u00a0", "\n"]) + "".join(
            (self.joiner() if n else "") + part for n, part in enumerate(parts))
        text += rng.choice(["", "", "", ".", " ", "\n", "!"])
        form = rng.choice([None, None, None, "NFC", "NFD", "NFKC", "NFKD"])
        return unicodedata.normalize(form, text) if form else text

    def fitting_text(self, masks: int) -> str:
        """A text with ``masks`` masks of at most ``limits.max_tokens`` tokens."""
        most = 12
        for _ in range(50):
            text = self.text(masks, most)
            if len(self.tokens(text)) <= self.limits["max_tokens"]:
                return text
            most = max(0, most - 2)
        return " ".join([self.mask] * masks)

    def edge_text(self) -> str:
        """A text at the limits that the spec still accepts: exactly ``limits.max_tokens`` tokens, or
        exactly ``limits.max_text_chars`` characters of which most are spaces or zero-width."""
        rng, limits = self.rng, self.limits
        if rng.random() < 0.5:
            filler = rng.choice([" ", "\u200b", "\t", "\u00a0", "\n"])
            text = self.fitting_text(rng.randint(1, 2))
            cut = rng.randint(0, len(text))
            longest = text[:cut] + filler * (limits["max_text_chars"] - len(text)) + text[cut:]
            if longest.count(self.mask) != text.count(self.mask):  # the cut fell inside a mask
                longest = text + filler * (limits["max_text_chars"] - len(text))
            return longest if len(self.tokens(longest)) <= limits["max_tokens"] else self.mask
        text = self.fitting_text(rng.randint(1, 3))
        pad = "A" if self.protein else rng.choice([",", " x", ".", " 東"])
        while len(self.tokens(text + pad)) <= limits["max_tokens"]:
            text += pad
        return text

    def masks(self) -> int:
        rng = self.rng
        roll = rng.random()
        return 1 if roll < 0.5 else rng.randint(2, 3) if roll < 0.85 else rng.randint(4, self.limits["max_masks"])

    # --- options -----------------------------------------------------------------------------------

    def top_k(self, masks: int) -> dict[str, Any]:
        rng = self.rng
        most = self.limits["top_k"]["max"] if masks <= 2 else min(self.limits["top_k"]["max"], 200 // masks)
        roll = rng.random()
        if roll < 0.15:
            return {}
        if roll < 0.2:
            return {"top_k": None}
        if roll < 0.3:
            return {"top_k": most}
        return {"top_k": rng.randint(1, min(most, 10)) if rng.random() < 0.7 else rng.randint(1, most)}

    def target(self, chosen: list[str]) -> str:
        rng = self.rng
        kind = rng.choice(["vocab", "vocab", "word", "split", "case", "spaced", "unicode", "special", "dup",
                           "nothing"])
        if kind == "dup" and chosen:
            return rng.choice(chosen)
        if kind == "nothing" and self.nothing:
            return rng.choice(self.nothing)
        if kind == "special" and self.special:
            return rng.choice(self.special) if rng.random() < 0.7 else rng.choice(self.lookalikes)
        if kind == "split":
            if self.protein:
                return "".join(rng.choice(AMINO) for _ in range(rng.randint(2, 4)))
            return rng.choice(["", " ", "-"]).join(rng.choice(self.words or ASCII) for _ in range(rng.randint(2, 3)))
        if kind == "case":
            word = rng.choice(self.words or self.ordinary)
            return rng.choice([word.upper(), word.title(), word.swapcase()])
        if kind == "spaced":
            word = rng.choice(self.words or self.ordinary)
            return rng.choice([" ", "  ", "\t", "\u00a0", ""]) + word + rng.choice([" ", "", "\n", "\u3000"]) \
                if rng.random() < 0.5 else " " + word
        if kind == "unicode":
            return rng.choice(UNICODE)
        if kind == "word" and self.words:
            return rng.choice(self.words)
        return rng.choice(self.ordinary)

    def targets(self) -> dict[str, Any]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.55:
            return {} if roll < 0.5 else {"targets": None}
        chosen: list[str] = []
        for _ in range(rng.randint(1, 6)):
            target = self.target(chosen)
            form = rng.choice([None, None, None, "NFD", "NFKC"])
            target = unicodedata.normalize(form, target) if form else target
            if target.strip() and len(target) <= self.limits["max_target_chars"]:
                chosen.append(target)
        if not chosen:
            chosen = [rng.choice(self.ordinary)]
        if len(chosen) == 1 and rng.random() < 0.4:
            return {"targets": chosen[0]}
        return {"targets": chosen}

    # --- requests the spec refuses ------------------------------------------------------------------

    def refused(self) -> Case:
        rng, mask, limits = self.rng, self.mask, self.limits
        text = self.fitting_text(1)
        kind = rng.choice(["no_mask", "case_mask", "too_many_masks", "too_many_tokens", "too_many_chars",
                           "top_k_low", "top_k_high", "top_k_float", "top_k_bool", "top_k_str", "targets_empty",
                           "targets_blank", "targets_long", "targets_type", "targets_too_many", "targets_nothing",
                           "deadline", "text_surrogate", "target_surrogate", "text_empty", "text_type"])
        if kind in ("no_mask", "case_mask"):
            other = rng.choice(["", " ", "_"]) if kind == "no_mask" else \
                mask.lower() if mask.lower() != mask else mask.upper()
            while mask in text:  # (a replacement can join a lookalike and what follows into a mask)
                text = text.replace(mask, other)
            return Case({"text": text}, "no_mask", kind)
        if kind in ("text_surrogate", "target_surrogate"):
            escaped, good = orjson.dumps(text).decode(), orjson.dumps(rng.choice(self.ordinary)).decode()
            if kind == "text_surrogate":
                return Case({"raw": "text"}, "invalid_field", kind, raw=f'"text": "\\ud800{escaped[1:]}')
            return Case({"raw": "targets"}, "invalid_targets", kind,
                        raw=f'"text": {escaped}, "targets": [{good}, "a\\udfff"]')
        if kind == "text_empty":
            return Case({"text": ""}, "no_mask", kind)
        if kind == "text_type":
            return Case({"text": rng.choice([[text], 7, {"text": text}])}, "invalid_field", kind)
        if kind == "too_many_masks":
            n = limits["max_masks"] + rng.randint(1, 3)
            return Case({"text": self.joiner().join([mask] * n)}, "too_many_masks", kind)
        if kind == "too_many_tokens":
            filler = "A" if self.protein else "the "
            return Case({"text": mask + filler * (limits["max_tokens"] + rng.randint(0, 10))}, "text_too_long", kind)
        if kind == "too_many_chars":
            return Case({"text": mask + " " * limits["max_text_chars"]}, "text_too_long", kind)
        if kind.startswith("top_k"):
            value = {"top_k_low": rng.choice([0, -1]), "top_k_high": limits["top_k"]["max"] + rng.randint(1, 5),
                     "top_k_float": 3.0, "top_k_bool": True, "top_k_str": "5"}[kind]
            return Case({"text": text, "top_k": value}, "invalid_top_k", kind)
        if kind == "deadline":
            return Case({"text": text, "deadline_ms": rng.choice([0, -5, limits["max_deadline_ms"] + 1, "1"])},
                        "invalid_deadline", kind)
        good = rng.choice(self.ordinary)
        targets: Any = {
            "targets_empty": rng.choice([[], "", [""]]),
            "targets_blank": [good, rng.choice([" ", "\t\n", "\u00a0", "\u3000", "\u2028 "])],
            "targets_long": [good, "x" * (limits["max_target_chars"] + 1)],
            "targets_type": rng.choice([[good, 5], 7, {"a": 1}, [None]]),
            "targets_too_many": [good] * (limits["max_targets"] + 1),
            "targets_nothing": [rng.choice(self.nothing) for _ in range(2)] if self.nothing else [],
        }[kind]
        return Case({"text": text, "targets": targets}, "invalid_targets", kind)

    def case(self) -> Case:
        if self.rng.random() < 0.2:
            return self.refused()
        if self.rng.random() < 0.08:
            return Case({"text": self.edge_text(), **self.top_k(3), **self.targets()}, why="at the limits")
        masks = self.masks()
        deadline = self.rng.choice([{}, {}, {}, {"deadline_ms": None}, {"deadline_ms": 60000.5}])
        return Case({"text": self.fitting_text(masks), **self.top_k(masks), **self.targets(), **deadline})


# --- the oracle ------------------------------------------------------------------------------------


def ask_pipeline(family: Family, text: str, top_k: int, targets: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return family.pipe(text, top_k=top_k, **({} if targets is None else {"targets": targets}))


def expected_notes(family: Family, targets: Any) -> list[dict[str, Any]]:
    """§4 ``targets``: each target that is not one vocabulary token and does not tokenize to exactly one
    token reading the same, in request order, once: with the token the pipeline scores in its place (the
    pipeline's own ``get_target_ids``) as ``decode`` reads it, or None when it tokenizes to nothing."""
    tokenizer = family.pipe.tokenizer
    vocab = tokenizer.get_vocab()
    notes: list[dict[str, Any]] = []
    for target in [targets] if isinstance(targets, str) else targets:
        if target in vocab:
            continue
        pieces = tokenizer(target, add_special_tokens=False)["input_ids"]
        if pieces:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                [first] = family.pipe.get_target_ids([target]).tolist()
            scored: str | None = tokenizer.decode([first])
        else:
            scored = None
        if len(pieces) == 1 and scored == target:
            continue
        note = {"given": target, "scored": scored}
        if note not in notes:
            notes.append(note)
    return notes


def settle(family: Family, case: Case) -> None:
    """The code of a request that looks valid but that the checks after tokenizing refuse (§3), from the
    pipeline's tokenizer: too many tokens, no or too many masks, no target that maps to a token."""
    if case.code is not None:
        return
    tokenizer, limits = family.pipe.tokenizer, family.hello["limits"]
    ids = tokenizer(case.fields["text"])["input_ids"]
    masks = ids.count(tokenizer.mask_token_id)
    if len(ids) > limits["max_tokens"]:
        case.code, case.why = "text_too_long", "long after tokenizing"
    elif masks == 0:
        case.code, case.why = "no_mask", "no mask after tokenizing"
    elif masks > limits["max_masks"]:
        case.code, case.why = "too_many_masks", "too many masks after tokenizing"
    elif case.fields.get("targets") is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                family.pipe.get_target_ids(case.fields["targets"])
        except ValueError:
            case.code, case.why = "invalid_targets", "no target maps to a token"
        else:
            case.notes = expected_notes(family, case.fields["targets"])


def compare_rows(got: list[Any], want: list[Any], wider: Callable[[], list[Any]], where: str) -> list[str]:
    """Problems with one mask's candidates: exact tokens and strings, scores within TOLERANCE, swaps only
    between candidates whose pipeline scores are within TIE (looked up in ``wider``, the pipeline's answer
    at a larger top_k, for a candidate that fell off the end)."""
    problems: list[str] = []
    if not isinstance(got, list) or len(got) != len(want):
        return [f"{where}: {len(got) if isinstance(got, list) else got!r} candidates, pipeline {len(want)}"]
    if len({g["token"] for g in got}) != len(got):
        problems.append(f"{where}: a token twice in {[g['token'] for g in got]}")
    for n, (g, e) in enumerate(zip(got, want, strict=True)):
        if set(g) != {"score", "token", "token_str", "sequence"}:
            problems.append(f"{where}[{n}]: fields {sorted(g)}")
            continue
        if g["token"] == e["token"]:
            ref = e
        else:
            ref = next((w for w in wider() if w["token"] == g["token"]), None)
            if ref is None or abs(ref["score"] - e["score"]) > TIE:
                problems.append(f"{where}[{n}]: server {g!r}, pipeline {e!r} (not a near tie: pipeline score "
                                f"of the server's token {None if ref is None else ref['score']})")
                continue
        if (g["token_str"], g["sequence"]) != (ref["token_str"], ref["sequence"]):
            problems.append(f"{where}[{n}] token {g['token']}: server token_str/sequence "
                            f"{(g['token_str'], g['sequence'])!r}, pipeline {(ref['token_str'], ref['sequence'])!r}")
        if not abs(g["score"] - ref["score"]) <= TOLERANCE:
            problems.append(f"{where}[{n}] token {g['token']}: score {g['score']!r}, pipeline {ref['score']!r}")
    return problems


_SIZES: dict[str, list[int]] = {}


def token_sizes(family: Family) -> list[int]:
    """§3's size of each token in a text's part: the JSON length without quotes of its vocabulary string,
    or of its text decoded alone where that is longer, plus one."""
    if family.name not in _SIZES:
        tokenizer = family.pipe.tokenizer
        sizes = [0] * len(tokenizer)
        for token, id_ in tokenizer.get_vocab().items():
            alone = tokenizer.decode([id_])
            sizes[id_] = max(len(orjson.dumps(token)), len(orjson.dumps(alone))) - 1
        _SIZES[family.name] = sizes
    return _SIZES[family.name]


def result_bound(family: Family, text: str, masks: int, candidates: int, notes: list[dict[str, Any]]) -> int:
    """§3: the most bytes a request's ``predictions`` (and its ``targets`` notes) can take."""
    sizes = token_sizes(family)
    ids = family.pipe.tokenizer(text)["input_ids"]
    part = max(sum(sizes[id_] for id_ in ids), len(orjson.dumps(family.pipe.tokenizer.decode(ids))) - 2)
    longest = max(sizes) + 1  # the JSON length of the longest token, quotes included
    return masks * candidates * (96 + part + 2 * (1 + longest)) + (len(orjson.dumps(notes)) if notes else 0)


def judge(family: Family, case: Case, frame: dict[str, Any]) -> list[str]:
    """Problems with the server's answer to ``case`` (empty: it is the spec's)."""
    label = f"{case.why} request {case.fields!r}"
    if case.code is not None:
        if frame.get("type") != "error" or frame.get("code") != case.code:
            return [f"{label}: expected error {case.code}, got {frame!r}"]
        if "\n" in frame["message"] or "\r" in frame["message"]:
            return [f"{label}: a message of several lines {frame['message']!r}"]
        return []
    if frame.get("type") != "result":
        return [f"{label}: expected a result, got {frame!r}"]
    fields, limits = case.fields, family.hello["limits"]
    top_k = fields.get("top_k") or limits["top_k"]["default"]
    targets = fields.get("targets")
    want = ask_pipeline(family, fields["text"], top_k, targets)
    widest: list[Any] = []

    def wider() -> Any:
        if not widest:
            k = min(top_k + 10, limits["top_k"]["max"]) if targets is None else top_k + 10
            widest.append(ask_pipeline(family, fields["text"], k, targets))
        return widest[0]

    problems: list[str] = []
    got = frame["predictions"]
    several = bool(want) and isinstance(want[0], list)
    if several:
        if not (isinstance(got, list) and got and isinstance(got[0], list) and len(got) == len(want)):
            return [f"{label}: predictions {got!r} for {len(want)} masks"]
        for n, (g, e) in enumerate(zip(got, want, strict=True)):
            problems += compare_rows(g, e, lambda n=n: wider()[n], f"{label} mask {n}")
    else:
        problems += compare_rows(got, want, wider, label)
    masks, candidates = (len(want), len(want[0])) if several else (1, len(want))
    size = len(orjson.dumps(got)) + (len(orjson.dumps(frame["targets"])) if "targets" in frame else 0)
    bound = result_bound(family, fields["text"], masks, candidates, case.notes)
    if size > bound:
        problems.append(f"{label}: {size} bytes of predictions and notes, more than §3's bound of {bound}")
    if frame.get("targets", []) != case.notes:
        problems.append(f"{label}: targets notes {frame.get('targets')!r}, expected {case.notes!r}")
    if "targets" in frame and not case.notes:
        problems.append(f"{label}: a targets field {frame['targets']!r} without a target to note")
    return problems


async def ask_server(family: Family, cases: list[Case], ids: list[Any]) -> dict[Any, dict[str, Any]]:
    """Every case in flight at once on one connection (as many at a time as
    ``limits.max_inflight_per_connection`` allows, for a deeper run); the answers by id."""
    most = family.hello["limits"]["max_inflight_per_connection"]
    frames: list[dict[str, Any]] = []
    async with session(family.server.url) as (ws, _):
        for start in range(0, len(cases), most):
            for frame_id, case in zip(ids[start:start + most], cases[start:start + most], strict=True):
                if case.raw:
                    await ws.send(f'{{"type": "fill_mask", "id": {orjson.dumps(frame_id).decode()}, {case.raw}}}')
                else:
                    await send(ws, {"type": "fill_mask", "id": frame_id, **case.fields})
            frames += await recv_n(ws, len(cases[start:start + most]), timeout=60)
    answers = {frame["id"]: frame for frame in frames}
    assert len(answers) == len(cases), "two answers under one id"
    return answers


@pytest.fixture(scope="module", params=FAMILIES)
async def family(request: pytest.FixtureRequest) -> AsyncIterator[Family]:
    async with family_server(request.param) as found:
        yield found


async def test_random_requests_get_the_pipelines_answers(family: Family) -> None:
    """§3/§4 on random requests: see the module doc."""
    generator = Generator(family, random.Random(f"{SEED}:{family.name}"))
    cases = [generator.case() for _ in range(REQUESTS)]
    for case in cases:
        settle(family, case)
    first = await ask_server(family, cases, list(range(len(cases))))
    order = list(range(len(cases)))
    generator.rng.shuffle(order)
    again = [n for n in order if cases[n].code is None]
    second = await ask_server(family, [cases[n] for n in again], [f"again-{n}" for n in again])
    problems = [problem for n, case in enumerate(cases) for problem in judge(family, case, first[n])]
    problems += [f"(second batch) {problem}" for n in again
                 for problem in judge(family, cases[n], second[f"again-{n}"])]
    assert not problems, f"{len(problems)} problems; {reproduce(family.name)}\n" + "\n".join(problems[:15])
