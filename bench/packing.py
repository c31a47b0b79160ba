"""What packed rows save: the server's own forward pass on batches in arrival order, padded and packed,
against the in-process limit's batches (sorted by length), in one process, side by side.

    .venv/bin/python -m bench.packing --model models/base --corpus short
    .venv/bin/python -m bench.packing --model models/families/roberta --family roberta --corpus mixed

Arrival order is what a server sees: a batch of whatever texts came, of mixed lengths. Sorted
batches are what ``bench.pipeline_limits`` runs for the limit: neighbouring lengths, little padding.
For each kind it prints the milliseconds of one ``FillMaskModel.forward`` of ``--batch`` texts (the
least of ``--repeats`` passes over the corpus, divided by its batches) and the tokens a batch
occupies (``batching.footprint``); packed rows are the model's own layout (``engine.layout`` in
hello), padded rows the same model with packing turned off. A model that does not pack (its load
check failed, or a reduced ``--dtype``) prints the padded figures twice.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.pipeline_limits import family_texts
from fillmask_server.batching import footprint


def per_batch_ms(model: Any, batches: list[list[Any]], repeats: int) -> float:
    """The least, over ``repeats`` passes, of one pass's time divided by its batches."""
    import torch

    best = float("inf")
    with torch.inference_mode():
        for items in batches[:2]:  # warm-up: kernels for these shapes
            model.forward(items)
        for _ in range(repeats):
            started = time.perf_counter()
            for items in batches:
                model.forward(items)
            best = min(best, (time.perf_counter() - started) / len(batches))
    return best * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model id or local directory")
    parser.add_argument("--family", default="", help="the checkpoint's family (its corpus: esm's is proteins)")
    parser.add_argument("--corpus", default="short", choices=["short", "mixed"])
    parser.add_argument("--batch", type=int, default=32, help="texts per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    from fillmask_server.items import Item
    from fillmask_server.loading import load_model

    model = load_model(args.model, "cpu", args.dtype)
    texts = family_texts(args.corpus, args.family, model.mask_token)  # (any family but esm: the corpus, its mask)
    ids = [row for row in model.tokenize(texts) if len(row) <= model.max_tokens]
    size = args.batch
    arrival = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]
    ordered = sorted(ids, key=len)
    sorted_ = [ordered[i:i + size] for i in range(0, len(ordered) - size + 1, size)]
    kinds = {"arrival order": arrival, "sorted (the limit's)": sorted_}
    width = model.pack_width
    print(f"{args.model} ({model.engine_facts()['layout']}, rows of {width or '-'} tokens), corpus {args.corpus}, "
          f"{len(arrival)} batches of {size}: ms per batch (tokens per batch)")
    for name, batches in kinds.items():
        items = [[Item(row, 5) for row in batch] for batch in batches]
        real = sum(len(row) for batch in batches for row in batch) / len(batches)
        padded_tokens = sum(footprint([len(row) for row in batch]) for batch in batches) / len(batches)
        packed_tokens = sum(footprint([len(row) for row in batch], width) for batch in batches) / len(batches)
        model.pack_width = 0
        padded = per_batch_ms(model, items, args.repeats)
        model.pack_width = width
        packed = per_batch_ms(model, items, args.repeats)
        print(f"  {name:22s} padded {padded:8.2f} ms ({padded_tokens:5.0f})   packed {packed:8.2f} ms "
              f"({packed_tokens:5.0f})   texts' own tokens {real:5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
