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

        # eight sandboxes, one request; one command in all of them, one request
        sbs = await c.create(count=8, backend="fncall", ttl=600)
        results = await c.exec_many(sbs, "echo hi from $(hostname)", timeout=10)
        print("exec_many:", [r.stdout.decode().strip() for r in results])

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

    with dsec.Client() as c:  # the same surface, synchronous
        print("sync fncall:", c.fncall("echo $((6*7))", language="bash").stdout.decode().strip())


if __name__ == "__main__":
    asyncio.run(main())
