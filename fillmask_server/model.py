"""The fill-mask model: loading, batched prediction equal to the transformers pipeline's.

``FillMaskModel`` is owned by the engine thread; nothing else calls it (the tokenizer and torch are
not used from two threads). Its ``predict`` returns, for each text of a batch, exactly what
``pipeline("fill-mask")(text, top_k=..., targets=...)`` returns for that text alone
(``transformers/pipelines/fill_mask.py``: softmax over the vocabulary at each mask, optional
restriction to target ids, top-k, then one decode per candidate), with two differences in *how*:

- The encoder runs once per batch on padded inputs, and the MLM head only on the hidden states at
  mask positions (for architectures whose head is a separate per-position module), instead of on
  every position of every text.
- Softmax and top-k run once over all mask rows of the batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Model types whose ``*ForMaskedLM.forward`` is exactly ``head(encoder(...).last_hidden_state)``
# with a per-position head, so the head may run on the mask positions alone.
_HEAD_ATTRIBUTE = {"bert": "cls", "roberta": "lm_head", "xlm-roberta": "lm_head", "camembert": "lm_head"}


class ModelLoadError(Exception):
    """The model could not be loaded; ``str(error)`` is one line for the operator."""


@dataclass(frozen=True)
class Item:
    """One text of a batch: its token ids (with special tokens), top_k, and target ids or None."""

    input_ids: Sequence[int]
    top_k: int
    target_ids: tuple[int, ...] | None = None


class TargetError(ValueError):
    """No target of a request maps to a vocabulary token."""


class FillMaskModel:
    """A tokenizer and a masked-LM model on one device. Not thread-safe: one owner thread."""

    def __init__(self, name: str, tokenizer: Any, model: Any, device: str, dtype: str) -> None:
        import torch

        self.name = name
        # A checkpoint made by ``fillmask_server.checkpoint`` says its weights are random (hello tells clients).
        self.random_weights = getattr(model.config, "fillmask_random_weights", False) is True
        self.tokenizer = tokenizer
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.mask_token: str = tokenizer.mask_token
        self.mask_token_id: int = tokenizer.mask_token_id
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.vocab_size: int = model.config.vocab_size
        self.max_tokens: int = _max_tokens(tokenizer, model.config)
        self._wants_token_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        head_attr = _HEAD_ATTRIBUTE.get(model.config.model_type)
        self._head = getattr(model, head_attr, None) if head_attr else None
        self._encoder = model.base_model if self._head is not None else None
        self._token_str = lru_cache(maxsize=65536)(self._decode_one)
        self._target_ids = lru_cache(maxsize=1024)(self._resolve_targets)

    # --- tokenizing ------------------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with special tokens, unpadded and untruncated (one batched call)."""
        encoded = self.tokenizer(texts, add_special_tokens=True, return_attention_mask=False,
                                 return_token_type_ids=False, verbose=False)
        return encoded["input_ids"]

    def target_ids(self, targets: tuple[str, ...]) -> tuple[int, ...]:
        """The pipeline's ``get_target_ids``: vocab id, else first token; deduplicated. Cached."""
        return self._target_ids(targets)

    def _resolve_targets(self, targets: tuple[str, ...]) -> tuple[int, ...]:
        vocab = self.tokenizer.get_vocab()
        ids: list[int] = []
        for target in targets:
            id_ = vocab.get(target)
            if id_ is None:
                pieces = self.tokenizer(target, add_special_tokens=False, return_attention_mask=False,
                                        return_token_type_ids=False, max_length=1, truncation=True)["input_ids"]
                if not pieces:
                    continue
                id_ = pieces[0]
            ids.append(id_)
        unique = list(set(ids))  # the pipeline's order, which decides ties in top-k
        if not unique:
            raise TargetError("none of the targets is a token of this model's vocabulary")
        return tuple(unique)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # --- predicting ------------------------------------------------------------------------------

    def predict(self, items: Sequence[Item]) -> list[Any]:
        """Pipeline-equal predictions for each item; every item must hold at least one mask token."""
        import torch

        lengths = [len(item.input_ids) for item in items]
        ids = torch.full((len(items), max(lengths)), self.pad_token_id, dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : lengths[row]] = torch.as_tensor(item.input_ids, dtype=torch.long)
        attention = (torch.arange(ids.shape[1]) < torch.as_tensor(lengths)[:, None]).long()
        rows, cols = (ids == self.mask_token_id).nonzero(as_tuple=True)
        inputs: dict[str, Any] = {"input_ids": ids.to(self.device), "attention_mask": attention.to(self.device)}
        if self._wants_token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            at_masks = (rows.to(self.device), cols.to(self.device))
            if self._head is not None:
                logits = self._head(self._encoder(**inputs).last_hidden_state[at_masks])
            else:
                logits = self.model(**inputs).logits[at_masks]
            # float32 softmax whatever the weights' dtype: reduced-precision modes lose digits in the
            # encoder only. For float32 models this is exactly the pipeline's computation.
            probs = logits.float().softmax(dim=-1).cpu()
            spans = _spans(rows.tolist(), len(items))
            plain = [row for row, item in enumerate(items) if item.target_ids is None]
            top: dict[int, tuple[list[list[float]], list[list[int]]]] = {}
            if plain:  # one top-k for every row without targets, sliced per request below
                k = min(max(items[row].top_k for row in plain), probs.shape[-1])
                picked = torch.cat([torch.arange(*spans[row]) for row in plain])
                values, indices = probs[picked].topk(k)
                values_list, indices_list = values.tolist(), indices.tolist()
                offset = 0
                for row in plain:
                    count = spans[row][1] - spans[row][0]
                    top[row] = (values_list[offset: offset + count], indices_list[offset: offset + count])
                    offset += count
            cols_list = cols.tolist()
            results: list[Any] = []
            for row, item in enumerate(items):
                first, last = spans[row]
                if row in top:
                    values_rows, indices_rows = top[row]
                    scores = [v[: item.top_k] for v in values_rows]
                    tokens = [i[: item.top_k] for i in indices_rows]
                else:
                    scores, tokens = self._top_targets(probs[first:last], item)
                results.append(self._describe(item, cols_list[first:last], scores, tokens))
        return results

    def _top_targets(self, probs: Any, item: Item) -> tuple[list[list[float]], list[list[int]]]:
        """The pipeline's top-k restricted to target ids (top_k shrinks to the number of targets)."""
        targets = list(item.target_ids or ())
        values, picks = probs[..., targets].topk(min(item.top_k, len(targets)))
        return values.tolist(), [[targets[p] for p in row] for row in picks.tolist()]

    def _describe(self, item: Item, positions: list[int], scores: list[list[float]],
                  tokens: list[list[int]]) -> Any:
        """The pipeline's output dictionaries: one list per mask, or the list itself for one mask."""
        single_mask = len(positions) == 1
        ids = list(item.input_ids)
        result = []
        for position, row_scores, row_tokens in zip(positions, scores, tokens, strict=True):
            row = []
            original = ids[position]
            for score, token in zip(row_scores, row_tokens, strict=True):
                ids[position] = token
                row.append({"score": score, "token": token, "token_str": self._token_str(token),
                            "sequence": self.tokenizer.decode(ids, skip_special_tokens=single_mask)})
            ids[position] = original
            result.append(row)
        return result[0] if single_mask else result


