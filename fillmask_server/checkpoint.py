"""Write an offline, random-weight BERT fill-mask checkpoint (config, weights, tokenizer).

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
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512},
    "small": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
}
VOCAB_FILE = "bert-base-uncased-vocab.txt"
RANDOM_WEIGHTS_KEY = "fillmask_random_weights"  # in config.json: these weights were never trained


def is_checkpoint(directory: Path) -> bool:
    """True when ``directory`` already holds a complete checkpoint of this command (so set-up can skip the work)."""
    if not all((directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return False
    try:
        return json.loads((directory / "config.json").read_text()).get(RANDOM_WEIGHTS_KEY) is True
    except (OSError, ValueError):
        return False


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
                        initializer_range=init_range, **SIZES[size], **{RANDOM_WEIGHTS_KEY: True})
    model = BertForMaskedLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write an offline random-weight BERT fill-mask checkpoint.")
    parser.add_argument("size", choices=sorted(SIZES), help="model shape")
    parser.add_argument("directory", type=Path, help="where to write config, weights and tokenizer")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    parser.add_argument("--force", action="store_true", help="rewrite even if the directory holds a checkpoint")
    args = parser.parse_args(argv)
    if is_checkpoint(args.directory) and not args.force:
        print(f"{args.directory}: checkpoint already there (use --force to rewrite)")
        return 0
    write_checkpoint(args.size, args.directory, seed=args.seed)
    print(f"{args.directory}: wrote random-weight '{args.size}' BERT fill-mask checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
