"""A blocking client for scripts and notebooks: the async client, run on its own loop in a thread.

    with SyncFillMaskClient("ws://127.0.0.1:8765/") as client:
        print(client.fill_mask("Paris is the [MASK] of France."))

It works where an event loop is already running in the calling thread (Jupyter), because it never uses
that loop: every call is handed to a private loop in a daemon thread and the caller blocks on the answer.
The methods may be called from several threads at once; their requests share the client's connection(s).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import ipaddress
import threading
import urllib.parse
import warnings
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, overload

from .async_client import FillMaskClient, check_texts
from .connection import redact
from .errors import ConnectError, ConnectionLostError, FillMaskError, check_seconds
from .frames import FillMaskResult, Predictions

_T = TypeVar("_T")
_P = ParamSpec("_P")

#: How long the background loop's last tasks have to end once cancelled, when the client closes.
STOP_GRACE_S = 1.0


async def _cancel_the_others() -> None:
    """Cancel every other task of the running loop and wait, at most ``STOP_GRACE_S``, for them to end."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=STOP_GRACE_S)


async def _close_then_stop(client: FillMaskClient) -> None:
    """Close ``client`` and stop the running loop, as ``close`` does but without a caller waiting (for a
    client dropped without ``close()``); the loop's thread then closes the loop and ends."""
    try:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_GRACE_S):
                await client.close()
        await _cancel_the_others()
    finally:
        asyncio.get_running_loop().stop()


Outcome = FillMaskResult | FillMaskError


async def _next_or_end(outcomes: AsyncGenerator[Outcome, None]) -> Outcome | None:
    """The async iterator's next outcome, or None at its end (outcomes are never None)."""
    try:
        return await anext(outcomes)
    except StopAsyncIteration:
        return None


