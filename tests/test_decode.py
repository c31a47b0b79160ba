"""The decode stage's sequences (decode.py): one decode with a slot gives the pipeline's strings exactly.

The oracle is the pipeline's own computation, ``tokenizer.decode`` of the whole text with the candidate
in place and padding ids dropped (``FillMaskPipeline.postprocess``), on the real bert-base-uncased
vocabulary, with and without transformers' whole-string cleanup (bert-base-uncased on the Hub turns it
on; the offline checkpoint leaves it off).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fillmask_server.decode import SequenceDecoder

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103


@pytest.fixture(scope="module", params=[False, True], ids=["no-cleanup", "cleanup"])
def tokenizer(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    loaded = copy.deepcopy(AutoTokenizer.from_pretrained(tiny_model_dir))
    loaded.clean_up_tokenization_spaces = request.param
    return loaded


def pipeline_sequence(tokenizer: Any, ids: list[int], position: int, candidate: int, skip: bool) -> str:
    """FillMaskPipeline.postprocess, verbatim in effect."""
    tokens = list(ids)
    tokens[position] = candidate
    return tokenizer.decode([t for t in tokens if t != tokenizer.pad_token_id], skip_special_tokens=skip)


# Tokens where decoding is subtle: specials, padding, glued pieces (##), punctuation the cleanup joins,
# the apostrophe forms, and words the cleanup rewrites ("do not").
SUBTLE = [PAD, UNK, CLS, SEP, MASK, 1005, 1010, 1012, 1029, 999, 1011, 2079, 2025, 1056, 1055, 1049, 2310, 2128,
          1050, 2015, 3436, 2075, 1001, 7592, 2088]
token_ids = st.one_of(st.sampled_from(SUBTLE), st.integers(min_value=0, max_value=30521))


@pytest.fixture(scope="module")
def shortcut(tokenizer: Any) -> SequenceDecoder:
    """One decoder per tokenizer for all examples (its caches only remember what the tokenizer says)."""
    return SequenceDecoder(tokenizer, self_check=0)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token_ids, min_size=1, max_size=14), data=st.data())
def test_one_slot_decode_equals_the_pipelines_full_decode(tokenizer: Any, shortcut: SequenceDecoder,
                                                          ids: list[int], data: Any) -> None:
    decoder = shortcut
    assert decoder.fast
    position = data.draw(st.integers(min_value=0, max_value=len(ids) - 1))
    candidates = data.draw(st.lists(token_ids, min_size=1, max_size=6))
    skip = data.draw(st.booleans())
    got = decoder.sequences(ids, position, candidates, skip)
    assert got == [pipeline_sequence(tokenizer, ids, position, c, skip) for c in candidates]


def test_real_texts_with_one_and_several_masks(tokenizer: Any) -> None:
    decoder = SequenceDecoder(tokenizer)
    assert decoder.fast  # the start-up self-check passed on this tokenizer
    for text in ["Paris is the [MASK] of France.", "[MASK] don't do not ' t [UNK] [PAD] x?!",
                 "The [MASK] sat on the [MASK], didn't it?", "##ing [MASK] ##s"]:
        ids = tokenizer(text)["input_ids"]
        masks = [i for i, t in enumerate(ids) if t == MASK]
        for position in masks:
            every = list(range(0, 30522, 7))
            skip = len(masks) == 1
            assert decoder.sequences(ids, position, every, skip) == [
                pipeline_sequence(tokenizer, ids, position, c, skip) for c in every]


def test_a_shortcut_that_disagrees_at_start_up_is_turned_off(tokenizer: Any) -> None:
    class Disagreeing(SequenceDecoder):
        def _full(self, ids: Any, position: int, candidate: int, skip_special: bool) -> str:
            return super()._full(ids, position, candidate, skip_special) + "!"

    assert not Disagreeing(tokenizer, self_check=50).fast


def byte_level(vocab: dict[str, int]) -> Any:
    """A byte-level BPE tokenizer (RoBERTa's kind) over ``vocab``, with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", mask_token="<mask>")


def test_byte_level_tokens_that_split_a_character_take_the_pipelines_path() -> None:
    """Byte-level BPE (RoBERTa's kind): "Ã" and "©" are the two bytes of "é", neither a character alone,
    so a candidate or a neighbour of the mask like them is decoded in full; whole tokens use the slot."""
    tokenizer = byte_level({"<pad>": 0, "<mask>": 1, "a": 2, "b": 3, "Ġa": 4, "Ġb": 5, "Ã": 6, "©": 7})
    decoder = SequenceDecoder(tokenizer)
    assert decoder.fast
    for ids, position in (([2, 1, 5], 1), ([6, 1, 5], 1), ([2, 1, 7], 1), ([1], 0)):
        candidates = [6, 7, 4, 2, 0, 1]
        assert decoder.sequences(ids, position, candidates, True) == [
            pipeline_sequence(tokenizer, ids, position, c, True) for c in candidates]
    assert decoder.sequences([6, 1], 1, [7], False) == ["é"]


UNICODE_TEXT = [line for n in range(300) for line in (
    f"Café número {n} über straße", "日本語のテキスト と 中文 文本", "emoji 🙂👍🏽 and naïve façade",
    "Ελληνικά кириллица")]


def _trained(kind: str) -> Any:
    """A tokenizer of ``kind`` trained on Unicode text, so its vocabulary has tokens that are parts of
    characters (byte-level) and pieces with and without the word marker (Metaspace)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    if kind == "bytelevel":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        backend = Tokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=specials, unk_token="<unk>")
    backend.train_from_iterator(UNICODE_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", mask_token="<mask>",
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_byte_level_and_metaspace_decoders_give_the_pipelines_strings(kind: str) -> None:
    """RoBERTa's and ModernBERT's decoder (byte-level) and the SentencePiece families' (Metaspace): the
    slot path is on, and every string equals the pipeline's on random texts over the whole vocabulary."""
    import random

    tokenizer = _trained(kind)
    decoder = SequenceDecoder(tokenizer)
    assert decoder.fast
    size = len(tokenizer)
    broken = [t for t in range(size) if "\ufffd" in tokenizer.decode([t])]
    assert (kind == "bytelevel") == bool(broken)  # byte-level has parts of characters; their path is tested
    rng = random.Random(1)
    for _ in range(400):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 12))]
        position = rng.randrange(len(ids))
        candidates = [rng.randrange(size) for _ in range(4)] + broken[:2]
        skip = rng.random() < 0.5
        assert decoder.sequences(ids, position, candidates, skip) == [
            pipeline_sequence(tokenizer, ids, position, c, skip) for c in candidates]
    text = "Café <mask> 日本語 🙂"
    ids = tokenizer(text)["input_ids"]
    position = ids.index(tokenizer.mask_token_id)
    assert decoder.sequences(ids, position, list(range(size)), True) == [
        pipeline_sequence(tokenizer, ids, position, c, True) for c in range(size)]


