"""The edge's parts, each alone: built with only what it is given (no NATS, no Edge)."""

import asyncio
from typing import ClassVar

import pytest

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, Capabilities, ExecCall, SandboxRef, SandboxStatus
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    ExecRequest,
    PauseReport,
    PauseRequest,
    SandboxInfo,
    SandboxSpec,
)
from dsec_kernel.contract.wire.exec import ExecOptions
from dsec_kernel.edge.node import NodeReport, RecentLayers
from dsec_kernel.edge.power import Power
from dsec_kernel.edge.table import SandboxRecord, SandboxTable

SID = "sb-00000000000000e1"


class Freezer(Backend):
    """Sandboxes that pause, giving back half of a 100-byte charge."""

    name = "freezer"
    capabilities: ClassVar[Capabilities] = Capabilities(pause=True)

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        return SandboxStatus(sandbox_id=sandbox.id, state="ready")

    async def destroy(self, ref: SandboxRef) -> None:
        pass

    async def status(self, ref: SandboxRef) -> SandboxStatus:
        return SandboxStatus(sandbox_id=ref.sandbox_id, state="ready")

    async def list_sandboxes(self) -> list[str]:
        return []

    async def pause(self, ref: SandboxRef) -> PauseReport:
        return PauseReport(
            sandbox_id=ref.sandbox_id, state="paused", memory_before_bytes=100 << 20,
            memory_after_bytes=50 << 20,
        )  # fmt: skip

    async def resume(self, ref: SandboxRef) -> PauseReport:
        return PauseReport(sandbox_id=ref.sandbox_id, state="ready")


class State:
    """The one call of the cluster state that pausing makes."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, str | None]] = []

    async def set_sandbox_state(self, sandbox_id: str, state: str, reason: str | None = None):
        self.written.append((sandbox_id, state, reason))
        return _info(sandbox_id).model_copy(update={"state": state, "paused_reason": reason})


def _info(sid: str = SID, **kw) -> SandboxInfo:
    spec = SandboxSpec(backend="freezer")
    return SandboxInfo(
        id=sid, tenant="t", backend="freezer", node="n", created_at=0, spec=spec, **kw
    )


def test_an_exec_call_carries_every_option_of_the_request():
    """An option added to ExecOptions reaches the backend with no other edit."""
    given = {"timeout_s": 7.5, "env": {"A": "1"}, "cwd": "/w", "user": "nobody",
             "stdin": b"\0in", "max_output_bytes": 123}  # fmt: skip
    assert set(given) == set(ExecOptions.model_fields), "give every option a value here"
    r = ExecRequest(sandbox_ids=[SID], command="echo hi", request_id="r1", **given)
    call = ExecCall.of(r, SID, "t")
    assert call.model_dump(include=set(given)) == given
    assert (call.sandbox_id, call.argv, call.tenant) == (SID, ["/bin/sh", "-c", "echo hi"], "t")
    assert ExecCall.of(r.model_copy(update={"command": ["true"]}), SID, "t").argv == ["true"]


def test_the_table_holds_one_record_per_sandbox():
    table = SandboxTable("n")
    with pytest.raises(errors.NotFound, match="not on node n"):
        table.require(SID)
    rec = SandboxRecord(_info(), Freezer())
    table.add(rec)
    assert (len(table), SID in table, list(table)) == (1, True, [SID])
    assert table.require(SID) is rec and table.remove(SID) is rec and not table


async def test_a_pause_is_counted_in_the_node_record_until_the_resume():
    table, state = SandboxTable("n"), State()
    table.add(SandboxRecord(_info(), Freezer()))
    power = Power(table, state)  # type: ignore[arg-type]  # (only set_sandbox_state is used)
    report = NodeReport("n", "default", 1.0, {"freezer": Freezer()}, table, RecentLayers())
    await power.pause_one(SID, "requested")
    load = report.info(running_execs=0).load
    assert (load.paused, load.reclaimed_mb, load.paused_by_backend) == (1, 50, {"freezer": 1})
    assert table.require(SID).info.state == "paused"  # the record as written
    with pytest.raises(errors.SandboxPaused, match="resume"):
        await power.awake(table.require(SID))
    await power.resume_one(SID, None)
    load = report.info(running_execs=0).load
    assert (load.sandboxes, load.paused, load.reclaimed_mb, load.by_backend) == (
        1,
        0,
        0,
        {"freezer": 1},
    )
    assert state.written == [(SID, "paused", "requested"), (SID, "ready", None)]


async def test_a_pause_batch_answers_each_sandbox():
    """A handler takes its request as the bus parsed it: a part answers without NATS."""
    table = SandboxTable("n")
    table.add(SandboxRecord(_info(), Freezer()))
    power = Power(table, State())  # type: ignore[arg-type]
    gone = "sb-00000000000000e3"
    call = bus.Call(None, "")  # type: ignore[arg-type]  # (the pause handler reads none of it)
    out = await power.pause(PauseRequest(ids=[SID, gone]), call)
    assert [d.sandbox_id for d in out.done] == [SID]
    assert [(f.id, f.error.code) for f in out.failed] == [(gone, errors.NotFound.code)]


async def test_an_idle_sandbox_is_paused_and_work_wakes_it():
    table = SandboxTable("n")
    idle = SandboxRecord(_info(idle_ttl_s=0.05), Freezer())
    busy = SandboxRecord(_info("sb-00000000000000e2", idle_ttl_s=0.05), Freezer(), busy=1)
    table.add(idle)
    table.add(busy)
    power = Power(table, State())  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    await power.pause_idle()
    assert (idle.paused, busy.paused) == ("idle", None)  # a command runs in the busy one
    await power.awake(idle)
    assert idle.paused is None and idle.info.state == "ready"


def test_recent_layers_keep_the_newest():
    layers = RecentLayers()
    layers.use([f"l:{i}" for i in range(300)])
    layers.use(["l:0"])
    names = layers.names()
    assert len(names) == 256 and names[-1] == "l:0" and "l:44" not in names
