"""Turning ``--model`` into a checked ``FillMaskModel``: the torch import, the device and dtype, the
tokenizer and weights, quantisation, the model's own load-time checks, and the refusals of a model that
could serve no request, each a one-line ``ModelLoadError`` (``diagnosis``). It all runs on a thread
that ends (``on_a_thread_that_ends``), for the reason ``load_model`` gives.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .config import CHOICES
from .diagnosis import (
    ModelLoadError,
    check_libraries,
    check_source,
    device_problem,
    explain_batch_failure,
    explain_load_failure,
    explain_set_up_failure,
    library_warnings,
    not_numbers,
    unnormalised,
    unservable,
    unused,
)
from .model import NOT_NUMBERS, FillMaskModel

log = logging.getLogger(__name__)
T = TypeVar("T")


def resolve_device(device: str) -> str:
    """``auto`` picks cuda when available, else cpu; anything else is passed to torch as is."""
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name: str, device: str = "auto", dtype: str = "float32", threads: int = 0,
               forward: str = "traced", progress: Callable[[str], None] | None = None,
               announce: bool = True, projection: str = "auto") -> FillMaskModel:
    """Load tokenizer and masked-LM model once; raise ``ModelLoadError`` with one readable line.

    ``check_libraries`` and ``check_source`` run first, on the caller's thread and before torch is
    imported, so a library too old or a wrong ``name`` fails without waiting for torch. ``progress``,
    when given, is called as each stage starts, with one short line: first, at once, ``loading NAME on
    DEVICE, DTYPE`` (``auto`` is not resolved yet: that needs torch), then the name of each stage
    (``fillmask_server.startup`` prints them).
    ``announce``: log the ``loaded NAME on DEVICE (DTYPE): ...`` line and the load's choices (the output
    projection's kernel, padded rows) at INFO (not for a copy loaded to compare: at DEBUG).
    ``projection``: ``auto`` (the output projection's kernel measured at load, ``projection.py``) or
    ``torch`` (the model's own). ``threads``: torch's thread count to load with (0: torch's own).
    ``forward``, ``projection`` and ``threads`` out of range raise ``ModelLoadError`` too.

    Process-wide effects, as for any program that loads a model through transformers: with
    ``threads``, torch's thread count (``torch.set_num_threads``, which threads started later inherit);
    ``TOKENIZERS_PARALLELISM`` set to ``false`` unless already set (the server tokenizes on a thread of
    its own); transformers' and huggingface_hub's loggers at ERROR, transformers' progress bars off.

    The work runs on a thread of its own that ends when the model is ready. Loading, tracing and the
    start-up checks run forward passes, and the first parallel operator on a thread gives that thread
    a pool of OpenMP workers for good. GNU OpenMP counts the workers of every pool, and once they
    outnumber the CPUs its workers stop spinning between operators and sleep after a few microseconds
    (its "throttled" mode), so each of the hundreds of operators in a forward pass waits for a sleeping
    worker to be woken. A pool left on the loading thread put the model thread's own pool in that mode,
    which cost throughput and idle latency (docs/performance-log.md, "OpenMP's throttled mode"); the
    pool of a thread that has ended is freed.
    """
    if forward not in CHOICES["forward"] or projection not in CHOICES["projection"] or threads < 0:
        raise ModelLoadError(f"cannot load with forward={forward!r}, projection={projection!r}, threads={threads}: "
                             "forward is traced or eager, projection auto or torch, threads 0 or more")
    check_libraries("transformers", "torch")
    name = check_source(name)
    progress = progress or _quiet
    progress(f"loading {name} on {'cuda or cpu (auto)' if device == 'auto' else device}, {dtype}")
    progress("torch import and device check")
    return on_a_thread_that_ends(
        lambda: _load_model(name, device, dtype, threads, forward, progress, announce, projection), "fillmask-load")


def on_a_thread_that_ends(work: Callable[[], T], name: str) -> T:
    """``work()`` on a new thread that ends when it returns; its result, or its exception raised here.

    For work that runs forward passes before the model thread starts (loading, calibration): the
    OpenMP worker pool such a thread gets goes with it (see ``load_model``)."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return done[0]


def _quiet(stage: str) -> None:
    """The ``progress`` of a caller that wants no start-up lines."""


def _load_model(name: str, device: str, dtype: str, threads: int, forward: str,
                progress: Callable[[str], None], announce: bool, projection: str = "auto") -> FillMaskModel:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    if dtype == "int8" and not device.startswith("cpu"):
        raise ModelLoadError("--dtype int8 (dynamic quantisation) runs on the CPU only; use --device cpu")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "int8": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ModelLoadError(f"cannot use --dtype {dtype}: choose float32, bfloat16, float16 or int8")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch asserts when built without CUDA
        raise ModelLoadError(f"cannot use --device {device}: {device_problem(exc)}; choose another --device "
                             "(cpu always works; auto takes cuda only where torch sees a GPU)") from None
    if device.startswith("cuda"):
        _one_attention_kernel()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        model_config = AutoConfig.from_pretrained(name)
    except Exception as exc:  # corrupt files raise library-specific errors: all become one line
        raise ModelLoadError(explain_load_failure(name, exc)) from None
    if type(model_config) not in MODEL_FOR_MASKED_LM_MAPPING:
        raise ModelLoadError(f"model {name!r} ({model_config.model_type}) has no masked-language-model head, so "
                             "it cannot fill masks; point --model at a fill-mask model such as "
                             "google-bert/bert-base-uncased")
    progress("tokenizer and weights")
    with library_warnings() as said:  # (each load's own warnings explain its own failure)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # corrupt files raise library-specific errors: all become one line
            raise ModelLoadError(explain_load_failure(name, exc, said)) from None
    with library_warnings() as said:
        try:
            model, loading = AutoModelForMaskedLM.from_pretrained(name, config=model_config, dtype=torch_dtype,
                                                                  output_loading_info=True)
        except Exception as exc:
            raise ModelLoadError(explain_load_failure(name, exc, said)) from None
    if getattr(tokenizer, "mask_token_id", None) is None:
        raise ModelLoadError(f"model {name!r} has a tokenizer without a mask token, so it cannot fill masks; "
                             "use a fill-mask model such as google-bert/bert-base-uncased")
    limit = getattr(tokenizer, "model_max_length", None)  # (a hand-edited "64" failed every text in the library)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        raise ModelLoadError(f"model {name!r} has a tokenizer whose model_max_length is {limit!r}, not a number: write "
                             "it as a number in its tokenizer_config.json, or leave it out")
    problem = unservable(tokenizer, model, sorted(loading.get("missing_keys") or ()),
                         sorted(loading.get("unexpected_keys") or ()))
    if problem is not None:
        raise ModelLoadError(f"model {name!r} {problem}")
    problem = not_numbers(model, dtype)
    if problem is not None:
        raise ModelLoadError(f"model {name!r} {problem}")
    unused(model, sorted(loading.get("unexpected_keys") or ()))
    if getattr(model.config, "return_dict", True) is False:  # (tuples: the model is asked for its outputs by name)
        model.config.return_dict = True
    if getattr(model.config, "is_decoder", False):
        log.warning("model %s has is_decoder true in its config.json: each position attends to those before it "
                    "only, so a mask sees none of the words after it (the pipeline answers the same); a fill-mask "
                    "checkpoint is saved with is_decoder false", name)
    model = model.to(device).eval()
    unquantized = None
    if dtype == "int8":
        progress("int8 quantisation")
        unquantized, model = model, _quantize_dynamic(model)  # (a copy: the float32 model is checked against)
    progress("forward pass traced and checked" if forward == "traced" else "model set-up")
    try:
        loaded = FillMaskModel(name, tokenizer, model, device, dtype, forward, unquantized, projection, announce)
        shortest = len(loaded.tokenize([loaded.mask_token])[0])
    except ModelLoadError:
        raise
    except Exception as exc:  # (a tokenizer setting the libraries took and then failed on: one line too)
        raise ModelLoadError(explain_set_up_failure(name, exc, model.config)) from None
    del unquantized
    if shortest > loaded.max_tokens:  # (a checkpoint audit: it started, and refused every request)
        whose, fix = {"tokenizer": ("its tokenizer's model_max_length", "raise it in its tokenizer_config.json"),
                      "positions": ("the positions its config.json's max_position_embeddings has room for",
                                    "its weights were made for that many: use another checkpoint"),
                      "declared": ("the length its config.json's max_position_embeddings declares",
                                   "set it to the length the model was made for")}[loaded.max_tokens_source]
        raise ModelLoadError(f"model {name!r} accepts at most {loaded.max_tokens} tokens ({whose}), and a text "
                             f"of one mask takes {shortest}: no request could run; {fix}")
    failure = loaded.fails_a_batch()
    unsteady = unnormalised(model.config) if failure == NOT_NUMBERS else None
    if unsteady is not None:  # (a trial: it blamed the weights)
        raise ModelLoadError(f"model {name!r} gives scores that are not numbers on a batch of two short texts with "
                             f"a mask: {unsteady}; correct it in the config.json of --model's directory")
    if failure == NOT_NUMBERS and dtype in ("float16", "bfloat16"):  # (an audit: it blamed weights and tokenizer)
        raise ModelLoadError(f"model {name!r} gives scores that are not numbers in {dtype} (its activations "
                             "overflow, or its weights hold NaN); use --dtype float32, or bfloat16 for float16")
    if failure == NOT_NUMBERS:  # (a trial: it blamed the tokenizer)
        raise ModelLoadError(f"model {name!r} gives scores that are not numbers on a batch of two short texts with "
                             "a mask (its weights hold NaN or infinite values?); it cannot serve requests: use a "
                             "checkpoint whose weights are all numbers")
    if failure is not None:
        raise ModelLoadError(explain_batch_failure(name, failure, model.config))
    facts = loaded.engine_facts()
    if announce:
        kernel = ", output projection on oneDNN's packed kernel" if loaded.projection_kernel != "torch" else ""
        log.info("loaded %s on %s (%s): forward %s, head %s%s", name, facts["device"], dtype, facts["forward"],
                 "at the masks" if facts["head"] == "masks" else "at every position (full model)", kernel)
        if dtype == "bfloat16" and device.startswith("cpu"):
            log.info("%s", kernel_cache_line())
    return loaded


#: oneDNN's two caches of compiled kernels, by the environment variable that sizes each (README, "Fast modes").
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def kernel_cache_line() -> str:
    """What bfloat16 on a CPU keeps in memory for each batch shape, and the caches' sizes in force."""
    sizes = ", ".join(f"{variable}={os.environ.get(variable, '1024 (its default)')}" for variable in KERNEL_CACHES)
    return (f"bfloat16 on a CPU: oneDNN keeps compiled kernels for each batch shape the load meets, up to its "
            f"caches' sizes ({sizes}); set both lower to bound that memory, at a price where shapes vary "
            "(README, Fast modes)")


def _quantize_dynamic(model: Any) -> Any:
    """int8 weights for every Linear layer, activations quantised on the fly (CPU)."""
    import warnings

    import torch
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its own deprecation
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def _one_attention_kernel() -> None:
    """cuDNN's attention and FlashAttention out of ``scaled_dot_product_attention``'s choices, for the
    whole process (one model a process), which leaves the memory-efficient kernel to every batch.

    - **cuDNN** builds an execution plan for each new shape, and a server's batches never stop taking
      new shapes (rows x widest row): on an H200 a batch of a new shape in bfloat16 or float16 took
      several times its repeat (README, "On a GPU").
    - **FlashAttention** takes only attention without a mask. transformers drops an all-ones mask in
      eager PyTorch but keeps it in a traced graph, so on a batch with no padding the two ran different
      kernels, the trace check (the same bits) failed in bfloat16 and float16, and both ran eager."""
    import torch

    backends = torch.backends.cuda
    off = []
    for name, enabled, enable in (("cuDNN", backends.cudnn_sdp_enabled, backends.enable_cudnn_sdp),
                                  ("FlashAttention", backends.flash_sdp_enabled, backends.enable_flash_sdp)):
        if enabled():
            enable(False)
            off.append(name)
    if off:
        log.info("attention runs the memory-efficient kernel for every batch (%s off)", " and ".join(off))
