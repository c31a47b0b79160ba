"""Write an offline, random-weight fill-mask checkpoint (config, weights, tokenizer): BERT in three
sizes, or one of nine model families (below).

Model hubs are unreachable on CI and on air-gapped machines, so tests, benchmarks and the quick
start use checkpoints made by this command. The tokenizer is the real ``bert-base-uncased``
WordPiece vocabulary (30522 tokens, ``[MASK]`` = 103, shipped in ``data/``), so texts tokenize
exactly as they would for the real model; only the weights are random.

    .venv/bin/python -m fillmask_server.checkpoint tiny models/tiny     # 2 layers, for tests
    .venv/bin/python -m fillmask_server.checkpoint base models/base     # bert-base-uncased shape, for benchmarks

Sizes:
- ``tiny``: 2 layers, hidden 128, 2 heads (about 4.5 M parameters, mostly the embeddings).
- ``small``: 4 layers, hidden 256, 4 heads.
- ``base``: 12 layers, hidden 768, 12 heads: the compute of ``bert-base-uncased`` (110 M).

The weights are drawn with a wider spread than BERT's usual initialisation so that predictions are
peaked rather than nearly uniform: rankings then don't hinge on the last bits of a float, and
comparisons between the server and the pipeline are meaningful. The config records
``fillmask_random_weights: true`` so that the server can say so (``hello.random_weights``).

**Other families** (``FAMILIES``: RoBERTa, XLM-R, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2, ModernBERT,
ESM, and BERT with a vocabulary of its own): ``write_family`` makes a tiny random-weight checkpoint of
each, with a tokenizer of the family's kind trained offline with ``tokenizers`` (about a second; tests
and ``bench/run.py --families`` cache them under ``models/families/``)::

    .venv/bin/python -m fillmask_server.checkpoint distilbert models/families/distilbert
    .venv/bin/python -m fillmask_server.checkpoint xlm-roberta models/x --family-shape base  # 12 x 768, 250,002 tokens

``--family-shape`` (``FAMILY_SHAPES``) sets the width and depth; ``base`` also gives the vocabulary its
family's real size (``FAMILY_REAL_VOCAB``) by padding the trained tokenizer with filler tokens.

The command does nothing where the checkpoint asked for (its name, family shape and seed, which
config.json records) is already there, and writes over an incomplete one of its own (an interrupted
write). It refuses, with one line and exit status 1, to write over another complete checkpoint of its
own or any other file (a trained model's, notes beside a checkpoint); ``--force`` first removes the
model files there (``MODEL_FILES``: config, weights, tokenizer), so none of another model's is read
beside the new one, and leaves anything else. Its files get the modes a plain
``open`` gives (transformers saves the weights as 0600): a container's user other than the writer
can read them.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import itertools
import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512},
    "small": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
}
VOCAB_FILE = "bert-base-uncased-vocab.txt"
RANDOM_WEIGHTS_KEY = "fillmask_random_weights"  # in config.json: these weights were never trained
SEED_KEY = "fillmask_seed"  # in config.json: the seed the weights were drawn with (checkpoints without it: 0)


def is_checkpoint(directory: Path, size: str | None = None, seed: int | None = None) -> bool:
    """True when ``directory`` already holds a complete BERT checkpoint of this command (so set-up can skip
    the work): of ``size`` and drawn with ``seed``, where given."""
    weights = ("config.json", "model.safetensors")
    if not (all((directory / name).is_file() for name in weights) and _tokenized(directory)):
        return False
    config = _config(directory)
    return (config.get(RANDOM_WEIGHTS_KEY) is True and FAMILY_KEY not in config
            and (size is None or _bert_size(config) == size)
            and (seed is None or config.get(SEED_KEY, 0) == seed))


def _tokenized(directory: Path) -> bool:
    """``directory`` holds a tokenizer's vocabulary, the last file a checkpoint is saved with
    (transformers 5 saves it as tokenizer.json; 4 as vocab.txt)."""
    return any((directory / name).is_file() for name in ("tokenizer.json", "vocab.txt"))


def _config(directory: Path) -> dict[str, Any]:
    """``directory``'s config.json as a dict; empty when there is none, or it is not a JSON object."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _bert_size(config: dict[str, Any]) -> str | None:
    """The name in ``SIZES`` of the shape ``config`` has, or None."""
    return next((name for name, shape in SIZES.items()
                 if all(config.get(key) == value for key, value in shape.items())), None)


