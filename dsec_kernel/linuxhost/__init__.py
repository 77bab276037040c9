"""Helpers that backends share on a Linux host: system calls (:mod:`.syscalls`, stdlib
only), cgroups, processes, file I/O that does not follow a sandbox's symlinks, and node
networking. Neither the contract nor the SDK imports them.
"""
