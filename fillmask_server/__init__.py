"""WebSocket streaming inference server for Hugging Face fill-mask models.

Modules, each one idea:
- ``protocol``: the wire format of protocol.md, pure (frame in, request or error out).
- ``session``: one connection's conversation, sans I/O (admission, in-flight table, cancel, deadlines).
- ``batching``: the batching policy, pure (queue in, next batch out).
- ``jobs``: an accepted request's states, the one table of legal moves, and its typed outcomes.
- ``model``: loading, tokenizing, and the batched forward pass (top-k tensors).
- ``intake``: the tokenizer stage's checks; ``decode``: top-k into the pipeline's predictions (JSON).
- ``core``: the engine's decisions, thread-free (admission, job containers, ledgers, the cost model).
- ``engine``: the stages' threads (tokenizer, model, decode) around the core, and the hand-over.
- ``calibration``: what the engine measures at start-up (torch threads, cost model, a dtype's speed).
- ``connection``: one socket's ordered, byte-counted outbox.
- ``server``: the thin websockets shell (wiring, watchdog, drain).
- ``http``: the HTTP routes and the decision on each WebSocket handshake.
- ``access``: the handshake's Origin rule, shared token and TLS context, pure.
- ``metrics``: the Prometheus metrics of one server; ``stats``: the live figures of ``stats`` frames.
- ``allocator``: giving freed answer memory back to the system (glibc).
- ``config``: the one configuration dataclass, from flags and environment.
- ``checkpoint``: offline random-weight checkpoints for tests and benchmarks.
- ``client``: the old import path of the Python client, which is the ``fillmask_client`` package
  (clients/python; it also holds the wire constants both sides share, ``fillmask_client.wire``).
"""

__version__ = "0.1.0"
