"""The forward pass (model.py): the traced graph is used when it is exact, and eager PyTorch otherwise."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fillmask_server import batching
from fillmask_server.items import Item
from fillmask_server.loading import load_model
from fillmask_server.model import PACK_WIDTH, FillMaskModel
from fillmask_server.server import model_display_name

TEXTS = ["Paris is the [MASK] of France.", "The [MASK] sat on the [MASK] all day long, didn't it?",
         "[MASK] is a word.", "A much longer sentence, about the old [MASK] who lived by the river in a small house."]


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path) -> FillMaskModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def traced_own(tiny_model_dir: Path) -> FillMaskModel:
    """Traced, with the model's own output projection (``--projection torch``: test_projection.py has the other)."""
    return load_model(str(tiny_model_dir), projection="torch")


@pytest.fixture(scope="module")
def eager(tiny_model_dir: Path) -> FillMaskModel:
    return load_model(str(tiny_model_dir), forward="eager")


def items(model: FillMaskModel) -> list[Item]:
    ids = model.tokenize(TEXTS)
    return [Item(ids[0], 5), Item(ids[1], 3), Item(ids[2], 7, model.target_ids(("word", "thing", "car"))),
            Item(ids[3], 100)]


def test_the_tiny_bert_runs_traced_by_default_and_eager_on_request(traced: FillMaskModel,
                                                                   eager: FillMaskModel) -> None:
    assert traced.forward_mode == "traced" and eager.forward_mode == "eager"


def test_traced_and_eager_give_the_same_bits(traced_own: FillMaskModel, eager: FillMaskModel) -> None:
    """Padding (texts of different lengths), several masks, targets and top_k 100 in one batch."""
    traced = traced_own
    assert traced.projection_kernel == "torch"
    a, b = traced.forward(items(traced)), eager.forward(items(eager))
    assert a.spans == b.spans and a.columns == b.columns
    assert torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)
    assert a.targeted is not None and b.targeted is not None
    assert all(torch.equal(x, y) for i in a.targeted for x, y in zip(a.targeted[i], b.targeted[i], strict=True))


def with_head_then(model: FillMaskModel, then: Callable[[Any, Any], Any]) -> FillMaskModel:
    """A copy of ``model`` whose head is its own followed by ``then(hidden, logits)``: a head that
    misbehaves the way a test needs."""
    own = model._head

    class HeadThen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = own

        def forward(self, hidden: Any) -> Any:
            return then(hidden, self.head(hidden))

    copied = copy.copy(model)
    copied._head = HeadThen()
    return copied


def test_a_model_the_tracer_cannot_follow_runs_eager(traced_own: FillMaskModel) -> None:
    """A head with a Python branch on the number of masks: the tracer bakes in one branch, the start-up
    check (which tries 1 to 32 masks) sees the difference, and the model runs eager, correctly."""
    traced = traced_own  # (the model's own projection, as eager runs it)
    model = with_head_then(traced, lambda hidden, logits: logits if hidden.shape[0] < 8 else logits.flip(-1))
    model._scores = model._trace()
    assert model._scores is None  # fell back to eager
    model._batch = model._batch_graph()
    few = [Item(ids, 5) for ids in model.tokenize(["[MASK] a b c."])]  # one mask: the head as it was
    many = [Item(ids, 5) for ids in model.tokenize(["[MASK] " * 3 + "x"] * 4)]  # 12 masks: the other branch
    assert torch.equal(model.forward(few).indices, traced.forward(few).indices)
    # Eager follows the branch a traced graph would have missed: other tokens win at 12 masks.
    assert not torch.equal(model.forward(many).indices, traced.forward(many).indices)


@pytest.mark.parametrize("fuses", [True, False], ids=["fusing", "not-fusing"])
def test_a_graph_whose_fused_kernels_round_otherwise_is_traced_again_without_fusion(
        traced_own: FillMaskModel, monkeypatch: pytest.MonkeyPatch, fuses: bool) -> None:
    """Where TorchScript fuses (CUDA), a fused kernel rounds a reduced dtype's intermediates otherwise
    than eager PyTorch: the first graph differs, fusion goes off and the second graph gives eager's bits.
    Here a head stands in for the fused kernel: traced while fusion is on, it moves every logit by a
    little. Where nothing fuses (``fuses`` False, the CPU), such a graph is given up for eager, as before.
    """
    from fillmask_server import model as model_module

    traced = traced_own  # (the model's own projection: the copy below is traced again with it)

    def rounds_otherwise_when_fused(hidden: Any, logits: Any) -> Any:
        fused = torch.jit.is_tracing() and torch._C._jit_texpr_fuser_enabled()
        return logits * (1 + 2 ** -10) if fused else logits

    monkeypatch.setattr(model_module, "_fuses", lambda device_type: fuses and torch._C._jit_texpr_fuser_enabled())
    model = with_head_then(traced, rounds_otherwise_when_fused)
    assert torch._C._jit_texpr_fuser_enabled()
    try:
        model._scores = model._trace()
        assert torch._C._jit_texpr_fuser_enabled() is not fuses
    finally:
        torch._C._jit_set_texpr_fuser_enabled(True)
    if not fuses:
        assert model._scores is None and "differs from eager PyTorch" in (model.forward_note or "")
        return
    assert model._scores is not None
    model._batch = model._batch_graph()
    batch = items(model)
    a, b = model.forward(batch), traced.forward(batch)
    assert torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)


