"""Egress links against a hostile tenant, driving :class:`Egress` directly.

Sandbox namespaces come from ``Egress.create``; what runs in them is ``nsenter`` + ``setpriv``
as uid 100000 without capabilities (a sandbox without CAP_NET_RAW/CAP_NET_ADMIN over its
network namespace), or root where the test is about what root there can do. The "internet" is
a namespace of the test's own behind the host, holding a public-looking address and, routed to
it by /32 routes for the test's duration, the metadata address and private ones, so no probe
ever leaves the machine even if a rule were missing.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from dsec_backend_container.network import Egress
from pyroute2 import IPRoute

from dsec_kernel.linuxhost import syscalls

T = TypeVar("T")
PORT = 20000 + int.from_bytes(os.urandom(2)) % 30000
TOOLS = ("nft", "nsenter", "setpriv", "unshare", "ip", "busybox")
_missing = [
    *(["root"] if os.geteuid() != 0 else []),
    *(t for t in (*TOOLS, "/usr/bin/python3") if not shutil.which(t)),
]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)}")
UNPRIVILEGED = ["setpriv", "--reuid=100000", "--regid=100000", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]  # fmt: skip

# What a sandbox runs: each check is [kind, host, port, source, timeout] with kind tcp (the
# server's first line), udp (its answer), ping (an unprivileged ICMP echo) or bind (a
# listening TCP socket); the answer, "timeout" or the errno's name. Concurrent unless
# "serial" is passed.
_PROBE = r"""
import errno, json, socket, sys, threading

def check(kind, host, port=0, src=None, timeout=1.0):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    typ, proto = socket.SOCK_STREAM, 0
    if kind in ("udp", "ping"):
        typ = socket.SOCK_DGRAM
        proto = socket.IPPROTO_ICMP if kind == "ping" else 0
    try:
        with socket.socket(fam, typ, proto) as s:
            s.settimeout(timeout)
            if kind == "bind":
                s.bind((host, port))
                s.listen()
                return "bound"
            if src:
                s.bind((src, 0))
            addr = socket.getaddrinfo(host, port, fam, typ)[0][4]
            if kind == "tcp":
                s.connect(addr)
                return s.recv(100).decode().strip()
            s.sendto(b"\x08\0\0\0\0\0\0\x01ping" if kind == "ping" else b"x", addr)
            data = s.recv(100)
            return "pong" if kind == "ping" else data.decode().strip()
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))

checks, out = json.loads(sys.argv[1]), []
if sys.argv[2:] == ["serial"]:
    out = [check(*c) for c in checks]
