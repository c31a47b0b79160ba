"""A deterministic, mixed corpus of fill-mask texts: short and long sentences, one and two masks.

The same seed gives the same list on every machine, so the pipeline and the server see the same
texts in the same order. No text appears twice, so no text follows itself; the generated texts are
shuffled so that lengths and mask counts are interleaved, as a real request stream's would be.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

MASK = "[MASK]"

_SUBJECTS = ["the old farmer", "my sister", "the new teacher", "a tired doctor", "our neighbour", "the young pilot",
             "the city council", "a small child", "the chef", "the museum guide", "his grandfather", "the captain",
             "the engineer", "a quiet student", "the band", "the writer"]
_VERBS = ["bought", "painted", "found", "repaired", "sold", "carried", "described", "forgot", "opened", "cleaned",
          "borrowed", "visited", "photographed", "ordered", "washed", "measured"]
_OBJECTS = ["a red bicycle", "the wooden door", "an old map", "the broken clock", "a warm coat", "the garden fence",
            "a silver ring", "the kitchen table", "a long letter", "the blue boat", "a heavy box", "the school bus"]
_PLACES = ["in the morning", "near the river", "before the storm", "after lunch", "at the market", "in the village",
           "during the holiday", "on the hill", "behind the station", "across the bridge", "at the airport",
           "by the lake"]
_REASONS = ["because it was cheap", "although nobody asked", "since the weather was fine", "so that everyone could see",
            "while the others were sleeping", "even though it was late", "as the sun went down",
            "before anyone else arrived"]
_TAILS = ["and then went home to rest for a while", "and told the whole story to the family at dinner",
          "and wrote about it in a small notebook that was kept on the shelf",
          "and nobody in the town ever forgot what happened on that day",
          "and the children laughed about it for many weeks afterwards",
          "and later that evening the rain started to fall on the empty streets"]
_FACTS = ["paris is the [MASK] of france.", "the sun rises in the [MASK].", "water boils at one hundred [MASK].",
          "a week has seven [MASK].", "cats like to drink [MASK].", "the sky is [MASK] today.",
          "she plays the [MASK] very well.", "we went to the [MASK] yesterday.", "he is a famous [MASK].",
          "i would like a cup of [MASK]."]


def _mask_one(words: list[str], rng: random.Random, avoid: set[int]) -> int:
    """Replace one word not in ``avoid`` (and not already a mask) by the mask token; return its index."""
    candidates = [i for i, word in enumerate(words) if i not in avoid and word != MASK and word.isalpha()]
    index = rng.choice(candidates)
    words[index] = MASK
    return index


def _sentence(rng: random.Random, kind: str) -> str:
    """One sentence of ``kind``: ``short`` (about 5-9 words), ``medium`` (10-20) or ``long`` (25-50)."""
    subject, verb, obj, place = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_PLACES)
    if kind == "short":
        return f"{subject} {verb} {obj}."
    if kind == "medium":
        return f"{subject} {verb} {obj} {place} {rng.choice(_REASONS)}."
    parts = [f"{subject} {verb} {obj} {place} {rng.choice(_REASONS)}, {rng.choice(_TAILS)}"]
    for _ in range(rng.randint(1, 2)):
        parts.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)} "
                     f"{rng.choice(_TAILS)}")
    return "; ".join(parts) + "."


def make_corpus(n: int = 200, seed: int = 0, two_mask_share: float = 0.3) -> list[str]:
    """``n`` distinct texts: about 35% short, 40% medium, 25% long; ``two_mask_share`` with two masks.

    Some short texts are fixed fact sentences (the classic fill-mask examples); the rest are built
    from templates. Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    kinds = ["short"] * 35 + ["medium"] * 40 + ["long"] * 25
    facts = _FACTS[: max(0, min(len(_FACTS), n // 20))]

    def one() -> str:
        words = _sentence(rng, rng.choice(kinds)).split(" ")
        first = _mask_one(words, rng, set())
        if rng.random() < two_mask_share:
            _mask_one(words, rng, {first - 1, first, first + 1})
        return " ".join(words)

    return _distinct(n, rng, one, facts)


def make_short_corpus(n: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct short texts of similar length, one mask each: 8-16 tokens with the special tokens.

    The corpus on which ``pipeline(list, batch_size=N)`` pads little, so batching buys the server less
    than on the mixed corpus (issue 9 measures both). Sentences of 4-13 words; deterministic for ``seed``.
    """
    rng = random.Random(seed)

    def one() -> str:
        words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}".split(" ")
        if rng.random() < 0.5:
            words += rng.choice(_PLACES).split(" ")
        if rng.random() < 0.3:
            words += rng.choice(["today", "again", "quickly", "and then left", "with great care"]).split(" ")
        words = words[:13]  # with the period and the two special tokens: at most 16
        _mask_one(words, rng, set())
        return " ".join(words) + "."

    return _distinct(n, rng, one)


def _distinct(n: int, rng: random.Random, make: Callable[[], str], first: Sequence[str] = ()) -> list[str]:
    """``first``, then texts from ``make`` (capitalised) until ``n`` distinct ones, shuffled by ``rng``."""
    texts = list(first)
    seen = set(texts)
    attempts = 0
    while len(texts) < n and attempts < 100 * n:
        attempts += 1
        text = make()
        text = text[0].upper() + text[1:] if text[0].isalpha() else text
        if text not in seen:
            seen.add(text)
            texts.append(text)
    if len(texts) < n:
        raise RuntimeError(f"could only make {len(texts)} distinct texts out of {n}")
    rng.shuffle(texts)
    return texts


CORPORA = {"mixed": make_corpus, "short": make_short_corpus}


def corpus_stats(texts: list[str], token_counts: list[int] | None = None) -> dict[str, Any]:
    """Summary of a corpus for the report: sizes, mask counts and (when given) token lengths."""
    masks = [text.count(MASK) for text in texts]
    stats: dict[str, Any] = {
        "texts": len(texts),
        "one_mask": sum(1 for m in masks if m == 1),
        "two_masks": sum(1 for m in masks if m == 2),
        "chars_min": min(len(t) for t in texts),
        "chars_max": max(len(t) for t in texts),
    }
    if token_counts:
        ordered = sorted(token_counts)
        stats.update({
            "tokens_min": ordered[0],
            "tokens_p50": statistics.median(ordered),
            "tokens_mean": round(statistics.fmean(ordered), 1),
            "tokens_max": ordered[-1],
        })
    return stats
