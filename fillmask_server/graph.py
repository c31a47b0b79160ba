"""A batch's whole forward pass as one TorchScript call: Python lists in, the top-k out.

Why one call, with Python lists for inputs: the model thread shares the GIL with the event loop and
the other stages, and every time it gives the GIL up it must win it back, which costs up to a switch
interval whenever another thread is running Python. Torch gives the GIL up for more than the call
itself: a tensor that has a Python object takes the GIL each time C++ code starts or stops sharing
it (``TensorImpl::incref_pyobject``/``decref_pyobject``), and releases it again when its Python
object dies. Tensors made from Python lists before the call (``torch.tensor``) and passed to the
traced graph therefore cost several hand-overs each, inside the graph and after it; tensors made
*inside* the scripted call have no Python object and cost none. So ``BatchGraph`` builds the inputs
from the lists (the attention mask from each row's length, or for packed rows from each token's
text), runs the traced graph, moves the probabilities to the CPU and takes the top-k there, all in
one call, which gives the GIL up once.

The top-k is taken at each row's own ``k``, the ``top_k`` of the request it belongs to, as the
pipeline takes it for that request alone: among equal scores, which tokens come first depends on
``k`` (torch's top-k orders ties differently at different ``k``), never on the other rows. So rows
are grouped by ``k``: one top-k call for a batch whose requests share a ``top_k`` (the usual case),
one per distinct ``k`` otherwise. Taken once at the batch's largest ``k`` and cut per request, a
request's answer among equal scores depended on what it was batched with.

Invariants: for the same batch the result is bit for bit what the same module gives unscripted, on
tensors built in Python (checked at load by ``FillMaskModel._batch_graph``, and by
``tests/test_model.py``); ``probs`` is returned only when asked for (requests with ``targets`` pick
their own columns from it).

No ``from __future__ import annotations`` here: TorchScript reads these annotations, and before
torch 2.2 it reads ``Optional``/``List``/``Tuple`` only (not ``X | None``), hence the typing names.
"""

import warnings
from typing import List, Optional, Tuple  # noqa: UP035 (TorchScript, above)

import torch


class BatchGraph(torch.nn.Module):
    """``scores`` (a traced ``(ids, attention, rows, cols) -> softmax at the masks``) on ``device``,
    wrapped so that a batch is one call (see the module docstring)."""

    def __init__(self, scores: torch.nn.Module, device: str, packed: Optional[torch.nn.Module] = None) -> None:  # noqa: UP045
        super().__init__()
        self.scores = scores
        self.packed = packed if packed is not None else Unpacked()
        self.device = device

    def forward(self, ids: List[int], lengths: List[int], rows: List[int], cols: List[int], width: int,  # noqa: UP006
                k: int, ks: List[int], keep: bool, segments: List[int], positions: List[int],  # noqa: UP006
                ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:  # noqa: UP006, UP045
        """``ids``: the batch's token ids, each row padded to ``width``, flat; ``lengths``: each row's
        length before padding; ``rows``, ``cols``: the mask positions; ``ks``: each mask row's ``k``, or
        empty when every row's is ``k``. For packed rows (several texts in one row), ``segments`` and
        ``positions`` give each token's text within its row (-1: padding) and its position within its
        text, flat as ``ids``: a token attends to its own text only; empty for padded rows. Returns
        (the probabilities if ``keep``, else None; the top scores and ids of every mask row, as wide as
        the largest ``k``: row ``r``'s first ``ks[r]`` columns are its top-k), on the CPU."""
        device = torch.device(self.device)
        batch = torch.tensor(ids, dtype=torch.long).view(-1, width)
        mask_rows = torch.tensor(rows, dtype=torch.long).to(device)
        mask_cols = torch.tensor(cols, dtype=torch.long).to(device)
        if len(segments) > 0:
            segment = torch.tensor(segments, dtype=torch.long).view(-1, width)
            attention = (segment.unsqueeze(2) == segment.unsqueeze(1)).unsqueeze(1)
            position = torch.tensor(positions, dtype=torch.long).view(-1, width)
            probs = self.packed(batch.to(device), attention.to(device), position.to(device), mask_rows, mask_cols)
        else:
            place = torch.arange(width, dtype=torch.long).unsqueeze(0)
            attention = (place < torch.tensor(lengths, dtype=torch.long).unsqueeze(1)).long()
            probs = self.scores(batch.to(device), attention.to(device), mask_rows, mask_cols)
        if probs.device.type != "cpu":
            probs = probs.cpu()
        if len(ks) == 0:
            values, indices = probs.topk(min(k, probs.shape[-1]))
        else:
            values, indices = top_k_per_row(probs, ks)
        if keep:
            return probs, values, indices
        return None, values, indices


class Unpacked(torch.nn.Module):
    """The packed path of a model that runs padded rows only (``BatchGraph`` is never given packed rows
    for it)."""

    def forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model runs padded rows only")


def top_k_per_row(probs: torch.Tensor, ks: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """Each row's top ``ks[row]`` (values, indices), padded with zeros to the largest ``k``; one
    ``topk`` call per distinct ``k`` (see the module docstring; a batch of one ``k`` takes one call on
    ``probs`` itself, in ``BatchGraph.forward``)."""
    vocabulary = probs.shape[-1]
    distinct: List[int] = []  # noqa: UP006
    for k in ks:
        if k not in distinct:
            distinct.append(k)
    widest = min(max(distinct), vocabulary)
    values = torch.zeros((probs.shape[0], widest), dtype=probs.dtype)
    indices = torch.zeros((probs.shape[0], widest), dtype=torch.long)
    for k in distinct:
        rows: List[int] = []  # noqa: UP006 (TorchScript has no comprehension with an if)
        for row in range(len(ks)):
            if ks[row] == k:
                rows.append(row)
        group = torch.tensor(rows, dtype=torch.long)
        top_values, top_indices = probs.index_select(0, group).topk(min(k, vocabulary))
        pad = [0, widest - top_values.shape[1]]
        values.index_copy_(0, group, torch.nn.functional.pad(top_values, pad))
        indices.index_copy_(0, group, torch.nn.functional.pad(top_indices, pad))
    return values, indices


def script(scores: torch.nn.Module, device: str, packed: Optional[torch.nn.Module] = None,  # noqa: UP045
           ) -> torch.jit.ScriptModule:
    """``BatchGraph`` around ``scores`` (and ``packed``), compiled (raises what ``torch.jit.script`` raises)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice (the tracer's: model.py)
        return torch.jit.script(BatchGraph(scores, device, packed))
