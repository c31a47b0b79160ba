"""The fast equivalent of a pure-Python tokenizer (``fillmask_server.tokenizing``): ESM's protein
tokenizer gets one with the very same ids, a tokenizer that is fast already keeps its own, and a
candidate that splits any check text differently is refused. A fast tokenizer is called through its
Rust backend, checked the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fillmask_server import tokenizing
from fillmask_server.checkpoint import ensure_family

ROOT = Path(__file__).resolve().parent.parent
FAMILY_DIR = ROOT / "models" / "families"


def slow_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=True, return_attention_mask=False, return_token_type_ids=False,
                     verbose=False)["input_ids"]


@pytest.fixture(scope="module")
def esm() -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_family("esm", FAMILY_DIR))
    assert not tokenizer.is_fast  # the case this module is for
    return tokenizer


def held_out(tokenizer: Any) -> list[str]:
    """Texts the load-time check did not see: another seed, protein sequences of up to 300 residues
    with masks, spaces and lower case."""
    mask = tokenizer.mask_token
    proteins = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ" * k for k in range(1, 10)]
    return [*tokenizing.check_texts(tokenizer, n=300, seed=1), *(p[:40] + mask + p[41:] for p in proteins),
            f"{mask}{mask}AC DE", f"ac{mask}de", f" {mask}\tKR\nQW ", "XBUZO.-", "<cls>A<eos>", "A<null_1>C",
            *(f"M{space}K{mask}" for space in tokenizing._WHITESPACE), f"\x1c{mask}", f"a\x1fb {mask}"]


def test_the_check_texts_hold_every_character_python_splits_words_on(esm: Any, tiny_model_dir: Path) -> None:
    """Slow tokenizers split words with ``str.split()``; the check must see every character it splits on
    (a differential run found U+001C–U+001F split by the slow tokenizer, kept by the candidate)."""
    assert set(tokenizing._WHITESPACE) == {chr(c) for c in range(0x110000) if chr(c).isspace()}
    from transformers import AutoTokenizer

    for tokenizer in (esm, AutoTokenizer.from_pretrained(tiny_model_dir)):  # 33 tokens, and 30,522
        checked = "".join(tokenizing.check_texts(tokenizer))
        assert all(space in checked for space in tokenizing._WHITESPACE), tokenizer.vocab_size


def test_a_pure_python_tokenizer_of_whole_tokens_gets_a_fast_equivalent_with_the_same_ids(esm: Any) -> None:
    fast = tokenizing.fast_equivalent(esm)
    assert fast is not None
    texts = held_out(esm)
    assert [encoding.ids for encoding in fast.encode_batch(texts, add_special_tokens=True)] == slow_ids(esm, texts)


@pytest.mark.parametrize("change", ["splits on punctuation too", "adds no special tokens",
                                    "splits on Rust's whitespace only"])
def test_a_candidate_that_splits_any_check_text_differently_is_refused(esm: Any, change: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import pre_tokenizers

    build = tokenizing._whole_token_tokenizer

    def changed(tokenizer: Any) -> Any:
        fast = build(tokenizer)
        if change == "splits on punctuation too":
            fast.pre_tokenizer = pre_tokenizers.Whitespace()
        elif change == "splits on Rust's whitespace only":  # the rule before the differential run
            fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        else:
            fast.post_processor = None
        return fast

    monkeypatch.setattr(tokenizing, "_whole_token_tokenizer", changed)
    assert tokenizing.fast_equivalent(esm) is None


def test_a_tokenizer_that_is_fast_already_keeps_its_own() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_family("bert", FAMILY_DIR))
    assert tokenizer.is_fast and tokenizing.fast_equivalent(tokenizer) is None


def test_the_model_splits_with_the_fast_equivalent(esm: Any) -> None:
    from fillmask_server.loading import load_model

    model = load_model(str(ensure_family("esm", FAMILY_DIR)))
    assert model._fast_tokenizer is not None
    texts = held_out(esm)
    assert model.tokenize(texts) == slow_ids(esm, texts)


FAST_FAMILIES = ["bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta-v2", "modernbert"]


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_a_fast_tokenizers_backend_gives_the_same_ids(family: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_family(family, FAMILY_DIR))
    direct = tokenizing.direct_backend(tokenizer)
    assert direct is not None
    mask = tokenizer.mask_token
    texts = [*held_out(tokenizer), f"paris is the {mask} of france.", f"{mask}{mask} a\tb\nc  ",
             "Ünïcödé 中文 🙂 " + mask, "x " * 600 + mask]  # the last: past any length
    assert tokenizing.token_ids(direct, texts) == slow_ids(tokenizer, texts)


def test_the_model_splits_a_fast_tokenizers_texts_with_its_backend() -> None:
    from tokenizers import Tokenizer

    from fillmask_server.loading import load_model

    model = load_model(str(ensure_family("roberta", FAMILY_DIR)))
    assert isinstance(model._fast_tokenizer, Tokenizer)  # the backend, not transformers' call
    texts = held_out(model.tokenizer)[:100]
    assert model.tokenize(texts) == slow_ids(model.tokenizer, texts)


def test_a_backend_that_splits_any_check_text_differently_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_family("bert", FAMILY_DIR))
    assert tokenizing.direct_backend(tokenizer) is not None
    copy_of = tokenizing._backend_copy

    def without_special_tokens(backend: Any) -> Any:
        direct = copy_of(backend)
        direct.post_processor = None
        return direct

    monkeypatch.setattr(tokenizing, "_backend_copy", without_special_tokens)
    assert tokenizing.direct_backend(tokenizer) is None


def test_a_backend_copy_ignores_the_truncation_and_padding_its_tokenizer_json_sets() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_family("roberta", FAMILY_DIR))
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    tokenizer.backend_tokenizer.enable_padding(length=64)
    direct = tokenizing.direct_backend(tokenizer)
    assert direct is not None and direct.truncation is None and direct.padding is None
    text = "a long text of many words " * 10 + tokenizer.mask_token
    assert len(tokenizing.token_ids(direct, [text])[0]) > 50
