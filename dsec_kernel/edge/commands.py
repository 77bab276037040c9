"""Commands in sandboxes, and stateless calls: run, logged, answered once per request id."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, ExecCall
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import (
    MAX_RESPONSE_OUTPUT,
    Error,
    ExecRequest,
    ExecResponse,
    ExecResult,
    FncallRequest,
    fit_results,
)
from dsec_kernel.edge.history import History
from dsec_kernel.edge.table import SandboxRecord, SandboxTable
from dsec_kernel.trajectory import Replays

__all__ = ["Commands"]


class Commands:
    """Runs exec requests (each sandbox's command through the guards, then its backend, then
    into its trajectory) and fncalls; ``running`` counts those under way. ``awake`` readies a
    sandbox for work (:meth:`~dsec_kernel.edge.power.Power.awake`)."""

    def __init__(
        self,
        node: str,
        backends: dict[str, Backend],
        table: SandboxTable,
        awake: Callable[[SandboxRecord], Awaitable[None]],
        replays: Replays,
        history: History,
        hooks: Hooks,
    ) -> None:
        self.node = node
        self.backends = backends
        self.table = table
        self.awake = awake
        self.replays = replays
        self.history = history
        self.hooks = hooks
        self.running = 0

    async def exec(self, r: ExecRequest, call: bus.Call) -> ExecResponse:
        # what the answer can carry is shared out before the commands run, not after: 150
        # commands printing 8 MiB each were held whole (2.9 GB) to send back 12 MB
        share = MAX_RESPONSE_OUTPUT // (2 * len(r.sandbox_ids))
        if r.max_output_bytes > share:
            r = r.model_copy(update={"max_output_bytes": max(share, 4096)})
        results = await asyncio.gather(*(self._exec_one(r, sid) for sid in r.sandbox_ids))
        return ExecResponse(results=fit_results(list(results)))

    async def _exec_one(self, r: ExecRequest, sandbox_id: str) -> ExecResult:
        """Run the command, log it in the sandbox's trajectory, answer; a request id that
        already ran there gets the logged result."""
        rid = r.request_id
        rec: SandboxRecord | None = None
        ran = mine = False
        result: ExecResult | None = None
        try:
            rec = self.table.require(sandbox_id)
            rec.busy += 1  # from before the paused check: no pause slips in
            await self.awake(rec)
            info = rec.info
            if rid:
                seen = await self.replays.lookup(info.tenant, sandbox_id, rid)
                if seen is not None:
                    return await asyncio.shield(seen)
                self.replays.begin(sandbox_id, rid)
                mine = True
            reason = await self.hooks.guard_exec(info, r)
            if reason:
                raise errors.Forbidden(f"refused by a guard: {reason}")
            call = ExecCall.of(r, sandbox_id, info.tenant)
            self.running += 1
            started = time.time()
            try:
                result = await rec.backend.exec(call)
            finally:
                self.running -= 1
            ran = True
            await self.history.command(info, call, rid, started, result)
        except errors.DsecError as exc:
            result = ExecResult(sandbox_id=sandbox_id, exit_code=-1, error=Error.of(exc))
        finally:
            if rec is not None:
                rec.busy -= 1
                rec.used = time.monotonic()
            if mine:
                assert rid is not None
                gone = errors.Unavailable("the command was cut short; send it again")
                fallback = ExecResult(sandbox_id=sandbox_id, exit_code=-1, error=Error.of(gone))
                self.replays.end(sandbox_id, rid, result or fallback, ran)
        if ran:
            await self._report(sandbox_id, result)
        return result

    async def fncall(self, r: FncallRequest, call: bus.Call) -> ExecResult:
        if r.sandbox_id:
            backend = self.table.require(r.sandbox_id).backend
        else:
            backend = next(
                (
                    b
                    for b in self.backends.values()
                    if r.language in b.capabilities.fncall_languages
                ),
                None,
            )
            if backend is None:
                raise errors.Unsupported(f"no backend on {self.node} serves {r.language!r} calls")
        self.running += 1
        try:
            result = await backend.fncall(r)
        finally:
            self.running -= 1
        await self._report(r.sandbox_id or "", result)
        return result

    async def _report(self, sandbox_id: str, result: ExecResult) -> None:
        if result.timed_out:
            await self.hooks.guard_event(sandbox_id, "timeout", {"duration_s": result.duration_s})
        if result.truncated:
            await self.hooks.guard_event(sandbox_id, "output_flood", {})
