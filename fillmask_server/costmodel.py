"""The cost model: a batch's engine time predicted from its shape, and fitted online from the batches that ran.

A batch of ``rows`` requests that occupies ``padded`` tokens (rows x its widest row, padding included)
and whose answers take ``out`` bytes costs ``overhead + token·padded + row·rows + byte·out`` seconds of
engine time: the forward pass and the decode (``Coefficients``). ``batching.BatchPolicy`` chooses
batches by it; ``core.EngineCore`` keeps a ``CostModel`` and feeds it each batch's measured time; the
start-up calibration gives it its first coefficients (``fit``).

Pure arithmetic: no threads, no torch, no clock. Tests: tests/test_core.py (the online fit, with fake
timings) and tests/test_calibration.py (the start-up fit under noise).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Coefficients:
    """The cost model: seconds of engine time for a batch (see the module docstring). The defaults are
    a prior for a CPU, used until the engine has measured its own."""

    overhead_s: float = 1e-3
    token_s: float = 2e-5
    row_s: float = 1e-4
    byte_s: float = 2e-8

    def batch_s(self, rows: int, padded: int, out_bytes: float) -> float:
        """Predicted engine time of a batch."""
        return self.overhead_s + self.token_s * padded + self.row_s * rows + self.byte_s * out_bytes

    def own_s(self, n_tokens: int, out_bytes: float) -> float:
        """A request's own work: what it adds to a batch, without padding."""
        return self.token_s * n_tokens + self.row_s + self.byte_s * out_bytes


class CostModel:
    """The forward pass's time fitted online as ``overhead + token·padded + row·rows`` (weighted least
    squares on relative error, older batches forgotten by ``forget`` per batch, no coefficient below
    zero and the overhead not above the fastest recent batch, both within the fit; then the overhead and
    the token price raised to a share of the prior's where below it), and the decode stage's time per
    byte of answer bound as a moving average.

    ``prior`` (the start-up calibration's fit, or the CPU defaults) is kept as a few pseudo-batches of
    small weight that are never forgotten: the fit stays defined when the server runs one shape only,
    and shapes it has not run are predicted from the prior's slope.
    """

    PRIOR_SHAPES = ((1, 16), (8, 128), (32, 1024))
    PRIOR_WEIGHT = 0.001  # each prior pseudo-batch weighs this many real batches
    # The fitted per-batch overhead and per-token price never go below these shares of the prior's.
    # Timings of a slow or busy machine are noisy, and a fit of no overhead made every batch of mixed
    # lengths look less efficient than its rows run alone; a fit of no token price made every request's
    # output (priced in tokens: byte / token) too large for any batch but its own. Either way the
    # server ran batches of one row. (The token price's floor is low: a small model's real price is far
    # below the CPU prior's; a prior of next to no token price is floored itself, in ``__init__``.)
    OVERHEAD_FLOOR = 0.5
    TOKEN_FLOOR = 0.01
    # ... but the overhead never above the fastest recent batch, which wins over its floor (every
    # coefficient is nonnegative, so no batch takes less than the overhead): a prior timed while a
    # neighbour was busy (two replicas calibrating at once) would otherwise keep a floor far above what
    # any batch takes, for good. The fastest batch is forgotten slowly (its bound grows by 1 / ``forget``
    # per batch), so a machine that became slower is followed too.

    def __init__(self, prior: Coefficients | None = None, forget: float = 0.98) -> None:
        self.prior = prior or Coefficients()
        self.forget = forget
        self._s = [[0.0] * 3 for _ in range(3)]  # sum of w·x·xᵀ over observed batches
        self._r = [0.0] * 3  # sum of w·x·y
        self._yy = 0.0  # sum of w·y²
        self._prior_s = [[0.0] * 3 for _ in range(3)]
        self._prior_r = [0.0] * 3
        self._prior_yy = 0.0
        for rows, padded in self.PRIOR_SHAPES:
            seconds = self.prior.overhead_s + self.prior.token_s * padded + self.prior.row_s * rows
            _accumulate(self._prior_s, self._prior_r, (1.0, padded, rows), seconds, self.PRIOR_WEIGHT)
            self._prior_yy += self.PRIOR_WEIGHT * 1.0  # w·y² with w = weight / y²
        self.batches = 0
        # A prior of no token price (or next to none: a calibration's degenerate fit) gives way to
        # TOKEN_FLOOR of TOKEN_FLOOR of the CPU defaults' price, from the start, as a fit would.
        self._token_floor = self.TOKEN_FLOOR * max(self.prior.token_s, self.TOKEN_FLOOR * Coefficients.token_s)
        self.coefficients = replace(self.prior, token_s=max(self.prior.token_s, self._token_floor))
        self._fastest_s = float("inf")  # the fastest recent batch, slowly forgotten (above)
        self._case: tuple[int, ...] = (0, 0, 0)  # the coefficients the last fit held at a bound

    def observe_forward(self, rows: int, padded_tokens: int, seconds: float) -> None:
        """One forward pass of ``rows`` rows and ``padded_tokens`` padded tokens took ``seconds``."""
        if seconds <= 0 or rows < 1:
            return
        for row in self._s:
            for j in range(3):
                row[j] *= self.forget
        self._r = [value * self.forget for value in self._r]
        self._yy *= self.forget
        _accumulate(self._s, self._r, (1.0, padded_tokens, rows), seconds, 1.0)
        self._yy += 1.0
        self.batches += 1
        self._fastest_s = min(seconds, self._fastest_s / self.forget)
        s = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(self._s, self._prior_s, strict=True)]
        r = [a + b for a, b in zip(self._r, self._prior_r, strict=True)]
        # The fastest batch bounds the overhead within the fit (a fact about the timings: the token and
        # the row price then take up what the overhead does not explain; an overhead cut to it after
        # the fit left every other batch predicted that much too fast). The floors are policy, which
        # keeps batching worth its while in the model: they raise a coefficient after the fit.
        high = [self._fastest_s, math.inf, math.inf]
        theta, self._case = _bounded_least_squares(s, r, self._yy + self._prior_yy, [0.0] * 3, high, self._case)
        overhead = max(theta[0], min(self.OVERHEAD_FLOOR * self.prior.overhead_s, self._fastest_s))
        token = max(theta[1], self._token_floor)
        self.coefficients = Coefficients(overhead, token, theta[2], self.coefficients.byte_s)

    def observe_decode(self, result_bytes: int, seconds: float) -> None:
        """The decode stage turned answers bounded by ``result_bytes`` into JSON in ``seconds``."""
        if result_bytes > 0 and seconds >= 0:
            old = self.coefficients
            self.coefficients = Coefficients(old.overhead_s, old.token_s, old.row_s,
                                             0.9 * old.byte_s + 0.1 * seconds / result_bytes)

    def forward_s(self, rows: int, padded_tokens: int) -> float:
        c = self.coefficients
        return c.overhead_s + c.token_s * padded_tokens + c.row_s * rows


