"""The in-process limits: ``transformers.pipeline("fill-mask")`` on the benchmark corpus.

Run as a child process by ``bench/run.py`` (so that torch's threads and memory go away with it
before the server is measured)::

    python -m bench.pipeline_limits --model models/tiny --texts 512 --repeats 3

It prints one JSON object on its last stdout line:

- ``throughput``: for each ``batch_size`` N, the req/s of ``pipe(texts, batch_size=N)`` over
  ``--texts`` corpus texts, one value per repeat (repeats are interleaved across N);
- ``single_ms``: the latency of ``pipe(text)`` for single texts, one value per call;
- ``token_counts``: the token length of each corpus text (special tokens included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import orjson

from bench.corpus import make_corpus
from bench.server_proc import QuietGate

SINGLE_WARMUP = 10  # the idle-server client's warm-up requests (bench.loadgen.idle_single)


def measure(model_dir: str, dtype: str, batch_sizes: list[int], n_texts: int, repeats: int, singles: int,
            seed: int, gate: QuietGate) -> dict[str, Any]:
    """Load the pipeline once, warm it up, then time batched and single calls (see module docstring)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from transformers import pipeline

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    started = time.perf_counter()
    pipe = pipeline("fill-mask", model=model_dir, device="cpu", dtype=torch_dtype)
    load_s = time.perf_counter() - started
    corpus = make_corpus(seed=seed)
    texts = [corpus[i % len(corpus)] for i in range(n_texts)]
    token_counts = [len(ids) for ids in pipe.tokenizer(corpus)["input_ids"]]

    # Warm-up: one batch of every batch size (first calls build kernels and caches).
    for size in batch_sizes:
        pipe(texts[:size], batch_size=size)

    throughput: dict[str, list[float]] = {str(size): [] for size in batch_sizes}
    for _ in range(repeats):
        for size in batch_sizes:
            gate.wait()
            t0 = time.perf_counter()
            out = pipe(texts, batch_size=size)
            elapsed = time.perf_counter() - t0
            assert len(out) == len(texts)
            throughput[str(size)].append(len(texts) / elapsed)

    # Single calls on the texts the idle-server client sends: corpus[0:10] as warm-up, then corpus[10:].
    gate.wait()
    for text in corpus[:SINGLE_WARMUP]:
        pipe(text)
    single_ms: list[float] = []
    for i in range(singles):
        text = corpus[(SINGLE_WARMUP + i) % len(corpus)]
        t0 = time.perf_counter()
        pipe(text)
        single_ms.append((time.perf_counter() - t0) * 1000)

    return {
        "model": model_dir,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "n_texts": n_texts,
        "throughput": throughput,
        "single_ms": single_ms,
        "quiet_waits": {"count": gate.waits, "waited_s": round(gate.waited_s, 1)},
        "token_counts": token_counts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the in-process fill-mask pipeline on the bench corpus.")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", default="1,8,16,32,64", help="comma-separated pipeline batch sizes")
    parser.add_argument("--texts", type=int, default=256, help="texts per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
    parser.add_argument("--singles", type=int, default=50, help="single-text calls to time")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="before each timed call, wait up to this many seconds for a quiet machine")
    parser.add_argument("--wait-budget", type=float, default=0.0, help="most seconds of such waiting in all")
    args = parser.parse_args(argv)
    result = measure(args.model, args.dtype, [int(s) for s in args.batch_sizes.split(",")], args.texts,
                     args.repeats, args.singles, args.seed, QuietGate(args.wait_quiet, args.wait_budget))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
