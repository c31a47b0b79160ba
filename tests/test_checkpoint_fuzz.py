"""Checkpoint directories broken the ways users' directories really get broken, loaded as the server does.

Each case copies one of the offline family checkpoints (``models/families/``, a BERT of 1,000 tokens by
default) to ``tmp_path`` and breaks it one way: config.json missing, empty, not JSON, of the wrong JSON
kind, with fields of the wrong type or value (``vocab_size``, ``hidden_size``, ``num_attention_heads``,
``max_position_embeddings``, ``pad_token_id``, ``model_type``, ``architectures``, ``dtype``, ...); the
weights missing, zero bytes, truncated, with a bit flipped in the safetensors header, a header claiming
tensors larger than the file, a tensor of the wrong shape or dtype, tensors missing (the MLM head, a
bias, the embeddings), a pickle beside or instead of the safetensors file; the tokenizer files missing,
truncated, not JSON, without a mask token, with a mask token beyond the embeddings, odd
``model_max_length`` values, a broken special_tokens_map.json; the directory a symlink loop, a path with
spaces and Unicode; other families' specifics (RoBERTa's ``pad_token_id`` that moves the position
table's padding index, ESM's ``vocab.txt`` empty, missing or reordered, ...). Fields and files that
loading ignores are grouped into one case each ("noise").

The promise checked for each (README, "Models and offline checkpoints"):

- a checkpoint the server cannot serve is refused with ONE line (``ModelLoadError`` in process; for a
  real ``python ws_server.py`` start, stderr holds the start-up's progress lines and one ``error:``
  line, exit status 1, within a bounded time), naming the problem, without a traceback, without a
  path into site-packages or a quoted Python source file;
- a checkpoint that starts answers every request exactly as ``pipeline("fill-mask")`` on the same
  directory does (tokens and strings equal, scores within 1e-5), on a real socket, with several texts
  in one padded batch.

Most cases load in this process (``load_model``, what ``ws_server.py`` calls; a load of these models is
a fraction of a second); the few whose point is what the process prints (library warnings on stderr, a
traceback) start ``ws_server.py`` in subprocesses, one at a time on a thread of their own while the
in-process cases run. The tests under "bugs found" each failed before its fix (each docstring says what
the server did then, and where).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from fillmask_server.checkpoint import FAMILIES as FAMILY_NAMES
from fillmask_server.checkpoint import ensure_family
from fillmask_server.config import Config
from fillmask_server.diagnosis import ModelLoadError, mistyped_config_field
from fillmask_server.loading import load_model
from fillmask_server.server import FillMaskServer
from tests.wire import assert_same_predictions, recv_n, send, session

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ROOT / "models" / "families"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
TOLERANCE = 1e-5
#: What a line for the operator must never hold: a traceback, a path into the installed libraries, a
#: quoted Python source file (``File "x.py"``).
INTERNALS = ("Traceback", "site-packages", '.py"', ".py:",
             # Python's own words for a value of the wrong type, which name no file or field
             "object has no attribute", "object cannot be interpreted", "is not an instance of", "object is not",
             "not supported between instances", "invalid literal for", "unhashable type", "NoneType",
             "index out of range", "<class '",
             # huggingface_hub's strict dataclasses' wording ("Class validation error for validator 'x':
             # ValueError: ...")
             "alidation error for", "Error: ")
START_TIMEOUT_S = 90

#: A way to break a checkpoint directory in place (what it returns is ignored).
Breakage = Callable[[Path], object]


# --- ways to break a checkpoint directory -----------------------------------------------------------


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def edit_json(name: str, **changes: Any) -> Breakage:
    """Set (or, for ``...``, remove) top-level fields of the JSON file ``name``."""

    def edit(directory: Path) -> None:
        data = _json(directory / name)
        for key, value in changes.items():
            if value is ...:
                data.pop(key, None)
            else:
                data[key] = value
        (directory / name).write_text(json.dumps(data))

    return edit


def config(**changes: Any) -> Breakage:
    return edit_json("config.json", **changes)


def tokenizer_json(change: Callable[[dict[str, Any]], object]) -> Breakage:
    """tokenizer.json, still valid JSON, after ``change`` (which edits its parsed object in place)."""
    def edit(directory: Path) -> None:
        path = directory / "tokenizer.json"
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


def tokenizer_config(**changes: Any) -> Breakage:
    return edit_json("tokenizer_config.json", **changes)


def write(name: str, content: str | bytes) -> Breakage:
    def edit(directory: Path) -> None:
        path = directory / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return edit


def remove(*names: str) -> Breakage:
    def edit(directory: Path) -> None:
        for name in names:
            (directory / name).unlink()

    return edit


def cut(name: str, keep: Callable[[int], int]) -> Breakage:
    """Keep the first ``keep(size)`` bytes of ``name`` (a copy cut short)."""

    def edit(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: keep(len(data))])

    return edit


def flip_byte(name: str, offset: int, bits: int = 0x40) -> Breakage:
    def edit(directory: Path) -> None:
        data = bytearray((directory / name).read_bytes())
        data[offset] ^= bits
        (directory / name).write_bytes(bytes(data))

    return edit


def safetensors_header(change: Callable[[dict[str, Any]], object], length: int | None = None) -> Breakage:
    """Rewrite model.safetensors' JSON header by ``change`` (the data after it as it was); ``length``:
    the 8-byte header length written instead of the true one."""

    def edit(directory: Path) -> None:
        raw = (directory / "model.safetensors").read_bytes()
        size = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8: 8 + size])
        change(header)
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        (directory / "model.safetensors").write_bytes(
            struct.pack("<Q", length if length is not None else len(encoded)) + encoded + raw[8 + size:])

    return edit


def tensors(change: Callable[[dict[str, Any]], object]) -> Breakage:
    """Load model.safetensors, ``change`` its dict of tensors, save it again."""

    def edit(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        weights = load_file(directory / "model.safetensors")
        change(weights)
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

    return edit


def drop(prefix: str) -> Breakage:
    return tensors(lambda weights: [weights.pop(key) for key in list(weights) if key.startswith(prefix)])


def set_tensor(key: str, make: Callable[[Any], Any]) -> Breakage:
    return tensors(lambda weights: weights.__setitem__(key, make(weights[key])))


def all_tensors(make: Callable[[Any], Any]) -> Breakage:
    return tensors(lambda weights: weights.update({key: make(value) for key, value in weights.items()}))


def pickled_weights(keep_safetensors: bool, scale: float = 1.0, protocol: int = 2) -> Breakage:
    """The weights as a pickle (``pytorch_model.bin``), beside the safetensors (multiplied by ``scale``,
    so the two disagree) or instead of it."""

    def edit(directory: Path) -> None:
        import torch
        from safetensors.torch import load_file

        weights = {key: value * scale for key, value in load_file(directory / "model.safetensors").items()}
        torch.save(weights, directory / "pytorch_model.bin", pickle_protocol=protocol)
        if not keep_safetensors:
            (directory / "model.safetensors").unlink()

    return edit


class _RunsACommand:
    """A pickle that would run a command when unpickled without ``weights_only``."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("true",))


def sharded(missing_shard: bool) -> Breakage:
    """model.safetensors as shard 1 of 2 with an index; the index names a second shard that is not there."""

    def edit(directory: Path) -> None:
        raw = (directory / "model.safetensors").read_bytes()
        keys = [key for key in json.loads(raw[8: 8 + struct.unpack("<Q", raw[:8])[0]]) if key != "__metadata__"]
        (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
        weight_map = dict.fromkeys(keys, "model-00001-of-00002.safetensors")
        if missing_shard:
            weight_map["cls.predictions.bias"] = "model-00002-of-00002.safetensors"
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    return edit


def symlink(name: str, target: str) -> Breakage:
    def edit(directory: Path) -> None:
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to(target if target.startswith("/") else directory / target)

    return edit


def directory_instead(name: str) -> Breakage:
    def edit(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).mkdir()

    return edit


def fifo_instead(name: str) -> Breakage:
    def edit(directory: Path) -> None:
        (directory / name).unlink()
        os.mkfifo(directory / name)

    return edit


def without_mask_in_tokenizer_json(directory: Path) -> None:
    data = _json(directory / "tokenizer.json")
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] != "[MASK]"]
    (directory / "tokenizer.json").write_text(json.dumps(data))


def loop_instead(directory: Path) -> None:
    """The model directory itself replaced by a symlink to itself."""
    shutil.rmtree(directory)
    directory.symlink_to(directory)


