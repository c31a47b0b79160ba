"""Turning a batch's top-k into the pipeline's predictions, as JSON bytes (the decode stage's work).

The pipeline builds each candidate's ``sequence`` by decoding the whole text again with the candidate
put in the mask's place: ``tokenizer.decode(ids, skip_special_tokens=single_mask)`` after dropping
padding ids (``FillMaskPipeline.postprocess``). For 8 masks x 100 candidates that is 800 full decodes.

``SequenceDecoder`` gives the same strings, byte for byte, from one decode of the text with a slot.
For a fast tokenizer whose decoder works piece by piece (``PIECEWISE``: WordPiece for BERT and its
relatives, Metaspace for the SentencePiece families such as XLM-R, ALBERT and DeBERTa, ByteLevel for
RoBERTa and ModernBERT), or a tokenizer written in Python whose decoding the self-check below finds
piecewise (ESM's: its tokens joined with spaces), decoding is, exactly:

1. ids → token strings, dropping ids the tokenizer cannot map and, when skipping, special tokens;
2. each token → a *piece* that depends only on the token and on whether it comes first (WordPiece:
   ``##`` glued on, others after a space, then its cleanup, per piece; Metaspace: ``▁`` is a space,
   dropped at the start; ByteLevel: the token's bytes, which stand alone only when they are whole
   UTF-8 characters, so a token whose piece holds U+FFFD, a broken character, is never a piece);
3. the pieces joined with ``""``;
4. when the tokenizer's ``clean_up_tokenization_spaces`` is set, transformers' whole-string cleanup.

So with ``left`` and ``right`` the joined pieces around the mask, a candidate's sequence is
``cleanup(left + piece(candidate) + right)``. Pieces come from the tokenizer's own decoder (one call per
vocabulary id, cached), not from a re-implementation. The few candidates that would change what is
dropped around them (a special token while skipping, the padding id, an unmappable id) or that are
not whole pieces take the pipeline's own path, and so does a text with such a token around the mask.
On start-up the fast path is checked against ``tokenizer.decode`` on random
sequences; any difference (an unknown tokenizer, a new library version) turns it off for good.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .items import Item, TopK

log = logging.getLogger(__name__)

_ANCHOR = "a"  # a plain token: decode([ANCHOR, t]) is ANCHOR followed by t's non-first piece
PIECEWISE = ("WordPiece", "Metaspace", "ByteLevel")  # decoders whose output is one piece per token
_BROKEN = "\ufffd"  # what a ByteLevel piece holds for bytes that are not a whole UTF-8 character
_UNSEEN: Any = object()  # not in a piece cache yet (typed Any: a cache's get gives it back, never kept)


class SequenceDecoder:
    """``sequences`` returns exactly the pipeline's ``sequence`` for each candidate (see the module doc).

    Not thread-safe (caches); owned by the decode stage, with a tokenizer no other thread uses.
    """

    def __init__(self, tokenizer: Any, self_check: int = 300) -> None:
        self.tokenizer = tokenizer
        self.pad_id: int | None = tokenizer.pad_token_id
        self._token_str: dict[int, str] = {}
        self._first: dict[int, str] = {}
        self._rest: dict[int, str] = {}
        self._mapped: dict[int, bool] = {}  # id -> whether the vocabulary has a token for it
        # (first, skip_special) -> id -> its piece there, or None where the id is dropped (``_piece_or_drop``)
        self._pieces: dict[tuple[bool, bool], dict[int, str | None]] = {
            (first, skip): {} for first in (False, True) for skip in (False, True)}
        self.fast = self._can_slot()
        if self.fast and self_check:
            mismatch = self._self_check(self_check)
            if mismatch is not None:
                log.warning("decoding each candidate in full (as the pipeline does): the one-decode shortcut "
                            "differs from the tokenizer on %r", mismatch)
                self.fast = False

    def _can_slot(self) -> bool:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self._can_slot_python()
        decoder: Any = getattr(backend, "decoder", None)
        if type(decoder).__name__ not in PIECEWISE:
            return False
        self._python_anchor: int | None = None
        self._backend: Any = backend
        self._decoder = decoder
        # One past the largest id (a vocabulary may have gaps, and then its size is smaller than that).
        self._vocab_size = max(self.tokenizer.get_vocab().values(), default=-1) + 1
        self._special = {id_ for id_, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        self._anchor_len = len(decoder.decode([_ANCHOR]))
        self._cleanup = self._whole_string_cleanup()
        return True

    def _can_slot_python(self) -> bool:
        """A tokenizer written in Python (ESM's, which joins tokens with spaces): pieces from its own
        ``decode``, next to a plain anchor token; only without the whole-string cleanup, which a piece
        cannot carry. The start-up self-check decides whether its decoding is piecewise at all."""
        tokenizer = self.tokenizer
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return False
        self._special = set(tokenizer.all_special_ids)
        self._vocab_size = len(tokenizer)
        plain = [id_ for id_ in range(self._vocab_size) if id_ not in self._special and id_ != self.pad_id]
        if not plain:
            return False
        self._python_anchor = plain[0]
        self._anchor_len = len(tokenizer.decode([self._python_anchor]))
        self._cleanup = None
        return True

    def _whole_string_cleanup(self) -> Callable[[str], str] | None:
        """transformers' own rule (``TokenizersBackend._decode``): cleanup when the flag is set, except for BPE."""
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        if type(self._backend.model).__name__ == "BPE" and not getattr(
                tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
            return None
        clean: Callable[[str], str] = tokenizer.clean_up_tokenization
        return clean

    def token_str(self, token: int) -> str:
        """The pipeline's ``token_str``: ``decode([token])``."""
        text = self._token_str.get(token)
        if text is None:
            text = self._token_str[token] = self.tokenizer.decode([token])
        return text

    def sequences(self, ids: Sequence[int], position: int, candidates: Sequence[int], skip_special: bool) -> list[str]:
        """For each candidate, the text ``ids`` decoded with the candidate at ``position``."""
        slot = self._slot(ids, position, skip_special) if self.fast else None
        if slot is None:
            return [self._full(ids, position, c, skip_special) for c in candidates]
        left, right, first = slot
        cache = self._pieces[first, skip_special]
        cleanup = self._cleanup
        out = []
        for candidate in candidates:
            piece = cache.get(candidate, _UNSEEN)
            if piece is _UNSEEN:
                piece = self._piece_or_drop(candidate, first, skip_special)
            if piece is None or _BROKEN in piece:
                out.append(self._full(ids, position, candidate, skip_special))
                continue
            text = left + piece + right
            out.append(text if cleanup is None else cleanup(text))
        return out

    def _slot(self, ids: Sequence[int], position: int, skip_special: bool) -> tuple[str, str, bool] | None:
        """The joined pieces left and right of ``position``, and whether the slot comes first; None when
        a token around it is not a whole piece."""
        first, rest = self._pieces[True, skip_special], self._pieces[False, skip_special]
        left: list[str] = []
        for token in ids[:position]:
            piece = (rest if left else first).get(token, _UNSEEN)
            if piece is _UNSEEN:
                piece = self._piece_or_drop(token, not left, skip_special)
            if piece is not None:
                left.append(piece)
        right: list[str] = []
        for token in ids[position + 1:]:
            piece = rest.get(token, _UNSEEN)
            if piece is _UNSEEN:
                piece = self._piece_or_drop(token, False, skip_special)
            if piece is not None:
                right.append(piece)
        joined_left, joined_right = "".join(left), "".join(right)
        if _BROKEN in joined_left or _BROKEN in joined_right:
            return None
        return joined_left, joined_right, not left

    def _piece_or_drop(self, token: int, first: bool, skip_special: bool) -> str | None:
        """``token``'s piece, first in the text or not, or None where decoding drops it (``_kept``);
        cached per (first, skip_special): both depend on the token alone."""
        piece = ((self._first_piece(token) if first else self._rest_piece(token))
                 if self._kept(token, skip_special) else None)
        self._pieces[first, skip_special][token] = piece
        return piece

    def _kept(self, token: int, skip_special: bool) -> bool:
        """Whether ``token`` survives the pipeline's padding filter and the tokenizer's skipping (an id
        the vocabulary has no token for, a gap in it, is dropped as the tokenizer drops it)."""
        if token == self.pad_id or not 0 <= token < self._vocab_size:
            return False
        if self._python_anchor is None:
            mapped = self._mapped.get(token)
            if mapped is None:
                mapped = self._mapped[token] = self._backend.id_to_token(token) is not None
            if not mapped:
                return False
        return not (skip_special and token in self._special)

    def _first_piece(self, token: int) -> str:
        piece = self._first.get(token)
        if piece is None:
            if self._python_anchor is not None:
                piece = self.tokenizer.decode([token])
            else:
                piece = self._decoder.decode([self._backend.id_to_token(token)])
            self._first[token] = piece
        return piece

    def _rest_piece(self, token: int) -> str:
        piece = self._rest.get(token)
        if piece is None:
            if self._python_anchor is not None:
                both = self.tokenizer.decode([self._python_anchor, token])
            else:
                both = self._decoder.decode([_ANCHOR, self._backend.id_to_token(token)])
            piece = self._rest[token] = both[self._anchor_len:]
        return piece

    def _full(self, ids: Sequence[int], position: int, candidate: int, skip_special: bool) -> str:
        """The pipeline's own way: the whole text decoded again, padding ids dropped first."""
        tokens = list(ids)
        tokens[position] = candidate
        text: str = self.tokenizer.decode([t for t in tokens if t != self.pad_id], skip_special_tokens=skip_special)
        return text

    def _self_check(self, cases: int) -> tuple[list[int], int, int, bool] | None:
        """Compare the shortcut with ``_full`` on random texts (special, glued and punctuation tokens
        included); the first case that differs, or None."""
        rng = random.Random(0)
        interesting = sorted(self._special) + [
            id_ for token, id_ in self.tokenizer.get_vocab().items()
            if token.startswith(("##", "\u2581", "\u0120")) or (len(token) == 1 and not token.isalnum())
            or "'" in token or token in ("do", "not", "n", "t", "s", "m", "ve", "re")]
        pool = rng.sample(range(self._vocab_size), min(2000, self._vocab_size)) + interesting
        for _ in range(cases):
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
            position = rng.randrange(len(ids))
            skip = rng.random() < 0.5
            candidates = [rng.choice(pool) for _ in range(3)]
            fast = self.sequences(ids, position, candidates, skip)
            for candidate, text in zip(candidates, fast, strict=True):
                if text != self._full(ids, position, candidate, skip):
                    return ids, position, candidate, skip
        return None


def predictions(decoder: SequenceDecoder, item: Item, topk: TopK, i: int) -> Any:
    """The pipeline's output for item ``i`` of a batch: a list of candidates, or one list per mask.
    (Scores that are not numbers would be JSON's ``null``: the engine answers such an item
    ``internal_error`` first, ``TopK.numbers``.)"""
    positions, scores, tokens = topk.candidates(i, item)
    single = len(positions) == 1
    out = []
    for position, row_scores, row_tokens in zip(positions, scores, tokens, strict=True):
        texts = decoder.sequences(item.input_ids, position, row_tokens, skip_special=single)
        out.append([{"score": score, "token": token, "token_str": decoder.token_str(token), "sequence": text}
                    for score, token, text in zip(row_scores, row_tokens, texts, strict=True)])
    return out[0] if single else out


def predictions_json(decoder: SequenceDecoder, item: Item, topk: TopK, i: int) -> bytes:
    """``predictions`` serialized, the bytes a ``result`` frame carries (§4)."""
    return orjson.dumps(predictions(decoder, item, topk, i))