def fit(samples: Iterable[tuple[int, int, float]], byte_s: float = Coefficients.byte_s) -> Coefficients | None:
    """Least-squares coefficients (relative error, none below zero) of ``(rows, padded, seconds)``
    samples: the start-up calibration's first fit. None with fewer than three timed samples. Samples
    that do not determine all three (a single shape) give one of the fits that explains them equally
    well; the calibration times shapes that vary rows and tokens apart."""
    s = [[0.0] * 3 for _ in range(3)]
    r = [0.0] * 3
    yy = 0.0
    count = 0
    for rows, padded, seconds in samples:
        if seconds > 0:
            _accumulate(s, r, (1.0, padded, rows), seconds, 1.0)
            yy += 1.0
            count += 1
    theta = _bounded_least_squares(s, r, yy, [0.0] * 3, [math.inf] * 3)[0] if count >= 3 else None
    return None if theta is None else Coefficients(theta[0], theta[1], theta[2], byte_s)


def _accumulate(s: list[list[float]], r: list[float], x: tuple[float, float, float], y: float,
                weight: float) -> None:
    """Add one sample, weighted by ``weight / y²`` (the fit minimises relative error)."""
    w = weight / (y * y)
    for i in range(3):
        r[i] += w * x[i] * y
        for j in range(3):
            s[i][j] += w * x[i] * x[j]


#: ``_bounded_least_squares``' cases, per coefficient 0 (free), 1 (at its low bound) or 2 (at its high
#: one), fewest held first: the usual answers (within the bounds; one coefficient at a bound) come first.
_CASES = sorted(itertools.product(range(3), repeat=3), key=lambda case: sum(choice != 0 for choice in case))


def _bounded_least_squares(s: list[list[float]], r: list[float], yy: float, low: list[float], high: list[float],
                           first: tuple[int, ...] = (0, 0, 0)) -> tuple[list[float], tuple[int, ...]]:
    """argmin over ``low`` ≤ θ ≤ ``high`` of θᵀSθ − 2θᵀr (+ yy), for S positive semidefinite (three
    coefficients; ``high`` may be infinite; ``low`` finite).

    Each case holds some coefficients at a bound and solves for the others, fewest held first. The
    objective is convex, so the first case whose solution lies within the bounds and whose held
    coefficients would not lower it by moving inward (the gradient's sign: the KKT conditions) is the
    answer: one solve when the unconstrained minimum lies within the bounds, a few of two unknowns when
    one coefficient is held (it runs per batch). ``first`` is tried before the others: the case of the
    last answer, which the next batch's fit mostly shares. Where S is singular no case may pass that
    check; then the case within the bounds of the lowest objective is the answer (every coefficient at
    its low bound is always one). Returns the answer and its case."""
    n = len(r)
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    for case in (first, *(case for case in _CASES if case != first)):
        if any(choice == 2 and high[i] == math.inf for i, choice in enumerate(case)):
            continue
        theta = [0.0 if choice == 0 else low[i] if choice == 1 else high[i] for i, choice in enumerate(case)]
        free = [i for i in range(n) if case[i] == 0]
        if free:
            held = [i for i in range(n) if case[i] != 0]
            solved = _solve([[s[i][j] for j in free] for i in free],
                            [r[i] - sum(s[i][j] * theta[j] for j in held) for i in free])
            if solved is None or any(not low[i] <= value <= high[i] for i, value in zip(free, solved, strict=True)):
                continue
            for i, value in zip(free, solved, strict=True):
                theta[i] = value
        pulls = [[s[i][j] * theta[j] for j in range(n)] for i in range(n)]
        gradient = [sum(pulls[i]) - r[i] for i in range(n)]
        slack = [1e-9 * (abs(r[i]) + sum(abs(pull) for pull in pulls[i])) for i in range(n)]
        if all(choice == 0 or (gradient[i] >= -slack[i] if choice == 1 else gradient[i] <= slack[i])
               for i, choice in enumerate(case)):
            return theta, case
        error = yy - 2 * sum(t * v for t, v in zip(theta, r, strict=True)) + sum(
            theta[i] * pull for i in range(n) for pull in pulls[i])
        if best is None or error < best[0]:
            best = (error, theta, case)
    assert best is not None  # (every coefficient at its low bound is always within the bounds)
    return best[1], best[2]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(col + 1, n):
            factor = m[i][col] / m[col][col]
            for j in range(col, n + 1):
                m[i][j] -= factor * m[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x
