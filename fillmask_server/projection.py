"""The output projection (hidden states to vocabulary logits) on oneDNN's packed kernel, where the
load measures it faster than torch's own.

At the masks, a fill-mask model's last step is one matrix product: a few rows of hidden states by
the vocabulary's weight (30,522 columns for BERT, 250,002 for XLM-R). ``nn.Linear`` runs it through
torch's BLAS, which on some CPUs runs so wide and short a product at a fraction of the speed it
gets on the encoder's square ones; oneDNN's kernel, on a copy of the weight reordered once for it
(``mkldnn._reorder_linear_weight``), runs it faster there, and not on every CPU. So ``choose``
times both on this machine, at each of ``ROWS`` rows, the kernels in turn for ``ROUNDS`` rounds
(each keeping its fastest: a neighbour's burst weighs on both alike), and ``Projection.swapped``
puts the packed kernel in the model's place while the forward pass is traced when it took at most
``MARGIN`` of the time of torch's own at every one of them. A copy that would take more than
``MEMORY_SHARE`` of the memory still available (``cpus.memory_left``: the kernel's, within every
cgroup limit above the process) is not made.

Invariants:

- only a float32 ``nn.Linear`` on the CPU is ever swapped: the model's ``get_output_embeddings``,
  as wide as its vocabulary (a head that returns another layer, or none, keeps its own), and only
  where torch has oneDNN's ops; anything else keeps the model's own module;
- ``swapped`` puts the model's own module back when the block ends, whatever happens in it: the
  model object is as it was loaded (a traced graph keeps the module it was traced with), so eager
  paths run the model's own code;
- ``PackedLinear`` computes the same product as the ``nn.Linear`` it was made from, rounded
  otherwise (the sums run in another order): ``FillMaskModel`` keeps it only if the model's head
  calls the layer (``Projection.called_by``) and the logits at the masks agree within the few units
  in the last place that a product's row count changes already;
- the copy costs the weight's size in memory once (``Projection.copy_bytes``);
- ``RowCounts.rows(n)`` is at least ``n``, at most ``n`` plus ``n / PER_OCTAVE`` (rounded up), and
  ``n`` itself while ``n <= EXACT_ROWS``, or ``n`` was met before, or fewer than ``FREE_COUNTS``
  counts were; it may be called from several threads at once.

**Row counts.** oneDNN compiles a kernel for each row count the packed product is called with (the
masks in a batch) and keeps it, in its own cache and in ideep's, until each holds 1,024, so the
memory a server keeps grows with every count its load happens to meet (docs/performance-log.md,
"Memory that grows with every new batch shape", and the README's "Memory for each row count").
``RowCounts`` bounds that without slowing steady loads: a count met before runs as it is, and so
does any new one until ``FREE_COUNTS`` counts have been met; after that, a new count above
``EXACT_ROWS`` runs on the smallest count met between it and its round-up to one of ``PER_OCTAVE``
counts per octave, or on the round-up (at most ``1 / PER_OCTAVE`` more rows: the extra rows repeat
the last mask and their answers are dropped). The counts met are then at most ``FREE_COUNTS``, plus
``EXACT_ROWS``, plus ``PER_OCTAVE`` per octave above ``EXACT_ROWS``, whatever the load.

Test hook: ``FILLMASK_TEST_PROJECTION_SPEED=F`` multiplies the packed kernel's measured time by ``F``
(the measurement still runs), so a test can see either choice on any CPU.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, List, Optional, Union  # noqa: UP035 (TorchScript reads these names)

import torch

from .cpus import memory_left
from .diagnosis import first_line

log = logging.getLogger(__name__)

ROWS = (8, 64)  # the product timed at these many rows (a lone request's few masks, a full batch's) ...
ROUNDS = 3  # ... the two kernels in turn, this many rounds, each keeping its fastest
MARGIN = 0.9  # the packed kernel replaces torch's own when its time is at most this share of it, at each row count
MEMORY_SHARE = 0.25  # the packed copy is made only when it takes at most this share of the memory available
SPEED_ENV = "FILLMASK_TEST_PROJECTION_SPEED"
EXACT_ROWS = 32  # row counts up to this many always run as they are ...
FREE_COUNTS = 64  # ... and so does any count until this many have been met; after that a new one is rounded up ...
PER_OCTAVE = 16  # ... to one of this many counts per octave (a power of two), or a count met in between


with warnings.catch_warnings():  # (TorchScript's deprecation notice: the traced graph is TorchScript anyway;
    # a DeprecationWarning until torch 2.13, a FutureWarning, which Python shows every user, from 2.14)
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=FutureWarning)

    class PackedLinear(torch.jit.ScriptModule):
        """A linear layer's product on oneDNN's kernel, on a copy of its weight reordered once for it (the
        model's own weight stays: it is often the input embeddings' too)."""

        def __init__(self, linear: torch.nn.Linear, rows: int = max(ROWS)) -> None:
            super().__init__()
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
                bias = None if linear.bias is None else linear.bias.detach()  # (shared with the model's)
            self.register_buffer("packed", packed)
            self.register_buffer("bias", bias)

        @torch.jit.script_method
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045 (TorchScript)
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.packed, self.bias, "none", scalars, "")


class RowCounts:
    """The row counts the packed product has been called with, and the count to call it with next
    (the module docstring's "Row counts"; thread-safe: the model thread and a part's helper threads
    run forward passes at once)."""

    def __init__(self, free: int = FREE_COUNTS) -> None:
        self._free = free
        self._met: set[int] = set()
        self._lock = threading.Lock()

    def rows(self, n: int) -> int:
        """The row count to run ``n`` rows at (``n`` or more; the caller adds the extra rows)."""
        with self._lock:
            if n not in self._met and n > EXACT_ROWS and len(self._met) >= self._free:
                top = rounded_up(n)
                n = next((m for m in range(n, top) if m in self._met), top)
            self._met.add(n)
            return n

    @property
    def met(self) -> frozenset[int]:
        """The row counts the product has been called with."""
        with self._lock:
            return frozenset(self._met)


def rounded_up(n: int) -> int:
    """``n`` rounded up to one of ``PER_OCTAVE`` counts per octave (``n`` itself below ``2 * PER_OCTAVE``)."""
    step = 1 << max(0, n.bit_length() - PER_OCTAVE.bit_length())
    return -(-n // step) * step


class _LayerCalled(Exception):
    """Raised by ``_Tripwire``: the model's head called the layer in its place."""


