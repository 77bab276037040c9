"""Network namespaces that make one machine look like several nodes (for local clusters).

A bridge on the host carries ``10.216.<n>.0/24``: the host is ``.1`` (the NATS servers
listen there), and each node gets a network namespace joined to the bridge by a veth, with
an address and a default route. A process runs in a node's namespace through ``nsenter
--net`` (only the network changes: mounts, cgroups and processes stay shared). Namespaces are
kept by bind mounts on files under ``root``, not in ``/run/netns``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from dsec_kernel.contract import errors

__all__ = ["NodeNetwork"]


def _ip(*args: str, netns: Path | None = None) -> None:
    argv = ["ip", *args] if netns is None else ["nsenter", f"--net={netns}", "ip", *args]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise errors.Unavailable(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")


class NodeNetwork:
    """The bridge and the nodes' namespaces; :meth:`close` removes them all."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        tag = secrets.token_hex(3)
        self.bridge = f"dsecc{tag}"
        self.prefix = f"10.216.{int(tag[:2], 16)}"
        self.host = f"{self.prefix}.1"
        self.nodes: dict[str, tuple[Path, str, str]] = {}  # node -> (nsfile, veth, address)
        self.started = False

    def start(self) -> NodeNetwork:
        self.root.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        self.started = True
        return self

    def add(self, node: str) -> str:
        """The node's namespace (made on first use); returns its address."""
        if node in self.nodes:
            return self.nodes[node][2]
        nsfile = self.root / node
        veth = f"dsn{secrets.token_hex(5)}"
        address = f"{self.prefix}.{10 + len(self.nodes)}"
        nsfile.touch()
        try:
            subprocess.run(["unshare", f"--net={nsfile}", "true"], check=True, capture_output=True)
            self.nodes[node] = (nsfile, veth, address)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(nsfile))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=nsfile)
            _ip("link", "set", "eth0", "up", netns=nsfile)
            _ip("link", "set", "lo", "up", netns=nsfile)
            _ip("route", "add", "default", "via", self.host, netns=nsfile)
        except (OSError, subprocess.CalledProcessError) as exc:
            self._remove(node)
            raise errors.Unavailable(f"cannot make a network namespace for {node}: {exc}") from exc
        return address

    def wrap(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` to run inside the node's namespace."""
        self.add(node)
        return ["nsenter", f"--net={self.nodes[node][0]}", *argv]

    def _remove(self, node: str) -> None:
        nsfile, veth, _ = self.nodes.pop(node, (self.root / node, "", ""))
        subprocess.run(["umount", "-l", str(nsfile)], capture_output=True)
        if veth:  # gone with the namespace once no process is in it; at once if none is
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        try:
            os.unlink(nsfile)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Remove every namespace and the bridge (stop the processes in them first)."""
        for node in list(self.nodes):
            self._remove(node)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.started = False
