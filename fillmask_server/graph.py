"""A batch's whole forward pass as one TorchScript call: Python lists in, the top-k out.

Why one call, with Python lists for inputs: the model thread shares the GIL with the event loop and
the other stages, and every time it gives the GIL up it must win it back, which costs up to a switch
interval whenever another thread is running Python. Torch gives the GIL up for more than the call
itself: a tensor that has a Python object takes the GIL each time C++ code starts or stops sharing
it (``TensorImpl::incref_pyobject``/``decref_pyobject``), and releases it again when its Python
object dies. Tensors made from Python lists before the call (``torch.tensor``) and passed to the
traced graph therefore cost several hand-overs each, inside the graph and after it; tensors made
*inside* the scripted call have no Python object and cost none. So ``BatchGraph`` builds the inputs
from the lists (the attention mask from each row's length), runs the traced graph, moves the
probabilities to the CPU and takes the top-k there (as the pipeline does: the same order of ties),
all in one call, which gives the GIL up once.

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

    def __init__(self, scores: torch.nn.Module, device: str) -> None:
        super().__init__()
        self.scores = scores
        self.device = device

    def forward(self, ids: List[int], lengths: List[int], rows: List[int], cols: List[int], width: int,  # noqa: UP006
                k: int, keep: bool) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:  # noqa: UP006, UP045
        """``ids``: the batch's token ids, each row padded to ``width``, flat; ``lengths``: each row's
        length before padding; ``rows``, ``cols``: the mask positions. Returns (the probabilities if
        ``keep``, else None; the top ``k`` scores and ids of every mask row), on the CPU."""
        device = torch.device(self.device)
        batch = torch.tensor(ids, dtype=torch.long).view(-1, width)
        positions = torch.arange(width, dtype=torch.long).unsqueeze(0)
        attention = (positions < torch.tensor(lengths, dtype=torch.long).unsqueeze(1)).long()
        probs = self.scores(batch.to(device), attention.to(device), torch.tensor(rows, dtype=torch.long).to(device),
                            torch.tensor(cols, dtype=torch.long).to(device))
        if probs.device.type != "cpu":
            probs = probs.cpu()
        values, indices = probs.topk(min(k, probs.shape[-1]))
        if keep:
            return probs, values, indices
        return None, values, indices


def script(scores: torch.nn.Module, device: str) -> torch.jit.ScriptModule:
    """``BatchGraph`` around ``scores``, compiled (raises what ``torch.jit.script`` raises)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice, as the tracer's in model._trace
        return torch.jit.script(BatchGraph(scores, device))