# Run in a fresh process: loading leaves no thread behind (see load_model's docstring). Had the forward
# passes of the load run on the caller's thread, its OpenMP pool would outlive the load, and the model
# thread's own pool would then run in GNU OpenMP's throttled mode.
LEAVES_NO_THREAD = """
import os, sys, time
import torch
from fillmask_server.loading import load_model
before = len(os.listdir("/proc/self/task"))
model = load_model(sys.argv[1])
if torch.get_num_threads() < 2:  # one torch thread: no worker pool to leave behind, nothing to test
    print("skip")
    sys.exit(0)
for _ in range(100):  # the loader's OpenMP workers end a moment after the loader thread
    after = len(os.listdir("/proc/self/task"))
    if after <= before:
        break
    time.sleep(0.05)
print(before, after)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_loading_leaves_no_thread_behind(tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LEAVES_NO_THREAD, str(tiny_model_dir)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "skip":
        pytest.skip("torch runs one thread here: no OpenMP worker pool to leave behind")
    before, after = map(int, done.stdout.split())
    assert after <= before, (before, after)


def test_a_batch_without_targets_is_one_call_into_torch(traced: FillMaskModel, eager: FillMaskModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor is made, and no operator called, from Python: each such call gives the GIL up and must
    win it back, and tensors made in Python take it again inside the graph (graph.py). The one call
    builds its inputs from lists, so ``torch.tensor`` and the tensor methods are never reached."""
    batch = [Item(ids, 5) for ids in traced.tokenize(TEXTS)]
    expected = traced.forward(batch)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a torch operator called from Python in the forward pass")

    for name in ("tensor", "as_tensor", "arange", "zeros", "ones", "full", "stack", "cat"):
        monkeypatch.setattr(torch, name, refuse)
    for name in ("topk", "to", "cpu", "__getitem__", "view", "long", "softmax", "float"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = traced.forward(batch)
    assert torch.equal(got.values, expected.values) and torch.equal(got.indices, expected.indices)
    with pytest.raises(AssertionError, match="from Python"):  # the check bites: eager runs operators
        eager.forward(batch)


def test_the_scripted_batch_gives_the_bits_of_the_same_module_unscripted(traced: FillMaskModel) -> None:
    """Texts of different lengths, padded (the attention mask is built from lengths inside the call) and
    packed (built from each token's text), several masks, every call a few times over (the profiling
    executor optimises after its first runs); and the load-time check that would keep the unscripted
    module if the bits differed does catch it."""
    from fillmask_server import graph

    assert isinstance(traced._batch, torch.jit.ScriptModule) and traced.pack_width
    plain = graph.BatchGraph(traced._scores, "cpu", traced._packed_scores)
    batch = items(traced)
    width = max(len(item.input_ids) for item in batch)
    ids = [t for item in batch for t in [*item.input_ids, *[traced.pad_token_id] * (width - len(item.input_ids))]]
    masks = [(n, c) for n, item in enumerate(batch) for c, t in enumerate(item.input_ids) if t == traced.mask_token_id]
    args = padded_args = (ids, [len(item.input_ids) for item in batch], [n for n, _ in masks], [c for _, c in masks],
                          width, 7, [7 - n % 2 for n, _ in masks], True, [], [])
    with torch.inference_mode():
        want = plain(*args)
        for _ in range(4):
            got = traced._batch(*args)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert traced._differs(traced._batch, plain) is None
    # Packed rows: the mask of which token attends to which is built inside the scripted call.
    lengths = [len(item.input_ids) for item in batch]
    rows = batching.layout(lengths, traced.pack_width)
    assert rows is not None and len(rows) < len(batch)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids, segments, places, starts = [], [], [], {}
    for r, row in enumerate(rows):
        used = 0
        for segment, i in enumerate(row):
            starts[i] = (r, used)
            ids += batch[i].input_ids
            segments += [segment] * lengths[i]
            places += range(lengths[i])
            used += lengths[i]
        ids += [traced.pad_token_id] * (width - used)
        segments += [-1] * (width - used)
        places += [0] * (width - used)
    at = [(starts[n][0], starts[n][1] + c) for n, c in masks]
    args = (ids, [], [r for r, _ in at], [c for _, c in at], width, 7, [7 - n % 2 for n, _ in masks], True,
            segments, places)
    with torch.inference_mode():
        want = plain(*args)
        for _ in range(4):
            got = traced._batch(*args)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert torch.allclose(want[1], traced._batch(*padded_args)[1], atol=1e-6)  # packed gives padded's answers

    def off_by_a_bit(*call: Any) -> Any:
        probs, values, indices = traced._batch(*call)
        return probs, torch.nextafter(values, values + 1), indices

    assert "differs" in (traced._differs(off_by_a_bit, plain) or "")


@pytest.mark.parametrize("forward", ["traced", "eager"])
def test_a_requests_answer_among_equal_scores_does_not_depend_on_the_top_k_of_its_batch(
        tiny_model_dir: Path, tmp_path: Path, forward: str) -> None:
    """Found by a differential run: the top-k ran once at the batch's largest ``top_k`` and was cut per
    request, and torch orders equal scores differently at different ``k`` (the pipeline's own ``top_k``
    1 answer is not the first of its ``top_k`` 100 one), so a ``top_k`` 1 request batched beside a
    ``top_k`` 100 one got another of the tied tokens than it gets at its own ``k``, as the pipeline
    takes it. Twenty tokens with no output weights and a large bias tie for first place here. The
    same rows run with other ``top_k`` beside them must give each request the answer it gets when
    every row has its ``top_k``."""
    import shutil

    from transformers import AutoModelForMaskedLM

    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    mlm = AutoModelForMaskedLM.from_pretrained(tied)
    head = mlm.get_output_embeddings()
    with torch.no_grad():
        head.weight[500:520] = 0.0
        head.bias[500:520] = 30.0
    mlm.save_pretrained(tied)
    model = load_model(str(tied), forward=forward)
    a, b, c = model.tokenize(["The old farmer bought a [MASK] bicycle.", "[MASK] went home [MASK].", "A [MASK] day."])
    targets = model.target_ids(tuple(f"[unused{n}]" for n in range(10)))
    mixed = [Item(a, 100), Item(a, 1), Item(b, 3), Item(c, 20), Item(b, 1), Item(a, 7, targets)]
    top = model.forward(mixed)
    (_, wide, wide_tokens), (_, _, narrow_tokens) = top.candidates(0, mixed[0]), top.candidates(1, mixed[1])
    assert len(set(wide[0][:20])) == 1 and set(wide_tokens[0][:20]) == set(range(500, 520))  # the tie
    if narrow_tokens[0][0] == wide_tokens[0][0]:
        pytest.skip("this torch orders equal scores alike at every k: the case in point cannot arise")
    for i, item in enumerate(mixed):
        alike = model.forward([Item(other.input_ids, item.top_k, other.target_ids) for other in mixed])
        assert top.candidates(i, item) == alike.candidates(i, item), (i, item.top_k)


# --- any family, any vocabulary: the head at the masks and the traced graph, or the reason why not ---------

RESIDUES = "ACDEFGHIKLMNPQRSTVWY"


def residue_model(positions: int = 16) -> tuple[Any, Any]:
    """An AntiBERTy-like BERT built in memory: 25 tokens (5 special, 20 amino acids), ``positions`` positions."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *RESIDUES]
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(tokens)}, do_lower_case=False,
                              model_max_length=positions)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions, initializer_range=0.2)
    return tokenizer, BertForMaskedLM(config).eval()


def test_a_vocabulary_of_25_tokens_and_16_positions_gets_the_traced_graph_and_the_head_at_the_masks() -> None:
    """Check inputs come from the tokenizer's own ordinary ids and fit the position table (a protein
    model once lost its traced graph: ids were drawn from 1000..2000, and checks were 40 tokens long)."""
    from transformers import pipeline

    tokenizer, model = residue_model()
    fill = FillMaskModel("residues", tokenizer, model, "cpu", "float32")
    assert fill.engine_facts() == {"forward": "traced", "head": "masks", "layout": "packed", "device": "cpu",
                                   "dtype": "float32"}
    assert (fill.head_note, fill.forward_note, fill.max_tokens) == (None, None, 16)
    text = "E V Q L [MASK] E S G G"
    expected = pipeline("fill-mask", model=model, tokenizer=tokenizer, device="cpu")(text, top_k=5)
    got = fill.forward([Item(fill.tokenize([text])[0], 5)])
    assert got.indices[0].tolist() == [p["token"] for p in expected]
    assert got.values[0].tolist() == pytest.approx([p["score"] for p in expected], abs=1e-6)


@pytest.mark.parametrize("positions", [3, 5, 16])
def test_the_start_up_batch_passes_on_any_position_table(positions: int) -> None:
    """The batch every load runs last (``fails_a_batch``) uses only texts the table takes, so a model with
    room for one masked token and its two special tokens is served, not refused."""
    tokenizer, model = residue_model(positions)
    assert FillMaskModel("residues", tokenizer, model, "cpu", "float32").fails_a_batch() is None


@pytest.mark.parametrize(("tokenizer_limit", "limit", "source"), [
    (8, 8, "its tokenizer's limit"),
    (16, 16, "its tokenizer's limit"),  # a tie: the tokenizer's, the file a user would edit
    (int(1e30), 16, "the positions it has room for"),  # a tokenizer with no limit of its own
    (40, 16, "the positions it has room for"),
])
def test_a_text_too_long_is_told_the_limit_and_whose_it_is(tokenizer_limit: int, limit: int, source: str) -> None:
    """A trial's find: DeBERTa, ModernBERT and ESM refuse texts the pipeline answers, and the refusal said
    "accepts at most N" without saying whose N: the tokenizer's, or the model's positions (in words a
    client can read: no file or key names, §7)."""
    from fillmask_server.intake import Refusal, check
    from fillmask_server.protocol import FillMaskRequest

    tokenizer, model = residue_model(positions=16)
    tokenizer.model_max_length = tokenizer_limit
    fill = FillMaskModel("residues", tokenizer, model, "cpu", "float32")
    assert fill.max_tokens == limit
    text = "[MASK] " + "E " * limit
    refusal = check(fill, FillMaskRequest(1, text, 5), fill.tokenize([text])[0], 8, 1 << 20)
    assert isinstance(refusal, Refusal) and refusal.code == "text_too_long"
    assert refusal.message.endswith(f"is {limit + 3} tokens long; this model accepts at most {limit} ({source}); "
                                    "shorten it")


def test_roberta_style_positions_leave_out_those_before_the_padding_index() -> None:
    """RoBERTa's position ids start after its padding index (1), so a table of 18 takes 16 tokens; a
    tokenizer saying 18 (as RoBERTa's say 514 for 512) is held to that (a review: nothing tested it)."""
    from types import SimpleNamespace

    from transformers import RobertaConfig, RobertaForMaskedLM

    from fillmask_server.model import _max_tokens

    config = RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=18, pad_token_id=1)
    model = RobertaForMaskedLM(config).eval()
    assert _max_tokens(SimpleNamespace(model_max_length=int(1e30)), model) == (16, "positions")
    assert _max_tokens(SimpleNamespace(model_max_length=18), model) == (16, "positions")
    assert _max_tokens(SimpleNamespace(model_max_length=12), model) == (12, "tokenizer")


