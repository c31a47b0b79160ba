"""The in-process limits on a benchmark corpus: the transformers pipeline, and the server's own work.

Run as a child process by ``bench/run.py`` (so that torch's threads and memory go away with it
before the server is measured)::

    .venv/bin/python -m bench.pipeline_limits --model models/tiny --corpus short --texts 512 --repeats 3

It prints one JSON object on its last stdout line:

- ``throughput``: for each ``batch_size`` N, the req/s of ``pipe(texts, batch_size=N)`` over
  ``--texts`` corpus texts (called again until ``MIN_TIMED_S`` has passed), one value per repeat
  (repeats are interleaved across N);
- ``single_ms``: the latency of ``pipe(text)`` for single texts, one value per call;
- ``limit``: the *in-process limit* (issue 9): the same model through the server's own code, with no
  sockets and no threads: the texts sorted by length, cut into batches of N rows, each tokenized in
  one call, one forward pass (encoder once, MLM head at the masks, one top-k per batch) and decoded to
  the pipeline's predictions as JSON, the texts again until ``MIN_TIMED_S`` has passed; in each repeat
  the fastest N of ``LIMIT_BATCHES`` (``limit_batch``: the N that was fastest most often), so that no
  batch the server forms under the benchmark's load beats its own limit; and on a CPU with two or more
  torch threads, each N both in one forward pass and in two parts side by side as the server's
  ``--forward-parts 2`` runs it (``limit_parts``: the layout that won with that N most often).
  ``limit_forward_only`` leaves out the decoding (information; its own fastest N and layout);
- ``token_counts``: the token length of each corpus text (special tokens included).

With ``--family NAME`` (a checkpoint of ``fillmask_server.checkpoint.write_family``) the corpus is
``family_texts``: the same texts with that model's mask token, or protein sequences for ``esm``.
With ``--limit-only`` it measures the limits alone (no pipeline, no single calls): ``bench/run.py``
measures them again after the servers, so that a ratio's two figures bracket the server's in time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench.corpus import CORPORA, MASK
from bench.server_proc import QuietGate
from fillmask_server.checkpoint import FAMILIES

SINGLE_WARMUP = 10  # the idle-server client's warm-up requests (bench.loadgen.idle_single)


#: The batch sizes the in-process limit tries: half the server's default row cap on a CPU, the cap,
#: and twice it (the most rows that 32 clients x 4 in flight, the benchmark's load, can give one
#: batch). A limit timed at 32 alone was not a limit: the server, forming batches of 64, served more
#: than it. 128 rows of long texts may pass the server's default token cap: there the limit is
#: stricter than any batch the server forms, never looser. (The automatic caps may grow past 128
#: rows under a larger load, which this limit does not try.)
LIMIT_BATCHES = (32, 64, 128)
#: Each timed measurement runs its texts again until it has lasted this long: through a tiny model
#: one pass over the texts is short enough to swing with a single preemption.
MIN_TIMED_S = 1.0
_RESIDUES = "ACDEFGHIKLMNPQRSTVWY"


def family_texts(corpus_name: str, family: str, mask_token: str, seed: int = 0) -> list[str]:
    """The benchmark corpus for a model family: ``corpus_name``'s texts with ``mask_token`` in place of
    ``[MASK]``; for ``esm`` (a protein model) as many distinct sequences of 8-14 residues with one mask
    instead (10-16 tokens with the special tokens, like the short corpus). Deterministic for ``seed``."""
    import random

    texts = CORPORA[corpus_name](seed=seed)
    if family != "esm":
        return [text.replace(MASK, mask_token) for text in texts]
    rng = random.Random(seed)
    proteins: list[str] = []
    seen: set[str] = set()
    while len(proteins) < len(texts):
        residues = [rng.choice(_RESIDUES) for _ in range(rng.randint(8, 14))]
        residues[rng.randrange(len(residues))] = mask_token
        text = "".join(residues)
        if text not in seen:
            seen.add(text)
            proteins.append(text)
    return proteins


def bench_corpus(corpus_name: str, family: str, mask_token: str, seed: int) -> list[str]:
    """The texts the limits and the pipeline run on: a family's (``family_texts``) or the corpus itself."""
    return family_texts(corpus_name, family, mask_token, seed) if family else CORPORA[corpus_name](seed=seed)


