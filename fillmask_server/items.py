"""What a batch is made of and what the forward pass gives back, as plain values: ``Item`` (one text
of a batch) in, ``TopK`` (its top-k, as tensors and lists) out, and ``TargetError`` when a request's
targets map to no token. No torch: the tensors come in from ``model``, and the code around the model
(``intake``, ``engine``, ``decode``, ``calibration``) imports these without needing the model's module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, unsafe_hash=True)  # a value, never changed (not frozen: see jobs.VALUES)
class Item:
    """One text of a batch: its token ids (with special tokens), top_k, and target ids or None."""

    input_ids: Sequence[int]
    top_k: int
    target_ids: tuple[int, ...] | None = None


class TargetError(ValueError):
    """No target of a request maps to a vocabulary token."""


@dataclass
class TopK:
    """The forward pass's answer for a batch, in the items' order: Python lists and CPU tensors.

    For item ``i``: ``spans[i]`` is the [first, last) range of its mask rows; ``columns[first:last]``
    are the mask positions in its ``input_ids``. Items without targets share one top-k over the
    vocabulary (``values``/``indices``, row ``plain_rows[i] + j`` for its ``j``-th mask, as wide as the
    largest ``top_k`` among them; each row's first ``top_k`` columns are its own top-k, taken at its
    item's ``top_k``, and each item keeps those). An item with
    targets has its own ``targeted[i] = (values, picks)`` where ``picks`` index its ``target_ids``.
    ``candidates`` (the decode stage) turns the shared top-k into lists once, on its first call.
    """

    spans: list[tuple[int, int]]
    columns: list[int]
    values: Any = None
    indices: Any = None
    plain_rows: dict[int, int] | None = None
    targeted: dict[int, tuple[Any, Any]] | None = None
    lists: tuple[list[list[float]], list[list[int]]] | None = field(default=None, repr=False, compare=False)
    all_numbers: bool | None = field(default=None, repr=False, compare=False)  # (``numbers``: once per batch)

    def numbers(self, i: int, item: Item) -> bool:
        """Whether item ``i``'s scores are all numbers (none NaN or infinite, as a model whose activations
        overflow on some texts gives): one sum over the batch's lists (which ``candidates`` makes anyway),
        item by item only in a batch where that sum is not a number. (No torch operation: the decode
        stage's CPU is the server's, and small tensor operations there cost more than these sums.)"""
        if self.targeted is not None and i in self.targeted:
            return math.isfinite(sum(map(sum, self.targeted[i][0].tolist())))
        values = self._lists()[0]
        if self.all_numbers is None:
            self.all_numbers = math.isfinite(sum(map(sum, values)))
        if self.all_numbers:
            return True
        assert self.plain_rows is not None
        first, last = self.spans[i]
        row = self.plain_rows[i]
        return math.isfinite(sum(sum(line[:item.top_k]) for line in values[row: row + last - first]))

    def _lists(self) -> tuple[list[list[float]], list[list[int]]]:
        """The shared top-k as Python lists: one conversion per batch, not three tensor operations per item."""
        if self.lists is None:
            assert self.values is not None and self.indices is not None
            self.lists = (self.values.tolist(), self.indices.tolist())
        return self.lists

    def candidates(self, i: int, item: Item) -> tuple[list[int], list[list[float]], list[list[int]]]:
        """Item ``i``'s mask positions, and per mask its scores and token ids, best first (Python lists)."""
        first, last = self.spans[i]
        positions = self.columns[first:last]
        if self.targeted is not None and i in self.targeted:
            values, picks = self.targeted[i]
            targets = item.target_ids or ()
            return positions, values.tolist(), [[targets[p] for p in row] for row in picks.tolist()]
        assert self.plain_rows is not None
        values, indices = self._lists()
        row = self.plain_rows[i]
        count = last - first
        top_k = item.top_k
        scores = [line[:top_k] for line in values[row: row + count]]
        tokens = [line[:top_k] for line in indices[row: row + count]]
        return positions, scores, tokens
