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


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token_ids, min_size=1, max_size=14), data=st.data())
def test_one_slot_decode_equals_the_pipelines_full_decode(tokenizer: Any, ids: list[int], data: Any) -> None:
    decoder = SequenceDecoder(tokenizer, self_check=0)
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


def test_a_tokenizer_that_is_not_wordpiece_is_decoded_in_full() -> None:
    """Byte-level BPE (RoBERTa's kind): characters span tokens, so no slot; the pipeline's way is used."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<mask>": 1, "a": 2, "b": 3, "Ġa": 4, "Ġb": 5, "Ã": 6, "©": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", mask_token="<mask>")
    decoder = SequenceDecoder(tokenizer)
    assert not decoder.fast
    ids = [2, 1, 5]
    assert decoder.sequences(ids, 1, [6, 7, 4], True) == [pipeline_sequence(tokenizer, ids, 1, c, True)
                                                           for c in (6, 7, 4)]
