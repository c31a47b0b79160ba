"""Fill-mask architectures beyond the nine families (``test_families.py``), where they break what those
nine take for granted, on a real socket against ``pipeline("fill-mask")``.

- **Padding changes the answer.** FNet mixes its tokens by a Fourier transform over the whole row,
  padding included (ConvBERT's convolutions, Funnel's pooling, YOSO's, Nyströmformer's and Reformer's
  attention reach it too): a text batched beside a longer one got another answer than alone, a
  different first token on the wire. The load now finds that out and runs one length a batch
  (``hello.engine.layout`` ``one_length``; protocol.md §2).
- **An embedding table that is not an ``nn.Embedding``.** I-BERT's is a ``QuantEmbedding`` and
  Perceiver's a bare ``Parameter``: the start-up's check of the mask and padding ids read
  ``num_embeddings`` and ended in a traceback.

Each checkpoint is built here with random weights (a wider spread than the library's, so that
predictions are peaked) around the suite's tiny BERT tokenizer, in a second or so.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fillmask_server.diagnosis import embedding_rows
from fillmask_server.loading import load_model
from fillmask_server.server import FillMaskServer
from tests.wire import assert_same_predictions, recv_n, send, session

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
#: Texts of nine different lengths (one mask; two in one), sent at once so that they share batches.
TEXTS = ["[MASK] home.", "The old farmer bought a [MASK] bicycle.", "It was [MASK], [MASK] and cold.",
         "The children were [MASK] near the river while the farmer bought a red bicycle in the morning.",
         "a [MASK]", "She [MASK] the door and went out into the rain without her coat.",
         "Paris is the [MASK] of France.", "[MASK]", "Nobody knew why the [MASK] had stopped."]


def _write(directory: Path, tiny_model_dir: Path, config: Any) -> Path:
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(config)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fnet_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import FNetConfig

    return _write(tmp_path_factory.mktemp("fnet"), tiny_model_dir, FNetConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512,
        pad_token_id=0, initializer_range=0.2))


@pytest.fixture(scope="module")
def ibert_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import IBertConfig

    return _write(tmp_path_factory.mktemp("ibert"), tiny_model_dir, IBertConfig(
        vocab_size=30522, hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=520, pad_token_id=0, type_vocab_size=1, initializer_range=0.2))


@pytest.fixture(scope="module")
def fnet_pipeline(fnet_dir: Path) -> Any:
    from transformers import pipeline

    return pipeline("fill-mask", model=str(fnet_dir), device="cpu")


async def answers_at_once(server: FillMaskServer, texts: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every text sent on one connection before any answer is read; hello and the answers in text order."""
    async with session(server.url) as (ws, hello):
        with server.engine.paused():  # (held until all are queued: one round takes them all)
            for n, text in enumerate(texts):
                await send(ws, {"type": "fill_mask", "id": n, "text": text, "top_k": 5})
            await wait_queued(server, len(texts))
        frames = await recv_n(ws, len(texts))
    return hello, sorted(frames, key=lambda frame: frame["id"])


async def wait_queued(server: FillMaskServer, count: int) -> None:
    for _ in range(1000):  # (bounded: 10 s)
        if server.engine.runnable() >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{server.engine.runnable()} of {count} requests tokenized and queued")


def same_as_alone(pipe: Any, frames: list[dict[str, Any]], texts: list[str]) -> None:
    for frame, text in zip(frames, texts, strict=True):
        assert frame["type"] == "result", frame
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_same_predictions(frame["predictions"], pipe(text, top_k=5), TOLERANCE)