class _Tripwire(torch.nn.Module):
    """In a layer's place: raises when called, and holds the layer's weights for a head that reads them."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise _LayerCalled


@dataclass
class Projection:
    """The model's output projection and its packed replacement, with what the load measured."""

    parent: torch.nn.Module  # the module that holds the projection ...
    name: str  # ... under this attribute name
    own: torch.nn.Linear
    packed: PackedLinear
    own_s: tuple[float, ...]  # the fastest time of each kernel at each of ``ROWS`` rows
    packed_s: tuple[float, ...]

    @property
    def faster(self) -> bool:
        """Whether the packed kernel is the one to run: faster by the margin at every row count timed."""
        return all(faster_by_margin(own, packed) for own, packed in zip(self.own_s, self.packed_s, strict=True))

    @property
    def copy_bytes(self) -> int:
        """The memory the packed copy of the weight takes."""
        return weight_bytes(self.own)

    @contextmanager
    def swapped(self, module: torch.nn.Module | None = None) -> Iterator[None]:
        """The packed kernel (or ``module``) in the model's place for the block; the model's own after it."""
        setattr(self.parent, self.name, self.packed if module is None else module)
        try:
            yield
        finally:
            setattr(self.parent, self.name, self.own)

    def called_by(self, run: Callable[[], Any]) -> bool:
        """Whether ``run`` (the model's head) calls the layer in the projection's place: a head that reads
        the layer's weight itself would never run the packed kernel."""
        try:
            with self.swapped(_Tripwire(self.own)):
                run()
        except _LayerCalled:
            return True
        return False

    def line(self) -> str:
        """What the load measured and chose, for the log."""
        shape = f"{self.own.in_features} -> {self.own.out_features}"
        ratios = " and ".join(f"{packed / own:.2f}x" if own > 0 else "inf"
                              for own, packed in zip(self.own_s, self.packed_s, strict=True))
        rows = " and ".join(str(n) for n in ROWS)
        if self.faster:
            return (f"the output projection ({shape}) runs on oneDNN's packed kernel: {ratios} the time of "
                    f"torch's own at {rows} rows, measured at load (a {self.copy_bytes / 2**20:.1f} MiB copy of "
                    "its weight; --projection torch keeps the model's own)")
        return (f"the output projection ({shape}) keeps torch's own kernel: oneDNN's packed one took {ratios} "
                f"its time at {rows} rows, measured at load")


