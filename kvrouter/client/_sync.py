"""``SyncClient``: :class:`~kvrouter.client.Client` for threads and scripts, one private event loop each.

The loop runs on a daemon thread of its own, started at the first call; a call hands its coroutine to that
loop and blocks until it is done. So a ``SyncClient`` may be called from any thread, from several at once,
and even from a thread whose own loop is running (``kvrouter top``'s UI thread closes its feed there),
which ``loop.run_until_complete`` in the caller's thread could not do. The cost is one thread per client
and a thread hop per call (tens of microseconds), little against an HTTP round trip.

Each method is the async client's, by the same name and signature, made blocking by :class:`_Blocking`.
Rejected: a hand-written twin of every method, which would drift from the async one at the first new field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, Final, Generic, ParamSpec, TypeVar, overload

from ._client import DEFAULT_CONNECTIONS, DEFAULT_TIMEOUT_S, DEFAULT_URL, Client, CompletionStream, Prompt

__all__ = ["SyncClient", "SyncCompletionStream"]

P = ParamSpec("P")
T = TypeVar("T")

CLOSE_TIMEOUT_S: Final = 10.0
"""How long :meth:`SyncClient.close` waits for the connections to close and the loop's thread to end."""


class _Blocking(Generic[P, T]):
    """A :class:`Client` coroutine method as a blocking method of :class:`SyncClient`: same name, signature
    and docstring, run on the client's loop."""

    def __init__(self, method: Callable[Concatenate[Client, P], Coroutine[Any, Any, T]]) -> None:
        self._method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, instance: None, owner: type[SyncClient]) -> _Blocking[P, T]: ...

    @overload
    def __get__(self, instance: SyncClient, owner: type[SyncClient]) -> Callable[P, T]: ...

    def __get__(self, instance: SyncClient | None, owner: type[SyncClient]) -> _Blocking[P, T] | Callable[P, T]:
        if instance is None:
            return self
        method = self._method

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return instance._run(lambda: method(instance._client, *args, **kwargs))

        call.__name__ = method.__name__
        call.__qualname__ = f"SyncClient.{method.__name__}"
        call.__doc__ = method.__doc__
        return call