def both(*edits: Breakage) -> Breakage:
    def edit(directory: Path) -> None:
        for one in edits:
            one(directory)

    return edit


def copy_of(family: str, tmp_path: Path, edit: Breakage, name: str = "model") -> Path:
    directory = tmp_path / name
    shutil.copytree(ensure_family(family, FAMILIES), directory, symlinks=True)  # (written once where missing)
    edit(directory)
    return directory


# --- the promise, checked -----------------------------------------------------------------------------


def assert_one_clear_line(line: str, *expected: str) -> None:
    """A refusal's text: one line, no internals, naming what ``expected`` says (outside the quoted path)."""
    assert "\n" not in line and line.strip() == line and line, line
    assert not any(internal in line for internal in INTERNALS), line
    said = re.sub(r"'/[^']*'", "'DIR'", line)  # (the words asked for, not in a test's tmp_path)
    for words in expected:
        assert words in said, (words, line)


def refusal(directory: Path) -> str:
    """The one line ``load_model`` refuses ``directory`` with (any other outcome fails the test)."""
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(directory))
    return str(refused.value)


def texts_for(mask: str) -> list[str]:
    """Texts of different lengths (one padded batch), one to three masks."""
    return [f"The old farmer bought a {mask} bicycle.", f"{mask} went home.",
            f"The children were {mask} near the river while the farmer bought a {mask} in the morning.",
            f"It was {mask}, {mask} and {mask}."]


def pipeline_answers(directory: Path, texts: list[str], top_k: int, **options: Any) -> list[Any]:
    from transformers import pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline("fill-mask", model=str(directory), device="cpu", **options)
        return [pipe(text, top_k=top_k) for text in texts]


@dataclass
class Served:
    hello: dict[str, Any]
    texts: list[str]
    frames: list[dict[str, Any]]
    max_tokens: int


async def serve_and_ask(directory: Path, top_k: int = 5) -> Served:
    """Load ``directory`` as ws_server.py does, serve it on a real socket, send every text at once on one
    connection (one padded batch); the hello and the answers in request order."""
    model = load_model(str(directory))
    server = FillMaskServer(Config(model=str(directory), host="127.0.0.1", port=0, shutdown_timeout=5.0), model)
    await server.start()
    try:
        async with session(server.url) as (ws, hello):
            texts = [text for text in texts_for(hello["mask_token"])
                     if len(model.tokenize([text])[0]) <= model.max_tokens]
            assert texts, "no text fits"
            for n, text in enumerate(texts):
                await send(ws, {"type": "fill_mask", "id": n, "text": text, "top_k": top_k})
            frames = sorted(await recv_n(ws, len(texts)), key=lambda frame: frame["id"])
    finally:
        await server.drain(timeout=2.0)
    return Served(hello, texts, frames, model.max_tokens)


def assert_answers_are_the_pipelines(served: Served, directory: Path, top_k: int = 5, **options: Any) -> None:
    expected = pipeline_answers(directory, served.texts, top_k, **options)
    for text, frame, answer in zip(served.texts, served.frames, expected, strict=True):
        assert frame["type"] == "result", (text, frame)
        assert_same_predictions(frame["predictions"], answer, TOLERANCE)


# --- refused in one line: config.json -------------------------------------------------------------------

