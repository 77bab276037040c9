"""The backend conformance suite: behaviour every backend must show, run against the real thing.

Use it from a backend package's tests (pytest + pytest-asyncio). The tests of the class share
one event loop, so one started backend, a class-scoped ``backend`` fixture, serves them all::

    import pytest_asyncio
    from dsec_kernel.contract.conformance import BackendConformance, started

    @pytest_asyncio.fixture(scope="class", loop_scope="class")
    async def backend(tmp_path_factory):
        async with started(MyBackend(), tmp_path_factory.mktemp("b")) as b:
            yield b

    class TestMyBackend(BackendConformance):
        pass

Tests of a capability the backend does not declare check that the method raises
``Unsupported`` instead. See docs/plugins.md.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import ClassVar

import pytest
import pytest_asyncio

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, BackendContext, ExecCall, SandboxRef
from dsec_kernel.contract.hooks import Hooks
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    FncallRequest,
    FsDiffRequest,
    ReadFileRequest,
    RestoreRequest,
    SandboxSpec,
    SnapshotRequest,
    WriteFileRequest,
)

__all__ = ["BackendConformance", "started"]


@asynccontextmanager
async def started(
    backend: Backend,
    state_dir: Path,
    node: str = "conformance",
    lost: Callable[[str, str], None] | None = None,
) -> AsyncIterator[Backend]:
    """Start ``backend`` with a private state directory (``lost``: see
    :attr:`BackendContext.lost`); close it afterwards."""
    state_dir.mkdir(parents=True, exist_ok=True)
    hooks = Hooks.of(plugins=[backend])
    ctx = BackendContext(node, state_dir, hooks, **({"lost": lost} if lost else {}))
    await backend.start(ctx)
    try:
        yield backend
    finally:
        await backend.close()


class BackendConformance:
    """Behaviour tests for any backend. Subclass it where a ``backend`` fixture is defined."""

    pytestmark = pytest.mark.asyncio(loop_scope="class")
    #: extra SandboxSpec fields every test sandbox gets (e.g. an ``env`` for layered backends);
    #: set it on the subclass
    spec: ClassVar[dict[str, object]] = {}
    #: seconds a timed-out command may overrun its timeout before the test fails
    timeout_slack_s = 5.0

    @pytest_asyncio.fixture(loop_scope="class")
    async def sandbox(self, backend: Backend) -> AsyncIterator[str]:
        sb = self.new(backend)
        await backend.create(sb)
        yield sb.id
        await backend.destroy(SandboxRef(sandbox_id=sb.id))

    def new(self, backend: Backend, **spec: object) -> EdgeSandbox:
        """A sandbox request with a fresh id and the class's ``spec``."""
        return EdgeSandbox(
            id="sb-" + secrets.token_hex(8),
            tenant="conformance",
            spec=SandboxSpec(backend=backend.name, **{**self.spec, **spec}),
            created_at=time.time(),
        )

    def call(self, sandbox: str, argv: list[str], **kw: object) -> ExecCall:
        """A command in ``sandbox`` with ExecCall's defaults, but 30 s to run (``kw``: fields)."""
        return ExecCall(sandbox_id=sandbox, argv=argv, **{"timeout_s": 30.0, **kw})  # type: ignore[arg-type]

    def need(self, backend: Backend, capability: str) -> None:
        if not getattr(backend.capabilities, capability):
            pytest.skip(f"{backend.name} does not declare {capability}")

    # -- lifecycle ---------------------------------------------------------------------------

    async def test_declares_capabilities(self, backend: Backend) -> None:
        assert backend.name
        assert backend.capabilities.max_sandboxes > 0

    async def test_create_status_list_destroy(self, backend: Backend) -> None:
        sb = self.new(backend)
        status = await backend.create(sb)
        assert status.sandbox_id == sb.id and status.state == "ready"
        assert (await backend.status(SandboxRef(sandbox_id=sb.id))).state == "ready"
        assert sb.id in await backend.list_sandboxes()
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
        assert sb.id not in await backend.list_sandboxes()
        with pytest.raises(errors.NotFound):
            await backend.status(SandboxRef(sandbox_id=sb.id))

    async def test_destroy_is_idempotent(self, backend: Backend) -> None:
        sb = self.new(backend)
        await backend.create(sb)
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
        await backend.destroy(SandboxRef(sandbox_id="sb-" + "0" * 16))

    async def test_create_existing_id_conflicts(self, backend: Backend, sandbox: str) -> None:
        sb = self.new(backend).model_copy(update={"id": sandbox})
        with pytest.raises(errors.Conflict):
            await backend.create(sb)
        assert (await backend.status(SandboxRef(sandbox_id=sandbox))).state == "ready"

    async def test_many_at_once(self, backend: Backend) -> None:
        sbs = [self.new(backend) for _ in range(20)]
        await asyncio.gather(*(backend.create(sb) for sb in sbs))
        listed = set(await backend.list_sandboxes())
        assert {sb.id for sb in sbs} <= listed
        await asyncio.gather(*(backend.destroy(SandboxRef(sandbox_id=sb.id)) for sb in sbs))
        assert not {sb.id for sb in sbs} & set(await backend.list_sandboxes())

    async def test_undeclared_capabilities_are_unsupported(
        self, backend: Backend, sandbox: str
    ) -> None:
        caps = backend.capabilities
        ref = SandboxRef(sandbox_id=sandbox)
        checks = {
            "exec": lambda: backend.exec(self.call(sandbox, ["true"])),
            "files": lambda: backend.read_file(ReadFileRequest(sandbox_id=sandbox, path="/tmp/x")),
            "snapshot": lambda: backend.snapshot(SnapshotRequest(sandbox_id=sandbox)),
            "restore": lambda: backend.restore(RestoreRequest(sandbox_id=sandbox)),
            "fs_diff": lambda: backend.fs_diff(FsDiffRequest(sandbox_id=sandbox)),
            "pause": lambda: backend.pause(ref),
        }
        for capability, fn in checks.items():
            if not getattr(caps, capability):
                with pytest.raises(errors.Unsupported):
                    await fn()
        if not caps.fncall_languages:
            with pytest.raises(errors.Unsupported):
                await backend.fncall(FncallRequest(code="print(1)"))

    # -- commands ----------------------------------------------------------------------------

    async def test_exec_output_and_exit_code(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        r = await backend.exec(
            self.call(sandbox, ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"])
        )
        assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
        assert not r.timed_out and not r.truncated and r.duration_s > 0

    async def test_exec_stdin_env_cwd(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        r = await backend.exec(
            self.call(
                sandbox,
                ["/bin/sh", "-c", 'cat; echo "$GREETING"; pwd'],
                stdin=b"in\n",
                env={"GREETING": "hello", "PATH": "/usr/bin:/bin"},
                cwd="/tmp",
            )
        )
        assert r.stdout == b"in\nhello\n/tmp\n", r

    async def test_exec_missing_program(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        r = await backend.exec(self.call(sandbox, ["/no/such/program"]))
        assert r.exit_code == 127 and b"no/such/program" in r.stderr

    async def test_exec_timeout_kills_everything(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        t = time.monotonic()
        script = (
            "(setsid sh -c 'sleep 1; echo escaped > /tmp/escaped' &);"
            " trap '' TERM; sleep 100 & sleep 100"
        )
        r = await backend.exec(self.call(sandbox, ["/bin/sh", "-c", script], timeout_s=0.5))
        assert r.timed_out and r.exit_code == -9
        assert time.monotonic() - t < 0.5 + self.timeout_slack_s
        if backend.capabilities.stateful:  # a new session it started went too
            await asyncio.sleep(1.5)
            check = ["/bin/sh", "-c", "cat /tmp/escaped 2>/dev/null || echo none"]
            assert (await backend.exec(self.call(sandbox, check))).stdout == b"none\n"

    async def test_exec_output_is_capped(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        r = await backend.exec(
            self.call(
                sandbox, ["/bin/sh", "-c", "head -c 5000000 /dev/zero"], max_output_bytes=1000
            )
        )
        assert r.truncated and len(r.stdout) == 1000 and r.exit_code == 0

    async def test_exec_state_follows_capability(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "exec")
        await backend.exec(self.call(sandbox, ["/bin/sh", "-c", "echo kept > /tmp/state"]))
        r = await backend.exec(self.call(sandbox, ["/bin/sh", "-c", "cat /tmp/state"]))
        if backend.capabilities.stateful:
            assert r.stdout == b"kept\n"
        else:
            assert r.exit_code != 0 and r.stdout == b""

    async def test_exec_unknown_sandbox(self, backend: Backend) -> None:
        self.need(backend, "exec")
        with pytest.raises(errors.NotFound):
            await backend.exec(self.call("sb-" + "0" * 16, ["true"]))

    # -- files -------------------------------------------------------------------------------

    async def test_files_roundtrip_and_visible_to_exec(
        self, backend: Backend, sandbox: str
    ) -> None:
        self.need(backend, "files")
        data = bytes(range(256)) * 100
        w = await backend.write_file(
            WriteFileRequest(sandbox_id=sandbox, path="/tmp/dir/f.bin", data=data, mode=0o640)
        )
        assert w.size == len(data)
        r = await backend.read_file(ReadFileRequest(sandbox_id=sandbox, path="/tmp/dir/f.bin"))
        assert r.data == data
        if backend.capabilities.exec:
            e = await backend.exec(self.call(sandbox, ["/bin/sh", "-c", "wc -c < /tmp/dir/f.bin"]))
            assert e.stdout.strip() == str(len(data)).encode()

    async def test_read_missing_file(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "files")
        with pytest.raises(errors.NotFound):
            await backend.read_file(ReadFileRequest(sandbox_id=sandbox, path="/tmp/missing"))

    # -- stateless calls ---------------------------------------------------------------------

    async def test_fncall_languages(self, backend: Backend) -> None:
        langs = backend.capabilities.fncall_languages
        if not langs:
            pytest.skip(f"{backend.name} serves no fncall languages")
        programs = {"python": "print(6*7)", "bash": "echo $((6*7))"}
        for lang in langs:
            if lang in programs:
                r = await backend.fncall(FncallRequest(code=programs[lang], language=lang))
                assert (r.stdout, r.exit_code) == (b"42\n", 0), (lang, r)
        with pytest.raises(errors.InvalidArgument):
            await backend.fncall(FncallRequest(code="x", language="no-such-language"))

    # -- pause -------------------------------------------------------------------------------

    async def test_pause_freezes_and_resume_continues(self, backend: Backend) -> None:
        """A paused sandbox runs nothing (a counter stops), keeps its files and processes,
        and carries on after resume; pause and resume are idempotent; a paused sandbox can
        be destroyed."""
        sb = self.new(backend)
        ref = SandboxRef(sandbox_id=sb.id)
        if not backend.capabilities.pause:
            with pytest.raises(errors.Unsupported):
                await backend.pause(ref)
            return
        await backend.create(sb)
        try:
            await self._sh(
                backend,
                sb.id,
                "echo kept > /tmp/file; (setsid sh -c 'i=0; while :; do i=$((i+1));"
                " echo $i > /tmp/n; mv /tmp/n /tmp/count; sleep 0.05; done'"
                " > /dev/null 2>&1 &)",  # (renamed whole: a pause never finds it empty)
            )
            await asyncio.sleep(0.3)
            report = await backend.pause(ref)
            assert report.sandbox_id == sb.id and report.state == "paused", report
            assert (await backend.status(ref)).state == "paused"
            assert (await backend.pause(ref)).state == "paused"  # idempotent
            count = await self._read(backend, sb.id, "/tmp/count")
            await asyncio.sleep(0.4)
            assert await self._read(backend, sb.id, "/tmp/count") == count, "still running"
            assert (await backend.resume(ref)).state == "ready"
            assert (await backend.resume(ref)).state == "ready"  # idempotent
            assert (await backend.status(ref)).state == "ready"
            await asyncio.sleep(0.4)
            assert int(await self._read(backend, sb.id, "/tmp/count")) > int(count)
            assert await self._read(backend, sb.id, "/tmp/file") == b"kept\n"
            await backend.pause(ref)
        finally:
            await backend.destroy(ref)
        assert sb.id not in await backend.list_sandboxes()

    async def _read(self, backend: Backend, sandbox: str, path: str) -> bytes:
        return (await backend.read_file(ReadFileRequest(sandbox_id=sandbox, path=path))).data

    # -- snapshots -------------------------------------------------------------------------------

    async def _sh(self, backend: Backend, sandbox: str, script: str) -> bytes:
        r = await backend.exec(self.call(sandbox, ["/bin/sh", "-c", script]))
        assert r.exit_code == 0, r
        return r.stdout

    async def test_snapshot_restore_puts_files_and_processes_back(
        self, backend: Backend, sandbox: str
    ) -> None:
        self.need(backend, "snapshot")
        await self._sh(backend, sandbox, "echo one > /tmp/a; echo keep > /tmp/c; mkdir -p /tmp/d")
        snap = await backend.snapshot(SnapshotRequest(sandbox_id=sandbox))
        assert snap.sandbox_id == sandbox and snap.id
        await self._sh(
            backend,
            sandbox,
            "echo two > /tmp/a; echo new > /tmp/b; rm /tmp/c; rmdir /tmp/d;"
            " (setsid sleep 1000 > /dev/null 2>&1 &)",
        )
        await backend.restore(RestoreRequest(sandbox_id=sandbox, snapshot_id=snap.id))
        out = await self._sh(
            backend,
            sandbox,
            "cat /tmp/a /tmp/c; test -e /tmp/b || echo no-b; test -d /tmp/d && echo d;"
            " ps -o args | grep -c '^sleep 1000' || true",
        )
        assert out == b"one\nkeep\nno-b\nd\n0\n", out

    async def test_incremental_snapshots_fork_and_reset(
        self, backend: Backend, sandbox: str
    ) -> None:
        self.need(backend, "snapshot")
        await self._sh(backend, sandbox, "echo 1 > /tmp/f1")
        s1 = await backend.snapshot(SnapshotRequest(sandbox_id=sandbox))
        await self._sh(backend, sandbox, "echo 2 > /tmp/f2; rm /tmp/f1")
        s2 = await backend.snapshot(SnapshotRequest(sandbox_id=sandbox))
        assert s2.parent == s1.id and s2.depth == s1.depth + 1
        if backend.capabilities.fork:
            forked = self.new(backend, snapshot=s2.id)
            await backend.create(forked)
            try:
                out = await self._sh(
                    backend, forked.id, "cat /tmp/f2; test -e /tmp/f1 || echo gone"
                )
                assert out == b"2\ngone\n", out
            finally:
                await backend.destroy(SandboxRef(sandbox_id=forked.id))
        await backend.restore(RestoreRequest(sandbox_id=sandbox, snapshot_id=s1.id))
        assert await self._sh(backend, sandbox, "cat /tmp/f1; test -e /tmp/f2 || echo none") == (
            b"1\nnone\n"
        )
        await backend.restore(RestoreRequest(sandbox_id=sandbox))  # the clean state
        assert await self._sh(backend, sandbox, "ls /tmp | wc -l") == b"0\n"

    async def test_fs_diff(self, backend: Backend, sandbox: str) -> None:
        self.need(backend, "fs_diff")
        await self._sh(backend, sandbox, "echo x > /tmp/new")
        snap = (
            await backend.snapshot(SnapshotRequest(sandbox_id=sandbox))
            if (backend.capabilities.snapshot)
            else None
        )
        await self._sh(backend, sandbox, "echo y > /tmp/later; echo z >> /tmp/new")
        diff = await backend.fs_diff(FsDiffRequest(sandbox_id=sandbox))
        assert {"/tmp/new", "/tmp/later"} <= set(diff.added), diff
        if snap is not None:
            since = await backend.fs_diff(FsDiffRequest(sandbox_id=sandbox, since=snap.id))
            assert since.added == ["/tmp/later"] and since.modified == ["/tmp/new"], since
        await self._sh(backend, sandbox, "rm /tmp/new")
        after = await backend.fs_diff(FsDiffRequest(sandbox_id=sandbox))
        assert "/tmp/new" not in after.added and "/tmp/new" not in after.deleted, after
        if snap is not None:
            since = await backend.fs_diff(FsDiffRequest(sandbox_id=sandbox, since=snap.id))
            assert since.deleted == ["/tmp/new"], since