def timed_rate(call: Callable[[], None], count: int) -> float:
    """Items per second of ``call`` (``count`` items a call), called again until ``MIN_TIMED_S`` has
    passed (at least once)."""
    started = time.perf_counter()
    done = 0
    while not done or time.perf_counter() - started < MIN_TIMED_S:
        call()
        done += count
    return done / (time.perf_counter() - started)


def in_process_limit(model_dir: str, dtype: str, texts: list[str], repeats: int, gate: QuietGate
                     ) -> tuple[list[float], list[float], int, int]:
    """req/s of the server's own work without sockets or stage threads (see the module docstring): with the
    decoding, and without it, one value per repeat each; and the batch size and parts that were fastest
    most often."""
    from fillmask_server.loading import load_model

    return limit_rates(load_model(model_dir, "cpu", dtype), texts, repeats, gate)


def limit_rates(model: Any, texts: list[str], repeats: int, gate: QuietGate,
                sizes: tuple[int, ...] = LIMIT_BATCHES) -> tuple[list[float], list[float], int, int]:
    """``in_process_limit`` on a model already loaded (bench/gpu.py's, on CUDA, loaded once per dtype):
    each repeat's rate is the fastest of ``sizes`` x layouts in that repeat (on a CPU with two or more
    torch threads: one pass, and two parts side by side on half the threads each, as the engine runs
    them: ``fillmask_server.parts``)."""
    import functools

    import torch

    from fillmask_server.decode import SequenceDecoder, predictions_json
    from fillmask_server.items import Item
    from fillmask_server.parts import PartRunner, plan

    decoder = SequenceDecoder(model.decode_tokenizer)
    lengths = [len(ids) for ids in model.tokenize(texts)]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    sizes = tuple(dict.fromkeys(min(size, len(texts)) for size in sizes))  # a size above the texts is all of them
    threads = torch.get_num_threads()
    layouts = (1, 2) if model.device.type == "cpu" and threads >= 2 else (1,)
    runner: PartRunner[Any] | None = (PartRunner(1, threads // 2, torch.set_num_threads, name="limit-part")
                                      if 2 in layouts else None)

    def forward(items: list[Item], parts: int) -> list[tuple[list[int], Any]]:
        cuts, each = plan([len(item.input_ids) for item in items], threads, parts if runner is not None else 1)
        torch.set_num_threads(each)
        if len(cuts) == 1 or runner is None:
            return [(cuts[0], model.forward(items))]
        calls = [functools.partial(model.forward, [items[i] for i in cut]) for cut in cuts]
        return list(zip(cuts, runner.run(calls, each), strict=True))

    def run(size: int, parts: int, decode: bool) -> float:
        batches = [[texts[i] for i in order[start: start + size]] for start in range(0, len(order), size)]

        def once() -> None:
            for batch in batches:
                items = [Item(ids, 5) for ids in model.tokenize(batch)]
                for cut, topk in forward(items, parts):
                    if decode:
                        for n, i in enumerate(cut):
                            predictions_json(decoder, items[i], topk, n)

        return timed_rate(once, len(texts))

    candidates = [(size, parts) for size in sizes for parts in layouts]
    try:
        for size, parts in candidates:
            run(size, parts, True)  # warm-up: kernels for these shapes, the decoder's caches
        full: list[float] = []
        forward_only: list[float] = []
        fastest: list[tuple[int, int]] = []
        for _ in range(repeats):
            gate.wait()
            rates = {candidate: run(*candidate, True) for candidate in candidates}
            fastest.append(max(rates, key=rates.__getitem__))
            full.append(rates[fastest[-1]])
            forward_only.append(max(run(*candidate, False) for candidate in candidates))
    finally:
        if runner is not None:
            runner.close()
        torch.set_num_threads(threads)
    size = max(sizes, key=lambda n: sum(won == n for won, _ in fastest))
    return full, forward_only, size, max(layouts, key=lambda p: fastest.count((size, p)))


def measure(model_dir: str, dtype: str, batch_sizes: list[int], n_texts: int, repeats: int, singles: int,
            seed: int, gate: QuietGate, corpus_name: str = "mixed", family: str = "") -> dict[str, Any]:
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
    corpus = bench_corpus(corpus_name, family, pipe.tokenizer.mask_token, seed)
    texts = [corpus[i % len(corpus)] for i in range(n_texts)]
    token_counts = [len(ids) for ids in pipe.tokenizer(corpus)["input_ids"]]

    # Warm-up: one batch of every batch size (first calls build kernels and caches).
    for size in batch_sizes:
        pipe(texts[:size], batch_size=size)

    throughput: dict[str, list[float]] = {str(size): [] for size in batch_sizes}
    for _ in range(repeats):
        for size in batch_sizes:
            gate.wait()

            def once(size: int = size, fill: Any = pipe) -> None:
                assert len(fill(texts, batch_size=size)) == len(texts)

            throughput[str(size)].append(timed_rate(once, len(texts)))

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

    mask_token = pipe.tokenizer.mask_token
    del pipe
    limit, limit_forward_only, limit_batch, limit_parts = in_process_limit(model_dir, dtype, texts, repeats, gate)
    return {
        "model": model_dir,
        "mask_token": mask_token,
        "dtype": dtype,
        "corpus": corpus_name,
        "limit": limit,
        "limit_forward_only": limit_forward_only,
        "limit_batch": limit_batch,
        "limit_parts": limit_parts,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "n_texts": n_texts,
        "throughput": throughput,
        "single_ms": single_ms,
        "quiet_waits": {"count": gate.waits, "waited_s": round(gate.waited_s, 1)},
        "token_counts": token_counts,
    }


def measure_limits_only(model_dir: str, dtype: str, n_texts: int, repeats: int, seed: int, gate: QuietGate,
                        corpus_name: str = "mixed", family: str = "") -> dict[str, Any]:
    """The in-process limits alone, on the texts ``measure`` would use (``--limit-only``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    mask_token = ""
    if family:
        from transformers import AutoTokenizer

        mask_token = AutoTokenizer.from_pretrained(model_dir).mask_token
    corpus = bench_corpus(corpus_name, family, mask_token, seed)
    texts = [corpus[i % len(corpus)] for i in range(n_texts)]
    limit, limit_forward_only, limit_batch, limit_parts = in_process_limit(model_dir, dtype, texts, repeats, gate)
    return {"model": model_dir, "dtype": dtype, "corpus": corpus_name, "limit": limit,
            "limit_forward_only": limit_forward_only, "limit_batch": limit_batch, "limit_parts": limit_parts,
            "n_texts": n_texts,
            "quiet_waits": {"count": gate.waits, "waited_s": round(gate.waited_s, 1)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Time the in-process fill-mask pipeline and the in-process limit on a benchmark corpus; "
                    "prints one JSON object on its last line (see the module docstring for its fields).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's dtype, for the pipeline and the limit")
    parser.add_argument("--batch-sizes", default="1,8,16,32,64", type=batch_sizes,
                        help="comma-separated pipeline batch sizes (the limit tries its own: "
                             f"{', '.join(map(str, LIMIT_BATCHES))})")
    parser.add_argument("--texts", type=positive, default=256, help="texts per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
    parser.add_argument("--singles", type=int, default=50, help="single-text calls to time")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--corpus", default="mixed", choices=sorted(CORPORA), help="which benchmark corpus")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="before each timed call, wait up to this many seconds for a quiet machine")
    parser.add_argument("--wait-budget", type=float, default=0.0, help="most seconds of such waiting in all")
    parser.add_argument("--family", default="", choices=["", *FAMILIES],
                        help="the model is this family's checkpoint: its corpus takes its mask token, or protein "
                        "sequences for esm")
    parser.add_argument("--limit-only", action="store_true", help="measure the in-process limits alone")
    args = parser.parse_args(argv)
    from fillmask_server.diagnosis import ModelLoadError, check_source, first_line

    try:
        check_source(args.model)  # (a missing relative path is also a valid Hub id, and a long wait)
        if args.limit_only:
            result = measure_limits_only(args.model, args.dtype, args.texts, args.repeats, args.seed,
                                         QuietGate(args.wait_quiet, args.wait_budget), args.corpus, args.family)
        else:
            result = measure(args.model, args.dtype, args.batch_sizes, args.texts, args.repeats, args.singles,
                             args.seed, QuietGate(args.wait_quiet, args.wait_budget), args.corpus, args.family)
    except (ModelLoadError, OSError) as exc:  # (the pipeline's own load raises OSError for a missing model)
        sys.stderr.write(f"error: {first_line(exc)}\n")
        return 1
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def positive(text: str) -> int:
    """A count of at least 1 (``--texts``: none would time nothing, for ever)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: positive integers, comma-separated."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, comma-separated (1,8,32)") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be at least 1")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