class SyncClient:
    """The service's HTTP API as blocking calls: ``with SyncClient(url) as c: c.workers()``.

    Every method of :class:`Client` is here by the same name, arguments, answer and errors
    (:class:`~kvrouter.errors.ApiError`, :class:`~kvrouter.errors.ServiceUnreachable`); see its docstrings.
    Thread-safe. :meth:`close` (or leaving the ``with`` block) closes the connections and ends the loop's
    thread; the client cannot be used after it.

    Args:
        url, token, timeout, connections: as :class:`Client`'s.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connections: int = DEFAULT_CONNECTIONS,
    ) -> None:
        self._client = Client(url, token=token, timeout=timeout, connections=connections)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._shutdown: weakref.finalize[Any, SyncClient] | None = None
        """Closes the connections and ends the thread: at :meth:`close`, or when the client is collected
        unclosed (``kvrouter top --url`` against a port nobody listens on never closes its feed's)."""

    @property
    def url(self) -> str:
        return self._client.url

    def __repr__(self) -> str:
        return f"SyncClient({self.url!r})"

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _started(self) -> asyncio.AbstractEventLoop:
        """The loop, its thread started on first use.

        Raises:
            RuntimeError: the client is closed, or this is the loop's own thread (it would wait on itself).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=f"kvrouter-client {self.url}", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                self._shutdown = weakref.finalize(self, _shut_down, loop, thread, self._client)
            if threading.current_thread() is self._thread:
                raise RuntimeError(f"{self!r} called from its own loop: await a Client there")
            return self._loop

    def _run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the coroutine ``make()`` gives on the loop and wait for its result (its exception re-raised);
        an interrupt while waiting (Ctrl-C) cancels it."""
        loop = self._started()  # first: a closed client makes no coroutine to leave unawaited
        future = asyncio.run_coroutine_threadsafe(make(), loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Close the connections and stop the loop's thread; a no-op the second time."""
        with self._lock:
            self._closed = True
            shutdown = self._shutdown
        if shutdown is not None:
            shutdown()  # runs once, whoever calls first

    request = _Blocking(Client.request)
    health = _Blocking(Client.health)
    ready = _Blocking(Client.ready)
    register = _Blocking(Client.register)
    unregister = _Blocking(Client.unregister)
    workers = _Blocking(Client.workers)
    query = _Blocking(Client.query)
    query_by_hash = _Blocking(Client.query_by_hash)
    select = _Blocking(Client.select)
    select_and_reserve = _Blocking(Client.select_and_reserve)
    prefill_complete = _Blocking(Client.prefill_complete)
    free = _Blocking(Client.free)
    loads = _Blocking(Client.loads)
    dump = _Blocking(Client.dump)
    busy_threshold = _Blocking(Client.busy_threshold)
    set_busy_threshold = _Blocking(Client.set_busy_threshold)
    decisions = _Blocking(Client.decisions)
    decision = _Blocking(Client.decision)
    events = _Blocking(Client.events)
    metrics = _Blocking(Client.metrics)
    completions = _Blocking(Client.completions)
    chat_completions = _Blocking(Client.chat_completions)
    models = _Blocking(Client.models)

    def stream_completions(
        self,
        prompt: Prompt,
        /,
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> SyncCompletionStream:
        """As :meth:`Client.stream_completions`: ``with c.stream_completions(prompt) as s: for chunk in s``."""
        stream = self._client.stream_completions(
            prompt, model=model, max_tokens=max_tokens, session_id=session_id, **fields
        )
        return SyncCompletionStream(self, stream)

    def stream_chat_completions(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        model: str,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> SyncCompletionStream:
        """As :meth:`Client.stream_chat_completions`: ``with c.stream_chat_completions(messages, model=m) as s``."""
        stream = self._client.stream_chat_completions(
            messages, model=model, max_tokens=max_tokens, session_id=session_id, **fields
        )
        return SyncCompletionStream(self, stream)


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: Client) -> None:
    """Close ``client``'s connections on ``loop``, stop the loop and end its ``thread``; from the thread
    itself (a collection that happened there) the loop is only told to stop."""
    if threading.current_thread() is thread:
        loop.call_soon(loop.stop)
        return
    closing = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
    try:
        closing.result(CLOSE_TIMEOUT_S)
    except (concurrent.futures.TimeoutError, OSError, RuntimeError):  # shutting down: nothing left to tell
        closing.cancel()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()


class SyncCompletionStream:
    """:class:`~kvrouter.client.CompletionStream` stepped from a thread: each item is fetched on the
    client's loop. Iterate it inside ``with``; leaving early closes the connection."""

    def __init__(self, client: SyncClient, stream: CompletionStream) -> None:
        self._client = client
        self._stream = stream
        self._payloads: AsyncIterator[dict[str, Any]] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        return self._stream.headers

    @property
    def worker(self) -> str:
        return self._stream.worker

    @property
    def selection_id(self) -> str:
        return self._stream.selection_id

    def __enter__(self) -> SyncCompletionStream:
        self._client._run(self._stream.__aenter__)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        payloads, self._payloads = self._payloads, None

        async def leave() -> None:
            if isinstance(payloads, AsyncGenerator):
                await payloads.aclose()
            await self._stream.__aexit__(kind, exc, tb)

        self._client._run(leave)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        payloads = self._payloads = aiter(self._stream)

        async def step() -> tuple[bool, dict[str, Any]]:
            try:
                return True, await anext(payloads)
            except StopAsyncIteration:
                return False, {}

        while True:
            more, chunk = self._client._run(step)
            if not more:
                return
            yield chunk
