"""Child-process helpers shared by the CLI, the edge and backends."""

from __future__ import annotations

import ctypes
import signal
import subprocess

__all__ = ["die_with_parent", "stop_process"]

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn``: the child gets ``sig`` when the thread that started it exits.

    Start such children from the main thread: PDEATHSIG fires when the *thread* that forked
    them ends.
    """
    _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the exit. Idempotent."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