def write_checkpoint(size: str, directory: Path, seed: int = 0, init_range: float = 0.2) -> Path:
    """Create ``directory`` with a random-weight ``BertForMaskedLM`` of ``size`` and its tokenizer."""
    import torch
    import transformers
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    transformers.utils.logging.disable_progress_bar()

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    directory.mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("fillmask_server") / "data" / VOCAB_FILE) as vocab:
        tokenizer = BertTokenizer(vocab=str(vocab), do_lower_case=True, model_max_length=512)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512,
                        initializer_range=init_range, **SIZES[size], **{RANDOM_WEIGHTS_KEY: True, SEED_KEY: seed})
    model = BertForMaskedLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- one tiny checkpoint per model family (tests and bench/run.py --families) ----------------------------

#: The fill-mask families ``write_family`` builds, each with a tokenizer of the kind its real checkpoints
#: use: WordPiece (BERT, DistilBERT, ELECTRA), byte-level BPE (RoBERTa, ModernBERT), Unigram with
#: Metaspace (XLM-R, ALBERT, DeBERTa-v2), and ESM's fixed character vocabulary of amino acids.
FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta-v2", "modernbert", "esm")
FAMILY_MAX_TOKENS = 64  # each family checkpoint's ``model_max_length`` (special tokens included)
FAMILY_VOCAB = 1000  # the size the trained tokenizers aim at (Unigram may stop a little short)
FAMILY_VERSION = 1  # recorded in config.json: a change to the builders bumps it, so caches are rebuilt
FAMILY_KEY = "fillmask_family_version"
#: ESM-2's vocabulary (``facebook/esm2_t6_8M_UR50D``), in its order: 33 tokens, 4 special and ``<mask>``.
ESM_VOCAB = ("<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q",
             "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>")
#: Family model shapes: ``tiny`` for tests (the Python around the model is most of the cost), ``small``
#: (4 layers of width 384, about MiniLM's: the model is most of it) and ``base`` (BERT-base's shape,
#: 12 layers of width 768, for every family, with each family's real vocabulary size) for the
#: benchmark. ``generator``: ELECTRA's generator as (embedding width, encoder width); by default
#: twice ``hidden`` over embeddings of ``hidden``. ``real_vocab``: the vocabulary is padded to
#: ``FAMILY_REAL_VOCAB`` (else it is the ``FAMILY_VOCAB`` tokens trained).
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 2},
    "small": {"hidden": 384, "intermediate": 1536, "layers": 4, "heads": 6},
    "base": {"hidden": 768, "intermediate": 3072, "layers": 12, "heads": 12, "generator": (768, 256),
             "real_vocab": True},
}
#: The vocabulary sizes of each family's common checkpoint (bert-base-uncased, roberta-base,
#: xlm-roberta-base, distilbert-base-uncased, albert-base-v2, electra-base-generator, deberta-v3-base,
#: ModernBERT-base, ESM-2): what the pipeline projects every position onto.
FAMILY_REAL_VOCAB = {"bert": 30522, "roberta": 50265, "xlm-roberta": 250002, "distilbert": 30522, "albert": 30000,
                     "electra": 30522, "deberta-v2": 128100, "modernbert": 50368, "esm": len(ESM_VOCAB)}
FAMILY_SHAPE_KEY = "fillmask_family_shape"