def test_a_tokenizer_whose_decoder_is_not_piecewise_is_decoded_in_full() -> None:
    """A decoder that is not one piece per token (here a byte-fallback sequence): no slot."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<mask>": 1, "a": 2, "b": 3, "▁a": 4, "▁b": 5, "<0xC3>": 6, "<0xA9>": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", mask_token="<mask>")
    decoder = SequenceDecoder(tokenizer)
    assert not decoder.fast
    ids = [2, 1, 5]
    assert decoder.sequences(ids, 1, [6, 7, 4], True) == [pipeline_sequence(tokenizer, ids, 1, c, True)
                                                           for c in (6, 7, 4)]


def test_a_python_tokenizer_that_joins_its_tokens_with_spaces_gets_the_slot_too() -> None:
    """ESM's tokenizer is written in Python (no fast version): its decode joins the residues with spaces,
    which the start-up self-check finds piecewise; every string equals the pipeline's. With the
    whole-string cleanup on, which a piece cannot carry, it is decoded in full."""
    import random

    from transformers import AutoTokenizer

    from fillmask_server.checkpoint import ensure_family

    directory = ensure_family("esm", Path(__file__).resolve().parent.parent / "models" / "families")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert getattr(tokenizer, "backend_tokenizer", None) is None
    decoder = SequenceDecoder(tokenizer)
    assert decoder.fast
    rng = random.Random(2)
    size = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 14))]
        position = rng.randrange(len(ids))
        skip = rng.random() < 0.5
        assert decoder.sequences(ids, position, list(range(size)), skip) == [
            pipeline_sequence(tokenizer, ids, position, c, skip) for c in range(size)]
    cleaned = copy.deepcopy(tokenizer)
    cleaned.clean_up_tokenization_spaces = True
    assert not SequenceDecoder(cleaned).fast


def test_an_id_the_vocabulary_has_no_token_for_is_dropped_as_the_tokenizer_drops_it() -> None:
    """A gap in the vocabulary (id 5 below): the tokenizer drops the id when decoding; so does the slot,
    around the mask and as a candidate, instead of failing at start-up (found in review)."""
    tokenizer = byte_level({"<pad>": 0, "<mask>": 1, "a": 2, "b": 3, "Ġa": 4, "Ġb": 7})
    decoder = SequenceDecoder(tokenizer)
    assert decoder.fast
    for ids in ([2, 1, 7], [5, 1, 4], [2, 1, 5, 7]):
        for skip in (True, False):
            assert decoder.sequences(ids, 1, [5, 6, 4, 7, 1], skip) == [
                pipeline_sequence(tokenizer, ids, 1, c, skip) for c in (5, 6, 4, 7, 1)]
