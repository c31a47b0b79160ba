"""The output projection on oneDNN's packed kernel (projection.py), chosen at load where it is faster."""

from __future__ import annotations

import math
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fillmask_server import projection
from fillmask_server.checkpoint import FAMILIES, ensure_family
from fillmask_server.items import Item
from fillmask_server.loading import load_model
from fillmask_server.model import FillMaskModel


def packs() -> bool:
    """Whether this torch and CPU run the packed kernel at all (the op names alone do not say so)."""
    if not projection.available():
        return False
    try:
        with torch.inference_mode():
            projection.PackedLinear(torch.nn.Linear(8, 16))(torch.ones(2, 8))
    except Exception:
        return False
    return True


needs_onednn = pytest.mark.skipif(not packs(), reason="this torch or CPU has no oneDNN packed linear kernel")

TEXTS = ["Paris is the [MASK] of France.", "The [MASK] sat on the [MASK] all day long, didn't it?",
         "[MASK] is a word."]


@needs_onednn
def test_the_packed_kernel_computes_the_linear_layers_product() -> None:
    """Any row count (the weight is packed for 64), 2-d and 3-d inputs, with and without a bias, within
    rounding; a graph traced through it keeps it after the model's own layer is put back."""
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(96, 3000, bias=bias)
        packed = projection.PackedLinear(linear)
        with torch.inference_mode():
            for shape in ((1, 96), (5, 96), (64, 96), (130, 96), (3, 7, 96)):
                hidden = torch.randn(*shape)
                want = linear(hidden)
                assert packed(hidden).shape == want.shape
                assert (packed(hidden) - want).abs().max().item() < 1e-4 * want.abs().max().item()

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = linear

        def forward(self, hidden: Any) -> Any:
            return self.decoder(hidden).softmax(-1)

    head = Head().eval()
    found = projection.Projection(head, "decoder", linear, projection.PackedLinear(linear), (1.0,), (0.5,))
    hidden = torch.randn(4, 96)
    with torch.inference_mode():
        with found.swapped():
            assert isinstance(head.decoder, projection.PackedLinear)
            with warnings.catch_warnings():  # (TorchScript's deprecation notice, as the server keeps it out)
                warnings.filterwarnings("ignore", message=r"`torch\.jit\.")
                traced = torch.jit.trace(head, (hidden,), check_trace=False)
            swapped = head(hidden)
        assert head.decoder is linear
        assert torch.equal(traced(hidden), swapped)
        assert traced.decoder.original_name == "PackedLinear"


@needs_onednn
def test_the_models_own_layer_is_back_after_the_block_whatever_happened_in_it(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir))
    found = projection.output_linear(model)
    assert found is not None
    parent, name, own = found
    assert own is model.get_output_embeddings() and getattr(parent, name) is own
    chosen = projection.Projection(parent, name, own, projection.PackedLinear(own), (1.0,), (0.5,))
    with pytest.raises(RuntimeError), chosen.swapped():
        assert getattr(parent, name) is chosen.packed
        raise RuntimeError("a trace that fails")
    assert getattr(parent, name) is own and model.get_output_embeddings() is own
    assert chosen.copy_bytes == own.weight.numel() * 4


def test_only_a_float32_linear_layer_on_the_cpu_is_ever_swapped(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForMaskedLM

    class NoProjection(torch.nn.Module):
        def get_output_embeddings(self) -> None:
            return None

    class Subclassed(torch.nn.Linear):
        pass

    class Unfindable(torch.nn.Module):  # (BERT's code after its ``cls`` was replaced: tests/test_model.py)
        def get_output_embeddings(self) -> None:
            raise AttributeError("'Mixing' object has no attribute 'predictions'")

    assert projection.output_linear(NoProjection()) is None
    assert projection.output_linear(Unfindable()) is None
    model = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir))
    own = model.get_output_embeddings()
    model.cls.predictions.decoder = Subclassed(own.in_features, own.out_features)  # (a layer of its own kind)
    assert projection.output_linear(model) is None
    assert projection.output_linear(AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir)).bfloat16()) is None
    narrower = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir))
    assert projection.output_linear(narrower) is not None
    narrower.config.vocab_size += 1  # (a layer that is not the vocabulary's: DeBERTa-v2 returns its dense transform)
    assert projection.output_linear(narrower) is None


