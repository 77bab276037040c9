"""A software-engineering episode on a real project, in container sandboxes.

    dsec up -- python3 examples/swe_episode.py

The workspace is more-itertools 10.2.0, its sdist from PyPI (with its 774 tests), as a
workspace layer on the Debian 12 base (python3, pip, git, build tools; built by debootstrap
the first time, 1-2 min, then cached). The episode: run the tests, apply an edit (the agent breaks
``chunked(strict=True)``), snapshot, run them again, restore after more changes, then fork 8
variants from the snapshot that each try a different fix, and see which pass. Each step
prints its structured result.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec_storage_3fs.images import debian_python

import dsec_kernel as dsec
from dsec_kernel.contract.errors import NotFound
from dsec_kernel.loader import open_store

PROJECT, VERSION = "more-itertools", "10.2.0"
SRC = "/workspace/more_itertools/more.py"
TESTS = ["bash", "-c", "set -o pipefail; python3 -m unittest discover -s tests 2>&1 | tail -n 3"]
RUN = {"cwd": "/workspace", "env": {"PYTHONDONTWRITEBYTECODE": "1"}, "timeout": 120}
CANDIDATES = ["!= n", "< n", "> n", "== n", "!= n - 1", "<= n", ">= n", "!= n + 1"]


def say(step: str, **fields: object) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def ensure_layers() -> dsec.Env:
    """The base and the project's workspace layer, imported into the store once."""
    store = open_store()
    debian_python(store, progress=lambda m: say("layers", progress=m))
    try:
        store.resolve(PROJECT, VERSION, "workspace")
    except NotFound:
        with tempfile.TemporaryDirectory() as tmp:
            pip = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                 "--no-deps", "--dest", tmp, f"{PROJECT}=={VERSION}"],
                capture_output=True, text=True,
            )  # fmt: skip
            if pip.returncode != 0:
                sys.exit(f"downloading the {PROJECT} sdist failed:\n{pip.stderr}")
            sdist = next(Path(tmp).glob("*.tar.gz"))  # more-itertools-10.2.0/... as /workspace/...
            layer = store.import_layer(
                str(sdist), "workspace", PROJECT, VERSION, under="workspace", strip=1
            )
            say("layers", imported=layer.ref, digest=layer.digest[:19], bytes=layer.size)
    return dsec.Env(base="debian-python:12", workspace=f"{PROJECT}:{VERSION}")


def summary(r: dsec.ExecResult) -> dict[str, object]:
    out = r.stdout.decode()
    ran = re.search(r"Ran (\d+) tests", out)
    failed = re.search(r"FAILED \((.*)\)", out)
    return {
        "exit_code": r.exit_code,
        "seconds": round(r.duration_s, 2),
        "tests": int(ran.group(1)) if ran else None,
        "result": "OK"
        if re.search(r"^OK", out, re.M)
        else (failed.group(1) if failed else out[-200:]),
    }


async def main() -> None:
    env = ensure_layers()
    async with dsec.AsyncClient() as c:
        t = time.perf_counter()
        [sb] = await c.create(count=1, backend="container", env=env,
                              limits=dsec.Limits(cpus=1, memory_mb=1024, pids=256))  # fmt: skip
        say("create", sandbox=sb.id, node=sb.node, ms=round((time.perf_counter() - t) * 1000, 1))

        say("run tests", **summary(await sb.exec(TESTS, **RUN)))

        source = (await sb.read_file(SRC)).decode()
        broken = source.replace("if len(chunk) != n:", "if len(chunk) > n:", 1)
        await sb.write_file(SRC, broken)
        diff = await sb.fs_diff()
        say("apply an edit", modified=diff.modified, added=diff.added, deleted=diff.deleted)

        t = time.perf_counter()
        snap = await sb.snapshot()
        say("snapshot", snapshot=snap.id, bytes=snap.info.bytes,
            ms=round((time.perf_counter() - t) * 1000, 1))  # fmt: skip

        say("run tests again", **summary(await sb.exec(TESTS, **RUN)))

        await sb.exec("rm -rf /workspace/tests && echo scratch > /workspace/notes.txt")
        lost = await sb.fs_diff(since=snap)
        t = time.perf_counter()
        await sb.restore(snap)
        back = await sb.fs_diff(since=snap)
        say("restore", changed_before=len(lost.added) + len(lost.deleted) + len(lost.modified),
            changed_after=len(back.added) + len(back.deleted) + len(back.modified),
            ms=round((time.perf_counter() - t) * 1000, 1))  # fmt: skip

        t = time.perf_counter()
        forks = dsec.check(await c.create(count=len(CANDIDATES), from_snapshot=snap))
        say("fork", sandboxes=len(forks), ms=round((time.perf_counter() - t) * 1000, 1))
        for fork, fix in zip(forks, CANDIDATES, strict=True):
            await fork.write_file(
                SRC, broken.replace("if len(chunk) > n:", f"if len(chunk) {fix}:", 1)
            )
        results = dsec.check(await c.exec_many(forks, TESTS, **RUN))
        for fork, fix, r in zip(forks, CANDIDATES, results, strict=True):
            say("variant", sandbox=fork.id, fix=f"len(chunk) {fix}", **summary(r))

        history = await sb.commands()
        say("history", commands=[{"argv": h.argv[-1][:40], "exit": h.exit_code,
                                  "s": round(h.duration_s, 2)} for h in history])  # fmt: skip
        await c.destroy([sb, *forks])
        say("done", left=len(await c.list()))


if __name__ == "__main__":
    asyncio.run(main())
