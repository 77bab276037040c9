"""Run N simulated edges (the noop backend) in one process: ``python sim_edges.py URL N``
(the NATS login from ``DSEC_NATS_LOGIN_FILE``, as real edges take it).

Each edge is a full :class:`dsec_kernel.edge.Edge` with its own node name, heartbeats and
NATS service; they share one NATS connection. Prints "ready" once all have started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

from dsec_kernel import bus
from dsec_kernel.cli.services import freeze_long_lived
from dsec_kernel.config import EdgeSettings
from dsec_kernel.edge import Edge, load_backends
from dsec_kernel.loader import load_hooks


async def main(url: str, count: int, prefix: str) -> None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    login = bus.Login.read(os.environ["DSEC_NATS_LOGIN_FILE"])
    nc = await bus.connect(url, name="sim-edges", login=login)
    hooks = load_hooks(guards=[])
    edges = []
    with tempfile.TemporaryDirectory(prefix="dsec-sim-") as tmp:
        for i in range(count):
            s = EdgeSettings(
                nats_url=url,
                node=f"{prefix}{i:03d}",
                state_dir=Path(tmp) / str(i),
                backends=["noop"],
                heartbeat_s=1.0,
            )
            backends, _ = load_backends(s)
            edge = Edge(
                nc, s, backends, hooks,
                connect=lambda: bus.connect(url, name="sim-heartbeat", login=login),
            )  # fmt: skip
            await edge.start()
            edges.append(edge)
        print("ready", flush=True)
        gc_task = asyncio.create_task(freeze_long_lived())  # as each real edge process does
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        gc_task.cancel()
        for edge in edges:
            await edge.stop()
    await nc.drain()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "sim"))
