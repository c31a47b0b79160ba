"""Transformers' other fill-mask architectures, beyond the nine families: does the server start on each,
and does it answer what ``pipeline("fill-mask")`` answers? (README, "Every model family", "Other
architectures".)

    .venv/bin/python scripts/architectures.py               # every architecture below (under a minute)
    .venv/bin/python scripts/architectures.py fnet ibert    # some of them
    .venv/bin/python scripts/architectures.py --list

For each architecture: a tiny random-weight checkpoint (two layers, hidden 32 to 64, weights spread
wider than the library's so that predictions are peaked), with a tokenizer of its kind made from the
vocabularies the families' tokenizers were trained to (``fillmask_server.checkpoint.ensure_family``:
WordPiece, byte-level BPE, Unigram), in the architecture's own tokenizer class where transformers has
one that needs no optional package. Then the pipeline's answers to seven requests (short and long texts,
two masks, ``targets``, ``top_k``); then the server in this process (``load_model`` and
``FillMaskServer``, as the tests run it) on a real socket, the seven requests sent at once, twice,
with the engine held until all are queued so that they share batches; each answer against the
pipeline's (tokens, strings and sequences equal, scores within ``TOLERANCE``). One line for each: the
path the server chose (``hello.engine``), the largest score difference, and the warnings its load
logged. Exit status 1 when the server fails to start, or answers otherwise, on a checkpoint the
pipeline serves; one the pipeline itself cannot serve is reported as such.

``--keep DIR`` keeps the checkpoints (``DIR/ARCH``), to start ``ws_server.py --model DIR/ARCH`` on one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4  # protocol.md §4: the pipeline's scores to this (the families' tests hold 1e-5)
MAX_TOKENS = 128  # each tokenizer's model_max_length
#: Two layers of a width that every architecture's head count divides.
SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}
SPREAD = {"initializer_range": 0.2}
LONG = ("In the early morning the small village near the river was quiet and the people who lived there walked "
        "slowly to the market where they sold bread and fish and talked about the weather and the news from the "
        "city, and then {m} came back home.")


def requests(mask: str) -> list[dict[str, Any]]:
    """The seven requests, for a tokenizer whose mask token is ``mask``."""
    return [
        {"id": "short", "text": f"The {mask} is here.", "top_k": 5},
        {"id": "mid", "text": f"Paris is the {mask} of France and the city is very large.", "top_k": 5},
        {"id": "long", "text": LONG.format(m=mask), "top_k": 3},
        {"id": "two", "text": f"The {mask} went to the {mask} yesterday.", "top_k": 4},
        {"id": "targets", "text": f"I like the {mask} very much.", "top_k": 3,
         "targets": ["city", "house", "music", "water"]},
        {"id": "alone", "text": mask, "top_k": 5},
        {"id": "ten", "text": f"She said that the {mask} would be ready by the end of the week.", "top_k": 10},
    ]


# --- tokenizers: the families' vocabularies in each architecture's class ------------------------------

@dataclass
class Vocabularies:
    """The trained models of three family tokenizers (their ``tokenizer.json``'s ``model``)."""

    root: Path
    _read: dict[str, dict[str, Any]] = field(default_factory=dict)

    def model(self, family: str) -> dict[str, Any]:
        if family not in self._read:
            from fillmask_server.checkpoint import ensure_family

            directory = ensure_family(family, self.root)
            self._read[family] = json.loads((directory / "tokenizer.json").read_text())["model"]
        return self._read[family]

    def wordpiece(self, rename: dict[str, str] | None = None) -> dict[str, int]:
        return {(rename or {}).get(token, token): i for token, i in self.model("bert")["vocab"].items()}

    def bpe(self, rename: dict[str, str] | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
        trained = self.model("roberta")
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
        return ({(rename or {}).get(token, token): i for token, i in trained["vocab"].items()},
                merges)  # type: ignore[return-value]

    def unigram(self, rename: dict[str, str] | None = None) -> list[tuple[str, float]]:
        return [((rename or {}).get(piece, piece), score) for piece, score in self.model("xlm-roberta")["vocab"]]

    def fast(self, rename: dict[str, str], template: str, specials: list[str], **tokens: str) -> Any:
        """A ``PreTrainedTokenizerFast`` from the BPE family's whole tokenizer, its special tokens renamed
        (for architectures whose own class needs a package the project does not install)."""
        import transformers
        from tokenizers import Tokenizer, processors

        self.model("roberta")  # (its checkpoint written first, where it is not yet)
        text = json.dumps(json.loads((self.root / "roberta" / "tokenizer.json").read_text()))
        for old, new in rename.items():
            text = text.replace(json.dumps(old), json.dumps(new))
        tokenizer = Tokenizer.from_str(text)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, pair=f"{template} $B {template.split()[-1]}",
            special_tokens=[(s, tokenizer.token_to_id(s)) for s in specials])
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=MAX_TOKENS, **tokens)


