"""Egress for sandboxes that ask for it: a routed point-to-point link per sandbox, and one
nftables table per :class:`Egress` that decides where packets from those links may go.

Per sandbox, a network namespace (kept alive by a bind mount of its nsfs file) and a veth
pair: inside, ``eth0`` with the sandbox's address, whose point-to-point peer is the gateway
(the subnet's first host), and the default route through it; on the host,
``dsv<11 hex digits of the id>`` in this instance's interface group, with the gateway address
and the sandbox's as its peer (so a /32 route to the sandbox). No two sandboxes share a
layer-2 segment: the host routes every packet, so whatever a sandbox says in ARP concerns only
its own link. IPv6 is off on both ends (inside, ``lo`` keeps ``::1``). Inside, unprivileged
processes may bind low ports and ping.

The table ``inet dsec-egress-<name>`` matches the interface group, so it is loaded once, not
per sandbox. From a sandbox link:

* IPv6, and IPv4 whose source is not that sandbox's address (strict reverse path: the route
  back to the source must be the link the packet came in on), are denied;
* everything addressed to the host (any local address: the gateway, the host's other
  addresses, broadcast) is denied, but for replies to connections the host opened;
* forwarded packets to another sandbox (this subnet, or any ``dsv*`` link of any instance)
  are denied; then the operator's ``allow`` list is accepted; then private and
  special-purpose ranges (:data:`NOT_GLOBAL`: RFC 1918, shared, loopback, link-local with the
  metadata address, multicast, reserved) and the operator's ``deny`` list are denied;
* a sandbox may track at most ``max_flows`` connections at once; more new ones are denied;
* what leaves is masqueraded behind the host's outgoing address.

From elsewhere than the host, only replies reach a sandbox link. Denied packets are dropped
and counted per link (:meth:`Egress.denied`). The first sandbox loads the table and turns on
``net.ipv4.ip_forward``, keeping the previous value in ``/run/dsec`` for every instance in the
same network namespace; :meth:`Egress.close` removes the table when no link of this instance
is left, and the ``ip_forward`` change when no instance's table is.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute

from dsec_kernel.contract import errors
from dsec_kernel.linuxhost import syscalls

__all__ = ["NOT_GLOBAL", "Egress"]

log = logging.getLogger(__name__)

NOT_GLOBAL = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",
    "100.64.0.0/10",  # shared address space (carrier-grade NAT)
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local, with the metadata address 169.254.169.254
    "172.16.0.0/12",
    "192.0.0.0/24",  # IETF protocol assignments
    "192.168.0.0/16",
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/3",  # multicast, reserved, broadcast
)
"""Destinations denied unless the operator's ``allow`` list names them."""

_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_RUN = Path("/run/dsec")
_TABLE_PREFIX = "dsec-egress-"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,15}$")
_PORTS = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")
_INSIDE_SYSCTLS = {
    "net/ipv6/conf/default/disable_ipv6": "1",  # eth0, made after this, gets no IPv6
    "net/ipv4/ip_unprivileged_port_start": "0",
    "net/ipv4/ping_group_range": "0 2147483647",
}


@dataclass(frozen=True)
class _Allowed:
    """One entry of the operator's allow list: ``CIDR``, ``CIDR tcp|udp`` or
    ``CIDR tcp|udp/PORT[-PORT]``."""

    net: ipaddress.IPv4Network
    proto: str | None = None
    ports: str | None = None

    @classmethod
    def parse(cls, text: str) -> _Allowed:
        parts = text.split()
        if len(parts) not in (1, 2):
            raise ValueError(f"egress allow entry {text!r}: expected 'CIDR [tcp|udp[/PORTS]]'")
        proto, _, ports = (parts[1] if len(parts) == 2 else "").partition("/")
        if proto not in ("", "tcp", "udp") or (ports and not proto):
            raise ValueError(f"egress allow entry {text!r}: protocol must be tcp or udp")
        if ports:
            m = _PORTS.match(ports)
            low, high = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
            if not 0 < low <= high <= 65535:
                raise ValueError(f"egress allow entry {text!r}: bad port range {ports!r}")
        return cls(_ipv4_net(parts[0]), proto or None, ports or None)

    def match(self) -> str:
        if self.ports:
            return f"ip daddr {self.net} {self.proto} dport {self.ports}"
        if self.proto:
            return f"ip daddr {self.net} meta l4proto {self.proto}"
        return f"ip daddr {self.net}"