def _spans(rows: list[int], count: int) -> list[tuple[int, int]]:
    """For each of ``count`` items, the [first, last) range of its mask rows in the sorted ``rows``."""
    spans = []
    first = 0
    for item in range(count):
        last = first
        while last < len(rows) and rows[last] == item:
            last += 1
        spans.append((first, last))
        first = last
    return spans


def _max_tokens(tokenizer: Any, config: Any) -> int:
    """Longest input the model accepts, special tokens included."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 1_000_000:
        return limit
    positions = getattr(config, "max_position_embeddings", 512)
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        positions -= config.pad_token_id + 1  # position ids start after the padding index
    return positions


def resolve_device(device: str) -> str:
    """``auto`` picks cuda when available, else cpu; anything else is passed to torch as is."""
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name: str, device: str = "auto", dtype: str = "float32", threads: int = 0) -> FillMaskModel:
    """Load tokenizer and masked-LM model once; raise ``ModelLoadError`` with one readable line."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    if dtype == "int8" and not device.startswith("cpu"):
        raise ModelLoadError("--dtype int8 (dynamic quantisation) runs on the CPU only; use --device cpu")
    try:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                       "int8": torch.float32}[dtype]
        torch.empty(1, device=device)
    except (KeyError, RuntimeError, AssertionError) as exc:  # torch asserts when built without CUDA
        raise ModelLoadError(f"cannot use --device {device} with --dtype {dtype}: {_first_line(exc)}") from None
    local = Path(name).expanduser().is_dir()
    if not local and name.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"cannot load model {name!r}: no such directory; {_HINT}")
    if not local and not _hub_reachable():
        raise ModelLoadError(f"cannot load model {name!r}: it is not a local directory and the Hugging Face Hub "
                             f"cannot be reached from here; {_HINT}")
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        model_config = AutoConfig.from_pretrained(name)
    except Exception as exc:  # corrupt files raise library-specific errors: all become one line
        raise ModelLoadError(_explain_load_failure(name, exc)) from None
    if type(model_config) not in MODEL_FOR_MASKED_LM_MAPPING:
        raise ModelLoadError(f"model {name!r} ({model_config.model_type}) has no masked-language-model head, so "
                             "it cannot fill masks; point --model at a fill-mask model such as "
                             "google-bert/bert-base-uncased")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForMaskedLM.from_pretrained(name, config=model_config, dtype=torch_dtype)
    except Exception as exc:  # corrupt files raise library-specific errors: all become one line
        raise ModelLoadError(_explain_load_failure(name, exc)) from None
    if getattr(tokenizer, "mask_token_id", None) is None:
        raise ModelLoadError(f"model {name!r} has a tokenizer without a mask token, so it cannot fill masks; "
                             "use a fill-mask model such as google-bert/bert-base-uncased")
    model = model.to(device).eval()
    if dtype == "int8":
        model = _quantize_dynamic(model)
    log.info("loaded %s on %s (%s)", name, device, dtype)
    return FillMaskModel(name, tokenizer, model, device, dtype)


def _quantize_dynamic(model: Any) -> Any:
    """int8 weights for every Linear layer, activations quantised on the fly (CPU)."""
    import warnings

    import torch
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its own deprecation
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


_HINT = ("point --model at a local directory holding config.json, the weights and the tokenizer files "
         "(make an offline test model with: python -m fillmask_server.checkpoint tiny models/tiny)")


def _explain_load_failure(name: str, exc: BaseException) -> str:
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"cannot load model from directory {name!r}: it has no config.json; {_HINT}"
        return f"cannot load model from directory {name!r}: {_first_line(exc)}; {_HINT}"
    return (f"cannot load model {name!r}: it is not a local directory and could not be fetched from the "
            f"Hugging Face Hub (offline, or no such model); {_HINT}")


def _hub_reachable() -> bool:
    """False when the Hub is surely out of reach: offline mode, or its host name does not resolve.

    Without this check an offline machine spends most of a minute in the Hub client's retries before
    failing. A model already in the local cache still loads in offline mode, so offline mode only
    skips the probe.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True  # from_pretrained looks in the cache only, and fails fast if it is not there
    host = urlparse(constants.ENDPOINT).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True
