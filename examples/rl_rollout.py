"""A GRPO-style rollout with a trainer that is preempted in the middle, against `dsec up`.

    dsec up -- python examples/rl_rollout.py

A group of episodes (one container sandbox each, on the busybox layer) runs a few steps of
commands; each keeps an "agent" process holding memory. Half-way through, the trainer "is
preempted": it stops renewing its job's lease, the platform pauses the job's sandboxes and
reclaims their memory. The trainer comes back, renews, everything resumes where it was, the
episodes finish, and the rewards are checked and turned into group-relative advantages. A
timeline of what happened, and when, is printed at the end.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import dsec_kernel as dsec

GROUP = 8  # episodes per prompt
LEASE_S = 2.0  # short, so that the demo's preemption is quick
HOLD_MB = 24  # memory each episode's agent process keeps
# the heartbeat is replaced whole (written aside, then renamed): `date > file` empties the
# file before it writes, and a pause that freezes the agent in between left it empty for the
# whole pause (a reader then got b"")
AGENT = f"""x=$(head -c {HOLD_MB << 20} /dev/zero | tr '\\000' a)
touch /work/agent-up
while :; do date +%s > /work/heartbeat.new; mv /work/heartbeat.new /work/heartbeat; sleep 0.2; done
"""


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []

    def __call__(self, what: str) -> None:
        t = time.monotonic() - self.t0
        self.events.append((t, what))
        print(f"  [{t:6.2f} s] {what}", flush=True)

    def print(self) -> None:
        print("\ntimeline")
        for t, what in self.events:
            print(f"  {t:6.2f} s  {what}")


async def states(sbs: list[dsec.Sandbox]) -> set[str]:
    return {(await sb.status()).state for sb in sbs}


async def until(sbs: list[dsec.Sandbox], state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while await states(sbs) != {state}:
        if time.monotonic() > deadline:
            raise SystemExit(f"the sandboxes did not become {state} within {timeout:g} s")
        await asyncio.sleep(0.1)


async def reclaimed_mb(c: dsec.AsyncClient, node: str) -> int:
    """What the node's paused sandboxes gave back (as its last heartbeat says)."""
    await asyncio.sleep(1.2)  # a fresh heartbeat
    return next(n.load.reclaimed_mb for n in await c.nodes() if n.node == node)


async def main() -> int:
    from dsec_storage_3fs.images import busybox_tree, ensure_layer

    from dsec_kernel.loader import open_store

    log = Timeline()
    async with dsec.AsyncClient() as c:
        if not any(n.backend("container") for n in await c.nodes()):
            print("this needs the container backend; `dsec plugins` says why it is missing")
            return 1
        ensure_layer(open_store(), "base", "busybox", "1", busybox_tree)
        env = dsec.Env(base="busybox:1")
        async with c.job("grpo-step-17", priority=5, lease_s=LEASE_S) as job:
            log(f"job {job.name} opened (lease {LEASE_S:g} s, renewed in the background)")
            sbs = dsec.check(await job.create(
                count=GROUP, backend="container", env=env,
                progress=lambda done, total: log(f"created {done}/{total} sandboxes"),
            ))  # fmt: skip
            for i, sb in enumerate(sbs):
                await sb.write_file("/work/agent.sh", AGENT)
                await sb.write_file("/work/prompt", f"{i * 7}\n")
            # a batch answers each sandbox; check raises the first error, if any
            dsec.check(await c.exec_many(sbs, "(setsid sh /work/agent.sh > /dev/null 2>&1 &)"))
            dsec.check(await c.exec_many(sbs, "while [ ! -e /work/agent-up ]; do sleep 0.05; done"))
            log(f"step 1: {GROUP} agents started, each holding {HOLD_MB} MB")

            dsec.check(await c.exec_many(sbs, "cp /work/prompt /work/state"))
            snaps = [await sb.snapshot() for sb in sbs]
            log(f"step 2: state written, {len(snaps)} snapshots taken")

            # the "policy" samples an action per episode: odd ones pick the wrong one
            for i, sb in enumerate(sbs):
                op = "+ 1" if i % 2 == 0 else "+ 2"
                await sb.exec(f"expr $(cat /work/state) {op} > /work/state.new")
            dsec.check(await c.exec_many(sbs, "mv /work/state.new /work/state"))
            log("step 3: actions applied")

            node = sbs[0].node
            job.stop_renewing()
            log("the trainer is preempted: it stops renewing the lease")
            await until(sbs, "paused")
            reasons = {(await sb.status()).paused_reason for sb in sbs}
            log(f"all {GROUP} sandboxes paused by the platform (reason: {', '.join(reasons)})")
            mb = await reclaimed_mb(c, node)
            log(f"node {node}: the paused sandboxes gave back {mb} MiB (frozen, swapped to zram)")
            try:
                await sbs[0].exec("true")
            except dsec.SandboxPaused as exc:
                log(f"a command sent meanwhile is refused: {exc.message}")
            beats = [int(await sb.read_file("/work/heartbeat")) for sb in sbs]
            await asyncio.sleep(1.0)
            still = [int(await sb.read_file("/work/heartbeat")) for sb in sbs]
            log(f"frozen: agent heartbeats unchanged over 1 s: {beats == still}")

            await job.renew()
            log("the trainer is back: lease renewed")
            await until(sbs, "ready")
            log("all sandboxes resumed")
            await asyncio.sleep(0.5)
            # a beat within the last second (the pause took seconds): a beat of the same
            # second only would fail whenever the check fell just after a second's turn
            alive = await c.exec_many(
                sbs, "test $(cat /work/heartbeat) -ge $(( $(date +%s) - 1 )) && echo up"
            )
            up = sum(r.stdout == b"up\n" for r in alive)
            log(f"agents alive after the pause: {up}/{GROUP}")

            dsec.check(await c.exec_many(sbs, "expr $(cat /work/state) \\* 2 > /work/state.new"))
            dsec.check(await c.exec_many(sbs, "mv /work/state.new /work/state"))
            final = dsec.check(await c.exec_many(sbs, "cat /work/state"))
            log("step 4: episodes finished")

            rewards = [
                1.0 if int(r.stdout) == (i * 7 + 1) * 2 else 0.0 for i, r in enumerate(final)
            ]
            mean, std = statistics.mean(rewards), statistics.pstdev(rewards) or 1.0
            advantages = [(r - mean) / std for r in rewards]
            log(f"rewards {rewards}")
            log(f"advantages {[round(a, 2) for a in advantages]}")
            traj = await sbs[0].trajectory()
            log(f"episode 0 trajectory: {len(traj)} entries, e.g. {traj[-1].argv[-1]!r}")
            expected = [1.0 if i % 2 == 0 else 0.0 for i in range(GROUP)]
            ok = rewards == expected and all(r.stdout == b"up\n" for r in alive)
        log("job closed: its sandboxes are destroyed")
    log.print()
    print("\nresult:", "correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