else:
    out = [None] * len(checks)
    def run(i, c):
        out[i] = check(*c)
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(checks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(json.dumps(out))
"""


def probe(nsfile: Path, checks: list[list], root: bool = False, serial: bool = False) -> list:
    """Run the checks in the sandbox's network namespace (as uid 100000 unless ``root``)."""
    argv = ["nsenter", f"--net={nsfile}", *([] if root else UNPRIVILEGED),
            "/usr/bin/python3", "-I", "-S", "-c", _PROBE, json.dumps(checks)]  # fmt: skip
    r = subprocess.run([*argv, *(["serial"] if serial else [])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def run_in(nsfile: Path, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` as root in the namespace, checked."""
    return subprocess.run(["nsenter", f"--net={nsfile}", *cmd], check=True, capture_output=True)


def in_netns(nsfile: Path, make: Callable[[], T]) -> T:
    """``make()`` called in the network namespace at ``nsfile`` (sockets stay in it)."""
    result: list = []

    def run() -> None:
        try:
            with open(nsfile) as ns:
                syscalls.setns(ns.fileno(), syscalls.CLONE_NEWNET)
            result.append(make())
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


class Listeners:
    """TCP and UDP servers on ``PORT`` that record who reached them and answer
    ``hello <peer address>``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (tcp|udp, peer address)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def listen(self, host: str, nsfile: Path | None = None, family=socket.AF_INET) -> None:
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):

            def make(kind=kind) -> socket.socket:
                s = socket.socket(family, kind)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, PORT))
                if kind == socket.SOCK_STREAM:
                    s.listen()
                return s

            s = in_netns(nsfile, make) if nsfile else make()
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ)
        self._wake_w.send(b"!")

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                s = key.fileobj
                if s is self._wake_r:
                    if s.recv(1) == b"":
                        return
                    continue
                try:
                    if s.type == socket.SOCK_STREAM:
                        conn, peer = s.accept()
                        self.seen.append(("tcp", peer[0]))
                        conn.sendall(f"hello {peer[0]}\n".encode())
                        conn.close()
                    else:
                        _, peer = s.recvfrom(100)
                        self.seen.append(("udp", peer[0]))
                        s.sendto(f"hello {peer[0]}".encode(), peer)
                except OSError:
                    pass

    def close(self) -> None:
        self._wake_w.close()
        self._thread.join()
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()


@dataclass
class World:
    """The "internet": a namespace behind the host at ``public`` (the host's end of the link
    is ``host_addr``), also holding the addresses in ``extra`` (routed there from the host)."""

    nsfile: Path
    host_addr: str
    public: str
    extra: dict[str, str] = field(default_factory=dict)


def _free_octet(prefix: str) -> int:
    """An octet N such that no route of the host starts with ``prefix.N.``."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                            text=True).stdout  # fmt: skip
    for _ in range(100):
        n = 1 + int.from_bytes(os.urandom(1)) % 250
        if f"{prefix}.{n}." not in routes:
            return n
    raise AssertionError(f"no free {prefix}.N.0/24 on this host")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    d = tmp_path_factory.mktemp("world")
    nsfile, link = d / "net", "dsecw" + os.urandom(3).hex()
    base = 4 * (int.from_bytes(os.urandom(1)) % 63)
    host_addr, public = f"198.51.100.{base + 1}", f"198.51.100.{base + 2}"
    n = _free_octet("172.31")
    w = World(nsfile, host_addr, public, {
        "metadata": "169.254.169.254",
        "link_local": f"169.254.{n}.1",
        "private_allowed": f"172.31.{n}.1",
        "private": f"172.31.{n}.2",
        "shared": f"100.64.{n}.1",
        "denied_public": f"203.0.113.{n}",
    })  # fmt: skip
    nsfile.touch()
    subprocess.run(["unshare", f"--net={nsfile}", "true"], check=True)
    try:
        with IPRoute() as ip:
            ip.link(
                "add", ifname=link, kind="veth", peer={"ifname": "eth0", "net_ns_fd": str(nsfile)}
            )
            idx = ip.link_lookup(ifname=link)[0]
            ip.addr("add", index=idx, address=host_addr, prefixlen=30)
            ip.link("set", index=idx, state="up")
            metric = 1000 + base  # routes of concurrent runs of this module coexist
            for addr in w.extra.values():
                ip.route("add", dst=f"{addr}/32", gateway=public, priority=metric)
        run_in(nsfile, "ip", "addr", "add", f"{public}/30", "dev", "eth0")
        for addr in w.extra.values():
            run_in(nsfile, "ip", "addr", "add", f"{addr}/32", "dev", "eth0")
        run_in(nsfile, "ip", "link", "set", "eth0", "up")
        yield w
    finally:
        syscalls.umount(str(nsfile), syscalls.MNT_DETACH)  # the veth and the routes go with it


@pytest.fixture(scope="module")
def servers(world) -> Iterator[Listeners]:
    """Listeners on the host (0.0.0.0 and [::]) and in the world (every address there)."""
    ls = Listeners()
    ls.listen("0.0.0.0")
    ls.listen("::", family=socket.AF_INET6)
    ls.listen("0.0.0.0", world.nsfile)
    yield ls
    ls.close()


class Sandboxes:
    """Sandboxes made with one :class:`Egress`, removed at the end."""

    def __init__(self, egress: Egress, root: Path) -> None:
        self.egress, self.root = egress, root
        self.made: dict[str, tuple[Path, str]] = {}

    def new(self) -> tuple[str, Path, str]:
        sid = "sb-" + os.urandom(8).hex()
        nsfile = self.root / sid
        addr = self.egress.create(sid, nsfile)
        self.made[sid] = (nsfile, addr)
        return sid, nsfile, addr

    def remove_all(self) -> None:
        for sid, (nsfile, addr) in self.made.items():
            self.egress.remove(sid, nsfile, addr)
        self.made.clear()
        _wait_gone(self.egress.group)


def _links_of(group: int) -> list[dict]:
    with IPRoute() as ip:
        return [link for link in ip.get_links() if link.get_attr("IFLA_GROUP") == group]


def _wait_gone(group: int) -> None:
    """The kernel drops a namespace's veth shortly after its last reference goes."""
    deadline = time.monotonic() + 10
    while _links_of(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _links_of(group)


_subnets: set[int] = set()


def _new_egress(**kw) -> Egress:
    """An Egress on a /24 of 10.217/16 that neither the host nor this module uses."""
    n = _free_octet("10.217")
    while n in _subnets:
        n = _free_octet("10.217")
    _subnets.add(n)
    return Egress(f"10.217.{n}.0/24", "dsect" + os.urandom(3).hex(), **kw)


@pytest.fixture(scope="module")
def egress(world) -> Iterator[Egress]:
    e = world.extra
    eg = _new_egress(allow=[f"{e['private_allowed']}/32 tcp/{PORT}"],
                     deny=[f"{e['denied_public']}/32"])  # fmt: skip
    yield eg
    eg.close()


@pytest.fixture
def sandboxes(egress, tmp_path) -> Iterator[Sandboxes]:
    sbs = Sandboxes(egress, tmp_path)
    yield sbs
    sbs.remove_all()


def _host_addresses() -> list[str]:
    """The host's own non-loopback addresses (IPv4 and IPv6; on a point-to-point link
    IFA_ADDRESS is the peer's)."""
    with IPRoute() as ip:
        mine = {a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS") for a in ip.get_addr()}
    return sorted(a for a in mine if not a.startswith(("127.", "::1", "fe80:")))


def _denied(egress: Egress, sid: str) -> int:
    return egress.denied().get(sid, 0)


# -- the tests ----------------------------------------------------------------------------------


def test_the_outside_is_reached_behind_the_hosts_address(egress, sandboxes, world, servers):
    """TCP, UDP and ping (unprivileged, so the namespace's ping_group_range works) reach the
    outside, which sees the host's address (masquerade); a low port can be bound."""
    sid, nsfile, addr = sandboxes.new()
    hello = f"hello {world.host_addr}"
    got = probe(nsfile, [["tcp", world.public, PORT], ["udp", world.public, PORT],
                         ["ping", world.public], ["bind", "0.0.0.0", 80]])  # fmt: skip
    assert got == [hello, hello, "pong", "bound"]
    assert ("tcp", addr) not in servers.seen and _denied(egress, sid) == 0


def test_the_host_other_sandboxes_and_non_global_ranges_are_denied_and_counted(
    egress, sandboxes, world, servers
):
    """From a sandbox: the host (gateway, its other addresses, IPv4 and IPv6, TCP and UDP),
    another sandbox, link-local, the metadata address, private and shared ranges and the
    operator's deny list are unreachable. Every IPv4 attempt is counted, for that sandbox
    only; IPv6 cannot even be sent. The operator's allow list opens what it names, and no
    more."""
    a, a_ns, _ = sandboxes.new()
    b, b_ns, b_addr = sandboxes.new()
    at_b = Listeners()
    at_b.listen("0.0.0.0", b_ns)
    e, gateway = world.extra, str(egress.gateway)
    targets = [gateway, b_addr, world.host_addr, *_host_addresses(), e["metadata"],
               e["link_local"], e["private"], e["shared"], e["denied_public"],
               "fe80::1%eth0"]  # fmt: skip
    checks = [[kind, t, PORT] for t in targets for kind in ("tcp", "udp")]
    checks += [["udp", e["private_allowed"], PORT], ["ping", gateway], ["ping", e["metadata"]]]
    seen = len(servers.seen)
    try:
        got = probe(a_ns, checks)
    finally:
        at_b.close()
    assert not [(c, g) for c, g in zip(checks, got, strict=True) if g.startswith("hello")]
    assert servers.seen[seen:] == [] and at_b.seen == []
    for c, g in zip(checks, got, strict=True):  # IPv4 is dropped; IPv6 cannot even be sent
        assert g == "timeout" if "." in c[1] else g.startswith("E"), (c, g)
    assert probe(a_ns, [["tcp", e["private_allowed"], PORT]]) == [f"hello {world.host_addr}"]
    ipv4 = sum(1 for c in checks if "." in c[1])
    counts = egress.denied()
    assert counts.get(a, 0) >= ipv4 and b not in counts, counts


def test_a_port_scan_is_counted(egress, sandboxes):
    sid, nsfile, _ = sandboxes.new()
    probe(nsfile, [["tcp", str(egress.gateway), port, None, 0.3] for port in range(1, 301)])
    assert _denied(egress, sid) >= 300


def test_forged_sources_do_not_get_out(egress, sandboxes, world, servers):
    """Root in a sandbox's namespace takes another sandbox's address, or a public one, as an
    extra address and sends from it: nothing gets out, and it is counted."""
    a, a_ns, _ = sandboxes.new()
    _, _, b_addr = sandboxes.new()
    for forged in (b_addr, "203.0.113.250"):
        run_in(a_ns, "ip", "addr", "add", f"{forged}/32", "dev", "eth0")
    before, seen = _denied(egress, a), len(servers.seen)
    checks = [[kind, world.public, PORT, src]
              for src in (b_addr, "203.0.113.250") for kind in ("tcp", "udp")]  # fmt: skip
    assert probe(a_ns, checks, root=True) == ["timeout"] * len(checks)
    assert servers.seen[seen:] == []
    assert _denied(egress, a) >= before + len(checks)


def test_arp_spoofing_steals_nothing(egress, sandboxes, world, servers):
    """Root in sandbox A claims sandbox B's address (an extra address and gratuitous ARP,
    through a packet socket): datagrams the host sends to B still reach B only, B's traffic
    to the outside still flows, and A cannot even resolve B (no shared layer 2)."""
    _, a_ns, _ = sandboxes.new()
    _, b_ns, b_addr = sandboxes.new()
    assert all(link.get_attr("IFLA_MASTER") is None for link in _links_of(egress.group))
    r = subprocess.run(["nsenter", f"--net={a_ns}", "busybox", "arping", "-c", "1", "-w", "1",
                        "-I", "eth0", b_addr], capture_output=True)  # fmt: skip
    assert r.returncode != 0, r.stdout  # nobody on A's link answers for B
    run_in(a_ns, "ip", "addr", "add", f"{b_addr}/32", "dev", "eth0")
    for how in ("-U", "-A"):  # gratuitous request and reply
        subprocess.run(["nsenter", f"--net={a_ns}", "busybox", "arping", how, "-c", "2", "-I",
                        "eth0", "-s", b_addr, b_addr], capture_output=True)  # fmt: skip

    def udp() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", PORT))
        s.settimeout(2)
        return s

    at_a, at_b = in_netns(a_ns, udp), in_netns(b_ns, udp)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(3):
                s.sendto(b"for b", (b_addr, PORT))
        assert at_b.recv(100) == b"for b"
        at_a.settimeout(0.5)
        with pytest.raises(TimeoutError):
            at_a.recv(100)
    finally:
        at_a.close()
        at_b.close()
    assert probe(b_ns, [["tcp", world.public, PORT]]) == [f"hello {world.host_addr}"]


def test_ipv6_is_off_even_for_root_in_the_namespace(egress, sandboxes, servers):
    """The sandbox has no IPv6 on eth0; root who turns it on and takes addresses reaches
    nothing: the host's end of the link has IPv6 off."""
    sid, nsfile, _ = sandboxes.new()
    assert run_in(nsfile, "ip", "-6", "addr", "show", "dev", "eth0").stdout == b""
    assert Path(f"/proc/sys/net/ipv6/conf/dsv{sid[3:14]}/disable_ipv6").read_text() == "1\n"
    run_in(nsfile, "sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=0")
    run_in(nsfile, "ip", "-6", "addr", "add", "fd00:dead::2/64", "dev", "eth0", "nodad")
    run_in(nsfile, "ip", "-6", "route", "add", "default", "dev", "eth0")
    seen = len(servers.seen)
    v6 = [a for a in _host_addresses() if ":" in a] + ["fd00:dead::1", "ff02::1%eth0"]
    got = probe(nsfile, [[k, t, PORT] for t in v6 for k in ("tcp", "udp")], root=True)
    assert not [g for g in got if g.startswith("hello")], got
    assert servers.seen[seen:] == []


def test_only_the_host_opens_connections_to_a_sandbox(egress, sandboxes, world):
    """The host (the edge's side) may connect to a sandbox and gets its replies; the outside,
    even with a route to the sandboxes' subnet, cannot."""
    sid, nsfile, addr = sandboxes.new()
    listener = in_netns(nsfile, lambda: socket.create_server(("0.0.0.0", PORT)))
    run_in(world.nsfile, "ip", "route", "add", str(egress.net), "via", world.host_addr)

    def connect() -> str:
        try:
            socket.create_connection((addr, PORT), timeout=1).close()
            return "connected"
        except OSError as exc:
            return type(exc).__name__

    try:
        assert connect() == "connected"
        assert in_netns(world.nsfile, connect) == "TimeoutError"
    finally:
        listener.close()
        run_in(world.nsfile, "ip", "route", "del", str(egress.net))
    assert _denied(egress, sid) == 0


def test_a_sandbox_cannot_fill_the_connection_table(world, servers, tmp_path):
    eg = _new_egress(max_flows=2)
    sbs = Sandboxes(eg, tmp_path)
    try:
        sid, nsfile, _ = sbs.new()
        checks = [["udp", world.public, PORT]] * 3  # three sockets, three flows
        hello = f"hello {world.host_addr}"
        assert probe(nsfile, checks, serial=True) == [hello, hello, "timeout"]
        assert _denied(eg, sid) >= 1
    finally:
        sbs.remove_all()
        eg.close()


def _table(name: str) -> list[dict]:
    r = subprocess.run(["nft", "-j", "list", "table", "inet", name], capture_output=True)
    return json.loads(r.stdout)["nftables"] if r.returncode == 0 else []


def _other_tables(own: str) -> list[str]:
    r = subprocess.run(["nft", "-j", "list", "tables", "inet"], capture_output=True, check=True)
    names = [o["table"]["name"] for o in json.loads(r.stdout)["nftables"] if "table" in o]
    return [n for n in names if n.startswith("dsec-egress-") and n != own]


def test_rules_survive_a_restart_and_go_with_the_last_sandbox(world, servers, tmp_path):
    """The NAT rule is installed (read back from the kernel); closing with a sandbox left
    keeps everything, a new instance adopts the sandbox; closing with none left removes the
    table, the links and (once no instance's table is left) the ip_forward change."""
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    before = forward.read_text()
    first = _new_egress()
    again = Egress(str(first.net), first.table.removeprefix("dsec-egress-"))
    sbs = Sandboxes(first, tmp_path)
    try:
        sid, nsfile, addr = sbs.new()
        rules = [o["rule"] for o in _table(first.table) if "rule" in o]
        assert any("masquerade" in r["expr"][-1] and r["chain"] == "postrouting" for r in rules)
        assert forward.read_text() == "1\n"
        first.close()
        assert _table(first.table) and len(_links_of(first.group)) == 1

        again.adopt(sid, addr)
        sbs.egress = again
        assert addr in again.used and _table(again.table)
        got = probe(nsfile, [["tcp", world.public, PORT], ["tcp", str(again.gateway), PORT]])
        assert got == [f"hello {world.host_addr}", "timeout"]
        counts = again.denied()
        assert list(counts) == [sid] and counts[sid] >= 1
        sbs.remove_all()
        assert again.denied() == {}  # a removed sandbox's count goes
    finally:
        sbs.remove_all()
        again.close()
    assert _table(again.table) == [] and _links_of(again.group) == []
    if not _other_tables(again.table):
        assert forward.read_text() == before
        netns = os.stat("/proc/self/ns/net").st_ino
        assert not Path(f"/run/dsec/egress-ip-forward.{netns}").exists()


def test_a_flushed_table_is_put_back_at_the_next_poll(servers, tmp_path):
    """A firewall reload that flushes the ruleset takes the table away; the next
    :meth:`Egress.denied` (which the backend polls) loads it again."""
    eg = _new_egress()
    sbs = Sandboxes(eg, tmp_path)
    try:
        _, nsfile, _ = sbs.new()
        subprocess.run(["nft", "delete", "table", "inet", eg.table], check=True)
        assert eg.denied() == {} and _table(eg.table)
        assert probe(nsfile, [["tcp", str(eg.gateway), PORT]]) == ["timeout"]
    finally:
        sbs.remove_all()
        eg.close()


def test_bad_configuration_is_refused():
    for allow in ("10.0.0.0/8 icmp", "10.0.0.0/8 tcp/0", "10.0.0.0/8 tcp/9-8", "fd00::/8",
                  "10.0.0.0/8 tcp 80", "10.0.0.0/8 /80", "nonsense"):  # fmt: skip
        with pytest.raises(ValueError):
            Egress("10.218.0.0/24", "dsecbad", allow=[allow])
    for subnet, name in (("10.218.0.0/31", "ok"), ("fd00::/64", "ok"), ("10.0.0.0/8", "a b")):
        with pytest.raises(ValueError):
            Egress(subnet, name)
    rules = Egress("10.218.0.0/24", "x", allow=["10.1.0.0/16", "10.2.0.0/16 udp",
                                                "10.3.0.0/16 tcp/80-90"])._ruleset()  # fmt: skip
    assert "ip daddr 10.1.0.0/16 goto out" in rules
    assert "ip daddr 10.2.0.0/16 meta l4proto udp goto out" in rules
    assert "ip daddr 10.3.0.0/16 tcp dport 80-90 goto out" in rules