@needs_onednn
def test_the_packed_kernel_replaces_torchs_own_only_when_faster_at_every_row_count_timed(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir))
    found = projection.output_linear(model)
    assert found is not None
    packed = projection.PackedLinear(found[2])
    assert projection.Projection(*found, packed, (1.0, 2.0), (0.9, 1.8)).faster
    assert not projection.Projection(*found, packed, (1.0, 2.0), (0.5, 1.9)).faster  # (slower for lone requests)
    assert not projection.Projection(*found, packed, (1.0, 2.0), (0.95, 0.5)).faster


def test_the_packed_kernel_replaces_torchs_own_only_when_faster_by_the_margin() -> None:
    assert projection.faster_by_margin(1.0, projection.MARGIN)
    assert not projection.faster_by_margin(1.0, projection.MARGIN + 0.01)
    assert not projection.faster_by_margin(1.0, 1.0)


def top(model: FillMaskModel) -> Any:
    ids = model.tokenize(TEXTS)
    return model.forward([Item(ids[0], 5), Item(ids[1], 3), Item(ids[2], 7)])


def test_row_counts_run_as_they_are_until_many_have_been_met() -> None:
    """A count up to ``EXACT_ROWS``, a count met before, and any count while fewer than ``FREE_COUNTS``
    were met run as they are; after that a new count runs on the smallest count met between it and
    its round-up, or on the round-up."""
    counts = projection.RowCounts(free=4)
    assert [counts.rows(n) for n in (33, 100, 7, 515)] == [33, 100, 7, 515]  # four free
    assert counts.rows(101) == 104 and counts.rows(102) == 104  # full: rounded up (4 per step at 64-127) ...
    assert counts.rows(100) == 100 and counts.rows(515) == 515  # ... a count met runs as it is ...
    assert counts.rows(509) == 512 and counts.rows(513) == 515  # ... and one met between n and its round-up wins
    assert counts.rows(32) == 32 and counts.rows(1) == 1  # up to EXACT_ROWS: always as it is
    assert counts.met == {1, 7, 32, 33, 100, 104, 512, 515}


