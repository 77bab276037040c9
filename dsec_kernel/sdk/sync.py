"""The synchronous SDK: the same surface as the async one, run on a private event loop.

Each method of :class:`Client`, :class:`SyncSandbox`, :class:`SyncJob` and :class:`SyncPool`
is the async method of the same name (same signature and documentation), waited for;
sandbox, job and pool handles are converted both ways.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from dsec_kernel.sdk.client import AsyncClient
from dsec_kernel.sdk.job import Job
from dsec_kernel.sdk.pool import Pool
from dsec_kernel.sdk.sandbox import Sandbox

__all__ = ["Client", "SyncJob", "SyncPool", "SyncSandbox"]


def _to_async(value: Any) -> Any:
    if isinstance(value, _Handle):
        return value._target
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
        coro = method(
            self._target, *_to_async(list(args)), **{k: _to_async(v) for k, v in kwargs.items()}
        )
        return self._wrap(self._loop.run(coro))

    return call


class _Handle:
    """A synchronous handle on an async SDK object, run on the client's loop."""

    def __init__(self, target: Any, loop: _Loop, wrap: Callable[[Any], Any]) -> None:
        self._target = target
        self._loop = loop
        self._wrap = wrap


class SyncSandbox(_Handle):
    """A synchronous handle on one sandbox; ``with`` destroys it on exit."""

    id = property(lambda self: self._target.id)
    backend = property(lambda self: self._target.backend)
    node = property(lambda self: self._target.node)
    info = property(lambda self: self._target.info)
    error = property(lambda self: self._target.error)

    def __repr__(self) -> str:
        return repr(self._target)

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


class SyncJob(_Handle):
    """A job (see :meth:`AsyncClient.job`): ``with client.job(...) as job:`` opens it and
    renews its lease in the background; leaving the block ends it."""

    name = property(lambda self: self._target.name)
    info = property(lambda self: self._target.info)

    create = _sync(Job.create)
    sandboxes = _sync(Job.sandboxes)
    renew = _sync(Job.renew)
    close = _sync(Job.close)

    def stop_renewing(self) -> None:
        """Stop the background renewals, as a preempted trainer would."""

        async def stop() -> None:
            self._target.stop_renewing()

        self._loop.run(stop())

    def __enter__(self) -> SyncJob:
        self.renew()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncPool(_Handle):
    """A warm pool (see :meth:`AsyncClient.pool`); ``with`` closes it on exit."""

    name = property(lambda self: self._target.name)
    info = property(lambda self: self._target.info)

    acquire = _sync(Pool.acquire)
    acquire_many = _sync(Pool.acquire_many)
    release = _sync(Pool.release)
    close = _sync(Pool.close)

    def __enter__(self) -> SyncPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """The synchronous DSec client: ``with dsec.Client() as c: ...``."""

    def __init__(self, url: str | None = None, token: str | None = None, **kwargs: Any) -> None:
        self._loop = _Loop()
        self._target = AsyncClient(url, token, **kwargs)
        try:
            self._loop.run(self._target.connect())
        except BaseException:
            self._loop.stop()
            raise

    def _wrap(self, value: Any) -> Any:
        for cls, sync in ((Sandbox, SyncSandbox), (Job, SyncJob), (Pool, SyncPool)):
            if isinstance(value, cls):
                return sync(value, self._loop, self._wrap)
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
    pool = _sync(AsyncClient.pool)
    prestage = _sync(AsyncClient.prestage)

    def job(self, name: str, *, priority: int = 0, lease_s: float = 30.0) -> SyncJob:
        """See :meth:`AsyncClient.job`; use it as ``with``."""
        return self._wrap(self._target.job(name, priority=priority, lease_s=lease_s))

    def close(self) -> None:
        """Disconnect and stop the client's event loop. Idempotent."""
        if self._loop.thread.is_alive():
            self._loop.run(self._target.close())
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
