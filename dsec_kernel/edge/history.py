"""What an edge writes in its sandboxes' trajectories: each command, snapshot and restore."""

from __future__ import annotations

import logging
import time

from dsec_kernel.contract.backend import ExecCall
from dsec_kernel.contract.wire import CommandRecord, ExecResult, SandboxInfo
from dsec_kernel.trajectory import Trajectory

__all__ = ["History"]

log = logging.getLogger(__name__)


class History:
    """Appends to the trajectory, stdin and output kept up to ``output_cap`` bytes each. A
    failed append is logged; the work it records is still answered."""

    def __init__(self, trajectory: Trajectory, output_cap: int) -> None:
        self.trajectory = trajectory
        self.output_cap = output_cap

    async def command(
        self,
        info: SandboxInfo,
        call: ExecCall,
        request_id: str | None,
        started: float,
        result: ExecResult,
    ) -> None:
        cap = self.output_cap
        rec = CommandRecord(
            request_id=request_id, argv=call.argv, env=call.env, cwd=call.cwd, user=call.user,
            timeout_s=call.timeout_s, stdin=call.stdin[:cap], started_at=started,
            duration_s=result.duration_s, exit_code=result.exit_code,
            timed_out=result.timed_out, truncated=result.truncated,
            stdout=result.stdout[:cap], stderr=result.stderr[:cap],
            stdout_bytes=len(result.stdout), stderr_bytes=len(result.stderr),
        )  # fmt: skip
        await self._append(info, rec)

    async def mark(self, info: SandboxInfo, kind: str, snapshot_id: str | None) -> None:
        """A snapshot or restore (a replay starts from the last one)."""
        await self._append(info, CommandRecord(kind=kind, started_at=time.time(),
                                               snapshot_id=snapshot_id))  # fmt: skip

    async def _append(self, info: SandboxInfo, rec: CommandRecord) -> None:
        try:
            await self.trajectory.append(info.tenant, info.id, rec)
        except Exception as exc:
            log.warning("could not log a %s of %s in its trajectory: %s", rec.kind, info.id, exc)