def _tokenizer(arch: str, v: Vocabularies) -> Any:
    import transformers as t

    limit = {"model_max_length": MAX_TOKENS}
    albert_specials = {"<s>": "[CLS]", "</s>": "[SEP]", "<mask>": "[MASK]"}
    if arch in ("megatron-bert", "ernie", "nomic_bert", "layoutlm", "roc_bert", "roformer"):
        return t.BertTokenizer(vocab=v.wordpiece(), **limit)  # (RoFormer's own needs rjieba)
    if arch in ("mobilebert", "convbert", "squeezebert"):
        cls = {"mobilebert": t.MobileBertTokenizer, "convbert": t.ConvBertTokenizer,
               "squeezebert": t.SqueezeBertTokenizer}[arch]
        return cls(vocab=v.wordpiece(), **limit)
    if arch == "tapas":  # TapasTokenizer wants a table (and pandas): BERT's, without token types
        tokenizer = t.BertTokenizer(vocab=v.wordpiece(), **limit)
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
        return tokenizer
    if arch == "mpnet":
        return t.MPNetTokenizer(vocab=v.wordpiece({"[PAD]": "<pad>", "[CLS]": "<s>", "[SEP]": "</s>",
                                                   "[MASK]": "<mask>"}), **limit)
    if arch == "funnel":
        return t.FunnelTokenizer(vocab=v.wordpiece({"[PAD]": "<pad>", "[UNK]": "<unk>", "[CLS]": "<cls>",
                                                    "[SEP]": "<sep>", "[MASK]": "<mask>"}), **limit)
    if arch in ("gte", "xlm-roberta-xl", "xmod", "jina_embeddings_v3"):
        return t.XLMRobertaTokenizer(vocab=v.unigram(), **limit)
    if arch == "camembert":
        return t.CamembertTokenizer(vocab=v.unigram(), **limit)
    if arch == "mbart":
        return t.MBartTokenizer(vocab=v.unigram(), **limit)
    if arch == "big_bird":
        return t.BigBirdTokenizer(vocab=v.unigram({"<mask>": "[MASK]"}), cls_token="<s>", sep_token="</s>", **limit)
    if arch == "rembert":
        return t.RemBertTokenizer(vocab=v.unigram(albert_specials), **limit)
    if arch in ("nystromformer", "yoso"):
        return t.AlbertTokenizer(vocab=v.unigram(albert_specials), **limit)
    if arch == "fnet":
        return t.FNetTokenizer(vocab=v.unigram(albert_specials), **limit)
    if arch in ("data2vec-text", "roberta-prelayernorm", "ibert", "mra", "ultrabert", "neomme"):
        return t.RobertaTokenizer(*v.bpe(), **limit)  # (UltraBERT and NeoMME have no tokenizer class)
    if arch in ("longformer", "bart", "mvp", "reformer"):
        cls = {"longformer": t.LongformerTokenizer, "bart": t.BartTokenizer, "mvp": t.MvpTokenizer,
               "reformer": t.ReformerTokenizer}[arch]
        if arch == "reformer":  # (its tokenizer splits the long request into 152 tokens: its positions take 512)
            return cls(*v.bpe(), mask_token="<mask>", pad_token="<pad>", model_max_length=512)
        return cls(*v.bpe(), **limit)
    if arch == "deberta":
        return t.DebertaTokenizer(*v.bpe({"<s>": "[CLS]", "<pad>": "[PAD]", "</s>": "[SEP]", "<unk>": "[UNK]",
                                          "<mask>": "[MASK]"}), **limit)
    if arch == "luke":
        return t.LukeTokenizer(*v.bpe(), entity_vocab={"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "[MASK2]": 3}, **limit)
    if arch == "perceiver":
        return t.PerceiverTokenizer(model_max_length=512)
    if arch == "esmc":
        from fillmask_server.checkpoint import ESM_VOCAB

        with tempfile.TemporaryDirectory() as scratch:  # (the tokenizer reads its vocabulary file at once)
            listing = Path(scratch) / "vocab.txt"
            listing.write_text("\n".join(ESM_VOCAB) + "\n")
            return t.EsmTokenizer(str(listing), **limit)
    if arch == "eurobert":  # Llama 3's special tokens on the byte-level BPE
        return v.fast({"<s>": "<|begin_of_text|>", "</s>": "<|end_of_text|>", "<mask>": "<|mask|>"},
                      "<|begin_of_text|> $A <|end_of_text|>", ["<|begin_of_text|>", "<|end_of_text|>"],
                      bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<pad>",
                      unk_token="<unk>", mask_token="<|mask|>")
    if arch in ("xlm", "flaubert"):  # their own classes need sacremoses
        return v.fast({"<mask>": "<special1>"}, "</s> $A </s>", ["</s>"], bos_token="<s>", eos_token="</s>",
                      sep_token="</s>", cls_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<special1>")
    raise KeyError(arch)


def _config(arch: str, tok: Any) -> Any:
    import transformers as t

    make = t.AutoConfig.for_model
    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
    ends = {"bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else tok.cls_token_id,
            "eos_token_id": tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id}
    past_padding = MAX_TOKENS + tok.pad_token_id + 9  # RoBERTa-like positions count from the padding index
    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 32, "intermediate_size": 128}
    if arch in ("megatron-bert", "ernie", "convbert", "layoutlm", "gte", "tapas"):
        return make(arch, **ids, **SHAPE, max_position_embeddings=MAX_TOKENS, **SPREAD)
    if arch in ("squeezebert", "roformer"):
        return make(arch, **ids, **SHAPE, max_position_embeddings=MAX_TOKENS, embedding_size=64, **SPREAD)
    if arch == "nomic_bert":
        return make(arch, **ids, **SHAPE, max_position_embeddings=MAX_TOKENS, head_dim=32, **SPREAD)
    if arch == "mobilebert":
        return make(arch, **ids, num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=64,
                    embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2,
                    max_position_embeddings=MAX_TOKENS, **SPREAD)
    if arch in ("camembert", "data2vec-text", "roberta-prelayernorm", "xlm-roberta-xl", "ibert", "xmod"):
        languages = {"languages": ["en_XX", "de_DE"], "default_language": "en_XX"} if arch == "xmod" else {}
        return make(arch, **ids, **ends, **SHAPE, max_position_embeddings=past_padding, type_vocab_size=1,
                    **SPREAD, **languages)
    if arch in ("mpnet", "mra"):
        return make(arch, **ids, **ends, **SHAPE, max_position_embeddings=past_padding, **SPREAD)
    if arch in ("yoso", "nystromformer"):  # (Nyströmformer's landmarks as many as its segments: the pipeline's)
        landmarks = {"segment_means_seq_len": 64, "num_landmarks": 64, "conv_kernel_size": 5} \
            if arch == "nystromformer" else {}
        return make(arch, **ids, **ends, **SHAPE, max_position_embeddings=MAX_TOKENS + 8, **SPREAD, **landmarks)
    if arch == "big_bird":
        return make(arch, **ids, **ends, sep_token_id=tok.sep_token_id, **SHAPE, max_position_embeddings=1024,
                    block_size=16, num_random_blocks=2, **SPREAD)
    if arch == "longformer":
        return make(arch, **ids, **ends, sep_token_id=tok.sep_token_id, **SHAPE, max_position_embeddings=past_padding,
                    type_vocab_size=1, attention_window=[16, 16], **SPREAD)
    if arch == "rembert":
        return make(arch, **ids, **ends, **SHAPE, input_embedding_size=32, output_embedding_size=48,
                    max_position_embeddings=MAX_TOKENS, **SPREAD)
    if arch == "fnet":
        return make(arch, **ids, **ends, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                    max_position_embeddings=MAX_TOKENS, **SPREAD)
    if arch == "funnel":
        return make(arch, **ids, block_sizes=[1, 1], num_decoder_layers=1, d_model=64, n_head=2, d_head=32,
                    d_inner=128, **SPREAD)
    if arch == "deberta":
        return make(arch, **ids, **SHAPE, max_position_embeddings=MAX_TOKENS, relative_attention=True,
                    pos_att_type=["c2p", "p2c"], max_relative_positions=-1, **SPREAD)
    if arch in ("xlm", "flaubert"):
        return make(arch, vocab_size=len(tok), emb_dim=64, n_layers=2, n_heads=2, max_position_embeddings=MAX_TOKENS,
                    bos_index=tok.bos_token_id, eos_index=tok.eos_token_id, pad_index=tok.pad_token_id,
                    unk_index=tok.unk_token_id, mask_index=tok.mask_token_id, mask_token_id=tok.mask_token_id,
                    pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    init_std=0.2, embed_init_std=0.2)
    if arch in ("bart", "mbart", "mvp"):
        return make(arch, **ids, **ends, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    max_position_embeddings=MAX_TOKENS + 2, init_std=0.2)
    if arch == "reformer":
        return make(arch, **ids, eos_token_id=tok.eos_token_id, attn_layers=["local", "local"], hidden_size=64,
                    attention_head_size=32, num_attention_heads=2, feed_forward_size=128, axial_pos_shape=[16, 32],
                    axial_pos_embds_dim=[32, 32], max_position_embeddings=512, local_attn_chunk_length=16,
                    is_decoder=False, num_hidden_layers=2, **SPREAD)
    if arch == "perceiver":
        return make(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id, d_model=64, d_latents=64,
                    num_latents=32, num_self_attends_per_block=2, num_self_attention_heads=2,
                    num_cross_attention_heads=2, max_position_embeddings=512, **SPREAD)
    if arch == "luke":
        return make(arch, **ids, **ends, **SHAPE, entity_vocab_size=4, entity_emb_size=32,
                    max_position_embeddings=past_padding, type_vocab_size=1, **SPREAD)
    if arch == "esmc":
        return make(arch, **ids, **small, max_position_embeddings=MAX_TOKENS + 2, mask_token_id=tok.mask_token_id,
                    bos_token_id=tok.cls_token_id, eos_token_id=tok.eos_token_id, **SPREAD)
    if arch == "eurobert":
        return make(arch, **ids, **ends, **small, mask_token_id=tok.mask_token_id, max_position_embeddings=MAX_TOKENS,
                    **SPREAD)
    if arch == "roc_bert":
        return make(arch, **ids, **SHAPE, max_position_embeddings=MAX_TOKENS, pronunciation_embed_dim=16,
                    shape_embed_dim=16, pronunciation_vocab_size=10, shape_vocab_size=10, **SPREAD)
    if arch == "jina_embeddings_v3":
        return make(arch, **ids, **ends, **SHAPE, max_position_embeddings=MAX_TOKENS + 2, **SPREAD)
    if arch == "ultrabert":
        return make(arch, **ids, **ends, **small, max_position_embeddings=256, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], prediction_head_size=64, **SPREAD)
    if arch == "neomme":
        return make(arch, **ids, **{**small, "num_key_value_heads": 1}, max_position_embeddings=256,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], per_layer_config={},
                    embedding_rank=32, **SPREAD)
    raise KeyError(arch)


