"""The tokenizer stage's work, as plain functions: tokenize new requests in one call and check them.

Run on the tokenizer stage's thread (``engine.Engine``), never on the event loop or the model thread:
the fast tokenizer's batch call releases the GIL while it works. Every check of protocol.md §3 that
needs tokens happens here, so the model's queue only ever holds requests that can run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .items import TargetError
from .protocol import FillMaskRequest, TargetNote, targets_field

if TYPE_CHECKING:  # (the engine core imports this module and needs no model)
    from .model import FillMaskModel

log = logging.getLogger(__name__)


# JSON of one candidate besides its two strings: {"score":…,"token":…,"token_str":,"sequence":}, with the
# longest float repr (22 characters), a token id of up to 10 digits, and the separators.
CANDIDATE_OVERHEAD_BYTES = 96


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Checked:
    """A request that may run: what the model and the batching policy need of it."""

    input_ids: list[int]
    masks: int
    target_ids: tuple[int, ...] | None
    result_bytes: int  # an upper bound on the JSON of its predictions (``result_bound``) and target_notes
    target_notes: tuple[TargetNote, ...] = ()  # targets not scored as given (§4 ``result.targets``)


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Refusal:
    """A request that may not run: the §7 error code and the one-line message for the client."""

    code: str
    message: str


def request_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by one request's work (tokenizing, checking, decoding), fails only that
    request: any ``Exception``, and a panic in a Rust library such as ``tokenizers``. pyo3 raises a
    panic as its own ``PanicException``, a ``BaseException`` (not importable by name), which an
    ``except Exception`` lets through: it would end the stage's thread, and the engine with it."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def tokenize_all(model: FillMaskModel, texts: list[str]) -> list[list[int] | None]:
    """Token ids of each text in one batched call; if that fails, text by text (None for a text that
    cannot be tokenized), so one bad text fails only itself."""
    try:
        return list(model.tokenize(texts))
    except BaseException as exc:
        if not request_fault(exc):
            raise
        log.exception("the tokenizer failed on a batch of %d texts; retrying them one by one", len(texts))
    out: list[list[int] | None] = []
    for text in texts:
        try:
            out.append(model.tokenize([text])[0])
        except BaseException as exc:
            if not request_fault(exc):
                raise
            out.append(None)
    return out


def result_bound(model: FillMaskModel, ids: list[int], masks: int, candidates: int) -> int:
    """An upper bound on the JSON size of a request's predictions, known before the model runs.

    Each candidate's ``sequence`` is the text decoded with the candidate in a mask's place: at most the
    sum of its tokens' JSON lengths, each with a joining space (decoding glues pieces, drops special
    tokens and cleans spaces up, never adds more), plus one token; its ``token_str`` is one token. So:
    masks x candidates x (overhead + text + 2 x the longest token), in JSON bytes, without decoding.
    """
    sizes = model.token_json_bytes
    if ids and min(ids) >= 0 and max(ids) < len(sizes):  # every id in the vocabulary: the usual case, in C
        text = sum(map(sizes.__getitem__, ids))
    else:
        text = sum(sizes[i] if 0 <= i < len(sizes) else model.longest_token_json for i in ids)
    return masks * candidates * (CANDIDATE_OVERHEAD_BYTES + text + 2 * model.longest_token_json)


#: ``text_too_long``'s word for whose limit ``FillMaskModel.max_tokens`` is (no file or key names: §7).
LIMIT_SOURCES = {"tokenizer": "its tokenizer's limit", "positions": "the positions it has room for",
                 "declared": "the length it was made for"}


def check(model: FillMaskModel, request: FillMaskRequest, ids: list[int] | None, max_masks: int,
          max_result_bytes: int) -> Checked | Refusal:
    """The §3 checks that need the tokenizer, in this order: tokenizable, every token within the model's
    embeddings, length, masks, targets, result size."""
    if ids is None:
        return Refusal("internal_error", "the model's tokenizer failed on this text (logged on the server); other "
                       "requests are unaffected; this text will fail the same way again")
    highest = max(ids, default=0)
    if highest >= model.vocab_size:  # a tokenizer that knows more tokens than its model
        token = model.tokenizer.convert_ids_to_tokens(highest)
        return Refusal("invalid_field", f"the text holds the token {str(token)[:100]!r}, which this model's tokenizer "
                       "knows but the model has no embedding for; leave it out")
    if len(ids) > model.max_tokens:
        return Refusal("text_too_long", f"the text is {len(ids)} tokens long; this model accepts at most "
                       f"{model.max_tokens} ({LIMIT_SOURCES[model.max_tokens_source]}); shorten it")
    masks = ids.count(model.mask_token_id)
    if masks == 0:
        return Refusal("no_mask", f"the text has no {model.mask_token} token after tokenizing; write "
                       f"{model.mask_token} exactly, with spaces around it")
    if masks > max_masks:
        return Refusal("too_many_masks", f"the text has {masks} mask tokens after tokenizing; the limit is "
                       f"{max_masks} per request: remove some, or split the text over several requests")
    target_ids = None
    notes: tuple[TargetNote, ...] = ()
    if request.targets is not None:
        try:
            target_ids = model.target_ids(request.targets)
            notes = model.target_notes(request.targets)
        except TargetError as exc:
            return Refusal("invalid_targets", f"{exc}; use words from the vocabulary")
        except BaseException as exc:  # (the tokenizer failed on a target, as ``tokenize_all`` on a text)
            if not request_fault(exc):
                raise
            log.exception("the tokenizer failed on the targets of a request")
            return Refusal("internal_error", "the model's tokenizer failed on these targets (logged on the server); "
                           "other requests are unaffected; these targets will fail the same way again")
    candidates = min(request.top_k, len(target_ids) if target_ids is not None else model.vocab_size)
    bound = result_bound(model, ids, masks, candidates) + len(targets_field(notes))  # notes count too (§3)
    if bound > max_result_bytes:
        return Refusal("result_too_large", f"the answer could be up to {bound} bytes, more than this server's "
                       f"{max_result_bytes} (limits.max_result_bytes); ask for a smaller top_k, fewer masks or "
                       "a shorter text")
    return Checked(ids, masks, target_ids, bound, notes)
