"""The ``dsec`` command's exit statuses (docs/configuration.md has the table).

``exec`` and ``fncall`` pass the command's own status through (0-255), with ``timeout(1)``'s
conventions for the rest: 124 for a command killed at its timeout, 128 + N for one killed by
signal N. Every other status is DSec's own: 2 for a command line that does not parse, and
one per kind of failure from 3 up.
"""

from __future__ import annotations

from dsec_kernel import errors

__all__ = ["TIMED_OUT", "USAGE", "for_error", "for_result"]

USAGE = 2
TIMED_OUT = 124
#: a plugin that is missing or broken (not a wire error)
PLUGIN = 13

#: wire error code -> exit status
BY_CODE = {
    "invalid_argument": 3,
    "unknown_backend": 3,
    "unauthenticated": 4,
    "not_found": 5,
    "unsupported": 6,
    "forbidden": 6,
    "capacity_exceeded": 7,
    "queue_full": 7,
    "quota_exceeded": 8,
    "unavailable": 9,
    "deadline_exceeded": 10,
    "sandbox_lost": 11,
    "sandbox_paused": 11,
    "conflict": 12,
    "internal": 1,
}


def for_error(exc: errors.DsecError) -> int:
    return BY_CODE.get(exc.code, 1)


def for_result(exit_code: int, timed_out: bool) -> int:
    """The status of a command that ran: its own, 124 if killed at its timeout, 128 + N if
    killed by signal N (an exit code of -N)."""
    if timed_out:
        return TIMED_OUT
    if exit_code < 0:
        return 128 + (-exit_code & 0x7F)
    return exit_code & 0xFF
