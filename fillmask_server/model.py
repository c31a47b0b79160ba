"""The fill-mask model: tokenizing, and the batched forward pass whose top-k the decode stage turns
into exactly what the transformers pipeline returns, on the fastest path proved at load (the head at
the masks, packed rows, a traced graph). Loading it is ``loading``'s work; the values a batch is made
of are in ``items``.

``FillMaskModel`` is shared by stages with one owner each: the tokenizer stage calls ``tokenize`` and
``target_ids`` (the tokenizer), the model thread calls ``forward`` (torch), and the decode stage reads
nothing of it but ``decode_tokenizer``, its own copy of the tokenizer (a Rust tokenizer is not used from
two threads at once). ``forward`` computes what ``pipeline("fill-mask")`` computes for each text alone
(``transformers/pipelines/fill_mask.py``: softmax over the vocabulary at each mask, optional restriction
to target ids, top-k), with two differences in *how*:

- The encoder runs once per batch on padded inputs, and the MLM head only on the hidden states at
  mask positions, instead of on every position of every text (see "The head at the masks").
- Softmax runs once over all mask rows of the batch, and top-k once per distinct ``top_k`` among the
  requests without targets (at each request's own ``top_k``, as the pipeline: equal scores come out
  in the same order; ``graph.top_k_per_row``); a request with targets picks its own columns from the
  probabilities.

It returns the top-k as tensors (``TopK``); turning them into Python lists and strings is the decode stage's work
(``decode.py``), so that the model thread can start the next batch at once.

**Traced forward.** In eager PyTorch every operator releases the GIL and takes it back, hundreds of
times per forward pass; whenever another thread runs Python (the event loop, the decode stage) the
model thread waits for the GIL after each of them: with one torch thread, a tiny model's encoder pass
took many times as long while another thread ran Python (``bench/gil.py``; docs/performance-log.md,
"The benchmark"). So by default (``forward="traced"``) the encoder, the head at the masks and the
softmax run as one TorchScript graph: one call, one GIL hand-over per batch. The
graph is traced at load time and checked against eager PyTorch on several shapes, padding patterns
and mask counts; if tracing fails or any output differs by a single bit, the eager path is used.

**The output projection** (hidden states to the vocabulary, the head's widest product) runs in the
traced graph on oneDNN's packed kernel where the load measures it faster than torch's own and the
logits at the masks agree within rounding (``projection.py``, ``--projection``): the model object
keeps its own layer, so eager PyTorch (the checks' reference, and ``--forward eager``) runs the
model's code, and the traced graph is checked bit for bit against eager with the same kernel in place.

**The head at the masks.** Nothing here names model types. The encoder is the model's ``base_model``;
the head is whatever the model's own ``forward`` does after it: ``HeadAfterEncoder`` calls that
``forward`` with the encoder's output given (BERT's ``cls``, DistilBERT's ``vocab_transform →
activation → vocab_layer_norm → vocab_projector``, ELECTRA's ``generator_predictions →
generator_lm_head``, DeBERTa-v2's ``lm_predictions`` with its word embeddings, ModernBERT's ``head →
decoder``, ESM's ``lm_head``, ... run as each model's code runs them). At load, on check inputs with
padding and masks, two things are verified, and if either fails the full model runs at every position
(``head_mode == "full"``, and the log says why):

- bit for bit: the head on the encoder's output at *every* position equals the model's own
  ``forward(...).logits``, so the head sees nothing but the encoder's last hidden state. A head that
  reads anything else differs on every try; a CPU's kernels can differ once (the model's own forward
  pass, first of a process, has been seen to give whole rows other bits than every later pass on the
  same input), so a mismatch is tried again, ``_HEAD_ATTEMPTS`` tries in all, and one exact match passes;
- the head on the *mask rows alone* equals those logits at the masks within a few units in the last
  place (a matrix product's last bits depend on how many rows it has), so the head works position
  by position. Not with ``--dtype int8``: dynamic quantisation scales each Linear layer's input by
  its own range, so there every layer's answer (the encoder's too) depends on what else is in the
  batch, and the head at the masks is no different.

**Packed rows.** A batch of texts of different lengths, padded to its longest, spends work on padding,
the more the further apart its lengths are. Where the model
allows it, the texts share rows instead (``batching.layout``: longest first, each into the first row
with room, rows of ``PACK_WIDTH`` tokens or the longest text): each token attends to its own text's
tokens only (a 4-d mask, built in ``graph.BatchGraph`` from each token's text) and takes its
position within its text (RoBERTa's positions start after the padding index: ``_first_position``),
so that a batch costs about its tokens, whatever the lengths in it. The batching policy prices a
batch by the same layout (``batching.footprint``), so texts of any lengths may share one. At load,
``_check_packing`` runs six texts of different lengths, one of them longer than a row, packed into
one row and padded, and packs only when every logit at the masks agrees within ``_PACK_TOLERANCE``
of the largest (a wrong first position or a mask the model replaces moves them by far more). A model
that takes no position ids or no 4-d mask (DeBERTa-v2 and ESM build their own attention from a 2-d
one), one with a local attention window (ModernBERT: its window mask, built from the 2-d mask, would
be replaced) and one whose logits differ keep one padded row per text, and ``packing_note`` says
why. In a reduced ``dtype`` rounding alone moves logits as far as a wrong position does, so there the
check runs in float32 on the same weights (``FillMaskModel._as_float32``: bfloat16 and float16
tensors made float32 and put back bit for bit; for int8, whose quantisation cannot be undone, the
float32 model it was quantised from, which ``loading`` passes in and nothing keeps), and then
packed rows in the dtype must be no more than ``_PACK_ROUNDING`` times as far from float32's logits
as padded rows are (a kernel that fails a 4-d mask in that dtype only is further, or NaN), a bound
that must itself be nearer than packed rows with no mask at all are: where rounding is as coarse as
that fault (random-weight base in bfloat16), the check cannot tell, and the rows stay padded.
Where positions skip the padding token (RoBERTa's), a batch with a text that holds it runs padded.
The traced graph of packed rows is checked bit for bit against eager PyTorch as the padded one is.

**One length a batch.** Most models give a text the same logits padded beside longer texts as alone
(the attention mask keeps the padding out), which is what lets texts of different lengths share a
batch. Not every fill-mask model does: FNet mixes tokens by a Fourier transform over the whole row,
padding included; ConvBERT's convolutions and Funnel's pooling reach across the padding; YOSO's and
Nyströmformer's approximate attention and Reformer's chunks depend on the row's length. Such a model's
answers would depend on what else is in its batch, and differ from the pipeline's, which runs each
text alone. So ``_check_padding`` runs texts of 3 to 70 tokens, each alone and padded together
beside one of over a hundred, in float32 (as the packing check does, on the same weights), and where
a logit at one of several places in a text moves by more than ``_PACK_TOLERANCE`` of the largest,
every batch holds texts of one length only (``one_length``: the batching policy forms one-length
batches, and the engine runs each length of a batch that still holds more as a pass of its own), no
text is packed, and ``hello.engine.layout`` says ``one_length``. What padding would do only to texts
longer than the check's, it cannot see.

**Check inputs** draw their ids from the tokenizer's own non-special ids (a protein model has 25
tokens) and are never longer than the model accepts (``max_tokens``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson

from . import batching, tokenizing
from .checkpoint import RANDOM_WEIGHTS_KEY
from .diagnosis import first_line
from .items import Item, TargetError, TopK
from .protocol import TargetNote

log = logging.getLogger(__name__)

#: The check inputs' shapes: (rows, width, padded rows, masks); widths are capped at ``max_tokens``,
#: and one more check runs at ``max_tokens`` itself.
_CHECK_SHAPES = ((1, 5, 0, 1), (3, 9, 2, 3), (32, 11, 0, 32), (4, 40, 3, 9))
#: ``FillMaskModel.fails_a_batch``'s answer for scores that are not finite.
NOT_NUMBERS = "its scores are not numbers (NaN or infinite weights?)"
#: Rows of packed texts hold up to this many tokens (or the batch's longest text): wide enough that the
#: texts of a batch share a few rows with little padding, narrow enough that attention across a row
#: (quadratic in its width, masked to each text) stays a small part of the encoder's work.
PACK_WIDTH = 64
#: Config fields of an attention with a local window (ModernBERT's ``local_attention``, Longformer's ...).
_LOCAL_WINDOWS = ("local_attention", "sliding_window", "attention_window")
#: Packed rows may move a logit by this share of the largest, at most, against padded rows (in float32,
#: rounding moves it by orders of magnitude less on this project's checkpoints, and a wrong position or
#: a mask the model overrides by orders of magnitude more: docs/performance-log.md, "Packed rows").
_PACK_TOLERANCE = 1e-3
#: In a reduced dtype, packed rows' logits may be this many times as far from float32's as padded rows'
#: are (both differ by rounding alone once the float32 check passed, and by about as much on this
#: project's checkpoints in bfloat16, float16 and int8; a kernel that breaks on a 4-d mask in that dtype,
#: by far more, or not finite).
_PACK_ROUNDING = 2
#: Tries of the bit-for-bit head check before the full model is taken: a head that reads more than the
#: encoder's output fails each one; a kernel that gives other bits once passes on the next.
_HEAD_ATTEMPTS = 3


class FillMaskModel:
    """A tokenizer and a masked-LM model on one device; each method has one owner thread (see above)."""

    def __init__(self, name: str, tokenizer: Any, model: Any, device: str, dtype: str, forward: str = "traced",
                 unquantized: Any = None, projection: str = "auto", announce: bool = True) -> None:
        """``unquantized``: for ``int8``, the float32 model ``model`` was quantised from, which the packing
        check reads at load (and keeps no reference to); without it an int8 model keeps padded rows.
        ``projection``: ``auto``, the output projection's kernel in the traced graph measured at load
        (``projection.py``); ``torch``, the model's own. ``announce``: log what the load chose at INFO
        (else at DEBUG: a copy loaded to compare, whose choices are not the server's); warnings either way."""
        import torch

        self._choice = log.info if announce else log.debug
        self.name = name
        # A checkpoint made by ``fillmask_server.checkpoint`` says its weights are random (hello tells clients).
        self.random_weights = getattr(model.config, RANDOM_WEIGHTS_KEY, False) is True
        self.tokenizer = tokenizer
        self.decode_tokenizer = copy.deepcopy(tokenizer)
        # A pure-Python tokenizer holds the GIL for every text: split with its checked fast equivalent. A
        # fast one is called through its checked Rust backend, without transformers' Python per text.
        self._fast_tokenizer = tokenizing.fast_equivalent(tokenizer)
        if self._fast_tokenizer is not None:
            log.info("%s is pure Python: texts are split by an equivalent fast tokenizer (the same ids on %d "
                     "check texts)", type(tokenizer).__name__, tokenizing.CHECK_TEXTS)
        else:
            self._fast_tokenizer = tokenizing.direct_backend(tokenizer)
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.mask_token: str = tokenizer.mask_token
        self.mask_token_id: int = tokenizer.mask_token_id
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # The padding index of the model's position table (RoBERTa's positions count from it; -1: none).
        self._padding_index: int = _position_padding_index(model)
        self.vocab_size: int = model.config.vocab_size
        # The longest input, special tokens included, and whose limit it is: "tokenizer" or "positions".
        self.max_tokens, self.max_tokens_source = _max_tokens(tokenizer, model)
        self._wants_token_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self._check_ids = _ordinary_ids(tokenizer, self.vocab_size)
        self._vocab: dict[str, int] | None = None
        self._targets: dict[tuple[str, ...], tuple[tuple[int, ...], tuple[TargetNote, ...]]] = {}
        # Each token's JSON length without quotes, plus the space that may join it (for result bounds,
        # intake.result_bound), and the longest: the most one candidate adds to a decoded text.
        self.token_json_bytes = _token_json_bytes(tokenizer)
        self.longest_token_json = max(self.token_json_bytes) + 2
        #: Why the head does not run at the masks alone, or why the graph is not traced (None: it is).
        self.head_note: str | None = None
        self.forward_note: str | None = None
        self._encoder: Any = None
        self._head: Any = None
        encoder = getattr(model, "base_model", None)
        if encoder is None or encoder is model:
            self.head_note = "the model has no separate encoder (base_model)"
        else:
            self._encoder, self._head = encoder, _head_after_encoder(model, encoder)
            self.head_note = self._check_head()
            if self.head_note is not None:
                self._encoder = self._head = None
                log.warning("%s; running the full model (the vocabulary projection at every position)",
                            self.head_note)
        self.head_mode = "masks" if self._head is not None else "full"
        #: Packed rows (see "Packed rows"): the row width, 0 when every text has a padded row of its own;
        #: and the first position id of a text (RoBERTa's start after the padding index).
        self.pack_width = 0
        self._first_position = 0
        #: Why a text's logits change when it is padded beside longer texts (None: they do not). Where they
        #: do, a batch holds texts of one length only, and none is packed ("One length a batch").
        self.padding_note = self._check_padding(unquantized)
        self.one_length = self.padding_note is not None
        self.packing_note: str | None  # why texts are not packed (None: they are)
        if self.one_length:
            self.packing_note = "a batch holds texts of one length only"
            log.warning("%s. So each batch holds texts of one length only, and every answer is the one the text "
                        "gets alone, as the pipeline runs it; batches are smaller where lengths vary",
                        self.padding_note)
        else:
            self.packing_note = self._check_packing(unquantized)
        if self.packing_note is None:
            self.pack_width = PACK_WIDTH
        elif not self.one_length:
            self._choice("texts get a padded row each: %s", self.packing_note)
        self._scores: Any = None  # the traced graph: inputs and mask positions in, softmax at the masks out
        self._packed_scores: Any = None  # the same for packed rows (None: the model does not pack)
        #: The output projection's kernel in the traced graph: "torch" (the model's own) or "onednn-packed"
        #: (``projection.py``: where the load measured it faster, and its logits agree; eager runs the own).
        self.projection_kernel = "torch"
        self._projection: Any = None
        #: The packed kernel's row counts met (``projection.RowCounts``: they bound oneDNN's kernel cache).
        self._row_counts: Any = None
        self.projection_setting = projection  # (``calibration`` loads its float32 reference with it)
        if forward == "traced" and projection == "auto":
            self._projection = self._faster_projection()
        if forward == "traced":
            self._scores = self._trace()  # (falls back to the model's own projection where it must: ``_trace``)
            if self._scores is not None and self.pack_width:
                chosen = self._projection
                self._packed_scores = self._trace(packed=True)
                if chosen is not None and self._projection is None:  # packed rows gave the kernel up: one kernel
                    self._scores = self._trace()
            if self._projection is not None and self._scores is not None:
                self.projection_kernel = "onednn-packed"
                from .projection import RowCounts

                self._row_counts = RowCounts()
                self._choice("%s", self._projection.line())
            self._projection = None  # (the traced graphs hold the kernel they were traced with)
        else:
            self.forward_note = "--forward eager"
        self.forward_mode = "traced" if self._scores is not None else "eager"
        # A batch in one call: lists in, top-k out (graph.py). Built from ``_scores`` and ``_head`` as they
        # are now: whoever replaces either must build it again.
        self._batch = self._batch_graph()

    def fails_a_batch(self) -> str | None:
        """Run one batch of two texts of different lengths (padding) with a mask each, as requests run;
        the first line of what went wrong, or None. The start-up checks before it fall back to slower
        paths where a part fails; this is the last: a model that fails here would fail every request.
        Scores that are not numbers (weights with NaN in them) fail too: JSON has no NaN."""
        import torch

        mask = self.mask_token
        try:
            texts = [ids for ids in self.tokenize([f"{mask}", f"{mask} {mask}. {mask}"]) if len(ids) <= self.max_tokens]
            if not texts:  # a position table too short for any text (``loading`` refuses such a model)
                return None
            top = self.forward([Item(ids, n + 1) for n, ids in enumerate(texts)])
        except Exception as exc:
            return first_line(exc)
        if not bool(torch.isfinite(top.values).all()):
            return NOT_NUMBERS
        return None

    def engine_facts(self) -> dict[str, str]:
        """Which path runs, for ``hello.engine``, ``/metrics`` and the start-up line (protocol.md §2)."""
        layout = "one_length" if self.one_length else "packed" if self.pack_width else "padded"
        return {"forward": self.forward_mode, "head": self.head_mode, "layout": layout, "device": str(self.device),
                "dtype": self.dtype}

    # --- tokenizing (the tokenizer stage) --------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with special tokens, unpadded and untruncated (one batched call)."""
        return tokenizing.token_ids(self._fast_tokenizer or self.tokenizer, texts)

    def target_ids(self, targets: tuple[str, ...]) -> tuple[int, ...]:
        """The pipeline's ``get_target_ids``: vocab id, else first token; deduplicated. Cached."""
        return self._resolved(targets)[0]

    def target_notes(self, targets: tuple[str, ...]) -> tuple[TargetNote, ...]:
        """The targets not scored as given, in request order, each with the token scored instead as its
        ``token_str`` reads (None: it is no token at all and was ignored, as in the pipeline). Empty when
        every target is scored as given. Cached with ``target_ids``."""
        return self._resolved(targets)[1]

    def _resolved(self, targets: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[TargetNote, ...]]:
        resolved = self._targets.get(targets)
        if resolved is None:
            resolved = self._resolve_targets(targets)
            if len(self._targets) >= 1024:
                self._targets.clear()
            self._targets[targets] = resolved
        return resolved

    def _resolve_targets(self, targets: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[TargetNote, ...]]:
        if self._vocab is None:
            self._vocab = self.tokenizer.get_vocab()
        ids: list[int] = []
        notes: list[TargetNote] = []
        for target in targets:
            id_ = self._vocab.get(target)
            if id_ is None:
                # The pipeline truncates to max_length=1; taking the first token is the same and does
                # not switch the shared Rust tokenizer's truncation setting back and forth.
                pieces = self.tokenizer(target, add_special_tokens=False, return_attention_mask=False,
                                        return_token_type_ids=False)["input_ids"]
                scored = self.tokenizer.decode(pieces[:1]) if pieces else None
                if (len(pieces) != 1 or scored != target) and (target, scored) not in notes:
                    notes.append((target, scored))
                if not pieces:
                    continue
                id_ = pieces[0]
            if not 0 <= id_ < self.vocab_size:
                raise TargetError(f"the target {target[:100]!r} is a token of the tokenizer that this model has no "
                                  "output for (the tokenizer knows more tokens than the model)")
            ids.append(id_)
        unique = list(set(ids))  # the pipeline's order, which decides ties in top-k
        if not unique:
            raise TargetError("none of the targets is a token of this model's vocabulary")
        return tuple(unique), tuple(notes)

    # --- the forward pass (the model thread) ---------------------------------------------------------

    def forward(self, items: Sequence[Item]) -> TopK:
        """The batch's top-k at every mask; every item must hold at least one mask token.

        The inputs are built as flat Python lists and the whole pass (inputs to tensors, graph, top-k)
        is one call of ``graph.BatchGraph``, which gives the GIL up once: every other hand-over costs
        the model thread up to a switch interval while the event loop or the decode stage runs
        Python (see ``graph.py``). The top-k runs over every mask row, at each item's own ``top_k``
        (items with targets: at the largest ``top_k`` of the others, unused); items with targets pick
        their own columns from the probabilities. On the packed projection, the mask rows may run
        rounded up to a count its kernels met before (``projection.RowCounts``: the extra rows'
        answers are dropped here).
        """
        import torch

        lengths = [len(item.input_ids) for item in items]
        plan = batching.layout(lengths, self.pack_width)
        if plan is not None and self._first_position and any(self._padding_index in item.input_ids for item in items):
            plan = None  # RoBERTa skips a padding token when it counts positions: padded rows do the same
        pad, mask = self.pad_token_id, self.mask_token_id
        ids: list[int] = []
        segments: list[int] = []  # packed rows only: each token's text within its row (-1: padding)
        places: list[int] = []  # packed rows only: each token's position within its text
        row_of, start_of = list(range(len(items))), [0] * len(items)  # each text's row and first column
        if plan is None:
            width = max(lengths)
            for item in items:
                ids += item.input_ids
                ids += [pad] * (width - len(item.input_ids))
        else:
            width = max(sum(lengths[i] for i in row) for row in plan)
            for r, row in enumerate(plan):
                used = 0
                for segment, i in enumerate(row):
                    row_of[i], start_of[i] = r, used
                    ids += items[i].input_ids
                    segments += [segment] * lengths[i]
                    places += range(lengths[i])
                    used += lengths[i]
                ids += [pad] * (width - used)
                segments += [-1] * (width - used)
                places += [0] * (width - used)
        rows: list[int] = []
        columns: list[int] = []  # each mask's position in its text (the decode stage's)
        at: list[int] = []  # ... and in its row
        counts: list[int] = []
        for n, item in enumerate(items):  # mask rows in item order, whatever the layout
            positions = [c for c, token in enumerate(item.input_ids) if token == mask]
            rows += [row_of[n]] * len(positions)
            columns += positions
            at += [start_of[n] + c for c in positions] if start_of[n] else positions
            counts.append(len(positions))
        spans = _spans(counts)
        plain = [i for i, item in enumerate(items) if item.target_ids is None]
        k = max((items[i].top_k for i in plain), default=0)  # the rows of items with targets: no group of their own
        ks: list[int] = []  # each mask row's k; empty when all are k (the usual case: one top-k call)
        if any(items[i].top_k != k for i in plain):
            for item, count in zip(items, counts, strict=True):
                ks += [k if item.target_ids is not None else item.top_k] * count
        keep = len(plain) < len(items)
        masks = len(rows)
        extra = (self._row_counts.rows(masks) - masks) if self._row_counts is not None else 0
        if extra:  # (the last mask again: rows whose answers are dropped, ``projection.RowCounts``)
            rows, at = rows + [rows[-1]] * extra, at + [at[-1]] * extra
            ks = ks + [ks[-1]] * extra if ks else ks
        with torch.inference_mode():
            probs, values, indices = self._batch(ids, lengths, rows, at, width, k, ks, keep, segments, places)
        if extra:
            probs = None if probs is None else probs[:masks]
            values, indices = values[:masks], indices[:masks]
        out = TopK(spans=spans, columns=columns, values=values, indices=indices)
        if plain:
            out.plain_rows = {i: spans[i][0] for i in plain}
        if keep:
            out.targeted = {}
            with torch.inference_mode():
                for i, item in enumerate(items):
                    if item.target_ids is not None:
                        targets = list(item.target_ids)
                        first, last = spans[i]
                        out.targeted[i] = probs[first:last][..., targets].topk(min(item.top_k, len(targets)))
        return out

    def set_threads(self, count: int) -> None:
        """Run the calling thread's later forward passes on ``count`` torch intra-op threads. The model
        thread calls it between batches, and a part's helper thread (``parts.py``) before a part at
        another count. Torch keeps a count per thread, and sets the process's too, which a thread
        takes at its first parallel operator: threads that start later take this one."""
        import torch

        torch.set_num_threads(count)

    def _extra(self, ids: Any) -> dict[str, Any]:
        import torch

        return {"token_type_ids": torch.zeros_like(ids)} if self._wants_token_types else {}

    def _eager_scores(self, ids: Any, attention: Any, rows: Any, cols: Any, positions: Any = None) -> Any:
        return self._logits(ids, attention, rows, cols, positions).float().softmax(dim=-1)

    def _logits(self, ids: Any, attention: Any, rows: Any, cols: Any, positions: Any = None) -> Any:
        """The logits at the masks (``rows``, ``cols``); for packed rows, ``attention`` is the 4-d mask
        (which token attends to which) and ``positions`` each token's position within its text."""
        extra = self._extra(ids)
        if positions is not None:
            extra["position_ids"] = positions + self._first_position
        if self._head is not None:
            hidden = self._encoder(input_ids=ids, attention_mask=attention, **extra).last_hidden_state
            return self._head(hidden[rows, cols])
        return self.model(input_ids=ids, attention_mask=attention, **extra).logits[rows, cols]

    def _check_head(self) -> str | None:
        """None when the head at the masks is the model's own head (see the module docstring), else why not."""
        import torch

        ids, attention, rows, cols = self._check_inputs(3, 12, padded=2, masks=4)
        extra = self._extra(ids)
        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tries = 0
                while True:
                    tries += 1
                    full = self.model(input_ids=ids, attention_mask=attention, **extra).logits
                    hidden = self._encoder(input_ids=ids, attention_mask=attention, **extra).last_hidden_state
                    every = self._head(hidden.reshape(-1, hidden.shape[-1]))
                    shaped = every.shape == (ids.numel(), full.shape[-1])
                    same = shaped and _same_bits(every, full.reshape(every.shape))
                    if same or not shaped or tries == _HEAD_ATTEMPTS:
                        break
                at_masks = self._head(hidden[rows, cols])
        except Exception as exc:  # an encoder or forward pass this split does not fit
            return f"the MLM head cannot run on the encoder's output alone ({first_line(exc)})"
        if not same:
            return "the MLM head on the encoder's output differs from the model's own forward pass"
        if tries > 1:
            log.info("the head check matched on try %d of the same input (the tries before gave other bits)", tries)
        if self.dtype == "int8":  # see the module docstring: no layer is per-position under dynamic quantisation
            return None
        expected = full[rows, cols].float()
        if (at_masks.float() - expected).abs().max().item() > _rounding_slack(expected, full.dtype):
            return "the MLM head on the mask positions alone differs from the model's own (it is not per-position)"
        return None

    def _faster_projection(self) -> Any:
        """The output projection's packed kernel (``projection.Projection``) when the load measures it
        faster, the model's head calls it, and the logits at the masks with it agree with the model's own
        within rounding at 1 to 130 masks (the weight is packed for 64 rows); else None (the model's own
        kernel runs). The log says what was measured, and why a faster kernel is not used."""
        import torch

        try:
            from . import projection

            chosen = projection.choose(self.model)
        except Exception as exc:  # (a torch without what it needs: the model's own kernel is right anyway)
            log.warning("the output projection keeps torch's own kernel (%s)", first_line(exc))
            return None
        if chosen is None:
            return None
        if not chosen.faster:
            self._choice("%s", chosen.line())
            return None
        shapes = ((1, 12, 0, 1), (4, 12, 1, 5), (4, 12, 1, 8), (16, 20, 2, 65), (16, 20, 2, 130))
        checks = [self._check_inputs(*shape) for shape in shapes]
        problem = None
        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not chosen.called_by(lambda: self._logits(*checks[0])):
                    problem = "the model's head does not call that layer (it reads its weight itself)"
                for ids, attention, rows, cols in checks if problem is None else ():
                    own = self._logits(ids, attention, rows, cols).float()
                    with chosen.swapped():
                        packed = self._logits(ids, attention, rows, cols).float()
                    off, slack = (packed - own).abs().max().item(), _rounding_slack(own, torch.float32)
                    if not off <= slack:  # (NaN too)
                        problem = (f"the packed one's logits differ from it by more than rounding at {len(rows)} "
                                   f"masks ({off:.2g}, against {slack:.2g})")
                        break
        except Exception as exc:  # a head that cannot take the swapped module: the model's own is right
            problem = f"the model's head failed with the packed one ({first_line(exc)})"
        if problem is not None:
            log.warning("the output projection keeps torch's own kernel: %s", problem)
            return None
        return chosen

    def _check_padding(self, unquantized: Any = None) -> str | None:
        """None when each check text (``_padding_check_inputs``) gets the same logits padded beside the
        others as alone, within ``_PACK_TOLERANCE`` of the largest, at each of its compared positions;
        else what padding does to them. In float32: a reduced dtype's weights made float32 for the
        check, an int8 model's float32 original (an int8 model without it is not checked: its
        quantisation scales each layer's input by the whole batch's range, so there no answer is quite
        independent of its neighbours)."""
        import torch

        if self.dtype == "int8" and unquantized is None:
            return None
        texts, places = self._padding_check_inputs()
        width, device = max(len(text) for text in texts), self.device
        ids = torch.tensor([text + [self.pad_token_id] * (width - len(text)) for text in texts], device=device)
        attention = torch.tensor([[1] * len(text) + [0] * (width - len(text)) for text in texts], device=device)
        rows = torch.tensor([r for r, at in enumerate(places) for _ in at], device=device)
        cols = torch.tensor([c for at in places for c in at], device=device)
        try:
            with torch.inference_mode(), warnings.catch_warnings(), (
                    contextlib.nullcontext() if self.dtype == "float32" else self._as_float32(unquantized)):
                warnings.simplefilter("ignore")
                padded = self._logits(ids, attention, rows, cols).float()
                alone = torch.cat([self._logits(
                    ids[r:r + 1, :len(text)], attention[r:r + 1, :len(text)],
                    torch.zeros(len(places[r]), dtype=torch.long, device=device),
                    torch.tensor(places[r], device=device)).float() for r, text in enumerate(texts) if places[r]])
        except torch.OutOfMemoryError as exc:  # (the float32 weights of a reduced dtype's check)
            log.warning("not enough memory to check in float32 whether padding changes this model's answers "
                        "(%s): texts of different lengths share batches as for most models, and where padding "
                        "does change this model's answers they may differ from the pipeline's", first_line(exc))
            return None
        except Exception as exc:  # (a model that fails on every batch: ``fails_a_batch`` refuses it next)
            log.warning("could not check whether padding changes this model's answers (%s): texts of different "
                        "lengths share batches as for most models", first_line(exc))
            return None
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # (what the check's float32 weights held)
        moved = (padded - alone).abs().max().item()
        largest = max(1.0, alone.abs().max().item())
        if moved <= _PACK_TOLERANCE * largest:  # (not NaN either)
            return None
        return (f"padding changes this model's answers: a text padded beside a longer one got logits up to "
                f"{moved:.3g} away from its own alone (its largest {largest:.3g}); the padding reaches into what "
                "it computes for the text")

    def _padding_check_inputs(self) -> tuple[list[list[int]], list[list[int]]]:
        """Texts for ``_check_padding`` (ordinary ids, a mask at the second place), within ``max_tokens``:
        compared ones of 3 to 70 tokens, some within one chunk of a chunked attention and some across
        several (Reformer's local chunks reach the padding only then: 16 tokens here, 64 by default),
        and the widest, past two packed rows, which pads them all and is not compared itself; and the
        places compared in each, from its first to its last token (none for the widest)."""
        compared = sorted({min(n, self.max_tokens) for n in (3, 12, 23, PACK_WIDTH + 6)})
        widest = min(2 * PACK_WIDTH + 3, self.max_tokens)
        lengths = compared + ([widest] if widest > compared[-1] else [])
        texts = self._check_texts(lengths)
        places = [sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 2, n - 1} & set(range(n))) for n in compared]
        return texts, places + [[]] * (len(lengths) - len(compared))

    def _check_texts(self, lengths: Sequence[int]) -> list[list[int]]:
        """A check text of each of ``lengths`` tokens: the tokenizer's ordinary ids, a different run for
        each length, with the mask at the second place (the first, in a text of one token)."""
        pool = self._check_ids
        texts = [[pool[(7 * j + 3 * n) % len(pool)] for j in range(n)] for n in lengths]
        for text in texts:
            text[min(1, len(text) - 1)] = self.mask_token_id
        return texts

    def _check_packing(self, unquantized: Any = None) -> str | None:
        """None when the model gives packed rows the logits it gives padded ones (see "Packed rows"),
        setting ``_first_position``; else why it does not."""
        import inspect

        import torch

        if self.dtype == "int8" and unquantized is None:
            return "packed rows in int8 are checked against the float32 model it was quantised from, not given here"
        forward = (self._encoder if self._head is not None else self.model).forward
        if "position_ids" not in inspect.signature(forward).parameters:
            return "the model takes no position ids"
        config = self.model.config
        for window in _LOCAL_WINDOWS:  # a mask of its own per layer, which a 4-d mask given would replace
            if getattr(config, window, None):
                return f"the model's attention has a local window ({window} = {getattr(config, window)})"
        padded, packed = self._packing_check_inputs()
        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self.dtype == "float32":
                    return self._packing_differs(self._logits(*padded).float(), packed)
                note = self._reduced_packing_differs(padded, packed, unquantized)
        except torch.OutOfMemoryError as exc:  # (the float32 weights of a reduced dtype's check)
            note = f"not enough memory to check packed rows against float32 ({first_line(exc)})"
        except Exception as exc:  # a model that builds its own attention from a 2-d mask, or none
            # (torch's words in brackets, said as what the model raised: an operator read them as a crash)
            note = ("the model does not take a mask of which token attends to which (given one, it raised: "
                    f"{first_line(exc)})")
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # (what the check's float32 weights held)
        if note is not None:
            self._first_position = 0
        return note

    def _reduced_packing_differs(self, padded: tuple[Any, ...], packed: tuple[Any, ...],
                                 unquantized: Any) -> str | None:
        """A reduced dtype's check: the float32 one on the same weights (``_as_float32``), then packed rows
        in the dtype against float32's logits. They may be ``_PACK_ROUNDING`` times as far as padded rows
        are (or ``_PACK_TOLERANCE`` of the largest logit), and that bound must be nearer than packed rows
        with no mask at all are (every token attending to the whole row): else this dtype's rounding is
        too coarse for the check to tell a fault from it, and the rows stay padded."""
        import torch

        reduced = self._logits(*padded).float()
        with self._as_float32(unquantized):
            reference = self._logits(*padded).float()
            note = self._packing_differs(reference, packed)
        if note is not None:
            return note
        def off(logits: Any) -> float:
            return float((logits.float() - reference).abs().max().item())

        ids, mask, rows, cols, places = packed
        padded_off, packed_off = off(reduced), off(self._logits(*packed))
        unmasked_off = off(self._logits(ids, torch.ones_like(mask), rows, cols, places))
        bound = max(_PACK_ROUNDING * padded_off, _PACK_TOLERANCE * max(1.0, reference.abs().max().item()))
        if not packed_off <= bound:  # (NaN too)
            return (f"packed rows in {self.dtype} are {packed_off:.3g} from float32's logits, padded rows "
                    f"{padded_off:.3g}")
        if not bound < unmasked_off:
            return (f"rounding in {self.dtype} moves this model's logits too far to check packed rows "
                    f"({padded_off:.3g} from float32's; packed rows with no mask at all, {unmasked_off:.3g})")
        return None

    @contextmanager
    def _as_float32(self, unquantized: Any = None) -> Iterator[None]:
        """The model in float32 for the block, the same weights: a reduced dtype's bfloat16 and float16
        tensors made float32 and put back (``_reduced_in_float32``), or an int8 model's ``unquantized``
        original in its place."""
        if unquantized is None:
            with _reduced_in_float32(self.model):
                yield
            return
        kept = self.model, self._encoder, self._head
        self.model = unquantized
        if self._head is not None:
            self._encoder = unquantized.base_model
            self._head = _head_after_encoder(unquantized, self._encoder)
        try:
            yield
        finally:
            self.model, self._encoder, self._head = kept

    def _packing_check_inputs(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``_logits``' arguments for six texts of different lengths, one of them longer than a row (a
        local window the model builds from a 2-d mask, and which a 4-d one replaces, shows only beyond
        its width): padded, one row each; and packed into one row."""
        import torch

        lengths = [min(n, self.max_tokens) for n in (5, 9, 3, 12, 7, 2 * PACK_WIDTH + 3)]
        texts = self._check_texts(lengths)
        width, device = max(lengths), self.device
        ids = torch.tensor([text + [self.pad_token_id] * (width - len(text)) for text in texts], device=device)
        attention = torch.tensor([[1] * len(text) + [0] * (width - len(text)) for text in texts], device=device)
        rows, cols = (ids == self.mask_token_id).nonzero(as_tuple=True)
        flat = torch.tensor([[token for text in texts for token in text]], device=device)
        segment = torch.tensor([n for n, text in enumerate(texts) for _ in text], device=device)
        mask = (segment.unsqueeze(1) == segment.unsqueeze(0)).view(1, 1, len(segment), len(segment))
        places = torch.tensor([[p for text in texts for p in range(len(text))]], device=device)
        at = (flat[0] == self.mask_token_id).nonzero(as_tuple=True)[0]
        return (ids, attention, rows, cols), (flat, mask, torch.zeros_like(at), at, places)

    def _packing_differs(self, expected: Any, packed: tuple[Any, ...]) -> str | None:
        """None, with ``_first_position`` set, when packed rows give ``expected`` (padded rows' logits)
        within ``_PACK_TOLERANCE`` of the largest at some first position; else why not (0 then)."""
        allowed = _PACK_TOLERANCE * max(1.0, expected.abs().max().item())
        # RoBERTa's positions start after the padding index of its position table.
        for first in (0, self._padding_index + 1) if self._padding_index >= 0 else (0,):
            self._first_position = first
            got = self._logits(*packed).float()
            if got.shape == expected.shape and (got - expected).abs().max().item() <= allowed:
                return None
        self._first_position = 0
        return "packed rows give other logits than padded ones"

    def _trace(self, packed: bool = False) -> Any:
        """The encoder, the head at the masks (or the full model) and the softmax as one TorchScript graph
        (of padded rows, or of ``packed`` rows), or None when tracing fails or the graph differs from
        eager PyTorch by one bit on any check input; ``forward_note`` (``packing_note`` for packed
        rows, which are then given up: padded rows still run traced) then says why. With the projection's
        packed kernel chosen (``_faster_projection``) it is traced with that, and where that fails, with
        the model's own layer; the kernel is then given up for both graphs (``__init__`` traces the padded
        one again), so that one kernel runs whatever the rows.

        Where TorchScript fuses operators (its fuser runs on CUDA; on the CPU only in a torch built with
        LLVM), a fused kernel keeps its intermediates in float32 where eager PyTorch rounds each one to
        a reduced dtype, so the bits differ. Then fusion is switched off for the process
        (``_stop_fusing``) and the graph traced again: it still runs as one graph from C++, which is
        what saves the time on a GPU, with eager PyTorch's kernels."""

        module = self._masked_scores(packed)
        frozen = [p for p in module.parameters() if p.requires_grad]
        for parameter in frozen:
            parameter.requires_grad_(False)
        shapes = [*_CHECK_SHAPES, (2, self.max_tokens, 1, 3)]
        if packed:  # (32 rows of one mask add no case to two texts a row)
            shapes = [shape for shape in shapes if shape[0] < 32]
        check = self._packed_check_inputs if packed else self._check_inputs
        if self._projection is not None:  # the projection's packed kernel traced, and run by eager in the checks
            traced, problem = self._traced_or_why(module, check, shapes, self._projection.swapped())
            if problem is None:
                return traced
            log.warning("the output projection keeps torch's own kernel: the forward pass of %s rows did not trace "
                        "with the packed one (%s)", "packed" if packed else "padded", problem)
            self._projection = None  # (for both graphs: ``__init__`` traces the padded one again if it had it)
        traced, problem = self._traced_or_why(module, check, shapes, contextlib.nullcontext())
        return traced if problem is None else self._untraced(packed, problem)

    def _traced_or_why(self, module: Any, check: Callable[..., tuple[Any, ...]],
                       shapes: Sequence[tuple[int, int, int, int]], swap: Any) -> tuple[Any, str | None]:
        """``_trace``'s attempt inside ``swap``: the traced graph and None, or None and why not."""
        try:
            with swap:
                fusing = _fuses(self.device.type)
                traced, differs = self._traced_and_checked(module, check, shapes, 3 if fusing else 1)
                if differs is not None and fusing:
                    _stop_fusing(f"the fused graph {differs} in {self.dtype}")
                    traced, differs = self._traced_and_checked(module, check, shapes, 1)
        except Exception as exc:  # an architecture the tracer cannot follow: eager still works
            return None, f"cannot trace the forward pass ({first_line(exc)})"
        if differs is not None:
            return None, f"the traced forward pass {differs}"
        return traced, None

    @staticmethod
    def _traced_and_checked(module: Any, check: Callable[..., tuple[Any, ...]],
                            shapes: Sequence[tuple[int, int, int, int]], calls: int) -> tuple[Any, str | None]:
        """``module`` traced, and None, or what differed: the first check input (of ``shapes``) on which
        the graph does not give eager PyTorch's bits, in any of ``calls`` calls (where TorchScript fuses,
        its profiling executor fuses a shape's graph after its first runs: three calls see the fused one)."""
        import torch

        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer warns about every Python-level branch
            traced = torch.jit.trace(module, check(2, 8, padded=1, masks=2), check_trace=False)
            for shape in shapes:
                inputs = check(*shape)
                want = module(*inputs)
                for _ in range(calls):
                    if not _same_bits(traced(*inputs), want):
                        return traced, (f"differs from eager PyTorch on inputs of {inputs[0].shape[0]} x "
                                        f"{inputs[0].shape[1]} tokens")
        return traced, None

    def _untraced(self, packed: bool, note: str) -> None:
        """``_trace``'s failure: the note, and for packed rows, padded rows from now on."""
        if packed:
            self.pack_width, self.packing_note = 0, f"{note} of packed rows"
            log.warning("%s; each text gets a padded row of its own", self.packing_note)
        else:
            self.forward_note = note
            log.warning("%s; running eager", note)

    def _masked_scores(self, packed: bool = False) -> Any:
        """``_eager_scores`` as a module (what ``_trace`` traces, and what runs when nothing is traced),
        of padded rows or of ``packed`` rows (which take each token's position too)."""
        import torch

        owner = self

        class MaskedScores(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = owner.model
                if owner._head is not None:  # the model's own head holds no module; another one may
                    self.head = owner._head

            def forward(self, ids: Any, attention: Any, rows: Any, cols: Any) -> Any:
                return owner._eager_scores(ids, attention, rows, cols)

        class PackedScores(MaskedScores):
            def forward(self, ids: Any, attention: Any, positions: Any, rows: Any, cols: Any) -> Any:  # type: ignore[override]
                return owner._eager_scores(ids, attention, rows, cols, positions)

        return (PackedScores() if packed else MaskedScores()).eval()

    def _batch_graph(self) -> Any:
        """``graph.BatchGraph`` around the traced graph, scripted; around the eager modules when nothing
        is traced, or when scripting fails (then the log says why: the batch is still right, only its
        GIL hand-overs are more)."""
        from . import graph

        device = str(self.device)
        if self._scores is None:
            packed = self._masked_scores(packed=True) if self.pack_width else None
            return graph.BatchGraph(self._masked_scores(), device, packed)
        plain = graph.BatchGraph(self._scores, device, self._packed_scores)
        try:
            scripted = graph.script(self._scores, device, self._packed_scores)
            problem = self._differs(scripted, plain)
        except Exception as exc:
            problem = f"cannot script it ({first_line(exc)})"
        if problem is None:
            return scripted
        log.warning("the batch around the traced graph runs its inputs through eager torch calls: the scripted "
                    "call %s", problem)
        return plain

    def _differs(self, scripted: Any, plain: Any) -> str | None:
        """None when ``scripted`` gives ``plain``'s bits on padded check batches, and on packed ones when
        the model packs (three calls each: the profiling executor optimises a graph on its first runs),
        else what differed."""
        import torch

        cases = [(shape, False) for shape in _CHECK_SHAPES[:2] + _CHECK_SHAPES[3:]]  # (32 rows of one mask add no case)
        cases += [(shape, True) for shape in _CHECK_SHAPES[1:2] + _CHECK_SHAPES[3:]] if self.pack_width else []
        for shape, packed in cases:
            ids, attention, rows, cols = (tensor.cpu() for tensor in self._check_inputs(*shape))
            width = ids.shape[1]
            ks = [5 - row % 3 for row in range(len(rows))]  # three groups of k: every row at its own k
            segments: list[int] = []
            places: list[int] = []
            if packed:
                segment, positions = self._packed_check_rows(ids, attention)
                segments, places = segment.flatten().tolist(), positions.flatten().tolist()
            args = (ids.flatten().tolist(), attention.sum(dim=1).tolist(), rows.tolist(), cols.tolist(), width, 5,
                    ks if shape[3] > 1 else [], True, segments, places)  # one k, and several (every row at its own)
            with torch.inference_mode():
                want = plain(*args)
                for _ in range(3):
                    got = scripted(*args)
                    if not all(_same_bits(a, b) for a, b in zip(got, want, strict=True)):
                        return f"differs from eager torch on {ids.shape[0]} x {width} tokens"
        return None

    def _check_inputs(self, rows: int, width: int, padded: int, masks: int) -> tuple[Any, ...]:
        """Deterministic inputs for tracing and checking: ``padded`` rows half padding, ``masks`` masks.

        Ids are drawn from the tokenizer's own non-special ids, and ``width`` is capped at ``max_tokens``,
        so the inputs are valid for any vocabulary and any position table.
        """
        import torch

        width = max(4, min(width, self.max_tokens))
        generator = torch.Generator().manual_seed(rows * 1000 + width)
        pool = torch.tensor(self._check_ids, dtype=torch.long)
        ids = pool[torch.randint(0, len(pool), (rows, width), generator=generator)]
        attention = torch.ones(rows, width, dtype=torch.long)
        attention[:padded, width // 2:] = 0
        ids[:padded, width // 2:] = self.pad_token_id
        for n in range(masks):
            ids[n % rows, 1 + (n // rows) % (width // 2 - 1)] = self.mask_token_id
        rows_, cols = (ids == self.mask_token_id).nonzero(as_tuple=True)
        device = self.device
        return ids.to(device), attention.to(device), rows_.to(device), cols.to(device)

    def _packed_check_inputs(self, rows: int, width: int, padded: int, masks: int) -> tuple[Any, ...]:
        """``_check_inputs`` as packed rows: each row's first half one text, its second half another
        (the ``padded`` rows: padding), with the 4-d mask and positions that ``graph.BatchGraph`` builds."""
        ids, attention, rows_, cols = self._check_inputs(rows, width, padded, masks)
        segment, places = self._packed_check_rows(ids, attention)
        mask = (segment.unsqueeze(2) == segment.unsqueeze(1)).unsqueeze(1)
        return ids, mask, places, rows_, cols

    @staticmethod
    def _packed_check_rows(ids: Any, attention: Any) -> tuple[Any, Any]:
        """Each check token's text within its row (the first half one text, the second half another or
        padding: -1) and its position within its text."""
        import torch

        width = ids.shape[1]
        half = width // 2
        segment = torch.zeros_like(ids)
        segment[:, half:] = 1
        segment[attention == 0] = -1
        places = torch.arange(width, device=ids.device).repeat(ids.shape[0], 1)
        places[:, half:] -= half
        places[attention == 0] = 0
        return segment, places


def _ordinary_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """The tokenizer's ids below ``vocab_size`` that are not special tokens (all ids if none are left)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    ids = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    return ids or list(range(vocab_size))


def _head_after_encoder(model: Any, encoder: Any) -> Any:
    """The part of ``model.forward`` after ``encoder``, as a module: hidden states of some positions
    (rows × hidden) in, their logits (rows × vocabulary) out.

    It calls the model's own ``forward`` with the encoder's output given: the encoder's ``forward``,
    during that call and on the calling thread alone, returns those hidden states as one sequence.
    So the head runs as the model's code runs it, whatever its modules are called; ``_check_head``
    verifies that the result is the model's. It registers no submodule (the model's parameters stay
    the model's: nothing is counted twice when traced).

    Invariant: the encoder's ``forward`` gives the hidden states only to the thread whose head call
    gave them; every other call, on any thread, runs the encoder. (Passes side by side, ``parts.py``,
    run the encoder on one thread while another runs the head: a replacement of the shared module's
    ``forward`` for the call gave one thread's hidden states to the other.) So the encoder's instance
    gets a ``forward`` of its own for good, which runs what it ran before (a hook library's wrapper,
    if any) unless this thread's head call is under way.
    """
    import functools
    import threading
    import types

    import torch
    from transformers.modeling_outputs import BaseModelOutput

    giving = threading.local()  # .given: the hidden states this thread's head call gives the encoder's place
    # What the encoder's instance ran before: a hook library's own wrapper (or an earlier head's), or its
    # class's forward, bound. Its signature is the encoder's (``_check_packing`` reads it).
    before = encoder.__dict__.get("forward") or types.MethodType(type(encoder).forward, encoder)

    @functools.wraps(before)
    def forward(*args: Any, **kwargs: Any) -> Any:
        given = getattr(giving, "given", None)
        return given if given is not None else before(*args, **kwargs)

    encoder.forward = forward

    class HeadAfterEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._owner = (model,)  # a tuple: not registered as a submodule

        def forward(self, hidden: Any) -> Any:
            placeholder = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            giving.given = BaseModelOutput(last_hidden_state=hidden.unsqueeze(0))
            try:
                output = self._owner[0](input_ids=placeholder)
            finally:
                giving.given = None
            logits = output.logits if hasattr(output, "logits") else output[0]
            return logits[0]

    return HeadAfterEncoder()


@contextmanager
def _reduced_in_float32(model: Any) -> Iterator[None]:
    """``model`` with every bfloat16 and float16 parameter and buffer in float32 for the block, then each
    back in its own dtype: exactly the weights it had (a bfloat16 or float16 value is a float32 value);
    tensors of any other dtype (float32 ones a model keeps among reduced ones, float64) are not touched."""
    import torch

    reduced = (torch.bfloat16, torch.float16)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.dtype in reduced}
    dtypes = {key: tensor.dtype for key, tensor in tensors.items()}
    try:
        with torch.inference_mode(False):  # (the caller's may be on: weights made there would be inference tensors)
            for tensor in tensors.values():
                tensor.data = tensor.data.to(torch.float32)
        yield
    finally:
        with torch.inference_mode(False):
            for key, tensor in tensors.items():
                tensor.data = tensor.data.to(dtypes[key])


def _rounding_slack(expected: Any, dtype: Any) -> float:
    """How far logits may move by rounding alone: 16 units in the last place (of ``dtype``) of the
    largest of ``expected``. What the number of rows changes in a product is up to a few in float32 on the
    families of tests/test_families.py (none in bfloat16), and another kernel's order of sums about as
    much (``projection.py``); 16 leaves room."""
    import torch

    return float(16 * torch.finfo(dtype).eps * max(1.0, expected.abs().max().item()))


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """For consecutive groups of ``counts[i]`` rows, each group's [first, last) range."""
    spans = []
    first = 0
    for count in counts:
        spans.append((first, first + count))
        first += count
    return spans


def _position_padding_index(model: Any) -> int:
    """The padding index a model with a position table that has one counts its position ids from
    (RoBERTa's: from the index plus one), or -1: none (position ids from 0).

    The embeddings' own ``padding_idx`` (config.json's pad_token_id, as the model counts with it) where
    they keep one, not the table's: torch keeps a negative one as its row counted from the end (a
    ``pad_token_id`` of -1 is row 65 of a 66-row table, from which the position ids would start past the
    table), while the model counts from -1 + 1 = 0 (the pipeline answered; the server refused every text)."""
    embeddings = getattr(getattr(model, "base_model", None), "embeddings", None)
    padding_idx = getattr(getattr(embeddings, "position_embeddings", None), "padding_idx", None)
    if not isinstance(padding_idx, int):
        return -1
    counted = getattr(embeddings, "padding_idx", padding_idx)
    return counted if isinstance(counted, int) and counted >= 0 else -1


def _same_bits(got: Any, want: Any) -> bool:
    """Whether two tensors hold the same values (as ``torch.equal``), NaN where the other has NaN: a model
    whose scores are NaN on some input (float16's overflow on long texts) gives NaN traced as it does
    eager, which is no reason to run it eager, nor its head whole, nor its batch around the graph eager
    (``internal_error`` answers such a text: ``TopK.numbers``)."""
    import torch

    return torch.equal(got, want) or (got.shape == want.shape and got.dtype == want.dtype and got.is_floating_point()
                                       and bool(torch.isclose(got, want, rtol=0, atol=0, equal_nan=True).all()))


def _max_tokens(tokenizer: Any, model: Any) -> tuple[int, str]:
    """Longest input the model accepts, special tokens included, and whose limit that is: the
    tokenizer's ``model_max_length`` (``"tokenizer"``) when it has one, and never more than
    ``max_position_embeddings``. For a model with a position table that is the positions it has room for
    (``"positions"``), less the offset of position ids that start after the padding index, as RoBERTa's
    do: a RoBERTa tokenizer that says 514 for a table of 514 takes 512; a longer limit let texts through
    that the model then failed on. A model without one (relative positions as DeBERTa-v3's, rotary as
    ModernBERT's and ESM-2's) would run longer texts, but is held to the length its config.json declares
    (``"declared"``), as other servers hold it: what it was made for. On a tie, the tokenizer's (the file
    a user would edit)."""
    limit = getattr(tokenizer, "model_max_length", None)
    positions = getattr(model.config, "max_position_embeddings", 512)
    padding_idx = _position_padding_index(model)
    if padding_idx >= 0:
        positions -= padding_idx + 1
    if isinstance(limit, int) and 0 < limit < 1_000_000 and limit <= positions:
        return limit, "tokenizer"
    return positions, "positions" if _has_position_table(model) else "declared"


def _has_position_table(model: Any) -> bool:
    """Whether ``model`` looks its positions up in a table: an embedding named ``position_embeddings``
    anywhere in it (BERT's, RoBERTa's, ALBERT's, DistilBERT's, XLM's, ESM-1b's; DeBERTa-v2's where
    ``position_biased_input``), which a position past its end fails in."""
    import torch

    return any(isinstance(module, torch.nn.Embedding) and name.rpartition(".")[2] == "position_embeddings"
               for name, module in model.named_modules())


def _token_json_bytes(tokenizer: Any) -> list[int]:
    """For each id of ``tokenizer``, the most JSON bytes (without quotes) its token adds to a decoded text,
    plus one for a joining space: the larger of its vocabulary string's and of its text decoded alone.

    The string alone is not enough: a byte-level BPE vocabulary (RoBERTa, ModernBERT) writes a control
    byte as a letter (``\\x01`` as ``ā``, two bytes) that decodes to a character JSON escapes in six
    (``\\u0001``), and a byte that is part of a character as a letter that, decoded alone, is U+FFFD
    (three bytes for two). Decoded among its neighbours a token never takes more than alone: its whole
    characters are the same, and its broken ones become at most as many U+FFFD, or whole characters of
    no more bytes."""
    count = len(tokenizer)
    sizes = [0] * count
    for token, id_ in tokenizer.get_vocab().items():
        if 0 <= id_ < count:
            sizes[id_] = len(orjson.dumps(token)) - 1
    each = [[id_] for id_ in range(count)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    alone = (backend.decode_batch(each, skip_special_tokens=False) if backend is not None
             else [tokenizer.decode(one) for one in each])  # a tokenizer in Python (ESM's: a small vocabulary)
    return [max(size, len(orjson.dumps(text)) - 1) for size, text in zip(sizes, alone, strict=True)]


def _fuses(device_type: str) -> bool:
    """Whether TorchScript fuses operators of a graph on ``device_type`` in this process."""
    import torch

    jit = torch._C
    can = getattr(jit, "_jit_can_fuse_on_cpu" if device_type == "cpu" else "_jit_can_fuse_on_gpu", lambda: False)
    return bool(getattr(jit, "_jit_texpr_fuser_enabled", lambda: False)() and can())


def _stop_fusing(why: str) -> None:
    """TorchScript's operator fusion off for the whole process (one model a process: ``_trace``)."""
    import torch

    torch._C._jit_set_texpr_fuser_enabled(False)
    log.info("%s: TorchScript's operator fusion is off, and the graph runs eager PyTorch's kernels", why)