async def _end(outcomes: AsyncGenerator[Outcome, None]) -> None:
    """Close the async iterator, which cancels the requests it still runs. One that a timeout cancelled
    is still running its own cleanup, which cancels them the same way."""
    with contextlib.suppress(RuntimeError):  # ("asynchronous generator is already running")
        await outcomes.aclose()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The client's thread: ``loop`` until it is stopped, then closed (``close`` closes it too, which
    is a no-op once closed; a client dropped without ``close()`` has nobody else to close it)."""
    loop.run_forever()
    loop.close()


def _blocked_loop_hint(urls: Iterable[str]) -> str:
    """Words for a timeout in a thread whose event loop the blocking call held up (a coroutine that called
    the sync client, or a notebook's cell, which runs in its loop) against a server on this machine, or ""
    elsewhere: a server on that loop (one embedded in the same program) could not answer while the
    thread waited, which looks like a busy or silent server. Conditional: the server may be elsewhere."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return ""
    if not any(_on_this_machine(url) for url in urls):
        return ""
    return ("; this call blocked the event loop running in this thread: if the server runs on that loop (one "
            "started in this program), it could not answer; in a coroutine, await FillMaskClient's calls instead")


def _on_this_machine(url: str) -> bool:
    """Whether ``url``'s host is a loopback name or address (where a server in this program listens)."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_options_as(
    source: Callable[Concatenate[Any, _P], None],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, _P], None]]:
    """Give the decorated ``__init__`` the signature of ``source`` (for ``help``, ``inspect`` and type
    checkers): it takes ``*args, **options`` and hands them to ``source``'s class unchanged, so the two
    constructors cannot drift apart (tests/test_client.py compares them)."""

    def apply(target: Callable[..., None]) -> Callable[Concatenate[Any, _P], None]:
        target.__signature__ = inspect.signature(source)  # type: ignore[attr-defined]
        return target

    return apply


class SyncFillMaskClient:
    """Blocking twin of ``FillMaskClient`` (same options, same exceptions), for code without asyncio.

    Use it as a context manager, or call ``close()`` when done. Each call takes an optional ``timeout`` in
    seconds (``None``: no limit; otherwise a finite number >= 0, else ``UsageError`` before anything is
    sent): when it passes, the request is cancelled on the server (§5) and ``TimeoutError`` is raised.
    Ctrl-C while waiting cancels the request the same way as ``KeyboardInterrupt`` propagates (the
    ``cancel`` frame leaves from the client's thread a moment later; ``in_flight`` counts the request
    until the server's answer to it comes), and Ctrl-C while it connects or closes leaves no socket
    or task behind.
    """

    @same_options_as(FillMaskClient.__init__)
    def __init__(self, *args: Any, **options: Any) -> None:
        # The async client checks the options (before any thread starts, so a bad one leaks nothing).
        client = FillMaskClient(*args, **options)
        # ``_closing`` and ``_calls`` (the calls handed to the loop and not yet returned) change under
        # ``_lock``: once ``close`` has set ``_closing``, no call reaches the loop, and every call that
        # did gets its outcome, if the loop ended before giving it one, from ``close``.
        self._lock = threading.Lock()
        self._closing = False
        self._calls: dict[concurrent.futures.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name="fillmask-client", daemon=True)
        self._thread.start()
        self._client = client
        try:
            self._call(self._client.connect(), None)
        except BaseException:
            self._closing = True  # (nothing the caller holds: ``__del__`` has nothing to warn of)
            self._stop_loop()
            raise

    def __enter__(self) -> SyncFillMaskClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._client).replace("FillMaskClient", "SyncFillMaskClient", 1)

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        """A client dropped without ``close()`` (a notebook cell run again, say) held its connection and
        its thread for the life of the process, without a word (an application developer's trial). Now
        it says so, as a ``ResourceWarning`` (shown with ``python -X dev`` or ``-W default``), and closes
        them without waiting: from whatever thread the collector runs this in, the loop's own included."""
        if getattr(self, "_closing", True) or getattr(self, "_client", None) is None or self._loop.is_closed():
            return  # closed, or its ``__init__`` failed (which stopped what it had started)
        self._closing = True
        with contextlib.suppress(Exception):  # the loop closed meanwhile
            asyncio.run_coroutine_threadsafe(_close_then_stop(self._client), self._loop)
        # (After the close: under -W error the warning raises, and the close must not depend on it.)
        _warn(f"unclosed {self!r}: call close(), or use it in a with block", ResourceWarning, source=self)

    def close(self) -> None:
        """Close the connection and stop the background thread; safe to call twice, and from any thread
        while other threads' calls are under way (they end with ``ConnectionLostError``, as the async
        client's do, and so does a call made after ``close``)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            self._call(self._client.close(), None, closing=True)
            # Other threads' calls end on their own once the client is closed (a long fill_mask_many
            # with return_exceptions takes a few turns of the loop to fill its list): let them, for up to
            # STOP_GRACE_S, before the stop cancels what is left.
            with self._lock:
                running = [future for future in self._calls if not future.done()]
            concurrent.futures.wait(running, timeout=STOP_GRACE_S)
        finally:
            try:
                self._stop_loop()
            finally:  # (also after a Ctrl-C during the stop: no other thread's call is left waiting)
                with self._lock:
                    abandoned = list(self._calls.items())
                for future, coro in abandoned:  # handed to the loop as it stopped: never to be run
                    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                        coro.close()
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        future.set_exception(self._closed_error())

    def _closed_error(self) -> ConnectionLostError:
        """What a call cut short by ``close``, or made after it, raises: the async client's words."""
        url = redact(self._client.url)
        return ConnectionLostError(f"the client for {url} was closed", url=url)

    def _stop_loop(self) -> None:
        """End the background loop as ``asyncio.run`` ends its own: the tasks still on it (a ``connect``
        or ``close`` that Ctrl-C cut short, a connection's reader and keepalive) are cancelled and given
        up to ``STOP_GRACE_S`` to finish, so that they close their sockets and none is destroyed
        pending; then the loop stops, its thread ends and it is closed. A Ctrl-C meanwhile ends the
        wait, and is raised once the loop is closed."""
        interrupted: BaseException | None = None
        try:
            asyncio.run_coroutine_threadsafe(_cancel_the_others(), self._loop).result(STOP_GRACE_S + 1)
        except concurrent.futures.TimeoutError:
            pass  # tasks that outlast the grace: the loop stops all the same
        except BaseException as exc:  # a Ctrl-C meanwhile: raised once the loop is closed
            interrupted = exc
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if interrupted is not None:
            raise interrupted

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float | None, *, closing: bool = False) -> _T:
        """Run ``coro`` on the client's loop and wait for it; ``timeout`` is checked before it starts."""
        if timeout is not None:
            try:
                check_seconds("timeout", timeout)
            except BaseException:
                coro.close()
                raise
        with self._lock:
            if (self._closing and not closing) or self._loop.is_closed():
                coro.close()
                raise self._closed_error()
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._calls[future] = coro
        try:
            # Beyond threading.TIMEOUT_MAX (about 292 years) a wait is no wait the platform can time:
            # no limit, as it means (Future.result would raise OverflowError, the request sent).
            return future.result(None if timeout is not None and timeout > threading.TIMEOUT_MAX else timeout)
        except concurrent.futures.TimeoutError:
            # Cancelling the concurrent future cancels the task on the loop, which sends `cancel` frames.
            future.cancel()
            raise TimeoutError(f"no answer within timeout={timeout:g} s; the call was cancelled"
                               + _blocked_loop_hint(self._client.urls)) from None
        except ConnectError as exc:
            hint = _blocked_loop_hint([exc.url]) if exc.kind == "timeout" else ""
            if not hint:
                raise
            raise ConnectError(str(exc) + hint, url=exc.url, http_status=exc.http_status,
                               kind=exc.kind) from exc.__cause__
        except KeyboardInterrupt:
            future.cancel()
            raise
        except concurrent.futures.CancelledError:  # its task cancelled as ``close`` stopped the loop
            if self._closing and not closing:
                raise self._closed_error() from None
            raise
        finally:
            with self._lock:
                self._calls.pop(future, None)

    @property
    def hello(self) -> dict[str, Any]:
        """The server's ``hello`` frame (§2)."""
        return self._client.hello

    @property
    def limits(self) -> dict[str, Any]:
        """The server's ``limits`` (§2)."""
        return self._client.limits

    @property
    def model(self) -> str:
        """The model the server runs."""
        return self._client.model

    @property
    def mask_token(self) -> str:
        """The literal mask string a text must contain, such as ``[MASK]``."""
        return self._client.mask_token

    def fill_mask(
        self,
        text: str,
        *,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> Predictions:
        """Blocking ``FillMaskClient.fill_mask``; ``timeout`` seconds, then cancel and ``TimeoutError``."""
        coro = self._client.fill_mask(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
        return self._call(coro, timeout)

    def fill_mask_result(
        self,
        text: str,
        *,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> FillMaskResult:
        """Blocking ``FillMaskClient.fill_mask_result``: predictions, timings and the raw frame."""
        coro = self._client.fill_mask_result(text, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
        return self._call(coro, timeout)

    def fill_mask_iter(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = None,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> Generator[FillMaskResult | FillMaskError, None, None]:
        """Blocking ``FillMaskClient.fill_mask_iter``: a generator of each text's ``FillMaskResult``, or
        its ``FillMaskError`` (yielded, not raised), in input order, each as soon as it and all before it
        are ready.

        A generator of texts is read as the requests go, at most ``AHEAD * concurrency`` texts ahead of
        the outcome your loop waits for (a list is sent as fast as ``concurrency`` allows), and on the
        client's thread: it must not call this client, and while it blocks (a pipe that has nothing
        yet) nothing else of the client moves, its keepalive included. ``timeout`` bounds each wait for
        the next outcome: when it passes, the requests still running are cancelled on the server and
        ``TimeoutError`` is raised, which ends the iteration. Leaving the loop early cancels them too,
        as soon as the generator is closed (a ``for`` loop's ``break`` drops it;
        ``contextlib.closing`` makes it explicit) or collected; the cancel is handed to the client's
        thread, not waited for."""
        check_texts(texts)  # (here, not at the first ``next``: a bare text is a mistake at the call)
        if timeout is not None:
            check_seconds("timeout", timeout)
        outcomes = self._client.fill_mask_iter(
            texts, concurrency=concurrency, top_k=top_k, targets=targets, deadline_ms=deadline_ms)
        return self._outcomes(outcomes, timeout)

    def _outcomes(self, outcomes: AsyncGenerator[Outcome, None],
                  timeout: float | None) -> Generator[Outcome, None, None]:
        """``fill_mask_iter``'s generator: each outcome of ``outcomes`` fetched on the client's loop."""
        try:
            while (outcome := self._call(_next_or_end(outcomes), timeout)) is not None:
                yield outcome
        finally:
            # Handed over, never waited for: the collector may run this on any thread, the loop's own
            # or one inside ``_call`` holding ``_lock`` (a review's deadlock), and after a timeout the
            # loop may be held up by a text source that blocks.
            ending = _end(outcomes)
            try:
                asyncio.run_coroutine_threadsafe(ending, self._loop)
            except RuntimeError:  # the loop closed: nothing runs any more
                ending.close()

    @overload
    def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: Literal[False] = ...,
        timeout: float | None = ...,
    ) -> list[Predictions]: ...

    @overload
    def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: Literal[True],
        timeout: float | None = ...,
    ) -> list[Predictions | FillMaskError]: ...

    @overload
    def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = ...,
        top_k: int | None = ...,
        targets: str | Sequence[str] | None = ...,
        deadline_ms: float | None = ...,
        return_exceptions: bool,
        timeout: float | None = ...,
    ) -> list[Predictions] | list[Predictions | FillMaskError]: ...

    def fill_mask_many(
        self,
        texts: Iterable[str],
        *,
        concurrency: int | None = None,
        top_k: int | None = None,
        targets: str | Sequence[str] | None = None,
        deadline_ms: float | None = None,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Predictions] | list[Predictions | FillMaskError]:
        """Blocking ``FillMaskClient.fill_mask_many``; ``timeout`` bounds the whole batch."""
        # A list here, in the caller's thread, not on the loop (checked first: one bare text, None...
        # are the async client's UsageError, not a TypeError, and one text listed would be one request
        # per character).
        check_texts(texts)
        coro: Coroutine[Any, Any, list[Predictions] | list[Predictions | FillMaskError]]
        coro = self._client.fill_mask_many(
            list(texts),
            concurrency=concurrency,
            top_k=top_k,
            targets=targets,
            deadline_ms=deadline_ms,
            return_exceptions=return_exceptions,
        )
        return self._call(coro, timeout)