def test_fnets_answers_change_with_padding_and_the_load_finds_it(fnet_dir: Path) -> None:
    """The premise, in transformers alone, then the load's verdict."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fnet_dir)
    model = AutoModelForMaskedLM.from_pretrained(fnet_dir).eval()
    with torch.inference_mode():
        alone = model(**tokenizer([TEXTS[0]], return_tensors="pt")).logits[0]
        padded = model(**tokenizer([TEXTS[0], TEXTS[3]], return_tensors="pt", padding=True)).logits[0, :len(alone)]
    assert (alone - padded).abs().max().item() > 0.1
    loaded = load_model(str(fnet_dir), "cpu", announce=False)
    assert loaded.one_length and loaded.pack_width == 0 and loaded.engine_facts()["layout"] == "one_length"
    assert loaded.padding_note is not None and "padding changes this model's answers" in loaded.padding_note
    # (No family is flagged: tests/test_families.py holds each to its packed or padded layout.)


@pytest.mark.parametrize("overrides", [{}, {"max_length_ratio": 3.0, "max_missed_batches": 0}],
                         ids=["cost-model", "a-band-that-would-force-every-request"])
async def test_a_model_that_padding_changes_answers_each_text_as_the_pipeline_does_alone(
        fnet_dir: Path, fnet_pipeline: Any, make_server: Any, overrides: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """Nine lengths at once: each batch is one length (a fixed band, whose tail bound would force every
    request into one batch, is not used for such a model), and every answer is the pipeline's for the
    text alone (before: a different first token for some)."""
    async with make_server(model=str(fnet_dir), **overrides) as server:
        hello, frames = await answers_at_once(server, TEXTS)
        assert hello["engine"]["layout"] == "one_length"
        same_as_alone(fnet_pipeline, frames, TEXTS)
        lengths: dict[int, set[int]] = {}
        for frame in frames:
            lengths.setdefault(frame["batch_id"], set()).add(frame["batch_tokens"] // frame["batch_size"])
        assert len(lengths) > 1 and all(len(widths) == 1 for widths in lengths.values()), lengths
    said = any(record.getMessage().startswith("--max-length-ratio is not used") for record in caplog.records)
    assert said == bool(overrides)


async def test_a_batch_of_several_lengths_still_runs_each_text_alone(fnet_dir: Path, fnet_pipeline: Any,
                                                                     make_server: Any) -> None:
    """The engine's own guard, for a batch that holds several lengths all the same (no policy forms one
    for such a model now; the fixed band's tail bound did): a pass for each length, each text's top
    token the pipeline's."""
    from fillmask_server.items import Item

    async with make_server(model=str(fnet_dir)) as server:
        model = server.model
        items = [Item(ids, 5) for ids in model.tokenize(TEXTS)]
        with server.engine.paused():
            groups, failed = server.engine._forward_all(items, list(range(len(items))))
    assert not failed and sorted(i for indices, _ in groups for i in indices) == list(range(len(items)))
    assert all(len({len(items[i].input_ids) for i in indices}) == 1 for indices, _ in groups)
    assert len(groups) == len({len(item.input_ids) for item in items})
    for indices, top in groups:
        for row, i in enumerate(indices):
            first = top.spans[row][0]
            expected = fnet_pipeline(TEXTS[i], top_k=1)
            token = (expected[0] if isinstance(expected[0], list) else expected)[0]["token"]
            assert int(top.indices[first][0]) == token, (TEXTS[i], int(top.indices[first][0]), token)


class _Table(torch.nn.Module):
    """An embedding module with a ``weight`` and no ``num_embeddings`` (I-BERT's ``QuantEmbedding``)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, 4))


class _Holder:
    def __init__(self, table: Any) -> None:
        self.table = table

    def get_input_embeddings(self) -> Any:
        if self.table is None:
            raise NotImplementedError
        return self.table


@pytest.mark.parametrize(("table", "rows"), [
    (torch.nn.Embedding(7, 4), 7), (_Table(9), 9), (torch.nn.Parameter(torch.zeros(11, 4)), 11), (None, None),
    (torch.nn.Parameter(torch.zeros(11)), None)])
def test_the_embedding_tables_rows_whatever_its_kind(table: Any, rows: int | None) -> None:
    assert embedding_rows(_Holder(table)) == rows


def test_ibert_whose_embedding_table_is_no_nn_embedding_loads_and_serves(ibert_dir: Path) -> None:
    """Before: ``AttributeError: 'QuantEmbedding' object has no attribute 'num_embeddings'``, a traceback
    at start-up, for a checkpoint the pipeline serves."""
    loaded = load_model(str(ibert_dir), "cpu", announce=False)
    assert type(loaded.model.get_input_embeddings()).__name__ == "QuantEmbedding"
    assert loaded.fails_a_batch() is None


def test_the_architectures_script_builds_serves_and_compares_one(tmp_path: Path) -> None:
    """``scripts/architectures.py``, where the README's figures for forty architectures come from, on FNet:
    its checkpoint kept, the server one length a batch, its answers the pipeline's."""
    run = subprocess.run([sys.executable, "scripts/architectures.py", "fnet", "--keep", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^fnet +same +traced/masks/one_length ", run.stdout, re.MULTILINE), run.stdout
    assert "warning: padding changes this model's answers" in run.stdout
    assert (tmp_path / "fnet" / "config.json").is_file()