def faster_by_margin(own_s: float, packed_s: float) -> bool:
    """Whether a kernel that took ``packed_s`` replaces one that took ``own_s`` (``MARGIN``)."""
    return packed_s <= MARGIN * own_s


def available() -> bool:
    """Whether this torch has oneDNN's linear kernels (a build with mkldnn)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def weight_bytes(linear: torch.nn.Linear) -> int:
    return int(linear.weight.numel() * linear.weight.element_size())


def output_linear(model: Any) -> tuple[torch.nn.Module, str, torch.nn.Linear] | None:
    """The model's output projection as (its parent module, its name there, the layer), when it is a
    float32 ``nn.Linear`` on the CPU, as wide as the model's vocabulary, that the model holds as a
    submodule; else None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        linear: Any = get() if callable(get) else None
    except Exception:  # a model whose head was replaced by one its own code cannot find the layer in
        return None
    if type(linear) is not torch.nn.Linear:  # (a quantised or a subclassed layer computes something else)
        return None
    if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
        return None
    vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)
    if linear.out_features != vocabulary:  # (DeBERTa-v2's returns its head's dense transform)
        return None
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is linear:
                return parent, name, linear
    return None


def choose(model: Any) -> Projection | None:
    """The model's projection and its packed replacement, timed (see the module docstring); None where
    nothing can be swapped, the copy would not fit, or the packed kernel cannot be made (then the
    model's own runs; the log says why for the last two)."""
    found = output_linear(model) if available() else None
    if found is None:
        return None
    parent, name, own = found
    room = memory_left()
    if room is not None and weight_bytes(own) > MEMORY_SHARE * room:
        log.info("the output projection keeps torch's own kernel: a packed copy of its weight (%.0f MiB) would "
                 "take more than a quarter of the memory available (%.0f MiB)", weight_bytes(own) / 2**20,
                 room / 2**20)
        return None
    slowdown = float(os.environ.get(SPEED_ENV, "1"))
    try:
        packed = PackedLinear(own)
        own_s, packed_s = time_kernels(own, packed)
    except Exception as exc:  # a torch whose oneDNN op refuses this weight: torch's own is right anyway
        log.warning("the output projection keeps torch's own kernel: oneDNN's packed one failed (%s)",
                    first_line(exc))
        return None
    return Projection(parent, name, own, packed, own_s, tuple(seconds * slowdown for seconds in packed_s))


def time_kernels(own: torch.nn.Linear, packed: torch.nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each kernel's fastest time at each of ``ROWS`` rows (on fixed random hidden states)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, own.in_features, generator=generator) for rows in ROWS]
    kernels = (own, packed)
    best = [[math.inf] * len(ROWS) for _ in kernels]
    with torch.inference_mode():
        for kernel in kernels:  # the first pass of each: allocations, the kernel's own first run
            for hidden in inputs:
                kernel(hidden)
        for _ in range(ROUNDS):
            for n, hidden in enumerate(inputs):
                for k, kernel in enumerate(kernels):
                    start = time.perf_counter()
                    kernel(hidden)
                    best[k][n] = min(best[k][n], time.perf_counter() - start)
    return tuple(best[0]), tuple(best[1])