#: The families whose positions are not looked up in a table (relative, rotary): no position overruns one.
WITHOUT_A_POSITION_TABLE = {"deberta-v2", "modernbert", "esm"}


@pytest.mark.parametrize("family", ["albert", "bert", "deberta-v2", "distilbert", "electra", "esm", "modernbert",
                                    "roberta", "xlm-roberta"])
def test_whose_limit_it_is_follows_whether_the_model_has_a_position_table(family: str) -> None:
    """A model with a table has room for its positions; one without (DeBERTa-v3's relative positions,
    ModernBERT's and ESM-2's rotary ones) runs a longer text, and is held to the length it declares.
    The refusal called that "the positions it has room for", which is not so for them."""
    from types import SimpleNamespace

    from transformers import AutoModelForMaskedLM

    from fillmask_server.checkpoint import ensure_family
    from fillmask_server.model import _max_tokens

    directory = ensure_family(family, Path(__file__).resolve().parent.parent / "models" / "families")
    model = AutoModelForMaskedLM.from_pretrained(directory).eval()
    limit, source = _max_tokens(SimpleNamespace(model_max_length=int(1e30)), model)
    assert source == ("declared" if family in WITHOUT_A_POSITION_TABLE else "positions")
    assert limit <= model.config.max_position_embeddings
    longer = torch.full((1, model.config.max_position_embeddings + 8), 5)
    if family in WITHOUT_A_POSITION_TABLE:  # (what makes "the positions it has room for" untrue of it)
        with torch.no_grad():
            assert model(input_ids=longer).logits.shape[1] == longer.shape[1]
    else:
        with pytest.raises((IndexError, RuntimeError)), torch.no_grad():  # (each family words its own)
            model(input_ids=longer)