BERT_REFUSED: dict[str, tuple[Breakage, tuple[str, ...]]] = {
    # config.json
    "config.json missing": (remove("config.json"), ("has no config.json",)),
    "config.json empty": (write("config.json", ""), ("config file", "not a valid JSON")),
    "config.json cut short": (write("config.json", '{"model_type": "bert",'), ("config file", "not a valid JSON")),
    "config.json a JSON array": (write("config.json", "[]"), ("model_type",)),
    "config.json a JSON string": (write("config.json", '"bert"'), ("model_type",)),
    "config.json an empty object": (write("config.json", "{}"), ("model_type",)),
    "config.json in UTF-16": (lambda d: (d / "config.json").write_bytes(
        (d / "config.json").read_text().encode("utf-16")), ("config file",)),
    "config.json a directory": (directory_instead("config.json"), ("has no config.json",)),
    "config.json nested too deeply": (write("config.json", "[" * 100_000 + "]" * 100_000),
                                      ("its config.json nests its values",)),
    "tokenizer_config.json nested too deeply": (write("tokenizer_config.json", "[" * 100_000 + "]" * 100_000),
                                                ("its tokenizer_config.json nests its values",)),
    # (deep enough for transformers' own recursion over it, not for the JSON parser)
    "config.json nested 800 deep": (config(deep=json.loads('{"a":' * 800 + "1" + "}" * 800)),
                                    ("its config.json nests its values 801 levels deep",)),
    # (a null token id, or one of 0, beside the real breakage: the real one is named)
    "pad_token_id null beside a null hidden_act": (config(pad_token_id=None, hidden_act=None), ("hidden_act is null",)),
    # (Saved by an editor that writes one: Python's own json.loads takes it in bytes, the libraries do not.)
    "config.json with a UTF-8 byte-order mark": (lambda d: (d / "config.json").write_bytes(
        b"\xef\xbb\xbf" + (d / "config.json").read_bytes()), ("its config.json starts with a UTF-8 byte-order mark",)),
    "tokenizer.json with a UTF-8 byte-order mark": (lambda d: (d / "tokenizer.json").write_bytes(
        b"\xef\xbb\xbf" + (d / "tokenizer.json").read_bytes()), ("its tokenizer.json starts with a UTF-8",)),
    "vocab_size smaller than the weights'": (config(vocab_size=500), ("where its config.json makes it [500",)),
    "vocab_size negative": (config(vocab_size=-1), ("-1",)),
    "hidden_size of another model": (config(hidden_size=64), ("where its config.json makes it",)),
    "num_attention_heads not dividing hidden_size": (config(num_attention_heads=3), ("not a multiple",)),
    # (a model_type of no masked-language-model head, whose configuration then refused a field of BERT's)
    "model_type t5": (config(model_type="t5"), ("model_type 't5' has no masked-language-model head",)),
    "num_hidden_layers more than the weights'": (config(num_hidden_layers=3), (
        "bert.encoder.layer.2", "(its num_hidden_layers is 3, and the checkpoint holds 2)")),
    "max_position_embeddings 0": (config(max_position_embeddings=0), ("position_embeddings", "[0, 32]")),
    "max_position_embeddings huge": (config(max_position_embeddings=10**12), ("position_embeddings",)),
    "max_position_embeddings smaller": (config(max_position_embeddings=8), ("position_embeddings", "[8, 32]")),
    "type_vocab_size 0": (config(type_vocab_size=0), ("token_type_embeddings",)),
    "pad_token_id beyond the vocabulary": (config(pad_token_id=5000), ("pad_token_id 5000 is no token", "1000")),
    "pad_token_id negative beyond the vocabulary": (config(pad_token_id=-5000), ("pad_token_id -5000 is no",)),
    # (a field of another type than transformers takes: its own validation error, Python's words, or a
    # batch that fails, none of which names config.json)
    "vocab_size as text": (config(vocab_size="1000"), ('vocab_size is "1000" (a JSON string)', "a whole number")),
    "pad_token_id a fraction": (config(pad_token_id=1.5), ("pad_token_id is 1.5", "a whole number or null")),
    "num_attention_heads null": (config(num_attention_heads=None), ("num_attention_heads is null",
                                                                    "takes a whole number")),
    "hidden_dropout_prob as text": (config(hidden_dropout_prob="0.1"), ('hidden_dropout_prob is "0.1"',
                                                                        "takes a number;")),
    "id2label a list": (config(id2label=["a", "b"]), ('id2label is ["a", "b"]', "takes an object")),
    "num_labels as text": (config(num_labels="2"), ('num_labels is "2"', "a whole number")),
    "attn_implementation a number": (config(attn_implementation=5), ("attn_implementation is 5", "not text")),
    "dtype a list": (config(dtype=["float32"]), ('dtype is ["float32"]', "not text")),
    "chunk_size_feed_forward as text": (config(chunk_size_feed_forward="x"), ('chunk_size_feed_forward is "x"',
                                                                               "takes a whole number")),
    "output_hidden_states as text": (config(output_hidden_states="yes"), ('output_hidden_states is "yes"',
                                                                         "true or false")),
    "model_type a list": (config(model_type=["bert"]), ('model_type is ["bert"], not the name',)),
    "model_type unknown": (config(model_type="fancybert"), ("model_type 'fancybert'",)),
    "model_type missing": (config(model_type=...), ("model_type",)),
    "model_type a number": (config(model_type=5), ("model type",)),
    "model_type gpt2": (config(model_type="gpt2"), ("has no masked-language-model head",)),
    "model_type bert-generation": (config(model_type="bert-generation"), ("has no masked-language-model head",)),
    "model_type roberta over BERT weights": (config(model_type="roberta"), ("has no weights for",)),
    "tie_word_embeddings false, no decoder weight": (config(tie_word_embeddings=False),
                                                     ("cls.predictions.decoder.weight",)),
    "bitsandbytes quantization_config": (config(quantization_config={"quant_method": "bitsandbytes",
                                                                     "load_in_8bit": True}), ("accelerate",)),
    # weights
    "weights missing": (remove("model.safetensors"), ("no file named model.safetensors",)),
    "weights zero bytes": (write("model.safetensors", b""), ("header",)),
    "weights cut in half": (cut("model.safetensors", lambda size: size // 2), ("header",)),
    "weights cut within the header": (cut("model.safetensors", lambda size: 100), ("header",)),
    "safetensors header length huge": (safetensors_header(lambda h: None, length=2**62), ("header too large",)),
    "safetensors header bit-flipped": (flip_byte("model.safetensors", 20), ("header",)),
    "safetensors header claims a huge tensor": (
        safetensors_header(lambda h: h["bert.embeddings.word_embeddings.weight"].__setitem__("data_offsets",
                                                                                            [0, 2**40])),
        ("invalid offset",)),
    "safetensors header lies about a shape": (
        safetensors_header(lambda h: h["bert.embeddings.word_embeddings.weight"].__setitem__("shape",
                                                                                            [100000, 32000])),
        ("header",)),
    "safetensors header lies about a dtype": (
        safetensors_header(lambda h: h["cls.predictions.bias"].__setitem__("dtype", "F64")), ("header",)),
    "weights a directory": (directory_instead("model.safetensors"), ("no file named model.safetensors",)),
    "weights a dangling symlink": (symlink("model.safetensors", "nowhere"), ("no file named",)),
    "weights a symlink loop": (symlink("model.safetensors", "model.safetensors"), ("no file named",)),
    "weights /dev/null": (symlink("model.safetensors", "/dev/null"), ("no file named",)),
    "weights a GGUF file only": (both(remove("model.safetensors"), write("model.gguf", b"GGUF" + b"\0" * 100)),
                                 ("no file named",)),
    "a tensor transposed": (set_tensor("bert.encoder.layer.0.intermediate.dense.weight", lambda t: t.T.contiguous()),
                            ("intermediate.dense.weight", "[32, 64]", "[64, 32]")),
    "the MLM head missing": (drop("cls."), ("has no weights for cls.predictions",)),
    # (a review's find: a classifier's or a pooler's weights were taken for "another kind of head")
    "a sequence classifier's head instead": (
        both(drop("cls."), tensors(lambda weights: weights.update(
            {"classifier.weight": weights["bert.embeddings.word_embeddings.weight"][:2].clone(),
             "classifier.bias": weights["bert.embeddings.LayerNorm.bias"][:2].clone()}))),
        ("an encoder saved without its masked-language-model head?", "use a checkpoint saved with its fill-mask")),
    "the word embeddings missing": (drop("bert.embeddings.word_embeddings"), ("word_embeddings.weight",)),
    "infinite weights": (set_tensor("bert.encoder.layer.0.attention.self.query.weight",
                                    lambda t: t.fill_(float("inf"))), ("not numbers",)),
    "a shard missing": (sharded(missing_shard=True), ("model-00002-of-00002.safetensors",)),
    "pickle garbage instead of weights": (both(remove("model.safetensors"),
                                               write("pytorch_model.bin", bytes(range(256)) * 4)), ()),
    "a pickle that runs a command": (both(remove("model.safetensors"),
                                          write("pytorch_model.bin", pickle.dumps(_RunsACommand(), protocol=2))), ()),
    # tokenizer
    "tokenizer files all missing": (remove("tokenizer.json", "tokenizer_config.json"),
                                    ("special tokens and no others",)),
    "tokenizer.json missing": (remove("tokenizer.json"), ("special tokens and no others",)),
    "tokenizer.json a FIFO": (fifo_instead("tokenizer.json"), ("special tokens and no others",)),
    "tokenizer.json cut short": (cut("tokenizer.json", lambda size: 500), ()),
    "tokenizer.json empty": (write("tokenizer.json", ""), ()),
    "tokenizer.json an empty object": (write("tokenizer.json", "{}"), ("its tokenizer.json has no model",)),
    "tokenizer.json a JSON array": (write("tokenizer.json", "[]"), ("its tokenizer.json holds a JSON array",)),
    # (the tokenizers library's words name a Rust type and a place, not the file)
    "tokenizer.json of an unknown model type": (tokenizer_json(lambda t: t["model"].__setitem__("type", "Banana")),
                                                ("the model in its tokenizer.json (line 1, column",)),
    "tokenizer.json a normalizer unknown": (tokenizer_json(lambda t: t.__setitem__("normalizer", {"type": "Nope"})),
                                            ("the normalizer in its tokenizer.json",)),
    "tokenizer.json vocab a list": (tokenizer_json(lambda t: t["model"].__setitem__("vocab", [1, 2])),
                                    ("the model's vocab in its tokenizer.json",)),
    "tokenizer.json padding a number": (tokenizer_json(lambda t: t.__setitem__("padding", 5)),
                                        ("the padding in its tokenizer.json",)),
    "tokenizer.json of a newer version": (tokenizer_json(lambda t: t.__setitem__("version", "9.0")),
                                          ("the version in its tokenizer.json", "pip install -U tokenizers")),
    "tokenizer.json an added token without an id": (tokenizer_json(lambda t: t["added_tokens"][0].pop("id")),
                                                    ("its tokenizer.json has an added token without its id",)),
    "tokenizer_config.json not JSON": (write("tokenizer_config.json", "{oops"), ()),
    "tokenizer_config.json empty": (write("tokenizer_config.json", ""), ()),
    "tokenizer_config.json a JSON array": (write("tokenizer_config.json", "[]"),
                                           ("its tokenizer_config.json holds a JSON array",)),
    "do_lower_case as text": (tokenizer_config(do_lower_case="yes"), ('do_lower_case is "yes"', "true or false")),
    "padding_side middle": (tokenizer_config(padding_side="middle"), ('padding_side is "middle"', '"left"')),
    "truncation_side a list": (tokenizer_config(truncation_side=[1]), ("truncation_side is [1]", '"right" or "left"')),
    "added_tokens_decoder a list": (tokenizer_config(added_tokens_decoder=[1, 2]), ("added_tokens_decoder is [1, 2]",
                                                                                     "by their ids")),
    "added_tokens_decoder by name": (tokenizer_config(added_tokens_decoder={"x": {"content": "<q>"}}),
                                     ("added_tokens_decoder is", "by their ids")),
    "additional_special_tokens a string": (tokenizer_config(additional_special_tokens="<x>"),
                                           ('additional_special_tokens is "<x>"', "not a list of tokens' texts")),
    "extra_special_tokens of numbers": (tokenizer_config(extra_special_tokens={"a": 1}),
                                        ('extra_special_tokens is {"a": 1}', "not a list of tokens' texts")),
    "no mask token": (tokenizer_config(mask_token=None), ("without a mask token",)),
    "mask token not in the vocabulary": (tokenizer_config(mask_token="<zzz>"), ("mask token '<zzz>' is id 1000",
                                                                                 "ids 0 to 999")),
    "mask token a number": (tokenizer_config(mask_token=5), ("mask_token",)),
    "tokenizer_class a number": (tokenizer_config(tokenizer_class=3), ("tokenizer_class is 3", "BertTokenizer")),
    "special_tokens_map.json not JSON": (write("special_tokens_map.json", "{broken"), ()),
    "special_tokens_map.json a JSON array": (write("special_tokens_map.json", "[1, 2]"),
                                             ("its special_tokens_map.json holds a JSON array",)),
    "special_tokens_map.json mask of the wrong type": (write("special_tokens_map.json",
                                                             json.dumps({"mask_token": {"content": 5}})),
                                                       ("special_tokens_map.json's mask_token is {\"content\": 5}",)),
    "added_tokens.json not JSON": (write("added_tokens.json", "{broken"), ()),
    "a model_max_length too short for any text": (tokenizer_config(model_max_length=2), ("accepts at most 2 tokens",)),
}


@pytest.mark.parametrize("case", list(BERT_REFUSED))
def test_a_broken_bert_checkpoint_is_refused_in_one_clear_line(case: str, tmp_path: Path) -> None:
    """Each breakage fails the load with ``ModelLoadError``: one line, no internals, naming the problem;
    nothing else raised (a traceback at the process's top) and within seconds."""
    edit, expected = BERT_REFUSED[case]
    directory = copy_of("bert", tmp_path, edit)
    started = time.monotonic()
    line = refusal(directory)
    assert time.monotonic() - started < 30
    assert_one_clear_line(line, *expected)
    assert str(directory) in line  # (each names the directory it refused)


# --- served, and answered as the pipeline answers ---------------------------------------------------------

#: Breakages the server starts with. ``warned``: words of a log warning it must give at load (None: none
#: asked for). Each answers a padded batch of four texts as the pipeline answers each alone.
BERT_SERVED: dict[str, tuple[Breakage, str | None]] = {
    "num_attention_heads 4 instead of 2": (config(num_attention_heads=4), None),
    "num_hidden_layers 1 of the weights' 2": (config(num_hidden_layers=1), None),
    "architectures naming a sequence classifier": (config(architectures=["BertForSequenceClassification"]), None),
    # (grouped: fields and files the loading ignores or tolerates, each of which started alone too)
    "config.json noise": (both(config(architectures="FancyForMaskedLM", position_embedding_type="banana",
                                      auto_map={"AutoModelForMaskedLM": "x.Y"},
                                      quantization_config={"quant_method": "x"},
                                      _attn_implementation="flash_attention_2"),
                               write("generation_config.json", "{broken")), None),
    "tokenizer noise": (both(tokenizer_config(tokenizer_class="FancyTokenizer", model_max_length=None),
                             write("added_tokens.json", json.dumps({"<new>": 999999}))), None),
    # (grouped to keep the file's time down: values that change nothing, each of which started alone too)
    "config.json values the model takes": (config(pad_token_id=-5, output_hidden_states=True,
                                                  output_attentions=True, torchscript=True), None),
    "tokenizer_config.json values the tokenizer takes": (tokenizer_config(
        model_input_names=["input_ids"], do_lower_case=False, bos_token="<newbos>", model_max_length=-1), None),
    "an extra tensor, safetensors metadata format tf": (both(
        tensors(lambda w: w.update({"junk.weight": w["cls.predictions.bias"][:3].clone()})),
        safetensors_header(lambda h: h.__setitem__("__metadata__", {"format": "tf"}))), None),
    "dtype a number": (config(dtype=16), None),  # (the pipeline fails on it: compared in float32)
    "dtype float16": (config(dtype="float16"), None),  # (the server computes in float32: README)
    "a tensor stored as int64": (set_tensor("bert.encoder.layer.0.intermediate.dense.weight",
                                            lambda t: (t * 100).round().to(__import__("torch").int64)), None),
    "every tensor float16": (all_tensors(lambda t: t.half()), None),
    "the MLM bias missing": (drop("cls.predictions.bias"), "has no cls.predictions.bias"),
    "a LayerNorm bias missing": (drop("bert.encoder.layer.0.output.LayerNorm.bias"),
                                 "has no bert.encoder.layer.0.output.LayerNorm.bias"),
    "tensor names without the bert. prefix": (tensors(lambda w: w.update({k[5:]: w.pop(k) for k in list(w)
                                                                          if k.startswith("bert.")})), None),
    "a pickle beside the safetensors, disagreeing": (pickled_weights(keep_safetensors=True, scale=-1.0), None),
    "a pickle only": (pickled_weights(keep_safetensors=False), None),
    "a complete shard index": (sharded(missing_shard=False), None),
    "tokenizer_config.json missing": (remove("tokenizer_config.json"), None),
    "the mask token removed from both tokenizer files": (both(tokenizer_config(mask_token=...),
                                                              without_mask_in_tokenizer_json), None),
    "the mask token is the padding token": (tokenizer_config(mask_token="[PAD]"), None),
    "the mask token an ordinary word": (tokenizer_config(mask_token="the"), None),
    "no padding token": (tokenizer_config(pad_token=None), None),
    "model_max_length 0": (tokenizer_config(model_max_length=0), None),
    "model_max_length 1e30": (tokenizer_config(model_max_length=1e30), None),
    "model_max_length 12": (tokenizer_config(model_max_length=12), None),
    "tokenizer_class of another family": (tokenizer_config(tokenizer_class="GPT2Tokenizer"), None),
    "tokenizer.json truncating at 8 tokens": (edit_json("tokenizer.json", truncation={
        "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}), None),
    "tokenizer.json padding to 24 tokens": (edit_json("tokenizer.json", padding={
        "strategy": {"Fixed": 24}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
        "pad_token": "[PAD]"}), None),
    "an unknown token beyond the embeddings": (tokenizer_config(unk_token="<newunk>"), None),
}


#: Cases compared with the pipeline in float32: it reads config.json's dtype, which fails for a number,
#: and computes in float16 where it says so, while the server computes in float32 (README, "Models and
#: offline checkpoints").
IN_FLOAT32 = {"dtype a number", "dtype float16"}


@pytest.mark.parametrize("case", list(BERT_SERVED))
async def test_a_checkpoint_that_starts_answers_as_the_pipeline(case: str, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    edit, warned = BERT_SERVED[case]
    directory = copy_of("bert", tmp_path, edit)
    caplog.set_level("WARNING")
    served = await serve_and_ask(directory)
    options: dict[str, Any] = {"dtype": "float32"} if case in IN_FLOAT32 else {}
    assert_answers_are_the_pipelines(served, directory, **options)
    if warned is not None:
        assert any(warned in record.getMessage() for record in caplog.records), caplog.text


#: Breakages of other families' checkpoints that the server starts with (family, breakage).
OTHERS_SERVED: dict[str, tuple[str, Breakage]] = {
    # RoBERTa's position ids count from config.json's pad_token_id: one that is not the tokenizer's
    # moves the position table's padding index away from the padding the batches hold.
    "roberta, pad_token_id 0 (the tokenizer's <s>)": ("roberta", config(pad_token_id=0)),
    "roberta, pad_token_id 5": ("roberta", config(pad_token_id=5)),
    "xlm-roberta, pad_token_id 3": ("xlm-roberta", config(pad_token_id=3)),
    "roberta, pad_token_id -1 (position ids from 0)": ("roberta", config(pad_token_id=-1)),
    "roberta, model_max_length 1e30": ("roberta", tokenizer_config(model_max_length=1e30)),
    "roberta, tokenizer_config.json missing": ("roberta", remove("tokenizer_config.json")),
    "esm, config mask_token_id not the tokenizer's": ("esm", config(mask_token_id=5)),
    "esm, vocab.txt with a line more": ("esm", lambda d: (d / "vocab.txt").write_text((d / "vocab.txt").read_text()
                                                                                       + "Z2\n")),
    "distilbert, no padding token": ("distilbert", tokenizer_config(pad_token=None)),
    "deberta-v2, mask token the padding token": ("deberta-v2", tokenizer_config(mask_token="[PAD]")),
    "modernbert, model_max_length 0": ("modernbert", tokenizer_config(model_max_length=0)),
    "albert, num_attention_heads 1": ("albert", config(num_attention_heads=1)),
    "electra, architectures a discriminator": ("electra", config(architectures=["ElectraForPreTraining"])),
    "roberta, clean_up_tokenization_spaces true": ("roberta", tokenizer_config(clean_up_tokenization_spaces=True)),
    "esm, vocab.txt in reverse order": ("esm", lambda d: (d / "vocab.txt").write_text(
        "\n".join(reversed((d / "vocab.txt").read_text().split())) + "\n")),
}


@pytest.mark.parametrize("case", list(OTHERS_SERVED))
async def test_another_familys_checkpoint_that_starts_answers_as_the_pipeline(case: str, tmp_path: Path) -> None:
    family, edit = OTHERS_SERVED[case]
    directory = copy_of(family, tmp_path, edit)
    assert_answers_are_the_pipelines(await serve_and_ask(directory), directory)


#: Other families' breakages refused in one line (family, breakage, words the line must hold).
OTHERS_REFUSED: dict[str, tuple[str, Breakage, tuple[str, ...]]] = {
    "esm, vocab.txt empty": ("esm", write("vocab.txt", ""), ("special tokens and no others",)),
    "esm, no mask token": ("esm", tokenizer_config(mask_token=None), ("without a mask token",)),
    "roberta, tokenizer.json missing": ("roberta", remove("tokenizer.json"), ("special tokens and no others",)),
    "xlm-roberta, tokenizer.json cut in half": ("xlm-roberta", cut("tokenizer.json", lambda size: size // 2), ()),
    "deberta-v2, vocab_size 10": ("deberta-v2", config(vocab_size=10), ("where its config.json makes it [10",)),
    # (loaded, then failed as the server set it up: a ValueError escaped load_model, a traceback at start-up)
    "esm, model_input_names a string": ("esm", tokenizer_config(model_input_names="input_ids"),
                                        ('model_input_names is "input_ids"', "not a list of the model's input")),
    "esm, model_input_names without input_ids": ("esm", tokenizer_config(model_input_names=["foo"]),
                                                 ('model_input_names is ["foo"]', 'with "input_ids"')),
    "esm, cls_token null": ("esm", tokenizer_config(cls_token=None), ("cls_token is null", "fails on a text")),
    # (a field of a type the configuration's annotation allows, though not its default's, or a flag ending
    # in _token, beside a real breakage: the real one is named)
    "roberta, tokenizer.json cut short, eos_token_id a list": (
        "roberta", both(config(eos_token_id=[2]), cut("tokenizer.json", lambda size: 500)),
        ("its tokenizer.json is not valid JSON",)),
    "modernbert, padding_side middle, add_eos_token false": (
        "modernbert", tokenizer_config(add_eos_token=False, padding_side="middle"), ('padding_side is "middle"',)),
    "esm, max_position_embeddings 0, bos_token null": (
        "esm", both(tokenizer_config(bos_token=None), config(max_position_embeddings=0)), ("max_position_embeddings",)),
    # (values whose failure speaks of none of them: "integer modulo by zero", "division by zero", a bare
    # KeyError 'banana', "index -59 is out of bounds", "ne() received an invalid combination of arguments")
    "distilbert, n_heads 0": ("distilbert", config(n_heads=0), ("n_heads is 0",)),
    "albert, num_hidden_groups 0": ("albert", config(num_hidden_groups=0), ("num_hidden_groups is 0",)),
    "distilbert, activation unknown": ("distilbert", config(activation="banana"), ("activation 'banana'",)),
    "modernbert, a rope_type unknown": (
        "modernbert", lambda d: edit_json("config.json", rope_parameters={
            **json.loads((d / "config.json").read_text())["rope_parameters"],
            "full_attention": {"rope_type": "banana", "rope_theta": 10000.0}})(d),
        ("rope_parameters.full_attention.rope_type is 'banana'",)),
    "roberta, pad_token_id -60": ("roberta", config(pad_token_id=-60), ("pad_token_id is -60", "position table")),
    "roberta, pad_token_id null": ("roberta", config(pad_token_id=None), ("gives no pad_token_id", "pad token")),
    "esm, mask_token_id null": ("esm", config(mask_token_id=None), ("gives no mask_token_id", "mask token")),
    "albert, num_hidden_groups 0 beside a bos_token_id 0": ("albert", config(num_hidden_groups=0, bos_token_id=0),
                                                            ("num_hidden_groups is 0",)),
    "roberta, pad_token_id beyond the position table": ("roberta", config(pad_token_id=70),
                                                        ("pad_token_id 70 is beyond its position table",)),
    "electra, embedding_size of another model": ("electra", config(embedding_size=16),
                                                 ("a size in it changed?",)),
    "modernbert, layer_types a string": ("modernbert", config(layer_types="full_attention"),
                                         ('layer_types is "full_attention"', "a list of texts or null")),
    # (weights config.json asks for and the checkpoint lacks, after a count or a flag changed: the guess
    # was "(a model_type or num_hidden_layers changed?)" for each)
    "distilbert, n_layers more than the weights'": ("distilbert", config(n_layers=3),
                                                    ("(its n_layers is 3, and the checkpoint holds 2)",)),
    "albert, num_hidden_groups 2 of 1": ("albert", config(num_hidden_groups=2),
                                         ("(its num_hidden_groups is 2, and the checkpoint holds 1)",)),
    "deberta-v2, share_att_key false": ("deberta-v2", config(share_att_key=False),
                                        ("pos_key_proj", "(a setting in it that adds weights changed?)")),
    "roberta, model_type bert": ("roberta", config(model_type="bert"),
                                 ("(its model_type changed, or the weights are another model's?)",)),
    # (rules between fields, in transformers' words with its backquotes, or blamed on another field)
    "modernbert, num_hidden_layers more than layer_types": (
        "modernbert", config(num_hidden_layers=3), ("layer_types has 2 entries, where num_hidden_layers is 3",)),
    "modernbert, layer_types empty": ("modernbert", config(layer_types=[]),
                                      ("layer_types has 0 entries, where num_hidden_layers is 2",)),
    "modernbert, a layer type unknown": ("modernbert", config(layer_types=["full_attention", "banana"]),
                                         ('layer_types holds "banana", not a kind of layer',)),
    # (heads that do not divide the hidden size: transformers' sentence, or for ELECTRA, which builds
    # the layers anyway, a report whose keys hold spaces ("layer.{0, 1}"), once blamed on a
    # "ignore_mismatched_sizes" and "the above report")
    "roberta, num_attention_heads 3": ("roberta", config(num_attention_heads=3),
                                       ("hidden_size 32 is not a multiple of its num_attention_heads 3",)),
    "electra, num_attention_heads 3": ("electra", config(num_attention_heads=3),
                                       ("where its config.json makes it [63", "a size in it changed?")),
    "distilbert, n_heads 3": ("distilbert", config(n_heads=3), ("dim 32 is not a multiple of its n_heads 3",)),
    "electra, hidden_size 1 of 2 heads": ("electra", config(hidden_size=1),
                                          ("hidden_size 1 is less than its num_attention_heads 2",)),
    # (a dropout out of range, in torch's words that name no field; a layer norm's epsilon of 0 or less,
    # whose scores that are not numbers were blamed on the weights)
    "bert, hidden_dropout_prob 2 beside a number past a float's range": (
        "bert", config(hidden_dropout_prob=2, some_count=10**400), ("hidden_dropout_prob is 2, where a dropout",)),
    "modernbert, mlp_dropout 1.5": ("modernbert", config(mlp_dropout=1.5),
                                    ("mlp_dropout is 1.5, where a dropout probability is between 0 and 1",)),
    "bert, attention_probs_dropout_prob -1": ("bert", config(attention_probs_dropout_prob=-1.0),
                                              ("attention_probs_dropout_prob is -1.0",)),
    "deberta-v2, layer_norm_eps 0": ("deberta-v2", config(layer_norm_eps=0.0),
                                     ("layer_norm_eps is 0.0, where a layer norm takes a small number above 0",)),
    "modernbert, norm_eps -1": ("modernbert", config(norm_eps=-1.0), ("norm_eps is -1.0",)),
    # (the head's weights missing after a setting changed, each blamed on "an encoder saved without its
    # masked-language-model head?")
    "roberta, tie_word_embeddings false": ("roberta", config(tie_word_embeddings=False),
                                           ("tie_word_embeddings is false", "set tie_word_embeddings to true")),
    "deberta-v2, legacy false": ("deberta-v2", config(legacy=False),
                                 ("holds other head weights (cls.predictions.", "another kind of head")),
    # (special tokens the vocabulary does not hold: a RecursionError in transformers for the unknown
    # token, the tokenizers library's "Expected Union[Tuple[str, int], ...]" for ALBERT's template, and a
    # tokenizer class transformers has none of, cut mid-sentence, where no tokenizer.json is there)
    "bert, unk_token empty": ("bert", tokenizer_config(unk_token=""),
                              ('unk_token is "", which is no token of its vocabulary',)),
    "albert, cls_token not in the vocabulary": ("albert", tokenizer_config(cls_token="banana"),
                                                ('cls_token is "banana", which is no token of its vocabulary',)),
    "esm, tokenizer_class unknown": ("esm", tokenizer_config(tokenizer_class="banana"),
                                     ('tokenizer_class is "banana", not a tokenizer class transformers',)),
    # (rotary positions, no table: the limit is the length config.json declares, not a table's room)
    "esm, max_position_embeddings 2 and no tokenizer limit": (
        "esm", both(config(max_position_embeddings=2), tokenizer_config(model_max_length=...)),
        ("max_position_embeddings declares", "set it to the length the model was made for")),
}


@pytest.mark.parametrize("case", list(OTHERS_REFUSED))
def test_another_familys_broken_checkpoint_is_refused_in_one_clear_line(case: str, tmp_path: Path) -> None:
    family, edit, expected = OTHERS_REFUSED[case]
    assert_one_clear_line(refusal(copy_of(family, tmp_path, edit)), *expected)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_no_field_of_a_familys_own_config_is_called_mistyped(family: str) -> None:
    """The fallback that names a config.json field of another type than its configuration takes, for an
    error in Python's own words, blames none of the fields a checkpoint saved by transformers has, nor
    an ``eos_token_id`` list (whose default is a whole number, and whose annotation allows one)."""
    saved = json.loads((ensure_family(family, FAMILIES) / "config.json").read_text())
    assert mistyped_config_field(saved) is None
    assert mistyped_config_field({**saved, "eos_token_id": [2, 3]}) is None
    assert "takes an object" in (mistyped_config_field({**saved, "id2label": ["a"]}) or "")  # (the check bites)


# --- the directory itself ---------------------------------------------------------------------------------


def test_a_model_directory_that_is_a_symlink_loop_or_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("not a model")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    for name in ("loop", "file", "to-file"):
        assert_one_clear_line(refusal(tmp_path / name), "cannot load model", "--model")


async def test_a_symlink_to_a_checkpoint_and_a_path_with_a_trailing_slash_are_served(tmp_path: Path) -> None:
    directory = copy_of("bert", tmp_path, lambda d: None)
    (tmp_path / "link").symlink_to(directory)
    served = await serve_and_ask(Path(f"{tmp_path / 'link'}/"))
    assert_answers_are_the_pipelines(served, directory)


# --- bugs found: each test names what the server should do --------------------------------------------------


def test_a_model_max_length_written_as_a_string_is_refused_in_one_line(tmp_path: Path) -> None:
    """``"model_max_length": "64"`` (a hand-edited tokenizer_config.json): the tokenizer loads, and the
    load's first tokenizing (``loading.py``: the length of a text of one mask, outside any ``try``) raised
    ``TypeError: '>' not supported between instances of 'int' and 'str'`` from inside transformers: a
    traceback at start-up (``test_a_real_start_says_one_line_or_serves`` shows it in a real start). The
    pipeline fails on every text of it too, so the server cannot serve it: one line, naming the field."""
    directory = copy_of("bert", tmp_path, tokenizer_config(model_max_length="64"))
    assert_one_clear_line(refusal(directory), "model_max_length")


@pytest.mark.parametrize(("case", "named"), [
    ("tokenizer.json cut short", "tokenizer.json"),
    ("tokenizer_config.json not JSON", "tokenizer_config.json"),
    ("special_tokens_map.json not JSON", "special_tokens_map.json"),
    ("weights zero bytes", "model.safetensors"),
    ("safetensors header bit-flipped", "model.safetensors"),
])
def test_a_corrupt_file_is_named_in_the_line(case: str, named: str, tmp_path: Path) -> None:
    """A directory holds five or six files; a line that says ``Expecting property name enclosed in double
    quotes: line 1 column 2 (char 1)`` or ``Error while deserializing header: header too small`` leaves the
    user to guess which one is broken (config.json's own error names it: transformers does). Today the
    library's first line is passed on as it is (``diagnosis.explain_load_failure``, ``first_line(exc)``),
    and these libraries' errors carry no file name."""
    edit, _ = BERT_REFUSED[case]
    assert_one_clear_line(refusal(copy_of("bert", tmp_path, edit)), named)


def test_a_pickle_the_safe_loader_cannot_read_is_named_and_not_cut_mid_word(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` torch's ``weights_only`` loader refuses (here: written with pickle protocol
    4, as ``torch.save(..., pickle_protocol=4)`` writes large files; garbage and a pickle that would run
    a command say the same). The line was torch's advice, cut at 200 characters: ``Weights only load
    failed. In PyTorch 2.6, we changed the default value of the `weights_only` argument in `torch.load`
    from `False` to `True`. Re-running `torch.load` with `weights_only` set to `Fal...``: it names no
    file, tells of a ``torch.load`` call the user never made, and stops mid-word. It should name
    pytorch_model.bin and say it cannot be read safely (convert it to safetensors)."""
    line = refusal(copy_of("bert", tmp_path, pickled_weights(keep_safetensors=False, protocol=4)))
    assert_one_clear_line(line, "pytorch_model.bin")
    assert "..." not in line and "Re-running" not in line, line


@pytest.mark.parametrize(("case", "edit", "named"), [
    ("hidden_act unknown", config(hidden_act="banana"), "hidden_act"),  # said: "'banana'"
    ("num_attention_heads 0", config(num_attention_heads=0), "num_attention_heads"),  # "integer modulo by zero"
    ("vocab_size 0", config(vocab_size=0), "vocab_size"),  # "index 0 is out of bounds for dimension 0 with size 0"
    ("dtype unknown", config(dtype="banana"), "dtype"),  # "module 'torch' has no attribute 'banana'"
    ("vocab_size a string", config(vocab_size="1000"), 'vocab_size is "1000"'),  # "Validation error for field"
    ("config.json null", write("config.json", "null"), "config.json"),  # "argument of type 'NoneType' is not iterable"
    ("add_cross_attention true", config(add_cross_attention=True), "add_cross_attention"),  # "BertLayer("
])
def test_a_config_field_of_a_wrong_value_is_named_with_what_is_wrong(case: str, edit: Breakage, named: str,
                                                                      tmp_path: Path) -> None:
    """The line passes on the first line of whatever Python error the library raised: a bare KeyError's key,
    a ZeroDivisionError's "integer modulo by zero", an IndexError, an AttributeError on ``torch``, or
    (for a validation error, whose reason is on its second line) ``Validation error for field
    'vocab_size':`` with the reason cut off; for ``add_cross_attention`` (an encoder that is no decoder)
    the first line of a module's repr, ``BertLayer(``. None names the config.json field or says what is wrong with
    it (``diagnosis.explain_load_failure`` -> ``first_line``)."""
    assert_one_clear_line(refusal(copy_of("bert", tmp_path, edit)), named)


@pytest.mark.parametrize("case", ["num_hidden_layers more than the weights'", "the word embeddings missing",
                                  "model_type distilbert over BERT weights"])
def test_missing_weights_outside_the_head_are_not_blamed_on_a_missing_head(case: str, tmp_path: Path) -> None:
    """``unservable`` says of any missing weight "(an encoder saved without its masked-language-model
    head?)" and to "use a checkpoint saved with its fill-mask head", also where the head is there and
    what is missing is an encoder layer config.json asks for (``num_hidden_layers`` 3 of 2), the word
    embeddings, or every weight (config.json names another family's ``model_type``)."""
    edit = (config(model_type="distilbert") if case.startswith("model_type distilbert")
            else BERT_REFUSED[case][0])
    line = refusal(copy_of("bert", tmp_path, edit))
    assert_one_clear_line(line, "has no weights for")
    assert "masked-language-model head" not in line, line


@pytest.mark.parametrize("case", ["max_position_embeddings smaller", "a tensor transposed", "type_vocab_size 0"])
def test_a_shape_mismatch_outside_the_vocabulary_does_not_blame_vocab_size(case: str, tmp_path: Path) -> None:
    """Every shape mismatch is told "(a vocab_size changed?)" (``diagnosis._warned_cause``), also one in the
    position table, the token-type table or an encoder layer, where vocab_size is not involved."""
    line = refusal(copy_of("bert", tmp_path, BERT_REFUSED[case][0]))
    assert_one_clear_line(line, "where its config.json makes it")
    assert "vocab_size" not in line, line


def test_a_division_by_zero_blames_a_count_of_0_not_a_token_id_of_0() -> None:
    """"division by zero" names no field: the one blamed is 0 where its default is a count above 0, never
    a token id, for which 0 is an id like any other (fields in the order that blamed bos_token_id)."""
    from fillmask_server.diagnosis import _config_value_cause

    line = _config_value_cause({"model_type": "albert", "bos_token_id": 0, "num_hidden_groups": 0},
                               ZeroDivisionError("division by zero"))
    assert line is not None and "num_hidden_groups is 0" in line, line


def test_word_embeddings_of_as_many_rows_as_config_json_makes_do_not_blame_vocab_size() -> None:
    """A word-embedding table has a row a token: one whose rows are as many as config.json makes them, and
    whose width is not (an ELECTRA ``embedding_size`` changed), is no vocab_size's doing."""
    from fillmask_server.diagnosis import _warned_cause

    def told(ckpt: str, model: str) -> str:
        return _warned_cause([f"electra.embeddings.word_embeddings.weight | MISMATCH | Reinit due to size mismatch - "
                              f"ckpt: torch.Size({ckpt}) vs model: torch.Size({model})"]) or ""

    assert "(a size in it changed?)" in told("[1000, 32]", "[1000, 16]")
    assert "(a vocab_size changed?)" in told("[1000, 32]", "[500, 32]")


@pytest.mark.parametrize("layers", [1, 0])
def test_weights_a_config_leaves_unused_are_warned_about(layers: int, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """config.json's ``num_hidden_layers`` below the checkpoint's: transformers drops the extra layers'
    weights (``unexpected_keys``) without a word, and the server serves a smaller model than the one
    saved, answering as the pipeline does (``test_a_checkpoint_that_starts_answers_as_the_pipeline``),
    silently. Weights missing are refused or logged (``diagnosis.unservable``); weights left unused are
    not looked at (``loading.py`` reads ``loading["missing_keys"]`` only). A warning naming them is due."""
    caplog.set_level("WARNING")
    load_model(str(copy_of("bert", tmp_path, config(num_hidden_layers=layers))))
    assert any("bert.encoder.layer.1" in record.getMessage() for record in caplog.records
               if record.levelname == "WARNING"), caplog.text


def test_only_a_layer_norms_epsilon_is_blamed_for_scores_that_are_not_numbers() -> None:
    """A review's find: any field ending in "eps" was taken for one (``warmup_steps`` 0 blamed for weights
    that overflow)."""
    from transformers import BertConfig

    from fillmask_server.diagnosis import unnormalised

    assert unnormalised(BertConfig(warmup_steps=0, max_steps=-1)) is None
    assert "layer_norm_eps is 0.0" in (unnormalised(BertConfig(layer_norm_eps=0.0)) or "")
    assert "eps is -1.0" in (unnormalised(BertConfig(eps=-1.0)) or "")


@pytest.mark.parametrize("vocab", [[""], [[]], ["", ["a", 0.0]]])
def test_a_vocabulary_of_odd_entries_does_not_break_the_unknown_token_check(vocab: list[Any],
                                                                            tmp_path: Path) -> None:
    """A review's find: entries of a Unigram vocabulary that are empty raised IndexError from the check
    that explains another failure (a traceback instead of its line)."""
    from fillmask_server.diagnosis import _unknown_template_token, _unknown_unk_token

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>", "cls_token": "<s>"}))
    assert _unknown_unk_token(tmp_path) is None
    assert _unknown_template_token(tmp_path, ValueError("Expected Union[Tuple[str, int], ...]")) is None


def test_encoder_weights_a_changed_setting_leaves_unused_are_warned_about_and_no_fewer_layers_blamed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DeBERTa's ``relative_attention`` turned off: transformers drops the relative position embeddings
    and their norm without a word, and the model served is another than the one saved. A weight left
    unused inside a layer the model has is no layer left out (the warning said "a num_hidden_layers
    lowered?" of any weight with a layer number)."""
    caplog.set_level("WARNING")
    query = "deberta.encoder.layer.0.attention.self.query_proj.weight"
    saved_apart = tensors(lambda weights: weights.__setitem__(  # (as a checkpoint saved with share_att_key false)
        "deberta.encoder.layer.0.attention.self.pos_key_proj.weight", weights[query].clone()))
    load_model(str(copy_of("deberta-v2", tmp_path, both(config(relative_attention=False), saved_apart))))
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any("leaves unused (deberta.encoder." in line and "a setting that uses them changed?" in line
               for line in warned), warned
    assert not any("num_hidden_layers" in line for line in warned), warned
    caplog.clear()
    load_model(str(ensure_family("deberta-v2", FAMILIES)))
    assert not [record for record in caplog.records if record.levelname == "WARNING"], caplog.text


# --- real starts: python ws_server.py --model DIR, beside the in-process cases -------------------------------


@dataclass
class Start:
    """What one ``python ws_server.py --model DIR --port 0`` did: exit status (0 after a SIGTERM once it
    served), stderr, seconds taken, and for a start that served, the hello and answers to ``texts``."""

    directory: Path
    returncode: int | None
    stderr: str
    seconds: float
    hello: dict[str, Any] | None = None
    texts: list[str] | None = None
    frames: list[dict[str, Any]] | None = None


#: The real starts (name -> family, breakage, the directory's name): refused ones whose point is what
#: the process prints, and one that serves from a path with spaces and Unicode.
STARTS: dict[str, tuple[str, Breakage, str]] = {
    "weights cut in half": ("bert", cut("model.safetensors", lambda size: size // 2), "model"),
    "a directory that is a symlink loop": ("bert", loop_instead, "model"),
    "model_max_length a string": ("bert", tokenizer_config(model_max_length="64"), "model"),
    "a pickle of protocol 4": ("bert", pickled_weights(keep_safetensors=False, protocol=4), "model"),
    "infinite weights": ("bert", BERT_REFUSED["infinite weights"][0], "model"),
    "attn_implementation flash_attention_2": ("bert", config(attn_implementation="flash_attention_2"), "model"),
    "served from a path with spaces and Unicode": ("bert", lambda d: None, "my models/Modèle ünï 模型"),
}


def _start(directory: Path) -> Start:
    """Start the server on ``directory``; if it says ready, ask it every text at once, then SIGTERM it."""
    from websockets.sync.client import connect

    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "ws_server.py", "--model", str(directory), "--port", "0",
                                "--calibration-s", "0"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(START_TIMEOUT_S, process.kill)  # a hang fails the test (status -9), not the run
    killer.start()
    try:
        assert process.stdout is not None
        ready = re.search(r"ready: (ws://\S+)", process.stdout.readline())
        result = Start(directory, None, "", 0.0)
        if ready:
            with connect(ready[1], max_size=None, open_timeout=30) as ws:
                result.hello = orjson.loads(ws.recv(timeout=30))
                result.texts = texts_for(result.hello["mask_token"])
                for n, text in enumerate(result.texts):
                    ws.send(orjson.dumps({"type": "fill_mask", "id": n, "text": text, "top_k": 5}).decode())
                result.frames = sorted((orjson.loads(ws.recv(timeout=30)) for _ in result.texts),
                                       key=lambda frame: frame["id"])
            process.send_signal(signal.SIGTERM)
        _, result.stderr = process.communicate()
    finally:
        killer.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    result.returncode, result.seconds = process.returncode, time.monotonic() - started
    return result


@pytest.fixture(scope="module", autouse=True)
def _starting(tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Start]]]:
    """Every case of ``STARTS`` started one after another on a thread, from the module's first test on:
    the subprocesses run on one core while the in-process loads run on the other. (None where no test
    selected needs them.)"""
    if not any("starts" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield {}
        return
    directories = {name: copy_of(family, tmp_path_factory.mktemp("start"), edit, folder)
                   if not folder.startswith("my ") else _nested(family, tmp_path_factory.mktemp("start"), folder)
                   for name, (family, edit, folder) in STARTS.items()}
    with ThreadPoolExecutor(1) as pool:
        yield {name: pool.submit(_start, directory) for name, directory in directories.items()}


@pytest.fixture
def starts(_starting: dict[str, Future[Start]]) -> dict[str, Start]:
    """The real starts' outcomes (waiting for those not done yet)."""
    return {name: future.result() for name, future in _starting.items()}


def _nested(family: str, root: Path, folder: str) -> Path:
    (root / folder).parent.mkdir(parents=True)
    return copy_of(family, root, lambda d: None, folder)


#: A log record of the server's own at INFO (the load's choices, before a later check refuses the model).
INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\S+ INFO fillmask_server[.\w]*: ")


def assert_refused_in_one_line(start: Start) -> str:
    """The README's refusal: status 1, the start-up's progress lines (and the server's own INFO records),
    then one ``error:`` line, nothing else (no warning, no library's line); no internals; within the bound.
    Returns the error line."""
    assert start.returncode == 1, (start.returncode, start.stderr)
    assert start.seconds < START_TIMEOUT_S
    lines = [line for line in start.stderr.splitlines() if line.strip()]
    assert lines, start.stderr
    *said, error = lines
    assert all(line.startswith(("loading ", "  ")) or INFO_LINE.match(line) for line in said), start.stderr
    assert error.startswith("error: cannot load model") or error.startswith("error: model "), start.stderr
    assert not any(internal in start.stderr for internal in INTERNALS), start.stderr
    return error


@pytest.mark.parametrize("case", ["weights cut in half", "a directory that is a symlink loop"])
def test_a_real_start_of_a_broken_checkpoint_says_one_line_and_exits_1(case: str, starts: dict[str, Start]) -> None:
    assert_refused_in_one_line(starts[case])


def test_a_real_start_from_a_path_with_spaces_and_unicode_serves_the_pipelines_answers(
        starts: dict[str, Start]) -> None:
    start = starts["served from a path with spaces and Unicode"]
    assert start.hello is not None and start.texts is not None and start.frames is not None, start.stderr
    assert start.returncode == 0, start.stderr
    assert "Traceback" not in start.stderr
    assert_answers_are_the_pipelines(Served(start.hello, start.texts, start.frames, 0), start.directory)


def test_a_real_start_with_a_string_model_max_length_prints_no_traceback(starts: dict[str, Start]) -> None:
    """See ``test_a_model_max_length_written_as_a_string_is_refused_in_one_line``: the real start ended in a
    traceback through ``loading.py``, ``model.py``, ``tokenizing.py`` and transformers' files."""
    assert_refused_in_one_line(starts["model_max_length a string"])


def test_a_pickle_torch_warns_about_is_refused_without_torchs_warning_on_stderr(starts: dict[str, Start]) -> None:
    """A ``pytorch_model.bin`` written with pickle protocol 4: before the ``error:`` line, torch's
    ``UserWarning`` (``.../site-packages/torch/serialization.py:2221: UserWarning: Detected pickle protocol
    4 in the checkpoint ...`` and the source line after it) reached stderr: ``library_warnings`` keeps
    transformers' logger quiet, not Python's ``warnings`` (``loading.py``, the weights' load)."""
    assert_refused_in_one_line(starts["a pickle of protocol 4"])


def test_infinite_weights_are_refused_without_warnings_about_padding_and_tracing_first(
        starts: dict[str, Start]) -> None:
    """Weights holding infinities are refused ("gives scores that are not numbers"), as they should be, but
    the start first logged two WARNING lines that the model's checks drew from the same infinities: "padding
    changes this model's answers: ... logits up to nan away ... So each batch holds texts of one length
    only" and "the traced forward pass differs from eager PyTorch ...; running eager". They tell the
    operator of a model that will serve in a slower mode, just before it is refused for another reason.
    (``FillMaskModel.__init__`` runs ``_check_padding`` and ``_trace`` before ``loading.py`` asks
    ``fails_a_batch``.)"""
    error = assert_refused_in_one_line(starts["infinite weights"])
    assert "not numbers" in error


def test_a_config_asking_for_flash_attention_is_refused_without_a_library_log_line(
        starts: dict[str, Start]) -> None:
    """config.json's ``"attn_implementation": "flash_attention_2"`` (saved by a trainer that used it): the
    refusal's line is clear, but before it the ``kernels`` library logged ``WARNING
    kernels._internals.hf_hub: Skipping publisher trust check for 'kernels-community/flash-attn2' because
    Hugging Face Hub is in offline mode.`` through the server's root handler: ``library_warnings`` and
    ``_load_model`` quiet transformers' and huggingface_hub's loggers only."""
    error = assert_refused_in_one_line(starts["attn_implementation flash_attention_2"])
    assert "FlashAttention2" in error


@pytest.mark.parametrize(("family", "tokens"), [
    ("bert", {"sep_token": "<newsep>"}),
    ("bert", {"sep_token": "<newsep>", "cls_token": "<newcls>"}),
    ("roberta", {"bos_token": "<newbos>", "cls_token": "<newbos>"}),
], ids=["bert sep", "bert sep and cls", "roberta bos and cls"])
def test_a_special_token_every_text_gets_beyond_the_embeddings_is_named(family: str, tokens: dict[str, str],
                                                                         tmp_path: Path) -> None:
    """A tokenizer_config.json naming a new separator or start token (not in the vocabulary: the tokenizer
    adds it past the model's embeddings, and puts it in every text). The pipeline fails on every text
    (IndexError), and the server rightly refuses, but its line is the first line of a TorchScript error,
    "(The following operation failed in the TorchScript interpreter.)", with "check that its tokenizer and
    its weights belong together". ``diagnosis.unservable`` names the mask and padding tokens beyond the
    embeddings; the tokens every text starts or ends with are left to ``fails_a_batch``."""
    line = refusal(copy_of(family, tmp_path, tokenizer_config(**tokens)))
    assert_one_clear_line(line)
    assert any(token in line for token in tokens.values()), line
    assert "TorchScript" not in line, line


async def test_a_config_with_return_dict_false_is_served_or_refused_naming_it(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """``"return_dict": false`` in config.json (the model returns tuples; the pipeline fails on it too).
    The server refused it as "fails on a batch of two short texts with a mask ('tuple' object has no
    attribute 'logits'); ... check that its tokenizer and its weights belong together", after three
    WARNING records that said it would run the full model, eager, with unchecked padding. Either serve it
    (calling the model with ``return_dict=True``: the pipeline's answers on the same directory without the
    field) or refuse it naming ``return_dict``; no warnings about modes it will never serve in."""
    caplog.set_level("WARNING")
    directory = copy_of("bert", tmp_path, config(return_dict=False))
    try:
        served = await serve_and_ask(directory)
    except ModelLoadError as refused:
        assert_one_clear_line(str(refused), "return_dict")
        assert not [record for record in caplog.records if record.levelname == "WARNING"], caplog.text
        return
    config(return_dict=...)(directory)
    assert_answers_are_the_pipelines(served, directory)


async def test_a_tokenizer_that_fails_on_unknown_words_is_refused_or_never_invites_a_retry(tmp_path: Path) -> None:
    """tokenizer_config.json's ``unk_token`` renamed to a token the vocabulary lacks: the tokenizer then
    fails on every word it does not know ("WordPiece error: Missing [UNK] token from the vocabulary"; the
    pipeline fails the same way). The server starts. A text with such a word is answered well
    (``internal_error``, "this text will fail the same way again", ``intake.check``); a target with such
    a word makes ``model.target_ids`` raise inside ``intake.check``, which the tokenizer stage answers with
    ``core.SERVER_FAILED``, "the server failed while handling this request; ... you may send it again",
    and a traceback in the log: a retry fails the same way. Either refuse such a tokenizer at start-up
    (one line), or answer the target as the text is answered (or as ``invalid_targets``)."""
    directory = copy_of("bert", tmp_path, tokenizer_config(unk_token="<newunk>"))
    try:
        model = load_model(str(directory))
    except ModelLoadError as refused:
        assert_one_clear_line(str(refused))
        return
    server = FillMaskServer(Config(model=str(directory), host="127.0.0.1", port=0, shutdown_timeout=5.0), model)
    await server.start()
    try:
        async with session(server.url) as (ws, hello):
            mask = hello["mask_token"]
            await send(ws, {"type": "fill_mask", "id": 0, "text": f"Tokyo is {mask} 東京", "top_k": 3})
            await send(ws, {"type": "fill_mask", "id": 1, "text": f"Tokyo is {mask}.", "targets": ["東京"]})
            frames = {frame["id"]: frame for frame in await recv_n(ws, 2)}
    finally:
        await server.drain(timeout=2.0)
    assert frames[0]["type"] == "error" and "fail the same way again" in frames[0]["message"], frames[0]
    assert frames[1]["type"] == "error" and "send it again" not in frames[1]["message"], frames[1]


def test_a_missing_vocab_txt_is_named(tmp_path: Path) -> None:
    """ESM's tokenizer is its vocab.txt (no tokenizer.json). Without it the line was "expected str, bytes
    or os.PathLike object, not NoneType" (EsmTokenizer opening a path of None), naming no file."""
    assert_one_clear_line(refusal(copy_of("esm", tmp_path, remove("vocab.txt"))), "vocab.txt")
