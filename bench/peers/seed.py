"""The seed design, a benchmark peer: the one-model, one-queue batching loop this project grew out of.

    python bench/peers/seed.py --model DIR --port 0

A Starlette WebSocket endpoint puts each ``fill_mask`` request on one asyncio queue; one loop takes
everything that arrives until 1 ms passes without a read (the timer restarts on every read), with no
batch cap, and runs ``pipeline(texts, batch_size=len(texts))`` on the event loop. It sends ``hello``
and tagged ``result`` frames, enough for ``bench/loadgen.py``; it has none of the server's limits,
errors or answers under overload. It prints ``ready: ws://127.0.0.1:PORT/`` like ``ws_server.py``.
"""

import argparse
import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from transformers import pipeline


def app(model: str) -> Starlette:
    fill = pipeline("fill-mask", model=model, device="cpu")
    queue: asyncio.Queue[tuple[str, asyncio.Future[Any]]] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def batcher() -> None:
        while True:
            batch = [await queue.get()]
            while True:
                try:
                    batch.append(await asyncio.wait_for(queue.get(), 0.001))
                except TimeoutError:
                    break
            try:
                outs = fill([text for text, _ in batch], batch_size=len(batch))
            except Exception as exc:  # e.g. a text without a mask: the batch fails, the loop goes on
                for _, future in batch:
                    future.set_exception(exc)
                continue
            outs = [outs] if len(batch) == 1 else outs  # the pipeline unwraps a list of one
            for (_, future), out in zip(batch, outs, strict=True):
                future.set_result(out)

    async def answer(ws: WebSocket, request_id: Any, future: asyncio.Future[Any]) -> None:
        try:
            frame = {"type": "result", "id": request_id, "predictions": await future}
        except Exception as exc:
            frame = {"type": "error", "id": request_id, "code": "failed", "message": str(exc)[:200]}
        await ws.send_text(orjson.dumps(frame).decode())

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text('{"type": "hello"}')
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                request = orjson.loads(await ws.receive_text())
                future = asyncio.get_running_loop().create_future()
                await queue.put((request["text"], future))
                spawn(answer(ws, request["id"], future))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        spawn(batcher())
        yield

    return Starlette(routes=[WebSocketRoute("/", endpoint)], lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args, _ = parser.parse_known_args()  # the server's other flags (e.g. --log-level) mean nothing here
    sock = socket.socket()
    sock.bind((args.host, args.port))
    sock.listen(1024)  # connections wait in the backlog until uvicorn serves them
    server = uvicorn.Server(uvicorn.Config(app(args.model), log_level="warning", ws="websockets"))
    print(f"ready: ws://127.0.0.1:{sock.getsockname()[1]}/", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