def test_a_text_too_long_for_a_model_without_a_position_table_is_told_the_length_it_was_made_for(
        tmp_path: Path) -> None:
    """ESM's rotary positions, its tokenizer without a limit of its own, config.json declaring 12."""
    import json
    import shutil

    from fillmask_server.checkpoint import ensure_family
    from fillmask_server.intake import Refusal, check
    from fillmask_server.protocol import FillMaskRequest

    directory = tmp_path / "esm"
    shutil.copytree(ensure_family("esm", Path(__file__).resolve().parent.parent / "models" / "families"), directory)
    for name, key, value in [("config.json", "max_position_embeddings", 12), ("tokenizer_config.json",
                                                                            "model_max_length", None)]:
        data = json.loads((directory / name).read_text())
        data.pop(key) if value is None else data.__setitem__(key, value)
        (directory / name).write_text(json.dumps(data))
    fill = load_model(str(directory), announce=False)
    assert (fill.max_tokens, fill.max_tokens_source) == (12, "declared")
    text = "<mask> " + "L " * 12
    refusal = check(fill, FillMaskRequest(1, text, 5), fill.tokenize([text])[0], 8, 1 << 20)
    assert isinstance(refusal, Refusal) and refusal.code == "text_too_long"
    assert refusal.message.endswith("is 15 tokens long; this model accepts at most 12 (the length it was made "
                                    "for); shorten it"), refusal.message


#: Four texts of different lengths that ``batching.layout`` packs into rows of 64 tokens.
RESIDUE_TEXTS = ["E V [MASK] L", "[MASK] V Q L Q E S G G [MASK] L", "Q [MASK] S", "E V Q L Q E S G G G L V Q [MASK] G"]


