"""DSec quickstart: run against `dsec up` (it writes the connection file this reads).

dsec up -- python examples/quickstart.py
"""

import asyncio

import dsec_kernel as dsec


async def main() -> None:
    async with dsec.AsyncClient() as c:
        nodes = await c.nodes()
        print(
            "nodes:",
            ", ".join(f"{n.node} ({', '.join(b.name for b in n.backends)})" for n in nodes),
        )

        # a stateless call, no sandbox to manage
        out = await c.fncall("print(6*7)", language="python", timeout=5)
        print("fncall:", out.stdout.decode().strip(), f"in {out.duration_s * 1000:.1f} ms")

        # eight sandboxes, one request; one command in all of them, one request. A batch
        # answers each sandbox: its result, or its error (dsec.check raises the first)
        sbs = dsec.check(await c.create(count=8, backend="fncall", ttl=600))
        results = await c.exec_many(sbs, "echo hi from $(hostname)", timeout=10)
        print("exec_many:", [r.error or r.stdout.decode().strip() for r in results])

        sb = sbs[0]
        await sb.write_file("/tmp/a.txt", b"data")
        print("read_file:", await sb.read_file("/tmp/a.txt"))
        r = await sb.exec(["python3", "-c", "print(open('/tmp/a.txt').read().upper())"], timeout=5)
        print("exec:", r.stdout.decode().strip(), "exit", r.exit_code)

        r = await sb.exec("sleep 5", timeout=0.5)
        print(
            "a command past its timeout:", "timed_out" if r.timed_out else "finished", r.exit_code
        )

        print("listed:", len(await c.list()), "sandboxes")
        await c.destroy(sbs)
        print("destroyed; left:", len(await c.list()))

        if any(n.backend("container") for n in nodes):
            await containers(c)

    with dsec.Client() as c:  # the same surface, synchronous
        print("sync fncall:", c.fncall("echo $((6*7))", language="bash").stdout.decode().strip())


async def containers(c: dsec.AsyncClient) -> None:
    """Stateful sandboxes on a layer: files, a snapshot, a diff, a restore and two forks."""
    from dsec_storage_3fs.images import busybox_tree, ensure_layer

    from dsec_kernel.loader import open_store

    ensure_layer(open_store(), "base", "busybox", "1", busybox_tree)  # once per store
    env = dsec.Env(base="busybox:1")
    sbs = dsec.check(
        await c.create(count=4, backend="container", env=env, limits=dsec.Limits(pids=64))
    )
    sb = sbs[0]
    await sb.exec("mkdir /work && echo v1 > /work/answer.txt")
    snap = await sb.snapshot()
    await sb.exec("echo v2 > /work/answer.txt && touch /work/scratch && sleep 600 &")
    diff = await sb.fs_diff(since=snap)
    print("container: since the snapshot, modified", diff.modified, "added", diff.added)
    await sb.restore(snap)
    r = await sb.exec("cat /work/answer.txt; ls /work; pgrep sleep || echo 'no sleep'")
    print("container: restored:", r.stdout.decode().split())
    forks = dsec.check(await c.create(count=2, from_snapshot=snap))
    print("container: forks see", [(await f.exec("cat /work/answer.txt")).stdout for f in forks])
    print("container: commands run in the first:", [" ".join(x.argv) for x in await sb.commands()])
    await c.destroy(sbs + forks)


if __name__ == "__main__":
    asyncio.run(main())