class Egress:
    """Egress links for the sandboxes of one backend instance.

    ``subnet`` (IPv4, at most /30) gives the addresses; the first host is the gateway. ``name``
    names the nftables table; instances on one host need different names and disjoint
    subnets. ``allow``: entries as ``CIDR``, ``CIDR tcp|udp`` or ``CIDR tcp|udp/PORT[-PORT]``
    that sandboxes may reach even in :data:`NOT_GLOBAL` (never the host or another sandbox).
    ``deny``: more CIDRs to refuse (e.g. public addresses of the cluster's own services).
    ``max_flows``: connections one sandbox may have tracked at once.
    """

    def __init__(
        self,
        subnet: str = "10.213.0.0/16",
        name: str = "dsec0",
        allow: Sequence[str] = (),
        deny: Sequence[str] = (),
        max_flows: int = 4096,
    ) -> None:
        self.net = _ipv4_net(subnet)
        if self.net.prefixlen > 30 or self.net.network_address in ipaddress.ip_network("0.0.0.0/8"):
            raise ValueError(f"egress subnet {subnet}: needs at least 4 addresses, not in 0/8")
        if not _NAME.match(name):
            raise ValueError(f"egress name {name!r}: 1-15 of A-Za-z0-9_-")
        if max_flows < 1:
            raise ValueError("max_flows must be at least 1")
        self.gateway = next(self.net.hosts())
        self.table = _TABLE_PREFIX + name
        self.group = int(self.net.network_address)  # distinct for disjoint subnets, never 0
        self.allow = [_Allowed.parse(a) for a in allow]
        self.deny = [_ipv4_net(d) for d in deny]
        self.max_flows = max_flows
        self.used: set[str] = set()
        self._links: dict[str, str] = {}  # host-side link -> sandbox id
        self._lock = threading.Lock()
        self._loaded = False

    # -- the rules --------------------------------------------------------------------------

    def _ruleset(self) -> str:
        """The nft script that (re)loads this instance's table in one transaction."""
        t, g = self.table, self.group
        blocked = ", ".join(map(str, ipaddress.collapse_addresses([
            *map(ipaddress.ip_network, NOT_GLOBAL), *self.deny,
        ])))  # fmt: skip
        allowed = "".join(f"\t\t{a.match()} goto out\n" for a in self.allow)
        return f"""add table inet {t}
delete table inet {t}
table inet {t} {{
	set denied {{ type ifname; size 65535; flags dynamic; counter; }}
	set flows {{ type ifname; size 65535; flags dynamic; }}
	chain prerouting {{
		type filter hook prerouting priority raw; policy accept;
		iifgroup {g} meta nfproto ipv6 jump deny
		iifgroup {g} fib saddr . iif oif missing jump deny
	}}
	chain input {{
		type filter hook input priority filter; policy accept;
		iifgroup {g} ct state established,related accept
		iifgroup {g} jump deny
	}}
	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifgroup {g} jump from_sandbox
		oifgroup {g} ct state != {{ established, related }} drop
	}}
	chain from_sandbox {{
		ct state invalid drop
		oifname "dsv*" jump deny
		ip daddr {self.net} jump deny
{allowed}		ip daddr {{ {blocked} }} jump deny
		goto out
	}}
	chain out {{
		ct state new add @flows {{ iifname ct count over {self.max_flows} }} jump deny
	}}
	chain deny {{
		add @denied {{ iifname }}
		drop
	}}
	chain postrouting {{
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr {self.net} oifgroup != {g} masquerade
	}}
}}
"""

    def _load(self) -> None:
        """Load the table and turn forwarding on, once per instance (idempotent: a table left
        by a previous instance is replaced in the same transaction, with no gap)."""
        with self._lock:
            if self._loaded:
                return
            with _node_lock():
                _nft(self._ruleset())
                _forwarding_on()
            self._loaded = True

    def denied(self) -> dict[str, int]:
        """Packets denied so far, per sandbox (created or adopted by this instance) that had
        any. Counts only grow, unless the table had to be loaded again: a table found gone
        (a firewall reload that flushed the ruleset) is put back here, so polling this also
        keeps the rules in place. Entries of removed sandboxes are dropped here."""
        elements = _set_elements(self.table, "denied")
        if elements is None:
            if self._loaded:
                log.warning("nftables table %s is gone; loading it again", self.table)
                self._loaded = False
                self._load()
            return {}
        counts: dict[str, int] = {}
        stale: list[str] = []
        for elem in elements:
            link, packets = elem["val"], elem.get("counter", {}).get("packets", 0)
            if (sandbox := self._links.get(link)) is not None:
                counts[sandbox] = packets
            else:
                stale.append(link)
        if stale:
            names = ", ".join(json.dumps(s) for s in stale)
            _nft(f"delete element inet {self.table} denied {{ {names} }}\n")
        return counts

    # -- sandboxes ---------------------------------------------------------------------------

    def create(self, sandbox_id: str, nsfile: Path) -> str:
        """Make the sandbox's network namespace at ``nsfile`` with its link; returns its
        address. Leaves nothing behind on failure."""
        self._load()
        link, addr = _link_name(sandbox_id), self._address(sandbox_id)
        try:
            _in_new_netns(
                nsfile,
                inside=lambda host, ns: self._plug_inside(host, ns, link, nsfile, addr),
                outside=lambda host: self._plug_outside(host, link, addr),
            )
        except Exception as exc:
            self.remove(sandbox_id, nsfile, addr)
            raise errors.Unavailable(f"cannot give {sandbox_id} egress: {exc}") from exc
        with self._lock:
            self._links[link] = sandbox_id
        return addr

    def _plug_inside(self, host: IPRoute, ns: IPRoute, link: str, nsfile: Path, addr: str) -> None:
        """The veth from the host (``link``, down) to the sandbox's ``eth0``, configured
        inside: ``addr`` with the gateway as its peer, a default route through it, and ``lo``
        up (``host`` and ``ns``: netlink sockets in the host's and the sandbox's namespace)."""
        host.link("add", ifname=link, kind="veth", group=self.group,
                  peer={"ifname": "eth0", "net_ns_fd": str(nsfile)})  # fmt: skip
        eth = socket.if_nametoindex("eth0")
        ns.addr("add", index=eth, local=addr, address=str(self.gateway), prefixlen=32)
        ns.link("set", index=eth, state="up")
        ns.route("add", dst="default", gateway=str(self.gateway), oif=eth)
        syscalls.loopback_up()

    def _plug_outside(self, host: IPRoute, link: str, addr: str) -> None:
        """The host's end: no IPv6, the gateway address with the sandbox's as its peer (so a
        /32 route to the sandbox), up (run in the host's namespace: ``/proc/sys/net`` is the
        reader's)."""
        _sysctl(f"net/ipv6/conf/{link}/disable_ipv6", "1")
        idx = socket.if_nametoindex(link)
        host.addr("add", index=idx, local=str(self.gateway), address=addr, prefixlen=32)
        host.link("set", index=idx, state="up")

    def adopt(self, sandbox_id: str, address: str) -> None:
        """Take over a sandbox that a previous instance made (after an edge restart): its
        address stays reserved, its denials are counted, the rules are (re)loaded."""
        self._load()
        with self._lock:
            self.used.add(address)
            self._links[_link_name(sandbox_id)] = sandbox_id

    def remove(self, sandbox_id: str, nsfile: Path, addr: str | None) -> None:
        """Undo :meth:`create` (the link, its address and route go with the namespace).
        Idempotent."""
        try:
            syscalls.umount(str(nsfile), syscalls.MNT_DETACH)
        except OSError:
            pass
        try:
            nsfile.unlink()
        except FileNotFoundError:
            pass
        with self._lock:
            self.used.discard(addr or "")
            self._links.pop(_link_name(sandbox_id), None)

    def _address(self, sandbox_id: str) -> str:
        hosts = self.net.num_addresses - 2
        n = int(hashlib.sha256(sandbox_id.encode()).hexdigest(), 16)
        with self._lock:
            for i in range(hosts):
                addr = str(self.net.network_address + 2 + (n + i) % (hosts - 1))
                if addr not in self.used:
                    self.used.add(addr)
                    return addr
        raise errors.CapacityExceeded(f"no free address in {self.net} for egress")

    def close(self) -> None:
        """Remove the table, unless a link of this instance is left (a restarted edge adopts
        its sandboxes), and the ``ip_forward`` change once no instance's table is left."""
        with _iproute() as ip:
            if any(link.get_attr("IFLA_GROUP") == self.group for link in ip.get_links()):
                return
        with self._lock, _node_lock():
            tables = _tables()
            if self.table in tables:
                _nft(f"delete table inet {self.table}\n")
            if not any(t.startswith(_TABLE_PREFIX) and t != self.table for t in tables):
                _forwarding_restore()
            self._loaded = False


