"""Python client for the fill-mask WebSocket server (``protocol.md``), async and blocking.

    import asyncio
    from fillmask_client import FillMaskClient

    async def main() -> None:
        async with FillMaskClient("ws://127.0.0.1:8765/") as client:
            print(await client.fill_mask("Paris is the [MASK] of France.", top_k=3))

    asyncio.run(main())

Modules, one idea each: ``wire`` (the protocol's constants, which the server imports too), ``frames``
(the wire, without I/O), ``errors`` (what a failed call raises), ``retry`` (backoff arithmetic),
``state`` (a connection's states and their one transition function), ``connection`` (one WebSocket and
the requests in flight on it), ``pool`` (which connection a call goes on; replacing those that go
away), ``async_client`` (the calls: retries and resends), ``sync_client`` (the same behind a background
loop), ``cli`` (the ``fillmask-client`` command).

This package needs only ``websockets`` and ``orjson``; it installs without the server (clients/python).
"""

from ._version import __version__ as __version__
from .async_client import DEFAULT_URL, FillMaskClient
from .cli import main
from .errors import (
    ConnectError,
    ConnectionLostError,
    DeadlineExceededError,
    FillMaskError,
    OverloadedError,
    RequestError,
    UsageError,
)
from .frames import FillMaskResult, Prediction, Predictions, ScoredTarget
from .retry import ReconnectBackoff, RetryPolicy
from .state import ConnState
from .sync_client import SyncFillMaskClient

__all__ = [
    "DEFAULT_URL",
    "ConnState",
    "ConnectError",
    "ConnectionLostError",
    "DeadlineExceededError",
    "FillMaskClient",
    "FillMaskError",
    "FillMaskResult",
    "OverloadedError",
    "Prediction",
    "Predictions",
    "ReconnectBackoff",
    "RequestError",
    "RetryPolicy",
    "ScoredTarget",
    "SyncFillMaskClient",
    "UsageError",
    "main",
]
