"""The ``dsec`` command's exit statuses (docs/configuration.md has the table).

``exec`` and ``fncall`` pass the command's own status through (0-255), with ``timeout(1)``'s
conventions for the rest: 124 for a command killed at its timeout, 128 + N for one killed by
signal N. Every other status is DSec's own: 2 for a command line that does not parse, and
one per kind of failure from 3 up.
"""

from __future__ import annotations

from dsec_kernel.contract import errors

__all__ = ["TIMED_OUT", "USAGE", "for_error", "for_result"]

USAGE = 2
TIMED_OUT = 124
#: a plugin, or the kernel's ``server`` extra, that is missing or broken (not a wire error)
PLUGIN = 13


def for_error(exc: errors.DsecError) -> int:
    """The status an error ends the command with (its class says it)."""
    return exc.exit_status


def for_result(exit_code: int, timed_out: bool) -> int:
    """The status of a command that ran: its own, 124 if killed at its timeout, 128 + N if
    killed by signal N (an exit code of -N)."""
    if timed_out:
        return TIMED_OUT
    if exit_code < 0:
        return 128 + (-exit_code & 0x7F)
    return exit_code & 0xFF