#: Every architecture here, in the order of the run. (The nine families are ``tests/test_families.py``'s;
#: the vision-language ModernVBERT and UltraVBERT are left out.)
ARCHITECTURES = (
    "camembert", "mpnet", "big_bird", "longformer", "mobilebert", "convbert", "roformer", "xlm", "flaubert",
    "funnel", "deberta", "megatron-bert", "rembert", "squeezebert", "data2vec-text", "xlm-roberta-xl",
    "roberta-prelayernorm", "nystromformer", "yoso", "mra", "ernie", "eurobert", "fnet", "ibert", "bart", "mbart",
    "mvp", "reformer", "perceiver", "luke", "xmod", "nomic_bert", "gte", "esmc", "tapas", "layoutlm", "roc_bert",
    "jina_embeddings_v3", "ultrabert", "neomme",
)


def write(arch: str, directory: Path, vocabularies: Vocabularies) -> None:
    """A tiny random-weight checkpoint of ``arch`` in ``directory``, with its tokenizer."""
    import torch
    import transformers

    from fillmask_server.checkpoint import RANDOM_WEIGHTS_KEY

    tokenizer = _tokenizer(arch, vocabularies)
    config = _config(arch, tokenizer)
    setattr(config, RANDOM_WEIGHTS_KEY, True)
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedLM.from_config(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


# --- one architecture: the pipeline, then the server --------------------------------------------------

@dataclass
class Outcome:
    arch: str
    verdict: str  # "same", "differs", "no start", "pipeline fails", "no checkpoint"
    engine: dict[str, str] = field(default_factory=dict)
    most_off: float = 0.0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict in ("differs", "no start")

    def line(self) -> str:
        path = "/".join(self.engine.get(key, "?") for key in ("forward", "head", "layout")) if self.engine else ""
        text = f"{self.arch:20} {self.verdict:14} {path:26} {self.most_off:9.2g} {self.seconds:5.1f} s"
        notes = self.problems[:3] + [f"warning: {line}" for line in self.warnings]
        return text + "".join(f"\n{'':22}{note[:200]}" for note in notes)


def differences(got: Any, want: Any, where: str) -> tuple[float, list[str]]:
    """The largest score difference between the server's ``predictions`` and the pipeline's, and what else
    differs (a token, its string, its sequence, the count)."""
    if want and isinstance(want[0], list):  # several masks: one list each
        if not (isinstance(got, list) and got and isinstance(got[0], list) and len(got) == len(want)):
            return 0.0, [f"{where}: {len(got)} lists of candidates, the pipeline {len(want)}"]
        most, problems = 0.0, []
        for n, (mine, theirs) in enumerate(zip(got, want, strict=True)):
            off, found = differences(mine, theirs, f"{where} mask {n}")
            most, problems = max(most, off), problems + found
        return most, problems
    problems = [f"{where}: {len(got)} candidates, the pipeline {len(want)}"] if len(got) != len(want) else []
    most = 0.0
    for n, (mine, theirs) in enumerate(zip(got, want, strict=False)):
        most = max(most, abs(mine["score"] - theirs["score"]))
        for key in ("token", "token_str", "sequence"):
            if mine.get(key) != theirs.get(key):
                problems.append(f"{where} #{n} {key}: {mine.get(key)!r} ({mine['score']:.6f}), the pipeline "
                                f"{theirs.get(key)!r} ({theirs['score']:.6f})")
                break
    return most, problems


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def _served(directory: Path, sent: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """hello and each answer by id: the server in this process, ``sent`` twice on one connection, held
    until all are queued (so that they share batches)."""
    import websockets

    from fillmask_server.config import Config
    from fillmask_server.loading import load_model
    from fillmask_server.server import FillMaskServer

    config = Config(model=str(directory), host="127.0.0.1", port=0, shutdown_timeout=5.0)
    server = FillMaskServer(config, load_model(config.model, config.device, config.dtype, announce=False))
    await server.start()
    answers: dict[str, Any] = {}
    try:
        async with websockets.connect(server.url, max_size=None, open_timeout=20) as ws:
            hello = json.loads(await asyncio.wait_for(ws.recv(), 20))
            batch = [{**request, "id": f"{request['id']}#{twice}"} for twice in (1, 2) for request in sent]
            with server.engine.paused():
                for request in batch:
                    await ws.send(json.dumps({"type": "fill_mask", **request}))
                for _ in range(3000):  # (bounded: 30 s)
                    if server.engine.runnable() >= len(batch):
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise TimeoutError(f"{server.engine.runnable()} of {len(batch)} requests queued after 30 s")
            while len(answers) < len(batch):
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                answers[frame.get("id")] = frame
    finally:
        await server.drain(timeout=5.0)
    return hello, answers


def check(arch: str, directory: Path, vocabularies: Vocabularies) -> Outcome:
    """Write ``arch``'s checkpoint into ``directory``, then the pipeline's answers against the server's."""
    from transformers import pipeline

    started = time.perf_counter()
    try:
        write(arch, directory, vocabularies)
    except Exception as exc:  # a recipe the installed transformers no longer takes
        return Outcome(arch, "no checkpoint", problems=[f"{type(exc).__name__}: {exc}"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = pipeline("fill-mask", model=str(directory), device="cpu")
            sent = requests(pipe.tokenizer.mask_token)
            expected = {request["id"]: pipe(request["text"], **{k: v for k, v in request.items()
                                                                  if k in ("top_k", "targets")}) for request in sent}
    except Exception as exc:
        return Outcome(arch, "pipeline fails", problems=[f"{type(exc).__name__}: {str(exc)[:160]}"],
                       seconds=time.perf_counter() - started)
    caught, server_log = _Warnings(), logging.getLogger("fillmask_server")
    kept = server_log.level, server_log.propagate
    server_log.addHandler(caught)
    server_log.setLevel(logging.WARNING)
    server_log.propagate = False  # (its warnings are the outcome's to print, under its line)
    try:
        hello, answers = asyncio.run(_served(directory, sent))
    except Exception as exc:
        return Outcome(arch, "no start", problems=[f"{type(exc).__name__}: {str(exc)[:200]}"],
                       warnings=caught.lines, seconds=time.perf_counter() - started)
    finally:
        server_log.removeHandler(caught)
        server_log.setLevel(kept[0])
        server_log.propagate = kept[1]
    outcome = Outcome(arch, "same", engine=hello.get("engine", {}), warnings=caught.lines)
    for key, frame in sorted(answers.items()):
        if frame.get("type") != "result":
            outcome.problems.append(f"{key}: {frame.get('type')} {frame.get('code', '')} {frame.get('message', '')}")
            continue
        off, found = differences(frame["predictions"], expected[key.split("#")[0]], key)
        outcome.most_off = max(outcome.most_off, off)
        outcome.problems += found
    if outcome.problems or outcome.most_off > TOLERANCE:
        outcome.verdict = "differs"
    outcome.seconds = time.perf_counter() - started
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architectures", nargs="*", metavar="ARCH", help="default: every one of --list")
    parser.add_argument("--list", action="store_true", help="print the architectures and exit")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the checkpoints to DIR/ARCH and keep them")
    parser.add_argument("--families", type=Path, default=ROOT / "models" / "families",
                        help="where the families' checkpoints (their vocabularies) are, or are written")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(ARCHITECTURES))
        return 0
    unknown = [arch for arch in args.architectures if arch not in ARCHITECTURES]
    if unknown:
        parser.error(f"no recipe for {', '.join(unknown)}; --list names those there are")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.ERROR)
    vocabularies = Vocabularies(args.families)
    outcomes = []
    print(f"{'architecture':20} {'verdict':14} {'forward/head/layout':26} {'most off':>9}  time", flush=True)
    with tempfile.TemporaryDirectory(prefix="fillmask-architectures-") as scratch:
        for arch in args.architectures or ARCHITECTURES:
            outcome = check(arch, (args.keep or Path(scratch)) / arch, vocabularies)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
    verdicts = [outcome.verdict for outcome in outcomes]
    print("; ".join(f"{verdict}: {verdicts.count(verdict)}" for verdict in dict.fromkeys(verdicts)))
    return 1 if any(outcome.failed for outcome in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
