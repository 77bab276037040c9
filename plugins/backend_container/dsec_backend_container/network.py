"""Egress for sandboxes that ask for it: a per-node bridge with NAT, and per sandbox a network
namespace (kept alive by a bind mount of its nsfs file) joined to the bridge by a veth.

Sandboxes without egress get none of this: their init makes a namespace with only ``lo``.
The bridge is made with the first egress sandbox and removed (with its NAT rule) when the
backend closes with no sandbox attached to it. Two edges on one host need different bridges
and subnets (``egress_bridge``, ``egress_subnet``).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pyroute2 import IPRoute

from dsec_kernel import errors, linux

__all__ = ["Egress"]

_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class Egress:
    """Addresses come from ``subnet``; the bridge takes the first one."""

    def __init__(self, subnet: str = "10.213.0.0/16", bridge: str = "dsec0") -> None:
        self.net = ipaddress.ip_network(subnet)
        self.gateway = next(self.net.hosts())
        self.bridge = bridge
        self.used: set[str] = set()
        self._bridge_ready = False
        self._forward_was: str | None = None
        self._nat = ["-t", "nat", "POSTROUTING", "-s", str(self.net), "!", "-o", bridge,
                     "-j", "MASQUERADE"]  # fmt: skip

    def _ensure_bridge(self) -> None:
        if self._bridge_ready:
            return
        with _iproute() as ip:
            if not ip.link_lookup(ifname=self.bridge):
                ip.link("add", ifname=self.bridge, kind="bridge")
            idx = ip.link_lookup(ifname=self.bridge)[0]
            have = {a.get_attr("IFA_ADDRESS") for a in ip.get_addr(index=idx)}
            if str(self.gateway) not in have:
                ip.addr("add", index=idx, address=str(self.gateway), prefixlen=self.net.prefixlen)
            ip.link("set", index=idx, state="up")
        forward = _FORWARD.read_text().strip()
        if forward != "1":
            self._forward_was = forward
            _FORWARD.write_text("1")
        if shutil.which("iptables") and self._iptables("-C") != 0:
            self._iptables("-A")
        self._bridge_ready = True

    def _iptables(self, action: str) -> int:
        return subprocess.run(["iptables", action, *self._nat], capture_output=True).returncode

    def close(self) -> None:
        """Remove the bridge, its NAT rule and our ip_forward change, unless a sandbox (of
        any edge) is still attached to it."""
        with _iproute() as ip:
            found = ip.link_lookup(ifname=self.bridge)
            if not found or any(k.get_attr("IFLA_MASTER") == found[0] for k in ip.get_links()):
                return
            ip.link("del", index=found[0])
        if shutil.which("iptables"):
            self._iptables("-D")
        if self._forward_was is not None:
            _FORWARD.write_text(self._forward_was)
            self._forward_was = None
        self._bridge_ready = False

    def _address(self, sandbox_id: str) -> str:
        hosts = self.net.num_addresses - 2
        n = int(hashlib.sha256(sandbox_id.encode()).hexdigest(), 16)
        for i in range(hosts):
            addr = str(self.net.network_address + 2 + (n + i) % (hosts - 1))
            if addr not in self.used:
                self.used.add(addr)
                return addr
        raise errors.CapacityExceeded(f"no free address in {self.net} for egress")

    def create(self, sandbox_id: str, nsfile: Path) -> str:
        """Make the sandbox's network namespace at ``nsfile`` with a veth to the bridge;
        returns its address. Leaves nothing behind on failure."""
        self._ensure_bridge()
        addr = self._address(sandbox_id)
        host_if = "dsv" + sandbox_id[3:14]
        try:
            _in_new_netns(nsfile, lambda host, ns: self._plug(host, ns, host_if, nsfile, addr))
        except Exception as exc:
            self.remove(sandbox_id, nsfile, addr)
            raise errors.Unavailable(f"cannot give {sandbox_id} egress: {exc}") from exc
        return addr

    def _plug(self, ip: IPRoute, ns: IPRoute, host_if: str, nsfile: Path, addr: str) -> None:
        """A veth from the bridge to the sandbox's ``eth0`` (``ns``: a netlink socket in its
        namespace), with ``addr`` and a default route through the bridge."""
        ip.link("add", ifname=host_if, kind="veth",
                peer={"ifname": "eth0", "net_ns_fd": str(nsfile)})  # fmt: skip
        idx = ip.link_lookup(ifname=host_if)[0]
        ip.link("set", index=idx, master=ip.link_lookup(ifname=self.bridge)[0], state="up")
        eth = ns.link_lookup(ifname="eth0")[0]
        ns.addr("add", index=eth, address=addr, prefixlen=self.net.prefixlen)
        ns.link("set", index=eth, state="up")
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        ns.route("add", dst="default", gateway=str(self.gateway))

    def remove(self, sandbox_id: str, nsfile: Path, addr: str | None) -> None:
        """Undo :meth:`create` (the veth goes with the namespace). Idempotent."""
        try:
            linux.umount(str(nsfile), linux.MNT_DETACH)
        except OSError:
            pass
        try:
            nsfile.unlink()
        except FileNotFoundError:
            pass
        self.used.discard(addr or "")


@contextmanager
def _iproute(**kw: object) -> Iterator[IPRoute]:
    """pyroute2's synchronous IPRoute on a plain selector loop of its own: the edge may run
    uvloop, whose loops cannot open netlink sockets."""
    loop = asyncio.SelectorEventLoop()
    try:
        with IPRoute(use_event_loop=loop, **kw) as ip:
            yield ip
        loop.run_until_complete(asyncio.sleep(0))  # the socket's transport finishes closing
    finally:
        loop.close()


def _in_new_netns(nsfile: Path, then: Callable[[IPRoute, IPRoute], None]) -> None:
    """Make a new network namespace, kept by a bind mount on ``nsfile``, and call ``then``
    with netlink sockets in the host's namespace and in the new one, in a short-lived thread
    (namespaces belong to threads, so the edge's own stay untouched; a socket keeps the
    namespace it was made in).

    Never through pyroute2's ``netns=``: it forks the (threaded) edge, and the SIGTERM it
    sends that child reaches the edge's own signal handlers through the shared wakeup fd."""
    nsfile.touch()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with _iproute() as host:
                linux.unshare(linux.CLONE_NEWNET)
                linux.mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", str(nsfile),
                            None, linux.MS_BIND)  # fmt: skip
                with _iproute() as ns:
                    then(host, ns)
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=run, name="dsec-netns")
    t.start()
    t.join()
    if failure:
        raise failure[0]