def _link_name(sandbox_id: str) -> str:
    return "dsv" + sandbox_id[3:14]


def _ipv4_net(text: str) -> ipaddress.IPv4Network:
    net = ipaddress.ip_network(text)
    if not isinstance(net, ipaddress.IPv4Network):
        raise ValueError(f"{text}: sandboxes have IPv4 only")
    return net


# -- node-wide state: nftables and ip_forward ---------------------------------------------------


def _nft(script: str) -> None:
    """Run an nft script (one transaction); raises :class:`errors.Unavailable` with nft's
    message if it fails."""
    try:
        r = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
    except FileNotFoundError:
        raise errors.Unavailable("egress needs nftables (the nft command)") from None
    if r.returncode:
        raise errors.Unavailable(f"nft failed: {r.stderr.strip()}")


def _nft_json(*command: str) -> list[dict] | None:
    """The objects of ``nft -j COMMAND``'s answer; None if nft fails (e.g. no such table) or
    is missing."""
    try:
        r = subprocess.run(["nft", "-j", *command], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return json.loads(r.stdout)["nftables"] if r.returncode == 0 else None


def _tables() -> list[str]:
    return [o["table"]["name"] for o in _nft_json("list", "tables", "inet") or [] if "table" in o]


def _set_elements(table: str, name: str) -> list[dict] | None:
    """The elements of a set, each as ``{"val": key, "counter": {...}}``; None if there is
    no such set."""
    for o in _nft_json("list", "set", "inet", table, name) or []:
        if "set" in o:
            return [
                e["elem"] if isinstance(e, dict) else {"val": e} for e in o["set"].get("elem", [])
            ]
    return None


@contextlib.contextmanager
def _node_lock() -> Iterator[None]:
    """Serialises the instances of a node around the table and ``ip_forward``."""
    _RUN.mkdir(parents=True, exist_ok=True)
    with open(_RUN / "egress.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _forwarding_record() -> Path:
    """Where the network namespace's own ``ip_forward`` is kept while DSec has it on (one per
    namespace: edges of a local cluster each run in their own)."""
    return _RUN / f"egress-ip-forward.{os.stat('/proc/thread-self/ns/net').st_ino}"


def _forwarding_on() -> None:
    """Turn IPv4 forwarding on, recording the namespace's own setting the first time."""
    was, record = _FORWARD.read_text().strip(), _forwarding_record()
    if was != "1":
        if not record.exists():
            record.write_text(was)
        _FORWARD.write_text("1")


def _forwarding_restore() -> None:
    record = _forwarding_record()
    with contextlib.suppress(FileNotFoundError):
        _FORWARD.write_text(record.read_text())
        record.unlink()


# -- netlink and namespaces ---------------------------------------------------------------------


@contextlib.contextmanager
def _iproute() -> Iterator[IPRoute]:
    """pyroute2's synchronous IPRoute, subscribed to no events, on a plain selector loop of
    its own: the edge may run uvloop, whose loops cannot open netlink sockets."""
    loop = asyncio.SelectorEventLoop()
    try:
        with IPRoute(use_event_loop=loop, groups=0) as ip:
            yield ip
        loop.run_until_complete(asyncio.sleep(0))  # the socket's transport finishes closing
    finally:
        loop.close()


def _sysctl(key: str, value: str) -> None:
    """Write ``/proc/sys/<key>`` of the calling thread's network namespace; an IPv6 key is
    skipped on a kernel without IPv6 (there is nothing to turn off)."""
    if key.startswith("net/ipv6/") and not Path("/proc/sys/net/ipv6").exists():
        return
    Path("/proc/sys", key).write_text(value)


def _in_new_netns(
    nsfile: Path,
    inside: Callable[[IPRoute, IPRoute], None],
    outside: Callable[[IPRoute], None],
) -> None:
    """Make a new network namespace, kept by a bind mount on ``nsfile``, with
    :data:`_INSIDE_SYSCTLS`; call ``inside`` with netlink sockets in the host's namespace and
    in the new one from within the new one, then ``outside`` with the host's socket from
    within the host's. All in a short-lived thread: namespaces belong to threads, so the
    edge's own stay untouched (a socket keeps the namespace it was made in).

    Never through pyroute2's ``netns=``: it forks the (threaded) edge, and the SIGTERM it
    sends that child reaches the edge's own signal handlers through the shared wakeup fd."""
    nsfile.touch()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with open("/proc/thread-self/ns/net") as own, _iproute() as host:
                syscalls.unshare(syscalls.CLONE_NEWNET)
                syscalls.mount("/proc/thread-self/ns/net", str(nsfile), None, syscalls.MS_BIND)
                for key, value in _INSIDE_SYSCTLS.items():
                    _sysctl(key, value)
                with _iproute() as ns:
                    inside(host, ns)
                syscalls.setns(own.fileno(), syscalls.CLONE_NEWNET)
                outside(host)
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=run, name="dsec-netns")
    t.start()
    t.join()
    if failure:
        raise failure[0]
