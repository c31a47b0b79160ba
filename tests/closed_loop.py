"""A fake-clock closed loop around ``BatchPolicy``: clients keep requests in flight, each batch takes the
cost model's predicted time, and every answer brings its client's next request. No threads, no real
clock, no torch: what the fairness tests measure is the policy's order alone."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fillmask_server.batching import BatchPolicy
from fillmask_server.costmodel import Coefficients

# Token-equivalent prices fitted live (bench/results/issue17-xeon-fairness.md): a tiny encoder, where a
# row costs dozens of tokens, and a bert-base-shaped one, where tokens dominate.
TINY = Coefficients(overhead_s=0.00135, token_s=2.8e-6, row_s=178e-6, byte_s=7.3e-8)
BASE = Coefficients(overhead_s=0.0016, token_s=698e-6, row_s=1.6e-3, byte_s=7e-8)

Make = Callable[[random.Random], tuple[int, int]]  # -> (tokens, answer bytes) of a client's next request


@dataclass(eq=False)
class SimJob:
    arrival: float
    n_tokens: int
    result_bytes: int
    owner: object  # the client's connection at the time
    client: Client
    deadline: float | None = None
    missed: int = 0


@dataclass(eq=False)
class Client:
    """Keeps ``depth`` requests in flight, each made by ``make``; records what it was served. With
    ``reconnects``, it sends ``depth`` at once and, when all are answered, closes its connection (the
    policy forgets it) and sends the next ``depth`` on a new one."""

    depth: int
    make: Make
    joins_at: float = 0.0
    reconnects: bool = False
    latencies: list[float] = field(default_factory=list)  # of requests sent after the warm-up
    engine_s: float = 0.0  # own work served after the warm-up, in engine seconds
    connection: object = field(default_factory=object)
    unanswered: int = 0


def mixed_lengths(rng: random.Random) -> tuple[int, int]:
    """The mixed corpus's shape: short, middling and long texts, one or two masks, top_k 5."""
    r = rng.random()
    n = rng.randint(8, 10) if r < 0.4 else rng.randint(15, 18) if r < 0.85 else rng.randint(50, 81)
    return n, (1 if rng.random() < 0.8 else 2) * 5 * (90 + 6 * n)


def fixed(n_tokens: int, result_bytes: int) -> Make:
    return lambda rng: (n_tokens, result_bytes)


def run(policy: BatchPolicy, clients: list[Client], cost: Coefficients, seconds: float,
        warmup: float = 0.0, seed: int = 0) -> None:
    """Run the closed loop for ``seconds`` of simulated engine time; fills each client's records."""
    rng = random.Random(seed)
    queue: deque[SimJob] = deque()
    now = 0.0
    joined: set[int] = set()

    def send(client: Client) -> None:
        n, size = client.make(rng)
        client.unanswered += 1
        queue.append(SimJob(now, n, size, client.connection, client))

    while now < seconds:
        for n, client in enumerate(clients):
            if n not in joined and client.joins_at <= now:
                joined.add(n)
                for _ in range(client.depth):
                    send(client)
        decision = policy.take(queue, now, None, cost)
        now += cost.batch_s(len(decision.batch), decision.padded_tokens,
                            sum(job.result_bytes for job in decision.batch)) if decision.batch else 1e-3
        for job in decision.batch:
            client = job.client
            client.unanswered -= 1
            if job.arrival >= warmup:
                client.latencies.append(now - job.arrival)
                client.engine_s += cost.own_s(job.n_tokens, job.result_bytes)
            if not client.reconnects:
                send(client)
            elif not client.unanswered:
                policy.forget(client.connection)
                client.connection = object()
                for _ in range(client.depth):
                    send(client)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def tail_ratio(clients: list[Client]) -> float:
    """p99 over p50 of every client's latencies together."""
    every = [x for client in clients for x in client.latencies]
    return percentile(every, 0.99) / percentile(every, 0.50)