def bfloat16_residues_with(change: Callable[[Any, Any], None]) -> tuple[Any, Any]:
    """``residue_model(64)``'s tokenizer and a bfloat16 copy whose encoder passes each output, with the
    attention mask it was given, through ``change`` (which may alter the output, or raise)."""
    tokenizer, model = residue_model(positions=64)
    half = copy.deepcopy(model).to(torch.bfloat16)
    bert = half.bert
    own = bert.forward

    def changed(*args: Any, attention_mask: Any = None, position_ids: Any = None, **kwargs: Any) -> Any:
        output = own(*args, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        change(output, attention_mask)
        return output

    bert.forward = changed
    return tokenizer, half


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (``torch.equal`` takes -0.0 for 0.0)."""
    return tensor.contiguous().view(torch.uint8) if tensor.is_floating_point() else tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_reduced_dtype_packs_where_float32_does_and_keeps_its_weights_bit_for_bit(dtype: torch.dtype) -> None:
    """In a reduced dtype rounding moves logits as far as a wrong position would: the check runs in
    float32 on the same weights, then packed rows in the dtype must be no further from float32's logits
    than padded rows are. Afterwards every tensor is what it was, bits and dtype, a float32 one among
    reduced ones too; and a packed batch gives what the same texts give padded."""
    tokenizer, model = residue_model(positions=64)
    half = copy.deepcopy(model).to(dtype)
    half.register_buffer("kept", torch.linspace(0, 1, 7))  # a float32 tensor the model keeps as it is
    half.register_buffer("wide", torch.linspace(0, 1, 7, dtype=torch.float64) / 3)  # float64: not touched either
    before = {name: tensor.clone() for name, tensor in half.state_dict().items()}
    fill = FillMaskModel("residues", tokenizer, half, "cpu", str(dtype).removeprefix("torch."))
    assert (fill.engine_facts()["layout"], fill.packing_note, fill.pack_width) == ("packed", None, PACK_WIDTH)
    after = half.state_dict()
    assert before.keys() == after.keys()
    assert all(after[name].dtype == old.dtype and torch.equal(bits(after[name]), bits(old))
               for name, old in before.items())
    assert not any(tensor.is_inference() for tensor in after.values())  # plain tensors, as loaded
    ids = fill.tokenize(RESIDUE_TEXTS)
    assert batching.layout([len(row) for row in ids], fill.pack_width) is not None  # the batch is packed
    batch = [Item(row, 5) for row in ids]
    packed = fill.forward(batch)
    fill.pack_width = 0
    padded = fill.forward(batch)
    assert packed.values.shape == padded.values.shape
    assert torch.allclose(packed.values, padded.values, atol=2e-2)


@pytest.mark.parametrize("fault", ["moved", "not finite"])
def test_a_kernel_that_fails_packed_rows_only_in_the_reduced_dtype_keeps_them_padded(fault: str) -> None:
    """The float32 check passes, but this encoder, given a 4-d mask in bfloat16, moves its hidden states
    (as a kernel broken for that dtype might) or makes them NaN: the rows stay padded, and the note gives
    both distances from float32's logits."""
    def broken_when_packed_in_bfloat16(output: Any, attention_mask: Any) -> None:
        hidden = output.last_hidden_state
        if attention_mask is not None and attention_mask.dim() == 4 and hidden.dtype == torch.bfloat16:
            output.last_hidden_state = hidden.roll(1, dims=1) if fault == "moved" else hidden * float("nan")

    tokenizer, half = bfloat16_residues_with(broken_when_packed_in_bfloat16)
    fill = FillMaskModel("residues", tokenizer, half, "cpu", "bfloat16")
    assert fill.engine_facts()["layout"] == "padded" and fill.pack_width == 0
    assert fill.packing_note is not None and fill.packing_note.startswith("packed rows in bfloat16 are ")
    assert ", padded rows " in fill.packing_note


def test_rounding_as_coarse_as_a_fault_keeps_rows_padded() -> None:
    """Where a dtype's rounding alone moves logits about as far as packed rows with no mask at all (every
    token attending to the whole row) do, the check could not tell a fault from rounding: padded, and the
    note gives both distances. (Here the encoder's hidden states come out scrambled in bfloat16, padded
    or packed alike: rounding at its worst.)"""
    def coarse_in_bfloat16(output: Any, attention_mask: Any) -> None:
        if output.last_hidden_state.dtype == torch.bfloat16:
            output.last_hidden_state = output.last_hidden_state.flip(-1)

    tokenizer, half = bfloat16_residues_with(coarse_in_bfloat16)
    fill = FillMaskModel("residues", tokenizer, half, "cpu", "bfloat16")
    assert fill.engine_facts()["layout"] == "padded" and fill.pack_width == 0
    assert fill.packing_note is not None
    assert fill.packing_note.startswith("rounding in bfloat16 moves this model's logits too far to check packed rows")


def test_running_out_of_memory_in_the_float32_check_says_so_and_puts_the_weights_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """The float32 weights of a reduced dtype's check may not fit (a large model on a full GPU): the note
    says so rather than blaming the model, the rows stay padded, and every tensor is bfloat16 again. The
    padding check, also in float32, says it could not run, and batches mix lengths as for most models."""
    def out_of_memory_in_float32(output: Any, attention_mask: Any) -> None:
        if output.last_hidden_state.dtype == torch.float32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    tokenizer, half = bfloat16_residues_with(out_of_memory_in_float32)
    with caplog.at_level("WARNING", logger="fillmask_server.model"):
        fill = FillMaskModel("residues", tokenizer, half, "cpu", "bfloat16")
    assert fill.engine_facts()["layout"] == "padded" and not fill.one_length
    assert any(record.getMessage().startswith("not enough memory to check in float32 whether padding changes")
               for record in caplog.records)
    assert fill.packing_note == ("not enough memory to check packed rows against float32 (CUDA out of memory. "
                                 "Tried to allocate 2.00 GiB)")
    assert {tensor.dtype for tensor in half.state_dict().values() if tensor.is_floating_point()} == {torch.bfloat16}


def test_int8_packs_when_checked_against_the_float32_model_it_was_quantised_from() -> None:
    """Dynamic quantisation cannot be undone for the check: it reads the float32 original instead (and
    keeps no reference to it: the server does not hold two models). Without the original, padded."""
    import gc
    import weakref

    from fillmask_server.loading import _quantize_dynamic

    tokenizer, model = residue_model(positions=64)
    quantized = _quantize_dynamic(model)  # a copy: the original is left as it was
    fill = FillMaskModel("residues", tokenizer, quantized, "cpu", "int8", unquantized=model)
    assert (fill.engine_facts()["layout"], fill.packing_note) == ("packed", None)
    assert fill.forward([Item(row, 5) for row in fill.tokenize(RESIDUE_TEXTS)]).values.shape == (5, 5)
    original = weakref.ref(model)
    del model
    gc.collect()
    assert original() is None
    alone = FillMaskModel("residues", tokenizer, quantized, "cpu", "int8")
    assert alone.engine_facts()["layout"] == "padded"
    assert alone.packing_note == ("packed rows in int8 are checked against the float32 model it was quantised "
                                  "from, not given here")


def test_packed_rows_need_a_model_that_takes_a_mask_of_which_token_attends_to_which() -> None:
    """A model that builds its attention from a 2-d mask itself fails the check: padded, with why."""
    tokenizer, model = residue_model()
    bert = model.bert
    own = bert.forward

    def two_dimensional_only(*args: Any, attention_mask: Any = None, position_ids: Any = None, **kwargs: Any) -> Any:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be 2-d")
        return own(*args, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    bert.forward = two_dimensional_only
    fill = FillMaskModel("residues", tokenizer, model, "cpu", "float32")
    assert fill.engine_facts()["layout"] == "padded" and fill.head_mode == "masks"
    assert fill.packing_note == ("the model does not take a mask of which token attends to which "
                                 "(given one, it raised: attention_mask must be 2-d)")
    texts = ["E V [MASK] L", "[MASK] V Q L Q E S G G [MASK] L"]
    assert fill.forward([Item(ids, 3) for ids in fill.tokenize(texts)]).values.shape == (3, 3)


def test_an_attention_with_a_local_window_keeps_padded_rows() -> None:
    """ModernBERT builds a window mask per layer from the 2-d mask; a 4-d one given replaces it, which
    shows only on texts longer than the window (a real checkpoint's 128 passed a check of short texts)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    tokenizer, _ = residue_model(positions=512)
    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=25, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=512, local_attention=128,
                              pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
    model = ModernBertForMaskedLM(config).eval()
    fill = FillMaskModel("windowed", tokenizer, model, "cpu", "float32")
    assert fill.engine_facts()["layout"] == "padded"
    assert fill.packing_note == "the model's attention has a local window (local_attention = 128)"


def test_a_head_that_is_not_per_position_runs_the_full_model_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """The load-time check compares the head on the encoder's output with the model's own forward pass:
    a head that mixes positions fails it, and the server runs the whole model (still traced), correctly."""
    tokenizer, model = residue_model()
    own_head = model.cls

    class Mixing(torch.nn.Module):  # each position's logits depend on the mean of its sequence
        def __init__(self) -> None:
            super().__init__()
            self.inner = own_head

        def forward(self, hidden: Any) -> Any:
            return self.inner(hidden + hidden.mean(dim=1, keepdim=True))

    model.cls = Mixing()
    with caplog.at_level("WARNING", logger="fillmask_server.model"):
        fill = FillMaskModel("mixing", tokenizer, model, "cpu", "float32")
    assert fill.engine_facts()["head"] == "full" and fill.forward_mode == "traced"
    assert fill.head_note is not None and "differs from the model's own forward pass" in fill.head_note
    # Its mean runs over the padding too, so a text's answer depends on what it is batched with: one
    # length a batch (and no packed rows, where it would mix the texts that share a row).
    assert fill.engine_facts()["layout"] == "one_length" and fill.pack_width == 0
    assert fill.padding_note is not None and fill.padding_note.startswith("padding changes this model's answers")
    assert any("running the full model" in record.getMessage() for record in caplog.records)
    texts = ["E V [MASK] L", "[MASK] V Q L Q E S G G [MASK] L"]
    ids = fill.tokenize(texts)
    got = fill.forward([Item(row, 5) for row in ids])
    width = max(map(len, ids))  # the model's own forward pass on the same padded batch
    padded = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    with torch.inference_mode():
        logits = model(input_ids=padded, attention_mask=attention).logits
    expected = logits[padded == tokenizer.mask_token_id].softmax(-1).topk(5)
    assert torch.equal(got.indices, expected.indices)
    assert torch.allclose(got.values, expected.values, atol=1e-6)


def test_a_forward_pass_that_gives_other_bits_once_keeps_the_head_at_the_masks(
        caplog: pytest.LogCaptureFixture) -> None:
    """Seen on ALBERT (1 start in 10 to 40, whole rows off by about 1e-4): the model's own first forward
    pass of a process gave other bits than every later pass on the same input, and the bit-for-bit head
    check sent the server to the full head for its whole life. A mismatch is now tried again; a head that
    reads more than the encoder's output (the test above) still fails every try."""
    tokenizer, model = residue_model()
    own_forward = model.forward
    perturbed: list[int] = []

    def first_pass_differs(*args: Any, **kwargs: Any) -> Any:
        output = own_forward(*args, **kwargs)
        if "attention_mask" in kwargs and not perturbed:  # the whole model on the check inputs, once
            perturbed.append(1)
            output.logits[0, 0] += 1e-4
        return output

    model.forward = first_pass_differs
    with caplog.at_level("INFO", logger="fillmask_server.model"):
        fill = FillMaskModel("flaky-first-pass", tokenizer, model, "cpu", "float32")
    assert perturbed and fill.head_note is None and fill.engine_facts()["head"] == "masks"
    assert any("matched on try 2" in record.getMessage() for record in caplog.records)


def test_the_start_up_line_names_the_path_and_a_home_link_loads_under_its_own_name(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A model-bringer's trial: ``FILLMASK_MODEL='~/models/current'`` (no shell to expand it) passed the
    directory check, then transformers took it for a Hub id and the load failed blaming the files; and
    ``hello`` named a linked directory by its target's name (``bert-2026-12-01``, not ``current``)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "current").symlink_to(tiny_model_dir)
    with caplog.at_level("INFO", logger="fillmask_server.loading"):
        load_model("~/models/current", "cpu", forward="eager")
    assert any(record.getMessage().endswith("on cpu (float32): forward eager, head at the masks")
               for record in caplog.records), [record.getMessage() for record in caplog.records]
    assert [model_display_name(name) for name in ("~/models/current", f"{tmp_path}/models/current/",
                                                  str(tiny_model_dir))] == ["current", "current", "tiny"]


def test_a_checkpoint_saved_as_a_decoder_is_served_with_a_warning_that_says_so(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model-bringer's trial: a BERT saved with ``is_decoder: true`` attends left to right, so a mask
    never sees the words after it; transformers' own warning is silenced with its logger, so nothing
    said so."""
    import json
    import shutil

    directory = tmp_path / "decoder"
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    with caplog.at_level("WARNING", logger="fillmask_server.loading"):
        model = load_model(str(directory), "cpu", forward="eager")
    said = [record.getMessage() for record in caplog.records if "is_decoder" in record.getMessage()]
    assert len(said) == 1 and "a mask sees none of the words after it" in said[0], said
    before = model.forward([Item(model.tokenize(["the [MASK] sat on the mat ."])[0], 3)])
    after = model.forward([Item(model.tokenize(["the [MASK] is red , blue and green today ."])[0], 3)])
    # Left to right: what follows the mask changes nothing.
    assert before.indices.tolist() == after.indices.tolist() and torch.allclose(before.values, after.values)


def test_a_pass_whose_scores_are_nan_on_some_inputs_is_traced_where_the_graph_gives_the_same_nan() -> None:
    """A model-bringer's trial: a model whose scores were NaN on long inputs (NaN in a position row) was
    run eager, the log blaming the traced graph ("differs from eager PyTorch on inputs of 2 x 512
    tokens"): NaN is not equal to NaN. The same NaN traced as eager is the same bits; other values,
    or NaN in other places, still differ."""

    class Scores(torch.nn.Module):
        def __init__(self, nan_from: int) -> None:
            super().__init__()
            self.nan_from = nan_from

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.where(ids >= self.nan_from, torch.full_like(ids, float("nan"), dtype=torch.float),
                               ids.float() / 7)

    def check(rows: int, width: int, *_: Any, **__: Any) -> tuple[torch.Tensor]:
        return (torch.arange(rows * width).reshape(rows, width),)

    shapes = [(2, 8, 0, 1), (2, 64, 0, 1)]
    assert FillMaskModel._traced_and_checked(Scores(100), check, shapes, 1)[1] is None  # NaN in the long one
    assert FillMaskModel._traced_and_checked(Scores(10_000), check, shapes, 1)[1] is None

    class Moved(Scores):  # traced with NaN from 100, run eager with NaN from 101: another bit pattern
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = super().forward(ids)
            self.nan_from += 1
            return out

    assert "differs from eager PyTorch on inputs of 2 x 64" in FillMaskModel._traced_and_checked(
        Moved(100), check, shapes, 1)[1]
    from fillmask_server.model import _same_bits

    nan, inf = float("nan"), float("inf")
    assert _same_bits(torch.tensor([nan, inf, 1.0]), torch.tensor([nan, inf, 1.0]))
    assert not _same_bits(torch.tensor([inf]), torch.tensor([torch.finfo(torch.float32).max]))
    assert not _same_bits(torch.tensor([nan, 1.0]), torch.tensor([1.0, nan]))


def test_deberta_v2_with_its_newer_head_gets_the_head_at_the_masks() -> None:
    """``legacy=False``: DeBERTa-v2's ``lm_predictions`` takes the word embeddings as a second argument, so
    no single submodule is the head; running the model's own forward after the encoder finds it all the same."""
    from transformers import AutoConfig, AutoTokenizer, DebertaV2ForMaskedLM, pipeline

    from fillmask_server.checkpoint import ensure_family

    directory = ensure_family("deberta-v2", Path(__file__).resolve().parent.parent / "models" / "families")
    config = AutoConfig.from_pretrained(directory)
    config.legacy = False
    torch.manual_seed(0)
    model = DebertaV2ForMaskedLM(config).eval()
    assert not hasattr(model, "cls") and hasattr(model, "lm_predictions")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    fill = FillMaskModel("deberta-v3-like", tokenizer, model, "cpu", "float32")
    assert fill.engine_facts()["head"] == "masks" and fill.forward_mode == "traced"
    text = "The old farmer bought a [MASK] bicycle in the morning."
    expected = pipeline("fill-mask", model=model, tokenizer=tokenizer, device="cpu")(text, top_k=5)
    got = fill.forward([Item(fill.tokenize([text])[0], 5)])
    assert got.indices[0].tolist() == [p["token"] for p in expected]


def test_a_family_checkpoint_has_the_shape_asked_for_and_only_that_shape_is_reused(tmp_path: Path) -> None:
    """``--family-shape small`` (the benchmark's compute-bound family run): the width and depth asked for,
    the same fast path, and a cache of one shape never passes for the other."""
    from transformers import AutoConfig

    from fillmask_server.checkpoint import FAMILY_SHAPES, ensure_family, is_family_checkpoint

    small = ensure_family("bert", tmp_path, shape="small")
    config = AutoConfig.from_pretrained(small)
    shape = FAMILY_SHAPES["small"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        shape["hidden"], shape["layers"], shape["intermediate"])
    assert is_family_checkpoint(small, "small") and not is_family_checkpoint(small, "tiny")
    model = load_model(str(small))
    assert model.engine_facts()["head"] == "masks" and model.forward_mode == "traced"
    tiny = ensure_family("bert", tmp_path, shape="tiny")  # replaces the small one in the same place
    assert AutoConfig.from_pretrained(tiny).hidden_size == FAMILY_SHAPES["tiny"]["hidden"]


def test_the_base_family_shape_gives_electra_a_generator_of_electra_base_generators_proportions() -> None:
    """``--family-shape base``: BERT-base's width and depth; ELECTRA's generator is narrower than its
    embeddings (256 over 768, heads of 64), as electra-base-generator is, not twice as wide as the others
    (the tiny and small shapes keep that)."""
    from fillmask_server.checkpoint import FAMILY_SHAPES, _family_config

    vocab = type("Vocab", (), {"__len__": lambda self: 1000, "pad_token_id": 0})()  # a tokenizer's two facts used
    widths = {key: value for key, value in FAMILY_SHAPES["base"].items() if key != "real_vocab"}
    base = _family_config("electra", vocab, **widths)
    assert (base.embedding_size, base.hidden_size, base.intermediate_size, base.num_attention_heads,
            base.num_hidden_layers) == (768, 256, 1024, 4, 12)
    bert = _family_config("bert", vocab, **widths)
    assert (bert.hidden_size, bert.intermediate_size, bert.num_hidden_layers) == (768, 3072, 12)
    tiny = _family_config("electra", vocab, **FAMILY_SHAPES["tiny"])
    assert (tiny.embedding_size, tiny.hidden_size, tiny.intermediate_size) == (32, 64, 128)


@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert", "xlm-roberta", "albert"])
def test_a_vocabulary_padded_to_a_real_size_splits_every_text_as_before(family: str, tmp_path: Path) -> None:
    """The base shape's tokenizers (``_pad``: WordPiece, byte-level BPE with and without a template,
    Unigram, lower-cased Unigram) have the size asked for, and split texts without fillers into the same tokens as the
    trained ones; the fillers decode to themselves."""
    from fillmask_server.checkpoint import _family_tokenizer

    trained = _family_tokenizer(family, tmp_path / "trained")
    padded = _family_tokenizer(family, tmp_path / "padded", 5000)
    assert len(padded) == 5000 and len(trained) < 5000
    texts = ["The old man lived by the river, 42 times!", "Ünïcode — and ** odd  spacing"]
    if family in ("roberta", "modernbert"):
        texts.append("zq12 zq 12")  # BPE has no merge that makes a filler (WordPiece and Unigram match them)
    for text in texts:
        tokens = [t.convert_ids_to_tokens(t(f"{text} {t.mask_token}")["input_ids"]) for t in (trained, padded)]
        assert tokens[0] == tokens[1]
    assert padded.decode([4999]).strip().endswith(f"zq{4999 - len(trained)}")


def test_a_cached_base_family_checkpoint_of_another_vocabulary_size_is_not_reused(tmp_path: Path) -> None:
    """The base shape's cache check wants the family's real vocabulary size, taken from the family named
    or else the directory's name: a checkpoint of the trained size (the shape before real vocabularies)
    is rebuilt, not reused."""
    import json

    from fillmask_server.checkpoint import (
        FAMILY_KEY,
        FAMILY_REAL_VOCAB,
        FAMILY_SHAPE_KEY,
        FAMILY_VERSION,
        is_family_checkpoint,
    )

    def fake(directory: Path, vocab_size: int, family: str | None = None) -> Path:
        directory.mkdir()
        config = {FAMILY_KEY: FAMILY_VERSION, FAMILY_SHAPE_KEY: "base", "vocab_size": vocab_size,
                  "model_type": family or directory.name}
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "model.safetensors").write_bytes(b"")
        (directory / "tokenizer_config.json").write_text("{}")
        (directory / "tokenizer.json").write_text("{}")
        return directory

    assert is_family_checkpoint(fake(tmp_path / "roberta", FAMILY_REAL_VOCAB["roberta"]), "base")
    assert not is_family_checkpoint(fake(tmp_path / "bert", 1000), "base")
    elsewhere = fake(tmp_path / "x", FAMILY_REAL_VOCAB["xlm-roberta"], "xlm-roberta")
    assert is_family_checkpoint(elsewhere, "base", "xlm-roberta") and not is_family_checkpoint(elsewhere, "base")


# --- checkpoints that cannot be served are refused at start-up, in one line (found by an adversarial run) ----


def odd_bert(tmp_path: Path, name: str, edit: Any) -> Path:
    """The tiny BERT family checkpoint, copied and changed by ``edit(tokenizer, model, directory)``."""
    import shutil

    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from fillmask_server.checkpoint import ensure_family

    directory = tmp_path / name
    shutil.copytree(ensure_family("bert", Path(__file__).resolve().parent.parent / "models" / "families"), directory)
    tokenizer, model = AutoTokenizer.from_pretrained(directory), AutoModelForMaskedLM.from_pretrained(directory)
    edit(tokenizer, model, directory)
    return directory


@pytest.mark.parametrize(("case", "expected"), [
    ("a mask token beyond the embeddings", "mask token '<newmask>' is id 1000, but the model has token embeddings "
                                           "for ids 0 to 999 only"),
    ("a pad token beyond the embeddings", "pad token '<newpad>' is id 1000"),
    ("an encoder without its head", "has no weights for cls.predictions"),
    ("no token type embeddings", "fails on a batch of two short texts with a mask"),
    ("NaN weights", "has weights that are not numbers (NaN or infinite values) in "
                    "bert.encoder.layer.0.attention.self.query.weight: its answers would be scores that are not "
                    "numbers; use a checkpoint whose weights are all numbers"),
    ("no tokenizer files", "has a tokenizer of 5 special tokens and no others"),
    # A checkpoint audit: these said "check that its tokenizer and its weights belong together", and started.
    ("a float16 overflow", "has weights that are not numbers in float16, in bert.encoder.layer.0.intermediate.dense"
                           ".weight (beyond its range, or NaN in the checkpoint): use --dtype float32"),
    ("a model_max_length of 2", "accepts at most 2 tokens (its tokenizer's model_max_length), and a text of one "
                                "mask takes 3: no request could run; raise it in its tokenizer_config.json"),
])
def test_a_checkpoint_that_would_fail_every_request_is_refused_at_start_up(tmp_path: Path, case: str,
                                                                           expected: str) -> None:
    """Each of these started, said ready, and then answered every request (or every padded batch) with
    internal_error and a traceback, or (the encoder) with a head of random weights that changed at each
    start."""
    from transformers import BertConfig, BertForMaskedLM

    from fillmask_server.diagnosis import ModelLoadError

    def edit(tokenizer: Any, model: Any, directory: Path) -> None:
        if case == "a mask token beyond the embeddings":
            tokenizer.add_special_tokens({"mask_token": "<newmask>"})
        elif case == "a pad token beyond the embeddings":
            tokenizer.add_special_tokens({"pad_token": "<newpad>"})
        elif case == "an encoder without its head":
            model.bert.save_pretrained(directory)
            return
        elif case == "no tokenizer files":  # transformers 5 then makes a BertTokenizer of [PAD] .. [MASK]
            for path in directory.iterdir():
                if path.name.startswith(("tokenizer", "vocab", "special_tokens")):
                    path.unlink()
            return
        elif case == "NaN weights":
            with torch.no_grad():
                model.bert.encoder.layer[0].attention.self.query.weight.fill_(float("nan"))
            model.save_pretrained(directory)
            return
        elif case == "a float16 overflow":  # finite in float32 and bfloat16, past float16's 65,504
            with torch.no_grad():
                model.bert.encoder.layer[0].intermediate.dense.weight.mul_(1e5)
            model.save_pretrained(directory)
            return
        elif case == "a model_max_length of 2":
            tokenizer.model_max_length = 2
        else:
            config = BertConfig.from_pretrained(directory, type_vocab_size=0)
            BertForMaskedLM(config).save_pretrained(directory)
            return
        tokenizer.save_pretrained(directory)

    directory = odd_bert(tmp_path, "odd", edit)
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(directory), dtype="float16" if case == "a float16 overflow" else "float32")
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_a_tokenizer_longer_than_the_position_table_is_held_to_the_table(tmp_path: Path) -> None:
    """A tokenizer that says 128 tokens for a table of 64 let texts of 65..128 tokens through, and each
    failed with internal_error; the check at that length also took the traced graph away for all."""

    def edit(tokenizer: Any, model: Any, directory: Path) -> None:
        tokenizer.model_max_length = 128
        tokenizer.save_pretrained(directory)

    model = load_model(str(odd_bert(tmp_path, "long", edit)))
    assert model.max_tokens == 64 and model.engine_facts()["forward"] == "traced"


def test_a_token_the_tokenizer_knows_and_the_model_does_not_is_refused_per_request(tmp_path: Path) -> None:
    """Added tokens beyond the model's vocabulary reached the model: internal_error, a traceback, and the
    whole batch run again one request at a time. Now the request alone is refused, with §7's codes."""
    from fillmask_server.intake import Checked, Refusal, check
    from fillmask_server.items import TargetError
    from fillmask_server.protocol import FillMaskRequest

    def edit(tokenizer: Any, model: Any, directory: Path) -> None:
        tokenizer.add_tokens(["zzalpha"])
        tokenizer.save_pretrained(directory)

    model = load_model(str(odd_bert(tmp_path, "added", edit)))
    texts = ["the [MASK] zzalpha sat.", "the [MASK] sat."]
    ids = model.tokenize(texts)
    refused = check(model, FillMaskRequest(1, texts[0], 5), ids[0], 8, 1 << 20)
    assert isinstance(refused, Refusal) and refused.code == "invalid_field" and "zzalpha" in refused.message
    assert isinstance(check(model, FillMaskRequest(2, texts[1], 5), ids[1], 8, 1 << 20), Checked)
    targeted = check(model, FillMaskRequest(3, texts[1], 5, ("zzalpha",)), ids[1], 8, 1 << 20)
    assert isinstance(targeted, Refusal) and targeted.code == "invalid_targets" and "zzalpha" in targeted.message
    with pytest.raises(TargetError):
        model.target_ids(("zzalpha", "the"))


def test_the_attention_switch_leaves_one_kernel_and_a_cpu_load_leaves_torch_as_it_was(traced: FillMaskModel) -> None:
    """``_one_attention_kernel`` (which a load on CUDA calls) takes cuDNN's attention (a plan built per
    new shape, which a server's batches never stop taking) and FlashAttention (unmasked batches only, so
    eager and traced ran different kernels where a batch had no padding) out of torch's choices; a load
    on the CPU (the fixture's) leaves torch's settings as they were. (The CUDA branch itself runs only on
    a GPU: bench/gpu.py's new-shape probe and its trace note measure it there.)"""
    from fillmask_server.loading import _one_attention_kernel

    backends = torch.backends.cuda
    assert traced.device.type == "cpu" and backends.cudnn_sdp_enabled() and backends.flash_sdp_enabled()
    try:
        _one_attention_kernel()
        assert not backends.cudnn_sdp_enabled() and not backends.flash_sdp_enabled()
        assert backends.mem_efficient_sdp_enabled()
    finally:
        backends.enable_cudnn_sdp(True)
        backends.enable_flash_sdp(True)


def test_eager_passes_on_two_threads_at_once_each_get_their_own_answers(eager: FillMaskModel) -> None:
    """A review's find: the eager head ran the model's own ``forward`` with the encoder's ``forward``
    replaced on the shared module for the call, so two passes at once (the parts side by side that the
    calibration times and the engine runs) took each other's hidden states: an IndexError at start-up
    with ``--forward eager`` on two cores, or another text's answers. The replacement is now per thread."""
    import threading

    texts = {"short": "Paris is the [MASK] of France.",
             "long": "the [MASK] sat on the mat while the rain kept falling on the roof all night ."}
    items = {name: [Item(ids, 5) for ids in eager.tokenize([text] * 3)] for name, text in texts.items()}
    alone = {name: eager.forward(batch).values.tolist() for name, batch in items.items()}
    wrong: list[str] = []

    def run(name: str) -> None:
        for _ in range(60):
            try:
                got = eager.forward(items[name]).values.tolist()
            except Exception as exc:  # (the old replacement's IndexError, among others)
                wrong.append(f"{name}: {type(exc).__name__}")
                return
            if got != alone[name]:
                wrong.append(f"{name}: another text's answers")
                return

    threads = [threading.Thread(target=run, args=(name,)) for name in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