def test_row_counts_keep_the_kernels_met_bounded_and_add_at_most_a_sixteenth() -> None:
    """Whatever the order, every count from 1 to 4,096 met many times: at most ``FREE_COUNTS``, plus
    ``EXACT_ROWS``, plus ``PER_OCTAVE`` counts per octave above ``EXACT_ROWS`` are ever met, and a count
    never runs on more than ``n + n / PER_OCTAVE`` rows (without the rule: 4,096 kernels)."""
    assert projection.rounded_up(33) == 34 and projection.rounded_up(64) == 64 and projection.rounded_up(129) == 136
    generator = random.Random(7)
    counts = projection.RowCounts()
    for _ in range(3):
        load = list(range(1, 4097))
        generator.shuffle(load)
        for n in load:
            rows = counts.rows(n)
            assert n <= rows <= n + -(-n // projection.PER_OCTAVE), (n, rows)
    octaves = math.log2(4096 / projection.EXACT_ROWS)
    most = projection.FREE_COUNTS + projection.EXACT_ROWS + projection.PER_OCTAVE * octaves
    assert len(counts.met) <= most, len(counts.met)


@needs_onednn
def test_a_batch_at_a_rounded_up_row_count_answers_as_at_its_own(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the packed kernel's free counts spent, 33 masks (with a request's targets, and several
    ``top_k``) run at 34 rows, the last mask repeated: each request gets the answers it gets at 33 rows
    (same tokens, scores within rounding), and the extra row's are dropped."""
    monkeypatch.setenv(projection.SPEED_ENV, "0.01")
    model = load_model(str(tiny_model_dir))
    assert model.projection_kernel == "onednn-packed"
    eight = model.tokenize([" ".join(["[MASK]"] * 8) + " is a word."])[0]
    ids = model.tokenize(TEXTS)
    targets = model.target_ids(("paris", "france", "word"))
    items = [Item(eight, 5), Item(eight, 3), Item(eight, 5, targets), Item(eight, 4), Item(ids[0], 2)]
    graph, called = model._batch, []

    def batch(*inputs: Any) -> Any:  # (the real graph, and the row count it was given)
        called.append(len(inputs[2]))
        return graph(*inputs)

    monkeypatch.setattr(model, "_batch", batch)
    answers = []
    for free in (projection.FREE_COUNTS, 0):
        model._row_counts = projection.RowCounts(free=free)
        got = model.forward(items)
        assert model._row_counts.met == {33 if free else 34} and called[-1] == (33 if free else 34)
        assert got.values.shape[0] == got.indices.shape[0] == got.spans[-1][1] == 33
        answers.append([got.candidates(n, item) for n, item in enumerate(items)])
    for exact, rounded in zip(*answers, strict=True):
        assert exact[0] == rounded[0] and exact[2] == rounded[2]  # the mask positions and the tokens
        assert exact[1] == [pytest.approx(row, abs=1e-6) for row in rounded[1]]


@needs_onednn
@pytest.mark.parametrize("speed", [0.01, 100.0])
def test_the_load_runs_the_kernel_it_measured_faster_and_answers_as_the_pipeline(
        tiny_model_dir: Path, reference_pipeline: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, speed: float) -> None:
    """The packed kernel measured 100x faster, or 100x slower (``SPEED_ENV``): the traced graph runs the
    faster, the log says which and what was measured, the answers are the pipeline's (same tokens in
    the same order, scores within 1e-6), and the model object keeps its own layer (eager runs it; with
    torch's own kernel traced, eager's bits: test_model.py's ``test_traced_and_eager_give_the_same_bits``)."""
    monkeypatch.setenv(projection.SPEED_ENV, str(speed))
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        model = load_model(str(tiny_model_dir))
    kernel = "onednn-packed" if speed < 1 else "torch"
    assert (model.forward_mode, model.projection_kernel) == ("traced", kernel)
    said = [r.getMessage() for r in caplog.records if "the output projection (128 -> 30522)" in r.getMessage()]
    assert len(said) == 1 and ("runs on oneDNN's packed kernel" in said[0]) == (speed < 1), said
    assert type(model.model.get_output_embeddings()) is torch.nn.Linear
    for graph in (model._scores, model._packed_scores):  # what the traced graphs run (padded and packed rows)
        assert ("PackedLinear" in {m.original_name for m in graph.modules()}) == (speed < 1)
    assert (model._row_counts is not None) == (speed < 1)  # (torch's own kernel keeps no kernel per row count)
    got = top(model)
    for n, (text, k) in enumerate(zip(TEXTS, (5, 3, 7), strict=True)):
        expected = reference_pipeline(text, top_k=k)
        expected = expected if isinstance(expected[0], list) else [expected]
        first, last = got.spans[n]
        for row, predictions in zip(range(first, last), expected, strict=True):
            assert got.indices[row][:k].tolist() == [p["token"] for p in predictions]
            assert got.values[row][:k].tolist() == pytest.approx([p["score"] for p in predictions], abs=1e-6)


@needs_onednn
def test_a_copy_loaded_to_compare_logs_its_kernel_choice_at_debug_only(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The calibration's float32 copy (``announce=False``, for ``--dtype bfloat16`` and the like) said
    "the output projection ... runs on oneDNN's packed kernel" at INFO, read as the server's own choice
    (a newcomer's trial: the bfloat16 server runs no packed kernel); now at DEBUG (the server's own, at
    INFO: ``test_the_load_runs_the_kernel_it_measured_faster_and_answers_as_the_pipeline``)."""
    monkeypatch.setenv(projection.SPEED_ENV, "0.01")
    with caplog.at_level("DEBUG", logger="fillmask_server.model"):
        model = load_model(str(tiny_model_dir), announce=False)
    assert model.projection_kernel == "onednn-packed"
    said = [r.levelname for r in caplog.records if "the output projection (128 -> 30522)" in r.getMessage()]
    assert said == ["DEBUG"], said


@needs_onednn
def test_projection_torch_keeps_the_models_own_kernel_without_measuring(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(model: Any) -> None:
        raise AssertionError("measured with --projection torch")

    monkeypatch.setattr(projection, "choose", refuse)
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        model = load_model(str(tiny_model_dir), projection="torch")
    assert (model.forward_mode, model.projection_kernel) == ("traced", "torch")
    assert not [r for r in caplog.records if "output projection" in r.getMessage()]


@needs_onednn
def test_a_head_that_reads_the_layers_weight_itself_keeps_torchs_own(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A head that computes the product from the layer's weight without calling the layer would never
    run the packed kernel: it is not counted as running it, and its copy is not kept."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir)).eval()
    head = model.cls.predictions
    head.forward = lambda hidden: torch.nn.functional.linear(head.transform(hidden), head.decoder.weight,
                                                             head.decoder.bias)
    monkeypatch.setenv(projection.SPEED_ENV, "0.01")
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        fill = FillMaskModel("reads-weight", tokenizer, model, "cpu", "float32")
    assert (fill.forward_mode, fill.projection_kernel) == ("traced", "torch")
    assert any("does not call that layer" in r.getMessage() for r in caplog.records)
    assert "PackedLinear" not in {m.original_name for m in fill._scores.modules()}


class FailsTracing(torch.nn.Module):
    """The model's own layer in the packed one's place, raising when traced the ``nth`` time (None: each time)."""

    def __init__(self, own: torch.nn.Linear, nth: int | None = None) -> None:
        super().__init__()
        self.own, self.nth, self.traces = own, nth, 0

    def forward(self, hidden: Any) -> Any:
        if torch.jit.is_tracing():
            self.traces += 1
            if self.nth is None or self.traces == self.nth:
                raise RuntimeError("cannot trace this kernel")
        return self.own(hidden)


def chosen_with(monkeypatch: pytest.MonkeyPatch, make: Any) -> list[torch.nn.Module]:
    """``projection.choose`` as measured faster (``(1.0,), (0.5,)``) with ``make(own)`` in the packed
    kernel's place; the modules it made, in order."""
    real_choose, made = projection.choose, []

    def choose(model: Any) -> projection.Projection | None:
        chosen = real_choose(model)
        assert chosen is not None
        made.append(make(chosen.own))
        return projection.Projection(chosen.parent, chosen.name, chosen.own, made[-1], (1.0,), (0.5,))

    monkeypatch.setattr(projection, "choose", choose)
    return made


@needs_onednn
def test_a_forward_pass_that_traces_only_with_the_models_own_layer_keeps_it(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The packed kernel is a speed-up: where the graph cannot be traced with it, the model is traced
    again with its own layer (not run eager)."""
    chosen_with(monkeypatch, FailsTracing)
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        model = load_model(str(tiny_model_dir))
    assert (model.forward_mode, model.projection_kernel) == ("traced", "torch") and model.forward_note is None
    assert any("did not trace with the packed one" in r.getMessage() for r in caplog.records)
    assert not any("running eager" in r.getMessage() for r in caplog.records)  # (it never did)
    assert model._packed_scores is not None  # (packed rows traced too, with the model's own layer)


@needs_onednn
def test_a_packed_rows_graph_that_traces_only_with_the_models_own_layer_gives_the_kernel_up_for_both(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded rows' graph traces with the packed kernel and the packed rows' does not: both run the
    model's own layer then (one kernel whatever the rows), and the model says so."""
    # (the first trace is the padded rows' graph, the second the packed rows')
    made = chosen_with(monkeypatch, lambda own: FailsTracing(own, nth=2))
    model = load_model(str(tiny_model_dir))
    assert made[0].traces == 2 and model.pack_width
    assert (model.forward_mode, model.projection_kernel) == ("traced", "torch")
    for graph in (model._scores, model._packed_scores):
        assert "FailsTracing" not in {m.original_name for m in graph.modules()}


@needs_onednn
def test_no_packed_copy_is_made_that_would_crowd_the_memory_left(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir))
    found = projection.output_linear(model)
    assert found is not None
    size = projection.weight_bytes(found[2])
    monkeypatch.setattr(projection, "memory_left", lambda: int(size / projection.MEMORY_SHARE) - 1)
    with caplog.at_level("INFO", logger="fillmask_server.projection"):
        assert projection.choose(model) is None
    assert any("more than a quarter of the memory available" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(projection, "memory_left", lambda: int(size / projection.MEMORY_SHARE) + 1)
    assert projection.choose(model) is not None
    monkeypatch.setattr(projection, "memory_left", lambda: None)  # (nothing readable: no bound)
    assert projection.choose(model) is not None


def test_the_memory_left_is_the_least_of_the_kernels_and_every_cgroup_limits() -> None:
    """``MemAvailable``, and each cgroup level's limit less its usage, v2 or else v1, from the process's own
    cgroup up to the mount's root (a pod's limit sits above the container's)."""
    from fillmask_server.cpus import CGROUP_ROOT, CGROUP_V1_MEMORY_DIR, PROC_MEMINFO, PROC_SELF_CGROUP, memory_left

    gib = 2**30
    meminfo = f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {20 * gib // 1024} kB\n"

    def files(found: dict[str, str]) -> Any:
        return lambda path: found.get(path)

    assert memory_left(files({})) is None
    assert memory_left(files({PROC_MEMINFO: meminfo})) == 20 * gib
    v2 = {PROC_MEMINFO: meminfo, PROC_SELF_CGROUP: "0::/kubepods/pod1/box\n",
          f"{CGROUP_ROOT}/kubepods/pod1/box/memory.max": "max",
          f"{CGROUP_ROOT}/kubepods/pod1/box/memory.current": str(gib),
          f"{CGROUP_ROOT}/kubepods/pod1/memory.max": str(3 * gib),
          f"{CGROUP_ROOT}/kubepods/pod1/memory.current": str(gib)}
    assert memory_left(files(v2)) == 2 * gib  # (the pod's limit, a level above the container's)
    v1 = {PROC_MEMINFO: meminfo, PROC_SELF_CGROUP: "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
          f"{CGROUP_V1_MEMORY_DIR}/docker/abc/memory.limit_in_bytes": str(4 * gib),
          f"{CGROUP_V1_MEMORY_DIR}/docker/abc/memory.usage_in_bytes": str(3 * gib),
          f"{CGROUP_V1_MEMORY_DIR}/memory.limit_in_bytes": "9223372036854771712",
          f"{CGROUP_V1_MEMORY_DIR}/memory.usage_in_bytes": str(5 * gib)}
    assert memory_left(files(v1)) == gib
    assert memory_left(files({**v1, f"{CGROUP_V1_MEMORY_DIR}/docker/abc/memory.usage_in_bytes": "junk"})) == 20 * gib


@needs_onednn
@pytest.mark.parametrize("scale", [1.001, float("nan")])
def test_a_packed_kernel_whose_logits_differ_is_not_used(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, scale: float) -> None:
    """A kernel measured faster whose logits at the masks are not the model's within rounding (here: made
    from another weight, or one that gives NaN) is put back, and the log says why."""

    def packed_from_another_weight(own: torch.nn.Linear) -> projection.PackedLinear:
        other = torch.nn.Linear(own.in_features, own.out_features)
        with torch.no_grad():
            other.weight.copy_(own.weight * scale)
            other.bias.copy_(own.bias)
        return projection.PackedLinear(other)

    chosen_with(monkeypatch, packed_from_another_weight)
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        model = load_model(str(tiny_model_dir))
    assert (model.forward_mode, model.projection_kernel) == ("traced", "torch")
    assert any("differ from it by more than rounding" in r.getMessage() for r in caplog.records)
    assert type(model.model.get_output_embeddings()) is torch.nn.Linear
    for graph in (model._scores, model._packed_scores):
        assert "PackedLinear" not in {m.original_name for m in graph.modules()}


@needs_onednn
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_answers_as_its_pipeline_with_the_packed_kernel(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed kernel forced (measured 100x faster) on each family's offline checkpoint: it runs in
    the traced graph, and the answers are the pipeline's (tokens in order, scores within 1e-5) at one
    mask and at two. (On those checkpoints, 32 wide, torch's own kernel is the faster: the load keeps it.)"""
    import warnings

    from transformers import pipeline

    from tests.test_families import FAMILY_DIR, PROTEIN, SENTENCE

    directory = ensure_family(name, FAMILY_DIR)
    monkeypatch.setenv(projection.SPEED_ENV, "0.01")
    model = load_model(str(directory))
    assert (model.forward_mode, model.projection_kernel) == ("traced", "onednn-packed")
    mask = model.mask_token
    words = PROTEIN[:30] if name == "esm" else SENTENCE
    sep = "" if name == "esm" else " "
    pieces = list(words) if name == "esm" else words.split()
    texts = [sep.join([*pieces[:3], mask, *pieces[4:12]]),
             sep.join([*pieces[:2], mask, *pieces[3:6], mask, *pieces[7:10]])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline("fill-mask", model=str(directory), tokenizer=str(directory), device="cpu")
    ids = model.tokenize(texts)
    got = model.forward([Item(row, 5) for row in ids])
    for n, text in enumerate(texts):
        expected = pipe(text, top_k=5)
        expected = expected if isinstance(expected[0], list) else [expected]
        first, last = got.spans[n]
        for row, predictions in zip(range(first, last), expected, strict=True):
            assert got.indices[row].tolist() == [p["token"] for p in predictions]
            assert got.values[row].tolist() == pytest.approx([p["score"] for p in predictions], abs=1e-5)


TORCH_2_14 = r"""
import sys, warnings
import torch

def as_in_torch_2_14(name):  # torch 2.14 warns with a FutureWarning, which Python shows every user
    original = getattr(torch.jit, name)
    def warned(*args, **kwargs):
        warnings.warn(f"`torch.jit.{name}` is deprecated. Please switch to `torch.compile` or `torch.export`.",
                      FutureWarning, stacklevel=2)
        return original(*args, **kwargs)
    setattr(torch.jit, name, warned)

for name in ("script_method", "script", "trace"):
    as_in_torch_2_14(name)
warnings.filterwarnings("error", message=r"`torch\.jit\.")
from fillmask_server.loading import load_model
model = load_model(sys.argv[1], threads=1, announce=False)
print(model.forward_mode, model.projection_kernel)
"""


@needs_onednn
def test_torchs_notice_that_torchscript_is_deprecated_reaches_no_operator(tiny_model_dir: Path) -> None:
    """Found with torch 2.14.1, which made TorchScript's deprecation notice a FutureWarning: every start
    printed a line of torch's source path and the notice, which an operator can do nothing about (the
    fast path is TorchScript, and says so in its log line). With the notices turned into errors here
    (the packed kernel measured faster, ``SPEED_ENV``), the load prints nothing of them and gives up
    neither the traced graph nor the packed kernel (it did: the error reached the kernel's class)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TORCH_2_14, str(tiny_model_dir)], cwd=Path(__file__).parent.parent,
                          env={**os.environ, projection.SPEED_ENV: "0.01"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["traced", "onednn-packed"], (done.stdout, done.stderr[-2000:])
    assert "torch.jit" not in done.stderr, done.stderr[-2000:]