def training_text(lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic English-like text for training the family tokenizers offline: sentences of the
    whole words of the shipped BERT vocabulary, with punctuation and digits."""
    import random

    with resources.as_file(resources.files("fillmask_server") / "data" / VOCAB_FILE) as vocab:
        words = [w for w in Path(vocab).read_text(encoding="utf-8").split() if w.isalpha() and w.isascii()]
    rng = random.Random(seed)
    common = words[1000:6000]  # the frequent words, so that they become single tokens
    text = []
    for n in range(lines):
        sentence = " ".join(rng.choice(common if rng.random() < 0.8 else words) for _ in range(rng.randint(4, 14)))
        text.append(sentence.capitalize() + rng.choice([".", ".", "!", "?", f", {n}."]))
    return text


def is_family_checkpoint(directory: Path, shape: str = "tiny", family: str | None = None,
                         seed: int | None = None) -> bool:
    """True when ``directory`` holds a checkpoint of ``family`` in ``shape`` written by this version of
    ``write_family``, with the family's real vocabulary size where the shape has one, drawn with ``seed``
    where given (``family``: by default the directory's name, as ``ensure_family`` names them)."""
    config = _config(directory)
    family = family or directory.name
    real = FAMILY_SHAPES.get(shape, {}).get("real_vocab", False)
    return (config.get(FAMILY_KEY) == FAMILY_VERSION and config.get("model_type") == family
            and config.get(FAMILY_SHAPE_KEY, "tiny") == shape
            and (not real or config.get("vocab_size") == FAMILY_REAL_VOCAB.get(family))
            and (seed is None or config.get(SEED_KEY, 0) == seed)
            and all((directory / name).is_file() for name in ("model.safetensors", "tokenizer_config.json"))
            and _tokenized(directory))


def ensure_family(family: str, root: Path, shape: str = "tiny") -> Path:
    """``root/FAMILY``, written by ``write_family`` unless a checkpoint of this version and ``shape`` is
    already there.

    Safe for several processes at once (the test suite's workers): each writes into a directory of its
    own beside the target and renames it into place, which is atomic, so a reader never sees a half
    written checkpoint; a process that loses the race throws its copy away."""
    import shutil
    import tempfile

    directory = root / family
    if is_family_checkpoint(directory, shape, family):
        return directory
    root.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=root))
    try:
        write_family(family, made, shape=shape)
        _readable(made, directory_too=True)  # (mkdtemp makes it 0700)
        if directory.exists() and not is_family_checkpoint(directory, shape, family):
            shutil.rmtree(directory, ignore_errors=True)  # an older version's (or another shape's) checkpoint
        try:
            made.rename(directory)
        except OSError:  # another process put a checkpoint there first
            if not is_family_checkpoint(directory, shape, family):
                raise
    finally:
        shutil.rmtree(made, ignore_errors=True)
    return directory


def write_family(family: str, directory: Path, seed: int = 0, shape: str = "tiny") -> Path:
    """A random-weight ``*ForMaskedLM`` of ``family`` in ``shape`` (``FAMILY_SHAPES``; tiny: 2 layers,
    hidden 32-64) and its tokenizer, trained offline with ``tokenizers`` on ``training_text``; the
    tokenizer is the family's own class, so it tokenizes, adds special tokens and decodes as that
    family's real checkpoints do."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if shape not in FAMILY_SHAPES:
        raise ValueError(f"unknown family shape {shape!r}; choose one of {', '.join(FAMILY_SHAPES)}")
    widths = dict(FAMILY_SHAPES[shape])
    vocab_size = FAMILY_REAL_VOCAB[family] if widths.pop("real_vocab", False) else None
    tokenizer = _family_tokenizer(family, directory, vocab_size)
    config = _family_config(family, tokenizer, **widths)
    setattr(config, RANDOM_WEIGHTS_KEY, True)
    setattr(config, FAMILY_KEY, FAMILY_VERSION)
    setattr(config, SEED_KEY, seed)
    if shape != "tiny":
        setattr(config, FAMILY_SHAPE_KEY, shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForMaskedLM.from_config(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _family_tokenizer(family: str, directory: Path, vocab_size: int | None = None) -> Any:
    """The family's tokenizer, trained to ``FAMILY_VOCAB`` tokens (and padded to ``vocab_size``: ``_pad``)."""
    import transformers

    limit = {"model_max_length": FAMILY_MAX_TOKENS}
    if family == "esm":
        directory.mkdir(parents=True, exist_ok=True)
        vocab = directory / "vocab.txt"
        vocab.write_text("\n".join(ESM_VOCAB) + "\n")
        return transformers.EsmTokenizer(str(vocab), **limit)
    if family in ("bert", "distilbert", "electra"):
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        cls = {"bert": transformers.BertTokenizer, "distilbert": transformers.DistilBertTokenizer,
               "electra": transformers.ElectraTokenizer}[family]
        return cls(vocab=_train("wordpiece", specials, vocab_size=vocab_size)["vocab"], **limit)
    if family in ("roberta", "modernbert"):
        if family == "roberta":
            model = _train("bpe", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], vocab_size=vocab_size)
            return transformers.RobertaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                                                 **limit)
        return _modernbert_tokenizer(limit, vocab_size)
    specials = {"xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                "albert": ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"],
                "deberta-v2": ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]}[family]
    cls = {"xlm-roberta": transformers.XLMRobertaTokenizer, "albert": transformers.AlbertTokenizer,
           "deberta-v2": transformers.DebertaV2Tokenizer}[family]
    trained = _train("unigram", specials, lowercase=family == "albert", vocab_size=vocab_size)
    pieces = [(piece, score) for piece, score in trained["vocab"]]
    return cls(vocab=pieces, **limit)


