"""The synchronous SDK: the same surface as the async one, run on a private event loop.

Each method of :class:`Client` and :class:`SyncSandbox` is the async method of the same
name (same signature and documentation), waited for; sandbox handles are converted both ways.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from dsec_kernel.sdk.client import AsyncClient, Sandbox

__all__ = ["Client", "SyncSandbox"]


def _to_async(value: Any) -> Any:
    if isinstance(value, SyncSandbox):
        return value._sandbox
    if isinstance(value, list | tuple):
        return type(value)(_to_async(v) for v in value)
    return value


class _Loop:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsec-sdk", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def _sync(method: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = self._sandbox if isinstance(self, SyncSandbox) else self._client
        coro = method(
            target, *_to_async(list(args)), **{k: _to_async(v) for k, v in kwargs.items()}
        )
        return self._wrap(self._loop.run(coro))

    return call


class SyncSandbox:
    """A synchronous handle on one sandbox; ``with`` destroys it on exit."""

    def __init__(self, sandbox: Sandbox, loop: _Loop, wrap: Callable[[Any], Any]) -> None:
        self._sandbox = sandbox
        self._loop = loop
        self._wrap = wrap

    id = property(lambda self: self._sandbox.id)
    backend = property(lambda self: self._sandbox.backend)
    node = property(lambda self: self._sandbox.node)
    info = property(lambda self: self._sandbox.info)

    def __repr__(self) -> str:
        return repr(self._sandbox)

    exec = _sync(Sandbox.exec)
    write_file = _sync(Sandbox.write_file)
    read_file = _sync(Sandbox.read_file)
    status = _sync(Sandbox.status)
    destroy = _sync(Sandbox.destroy)
    snapshot = _sync(Sandbox.snapshot)
    restore = _sync(Sandbox.restore)
    reset = _sync(Sandbox.reset)
    fs_diff = _sync(Sandbox.fs_diff)
    commands = _sync(Sandbox.commands)
    trajectory = _sync(Sandbox.trajectory)
    pause = _sync(Sandbox.pause)
    resume = _sync(Sandbox.resume)

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


class Client:
    """The synchronous DSec client: ``with dsec.Client() as c: ...``."""

    def __init__(self, url: str | None = None, token: str | None = None, **kwargs: Any) -> None:
        self._loop = _Loop()
        self._client = AsyncClient(url, token, **kwargs)
        try:
            self._loop.run(self._client.connect())
        except BaseException:
            self._loop.stop()
            raise

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, Sandbox):
            return SyncSandbox(value, self._loop, self._wrap)
        if isinstance(value, list):
            return [self._wrap(v) for v in value]
        return value

    create = _sync(AsyncClient.create)
    get = _sync(AsyncClient.get)
    list = _sync(AsyncClient.list)
    destroy = _sync(AsyncClient.destroy)
    nodes = _sync(AsyncClient.nodes)
    exec_many = _sync(AsyncClient.exec_many)
    fncall = _sync(AsyncClient.fncall)
    publish = _sync(AsyncClient.publish)
    pause = _sync(AsyncClient.pause)
    trajectory = _sync(AsyncClient.trajectory)
    recover = _sync(AsyncClient.recover)
    resume = _sync(AsyncClient.resume)

    def close(self) -> None:
        """Disconnect and stop the client's event loop. Idempotent."""
        if self._loop.thread.is_alive():
            self._loop.run(self._client.close())
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
