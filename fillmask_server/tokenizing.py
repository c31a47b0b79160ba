"""A fast equivalent of a slow (pure Python) tokenizer whose vocabulary is matched whole, checked at load.

Most fill-mask checkpoints come with a Rust ("fast") tokenizer. Some do not: ESM's protein tokenizer is
pure Python, and it holds the GIL for every text it splits, which the server's other stages then wait
for. Such a tokenizer splits a text at every vocabulary token it holds (ESM's trie is the whole
vocabulary: one token per residue), splits what is left on whitespace, and maps each leftover word to
the unknown token. ``fast_equivalent`` builds that rule with ``tokenizers`` (every vocabulary token an
added token, a word-level model with the unknown token, splitting at Python's whitespace, the tokenizer's own
special-token template) and keeps it only if it gives the very ids of the slow tokenizer on a few
hundred check texts: the vocabulary's tokens in random orders, with spaces, tabs, newlines, lower case,
letters of other scripts and unknown symbols. Any other slow tokenizer (WordPiece, SentencePiece, ...)
fails that check and keeps its own path.

A fast tokenizer is called through its Rust backend directly (``direct_backend``): transformers' call
wraps each text's encoding in Python objects (a dict per text, the batch's lists) while holding the
GIL, several microseconds a text that the tokenizer stage spends on every request. The backend copy
has truncation and padding off, and is kept only if it gives the tokenizer's own ids on the check
texts (special tokens, whitespace, unknown symbols).

Only ``FillMaskModel.tokenize`` (the hot path) uses either; targets and decoding keep the tokenizer
itself.
"""

from __future__ import annotations

import copy
import logging
import random
from typing import Any

log = logging.getLogger(__name__)

CHECK_TEXTS = 400
_SENTINEL = -7  # an id no vocabulary has: where the text goes in the special-token template
# Every character Python's ``str.split()`` splits on (what slow tokenizers split words with) is here,
# with a few it does not: a candidate that splits on another whitespace (Rust's has no U+001C–U+001F)
# fails the check. Found by a differential run, when the list had only space, tab, newline and NBSP.
_WHITESPACE = ["\t", "\n", "\x0b", "\x0c", "\r", "\x1c", "\x1d", "\x1e", "\x1f", " ", "\x85", "\xa0", "\u1680",
               *(chr(c) for c in range(0x2000, 0x200B)), "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
_ODD = [*_WHITESPACE, "  ", " \u00a0", "\u200b", "\u180e", "\ufeff",
        "x", "q", "é", "中", "🙂", "<", ">", "##", "1", "?", "_"]


def fast_equivalent(tokenizer: Any) -> Any | None:
    """A ``tokenizers.Tokenizer`` giving ``tokenizer``'s ids (special tokens added) on every check
    text, or None: the tokenizer is fast already, or no such equivalent was found."""
    if getattr(tokenizer, "is_fast", True):
        return None
    try:
        candidate = _whole_token_tokenizer(tokenizer)
    except Exception as exc:  # a tokenizer of another kind: no such rule
        log.debug("no fast equivalent of %s: %s", type(tokenizer).__name__, exc)
        return None
    if candidate is None:
        return None
    texts = check_texts(tokenizer)
    want, got = token_ids(tokenizer, texts), token_ids(candidate, texts)
    if got != want:
        log.debug("the fast equivalent of %s differs on %d of %d check texts", type(tokenizer).__name__,
                  sum(a != b for a, b in zip(got, want, strict=True)), len(texts))
        return None
    return candidate


def direct_backend(tokenizer: Any) -> Any | None:
    """A copy of a fast tokenizer's ``tokenizers.Tokenizer`` (truncation and padding off) that gives the
    tokenizer's own ids on every check text, or None: the tokenizer is slow, or its call does more than
    its backend (the check found a text where they differ)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return None
    try:
        direct = _backend_copy(backend)
        direct.no_truncation()
        direct.no_padding()
        texts = check_texts(tokenizer)
        same = token_ids(direct, texts) == token_ids(tokenizer, texts)
    except Exception as exc:  # a backend that cannot be copied or called alone: keep transformers' call
        log.debug("%s is called through transformers: %s", type(tokenizer).__name__, exc)
        return None
    if not same:
        log.info("%s's backend alone splits some check text differently from its own call; texts go through "
                 "transformers' call", type(tokenizer).__name__)
        return None
    return direct


def _backend_copy(backend: Any) -> Any:
    """A copy of ``backend`` that the server may reconfigure (the tokenizer keeps its own)."""
    return copy.deepcopy(backend)


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids, special tokens added, unpadded and untruncated, in one batched call: through
    transformers' tokenizer, or a ``tokenizers.Tokenizer`` (``fast_equivalent``'s or
    ``direct_backend``'s) directly, without offsets where the library can leave them out."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # tokenizers >= 0.21
        return [encoding.ids for encoding in encode(texts, add_special_tokens=True)]
    ids: list[list[int]] = tokenizer(texts, add_special_tokens=True, return_attention_mask=False,
                                     return_token_type_ids=False, verbose=False)["input_ids"]
    return ids


def check_texts(tokenizer: Any, n: int = CHECK_TEXTS, seed: int = 0) -> list[str]:
    """Texts of the tokenizer's own tokens (special ones too) mixed with whitespace, lower case and
    symbols it may not know; deterministic for ``seed``. Every piece of ``_ODD`` is in them, between
    two tokens, however large the vocabulary (the random texts alone would miss some)."""
    rng = random.Random(seed)
    tokens = sorted(tokenizer.get_vocab())
    pieces = tokens + [token.lower() for token in tokens] + _ODD
    between = "".join(f"{tokens[n % len(tokens)]}{piece}" for n, piece in enumerate(_ODD)) + tokenizer.mask_token
    texts = ["", " ", tokenizer.mask_token, f" {tokenizer.mask_token} ", "".join(tokens), " ".join(tokens), between]
    while len(texts) < n:
        texts.append("".join(rng.choice(pieces if rng.random() < 0.3 else tokens)
                             for _ in range(rng.randint(1, 40))))
    return texts


def _whole_token_tokenizer(tokenizer: Any) -> Any | None:
    """The candidate rule (module doc); None when the tokenizer has no unknown token."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, processors

    vocab = tokenizer.get_vocab()
    unk = tokenizer.unk_token
    if unk is None or unk not in vocab:
        return None
    fast = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    # Python's whitespace: Rust's (``WhitespaceSplit``) and U+001C–U+001F, which ``str.split()`` splits on too
    fast.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\x1c-\x1f]+"), behavior="removed")
    specials = set(tokenizer.all_special_tokens)
    by_length = sorted(vocab, key=len, reverse=True)  # (the added vocabulary matches the longest first)
    fast.add_tokens([AddedToken(token, normalized=False) for token in by_length if token not in specials])
    fast.add_special_tokens([AddedToken(token, normalized=False) for token in by_length if token in specials])
    template = tokenizer.build_inputs_with_special_tokens([_SENTINEL])
    at = template.index(_SENTINEL)
    names = {id_: token for token, id_ in vocab.items()}
    before, after = [names[id_] for id_ in template[:at]], [names[id_] for id_ in template[at + 1:]]
    fast.post_processor = processors.TemplateProcessing(
        single=" ".join([*before, "$A", *after]),
        special_tokens=[(token, vocab[token]) for token in dict.fromkeys(before + after)])
    return fast