def _train(kind: str, specials: list[str], lowercase: bool = False, vocab_size: int | None = None) -> dict[str, Any]:
    """Train a ``tokenizers`` model of ``kind`` on ``training_text``; its JSON ``model`` section (with
    ``vocab_size``, its vocabulary padded to that size: ``_pad``). Each call gets a fresh copy of the one
    training a process makes for each (kind, specials, lowercase): the trainers are not deterministic from
    one process to the next, and a padded vocabulary must be the unpadded one plus fillers, not another
    training."""
    model = json.loads(_trained(kind, tuple(specials), lowercase))
    return model if vocab_size is None else _pad(model, vocab_size)


@functools.cache
def _trained(kind: str, specials: tuple[str, ...], lowercase: bool) -> str:
    """``_train``'s model section as JSON text, unpadded."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer: Any = trainers.WordPieceTrainer(vocab_size=FAMILY_VOCAB, special_tokens=list(specials),
                                             show_progress=False)
    elif kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=FAMILY_VOCAB, special_tokens=list(specials),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        tokenizer = Tokenizer(models.Unigram())
        steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
        tokenizer.normalizer = normalizers.Sequence(steps)
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=FAMILY_VOCAB, special_tokens=list(specials), unk_token=specials[
            [s.strip("<>[]").lower() for s in specials].index("unk")], show_progress=False)
    tokenizer.train_from_iterator(training_text(), trainer)  # (no progress bars: they printed blank lines)
    return json.dumps(json.loads(tokenizer.to_str())["model"])


def _pad(model: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """``model`` (a trained model's JSON) with filler tokens after its own up to ``vocab_size``: ``zq``
    and a number (``▁zq`` and a number, of the lowest score, for Unigram). No text the benchmark or the
    tests send holds one, and BPE has no merge that makes one, so the tokenizer splits every text as
    before; the vocabulary, the model's embeddings and its MLM head have the real size."""
    unigram = model["type"] == "Unigram"
    vocab = model["vocab"]
    if not unigram and sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError("a trained vocabulary's ids are not 0 .. n-1: cannot pad it")
    taken = {piece for piece, _ in vocab} if unigram else set(vocab)
    floor = min(score for _, score in vocab) - 10.0 if unigram else 0.0
    fillers = (piece for n in itertools.count() if (piece := f"\u2581zq{n}" if unigram else f"zq{n}") not in taken)
    for piece in itertools.islice(fillers, max(0, vocab_size - len(vocab))):
        if unigram:
            vocab.append([piece, floor])
        else:
            vocab[piece] = len(vocab)
    return model


def _modernbert_tokenizer(limit: dict[str, int], vocab_size: int | None = None) -> Any:
    """ModernBERT's kind: byte-level BPE with BERT-style special tokens (``[CLS] text [SEP]``)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    trained = _train("bpe", specials, vocab_size=vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]]))
    tokenizer.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]", **limit)


def _family_config(family: str, tokenizer: Any, hidden: int, intermediate: int, layers: int, heads: int,
                   generator: tuple[int, int] | None = None) -> Any:
    """The family's config for a model of this width and depth whose position table fits
    ``FAMILY_MAX_TOKENS`` exactly. (ELECTRA's generator is ``generator``'s encoder width over its
    embedding width, by default twice as wide over embeddings of ``hidden``, as a generator of its
    own heads of 64; ALBERT's embeddings are half as wide.)"""
    import transformers as t

    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    positions = FAMILY_MAX_TOKENS
    common = {"num_hidden_layers": layers, "num_attention_heads": heads, "initializer_range": 0.2}
    width = {"hidden_size": hidden, "intermediate_size": intermediate}
    if family == "bert":
        return t.BertConfig(vocab_size=vocab, max_position_embeddings=positions, pad_token_id=pad, **width, **common)
    if family in ("roberta", "xlm-roberta"):  # position ids start after the padding index
        cls = t.RobertaConfig if family == "roberta" else t.XLMRobertaConfig
        return cls(vocab_size=vocab, max_position_embeddings=positions + pad + 1, pad_token_id=pad,
                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, type_vocab_size=1,
                   **width, **common)
    if family == "distilbert":
        return t.DistilBertConfig(vocab_size=vocab, dim=hidden, hidden_dim=intermediate, n_layers=layers, n_heads=heads,
                                  max_position_embeddings=positions, pad_token_id=pad, initializer_range=0.2)
    if family == "albert":
        return t.AlbertConfig(vocab_size=vocab, embedding_size=hidden // 2, max_position_embeddings=positions,
                              pad_token_id=pad, bos_token_id=tokenizer.cls_token_id,
                              eos_token_id=tokenizer.sep_token_id, **width, **common)
    if family == "electra":  # a generator: the embeddings are projected to the encoder's width
        embedding, width_ = generator or (hidden, 2 * hidden)
        electra = {**common, "num_attention_heads": max(1, width_ // 64) if generator else heads}
        return t.ElectraConfig(vocab_size=vocab, embedding_size=embedding, hidden_size=width_,
                               intermediate_size=4 * width_ if generator else 2 * intermediate,
                               max_position_embeddings=positions, pad_token_id=pad, **electra)
    if family == "deberta-v2":  # DeBERTa-v3's shape: relative positions in log buckets, no absolute ones
        return t.DebertaV2Config(vocab_size=vocab, max_position_embeddings=512, relative_attention=True,
                                 position_buckets=16, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                                 position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True,
                                 type_vocab_size=0, pad_token_id=pad, **width, **common)
    if family == "modernbert":  # even layers global attention, odd layers a sliding window of 16 tokens
        return t.ModernBertConfig(vocab_size=vocab, max_position_embeddings=512, local_attention=16,
                                  global_attn_every_n_layers=2, pad_token_id=pad,
                                  cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                                  **width, **common)
    # esm: ESM-2's shape (rotary positions, token dropout: mask embeddings zeroed and the rest rescaled)
    return t.EsmConfig(vocab_size=vocab, max_position_embeddings=positions + 2, position_embedding_type="rotary",
                       token_dropout=True, mask_token_id=tokenizer.mask_token_id, pad_token_id=pad,
                       emb_layer_norm_before=False, **width, **common)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fillmask_server.checkpoint",
                                     description="Write an offline random-weight fill-mask checkpoint.")
    parser.add_argument("size", choices=[*sorted(SIZES), *FAMILIES], metavar="SHAPE_OR_FAMILY",
                        help="a BERT shape (tiny, small, base) or a family's model: " + ", ".join(FAMILIES))
    parser.add_argument("directory", type=Path, metavar="DIRECTORY",
                        help="where to write config, weights and tokenizer")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    parser.add_argument("--force", action="store_true",
                        help="write even where the directory holds the checkpoint asked for, another one, or files "
                             "that are not one: its model files (config, weights, tokenizer) are removed first, "
                             "anything else stays")
    parser.add_argument("--family-shape", choices=sorted(FAMILY_SHAPES), default="tiny",
                        help="a family model's shape: tiny (2 layers, hidden 32-64), small (4 layers, hidden 384) "
                             "or base (12 layers, hidden 768, the family's real vocabulary size); every shape takes "
                             f"texts of at most {FAMILY_MAX_TOKENS} tokens (its tokenizer's model_max_length), "
                             "special tokens included")
    args = parser.parse_args(argv)
    family = args.size in FAMILIES
    asked = _name(args.size, args.family_shape if family else None, args.seed)
    try:
        there = (is_family_checkpoint(args.directory, args.family_shape, args.size, args.seed) if family
                 else is_checkpoint(args.directory, args.size, args.seed))
        problem = _problem(args.directory) or (None if args.force else _in_the_way(args.directory, asked))
    except OSError as exc:  # (a name too long for the system, a loop of links: beyond "no such file")
        print(f"error: {args.directory} cannot be read: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if there and not args.force:
        print(f"{args.directory}: checkpoint already there (use --force to rewrite)")
        return 0
    if problem is not None:
        print(f"error: {args.directory} {problem}", file=sys.stderr)
        return 1
    try:
        if args.force:
            _clear(args.directory)  # (no file of the model it replaces is left beside the checkpoint)
        if family:
            write_family(args.size, args.directory, seed=args.seed, shape=args.family_shape)
        else:
            write_checkpoint(args.size, args.directory, seed=args.seed)
        _readable(args.directory)
    except OSError as exc:  # a directory this user may not write, a full disk...
        print(f"error: {args.directory}: cannot write the checkpoint there: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{args.directory}: wrote random-weight {asked} fill-mask checkpoint")
    return 0


def _name(kind: str, family_shape: str | None, seed: int) -> str:
    """How this command names a checkpoint: ``'tiny' BERT`` (a BERT size), ``small 'roberta'`` (a family
    in a shape), with ``(seed N)`` where the seed is not 0."""
    return (f"{family_shape} '{kind}'" if family_shape is not None else f"'{kind}' BERT") + _drawn(seed)


def _drawn(seed: object) -> str:
    """`` (seed N)``, or nothing for the default seed, 0."""
    return f" (seed {seed})" if seed != 0 else ""


def _problem(directory: Path) -> str | None:
    """Why nothing can be written at ``directory`` whatever ``--force`` says (the end of a sentence that
    starts with the directory), or None."""
    if directory.is_symlink() and not directory.exists():
        return "is a symbolic link to a path that does not exist: name a directory to write the checkpoint into"
    if directory.exists() and not directory.is_dir():
        return "is not a directory: name a directory to write the checkpoint into"
    return None


def _in_the_way(directory: Path, asked: str) -> str | None:
    """Why writing the checkpoint ``asked`` for (as ``_name`` names it) at ``directory`` would overwrite
    something worth keeping (the end of a sentence that starts with the directory), or None: it does
    not exist, it is empty, or it holds only files of a checkpoint of this command that is incomplete
    or from an older ``write_family`` (a cache to build again; ``WRITTEN`` names them). The caller has
    checked that it does not hold the checkpoint asked for; any other complete checkpoint of this
    command, or any other file (a trained model's, notes beside a checkpoint), is in the way."""
    if not directory.is_dir():
        return None
    config = _config(directory)
    names = sorted(path.name for path in directory.iterdir())
    if config.get(RANDOM_WEIGHTS_KEY) is True:
        held = _held(directory, config)
        if held is not None:
            return (f"holds the random-weight {held} checkpoint, not the {asked} one asked for: pass --force to "
                    "replace it, or name another directory")
        names = [name for name in names if name not in WRITTEN]  # (an incomplete one of ours is written over)
    if not names:
        return None
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"holds files that are not a checkpoint of this command ({listed}): name a new or empty directory, "
            "or pass --force to write there anyway (model files there are removed first)")


def _held(directory: Path, config: dict[str, Any]) -> str | None:
    """The name (``_name``) of the complete checkpoint of this command in ``directory``, whose config is
    ``config``; None: it is incomplete, or an older ``write_family``'s."""
    seed = config.get(SEED_KEY, 0)
    if FAMILY_KEY in config:
        family, shape = str(config.get("model_type")), str(config.get(FAMILY_SHAPE_KEY, "tiny"))
        return _name(family, shape, seed) if is_family_checkpoint(directory, shape, family) else None
    if not is_checkpoint(directory):
        return None
    size = _bert_size(config)
    return _name(size, None, seed) if size is not None else f"BERT of another shape{_drawn(seed)}"


#: The files this command writes into a checkpoint's directory (transformers 5's names; 4's too).
WRITTEN = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                     "special_tokens_map.json", "added_tokens.json", "generation_config.json"})


#: The files a checkpoint is made of, any model's (shell patterns): what ``--force`` removes before it
#: writes, so that no file of another model (a tokenizer's added tokens, a second weights file) is read
#: beside the new one. Anything else in the directory (notes, folders) stays.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "pytorch_model*.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.txt", "vocab.json", "merges.txt", "*.model", "chat_template.*")


def _clear(directory: Path) -> None:
    """Remove the model files (``MODEL_FILES``) ``directory`` holds; the directory itself and anything
    else in it stay (a mount point, or ``.``, can be written into)."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        model_file = any(fnmatch.fnmatch(path.name, pattern) for pattern in MODEL_FILES)
        if model_file and (path.is_file() or path.is_symlink()):
            path.unlink()


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # (elsewhere: set and put back at once)
    os.umask(mask)
    return mask


def _readable(directory: Path, directory_too: bool = False) -> None:
    """Give the files in ``directory`` (and, ``directory_too``, the directory itself) the modes a plain
    ``open`` (and ``mkdir``) give under this process's umask, usually readable by all: transformers saves
    ``model.safetensors`` as 0600, and ``tempfile.mkdtemp`` makes a directory 0700, so a container's user
    other than the writer (the Dockerfile's, uid 10001, reading a mounted ``models/``) could not read
    the weights. Links are left alone (their targets are not this command's)."""
    umask = _umask()
    if directory_too:
        directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


if __name__ == "__main__":
    sys.exit(main())
