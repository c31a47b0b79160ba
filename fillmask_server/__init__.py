"""WebSocket streaming inference server for Hugging Face fill-mask models.

Modules, each one idea:
- ``protocol``: the wire format of protocol.md, pure (frame in, request or error out).
- ``batching``: the batching policy, pure (queue in, next batch out).
- ``model``: loading and batched, pipeline-equal prediction.
- ``engine``: the one thread that owns the model and the queue.
- ``server``: the thin websockets shell (connections, outboxes, drain).
- ``http``: the HTTP routes and the decision on each WebSocket handshake.
- ``access``: the handshake's Origin rule, shared token and TLS context, pure.
- ``metrics``: the Prometheus metrics of one server.
- ``config``: the one configuration dataclass, from flags and environment.
- ``checkpoint``: offline random-weight checkpoints for tests and benchmarks.
- ``client``: the Python client (async and sync) and the ``fillmask-client`` command.
"""

__version__ = "0.1.0"
