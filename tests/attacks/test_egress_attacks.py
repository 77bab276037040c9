"""Egress against a hostile tenant (issue 7, item 8): an attacker's ``network="egress"``
sandbox scans, spoofs and connects to what it can, through the SDK only.

What must hold: from an egress sandbox, the host's services (through the gateway and the
host's other addresses, on 0.0.0.0 and [::], TCP and UDP), another tenant's egress sandbox,
link-local and the metadata address, and IPv6 are all unreachable; claiming another sandbox's
address in ARP steals none of its traffic; a port scan finds nothing.

The test's servers run in the host's network namespace (where the platform's edge runs) and
record every peer; 169.254.169.254 is made a host address on a dummy link of the test's own
(a veth) for the module's duration, so that no probe ever leaves the machine, blocked or not.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import socket
import threading
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute

import dsec_kernel as dsec

BUSYBOX = dsec.Env(base="busybox:1")
PORT = 20000 + int.from_bytes(os.urandom(2)) % 30000
METADATA = "169.254.169.254"


@pytest.fixture(autouse=True)
def _container(needs):
    needs("container")


class Listeners:
    """TCP and UDP servers on ``PORT`` (0.0.0.0 and [::]) that record every peer and answer
    ``hello``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self._sel = selectors.DefaultSelector()
        self._stop_r, self._stop_w = socket.socketpair()
        self._sel.register(self._stop_r, selectors.EVENT_READ)
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                s = socket.socket(family, kind)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, PORT))
                if kind == socket.SOCK_STREAM:
                    s.listen()
                s.setblocking(False)
                self._sel.register(s, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                s = key.fileobj
                if s is self._stop_r:
                    return
                try:
                    if s.type == socket.SOCK_STREAM:
                        conn, peer = s.accept()
                        self.seen.append(("tcp", peer[0]))
                        conn.sendall(b"hello\n")
                        conn.close()
                    else:
                        _, peer = s.recvfrom(512)
                        self.seen.append(("udp", peer[0]))
                        s.sendto(b"hello", peer)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop_w.send(b"!")
        self._thread.join()
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._stop_w.close()
        self._sel.close()


@pytest.fixture(scope="module")
def host() -> Iterator[Listeners]:
    """The host's services, and the metadata address as a host address."""
    link = "dsecmd" + os.urandom(3).hex()
    with IPRoute() as ip:
        ip.link("add", ifname=link, kind="veth", peer=link + "p")  # no dummy driver here
        try:
            idx = ip.link_lookup(ifname=link)[0]
            ip.addr("add", index=idx, address=METADATA, prefixlen=32)
            ip.link("set", index=idx, state="up")
            servers = Listeners()
            try:
                yield servers
            finally:
                servers.close()
        finally:
            ip.link("del", index=ip.link_lookup(ifname=link)[0])


def host_addresses(family: int) -> list[str]:
    """The host's own addresses of ``family`` but loopback and IPv6 link-local (pyroute2's
    synchronous API: not on the event loop's thread)."""
    with IPRoute() as ip:
        found = {
            a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS") for a in ip.get_addr(family=family)
        }
    return sorted(a for a in found if not a.startswith(("127.", "::1", "fe80:")))


async def sh(sb: dsec.Sandbox, script: str, timeout: float = 60) -> str:
    r = await sb.exec(["/bin/sh", "-c", script], timeout=timeout)
    return (r.stdout + r.stderr).decode(errors="replace")


async def egress_pair(attacker, victim) -> tuple[dsec.Sandbox, dsec.Sandbox, str, str]:
    """(the attacker's sandbox, the victim's, the victim's address, the attacker's gateway)."""
    [evil] = await attacker.create(count=1, backend="container", env=BUSYBOX, network="egress")
    [prey] = await victim.create(count=1, backend="container", env=BUSYBOX, network="egress")
    addr = re.search(r"inet (\d+\.\d+\.\d+\.\d+)", await sh(prey, "ip -o -4 addr show eth0"))
    gateway = re.search(r"default via (\S+)", await sh(evil, "ip route"))
    assert addr and gateway
    return evil, prey, addr[1], gateway[1]


def tcp_and_udp(targets: list[str]) -> str:
    """A script trying each target on ``PORT`` by TCP (nc) and UDP (tftp), all at once,
    printing ``OPEN <target>`` for a TCP answer."""
    tries = [
        f"(nc -w 2 {t} {PORT} </dev/null | grep -q hello && echo OPEN {t}) &"
        f" (timeout 3 tftp -g -r x -l /tmp/x {t} {PORT} >/dev/null 2>&1) &"
        for t in targets
    ]
    return " ".join(tries) + " wait"


async def test_the_host_and_the_metadata_address_are_out_of_reach(
    platform, attacker, victim, attack, host
):
    evil, prey, _, gateway = await egress_pair(attacker, victim)
    try:
        others = [
            a
            for a in await asyncio.to_thread(host_addresses, socket.AF_INET)
            if a not in (gateway, METADATA)
        ]
        seen = len(host.seen)
        out = await sh(evil, tcp_and_udp([gateway, *others, METADATA]))
        reached = host.seen[seen:]
        assert "OPEN" not in out and reached == [], (out, reached)
        attack("egress: TCP+UDP to host services via the gateway", "container", "dropped")
        attack("egress: TCP+UDP to the host's other addresses", "container", "dropped")
        attack(f"egress: metadata {METADATA} (TCP+UDP)", "container", "dropped")
    finally:
        await asyncio.gather(evil.destroy(), prey.destroy())


async def test_ipv6_reaches_nothing(platform, attacker, victim, attack, host):
    evil, prey, _, _ = await egress_pair(attacker, victim)
    try:
        assert "inet6" not in await sh(evil, "ip -6 addr show dev eth0")
        seen = len(host.seen)
        targets = await asyncio.to_thread(host_addresses, socket.AF_INET6)
        out = await sh(evil, " ".join(
            f"(nc -w 2 {t} {PORT} </dev/null | grep -q hello && echo OPEN {t}) &" for t in targets
        ) + " ping6 -c 2 -W 2 -I eth0 ff02::1 || echo NO-NEIGHBOURS; wait")  # fmt: skip
        assert "OPEN" not in out and "NO-NEIGHBOURS" in out and host.seen[seen:] == [], out
        attack("egress: IPv6 to the host's global addresses", "container", "no IPv6 route")
        attack("egress: IPv6 link-local all-nodes (ff02::1)", "container", "no IPv6 on eth0")
    finally:
        await asyncio.gather(evil.destroy(), prey.destroy())


async def test_another_tenants_egress_sandbox_is_out_of_reach(platform, attacker, victim, attack):
    evil, prey, prey_addr, _ = await egress_pair(attacker, victim)
    try:
        await sh(prey, f"nc -l -p {PORT} </dev/null >/tmp/got 2>&1 & sleep 0.2")
        await sh(evil, f"echo pwned | nc -w 2 {prey_addr} {PORT}")
        assert "pwned" not in await sh(prey, "cat /tmp/got")
        attack("egress: TCP to another tenant's egress sandbox", "container", "dropped")
    finally:
        await asyncio.gather(evil.destroy(), prey.destroy())


async def test_claiming_anothers_address_in_arp_steals_nothing(platform, attacker, victim, attack):
    """The attacker announces the victim's address (and the gateway's) as its own in
    gratuitous ARP, and listens where the victim does; what the host then sends to the
    victim reaches the victim."""
    evil, prey, prey_addr, gateway = await egress_pair(attacker, victim)
    try:
        await sh(prey, f"nc -l -p {PORT} </dev/null >/tmp/got 2>&1 & sleep 0.2")
        arping = await sh(evil, f"nc -l -p {PORT} </dev/null >/tmp/got 2>&1 & "
                                f"for who in {prey_addr} {gateway}; do for how in -U -A; do"
                                f" arping $how -c 2 -I eth0 -s $who $who; done; done")  # fmt: skip

        def send() -> None:
            with socket.create_connection((prey_addr, PORT), timeout=5) as s:
                s.sendall(b"for the victim\n")

        await asyncio.to_thread(send)
        await asyncio.sleep(0.2)
        assert "for the victim" in await sh(prey, "cat /tmp/got")
        assert "for the victim" not in await sh(evil, "cat /tmp/got")
        refused = "permission denied" in arping.lower() or "not permitted" in arping
        outcome = "arping refused (no raw sockets)" if refused else "heard on its own link only"
        attack("egress: gratuitous ARP for the victim's address", "container", outcome)
    finally:
        await asyncio.gather(evil.destroy(), prey.destroy())


async def test_a_port_scan_finds_nothing(platform, attacker, victim, attack, host):
    evil, prey, prey_addr, gateway = await egress_pair(attacker, victim)
    try:
        seen = len(host.seen)
        ports = f"$(seq 1 150) {PORT}"
        out = await sh(evil, f"for t in {gateway} {prey_addr}; do for p in {ports}; do"
                             f" (nc -w 1 $t $p </dev/null >/dev/null 2>&1 && echo OPEN $t $p) &"
                             f" done; done; wait")  # fmt: skip
        assert "OPEN" not in out and host.seen[seen:] == [], out
        attack("egress: TCP port scan of the gateway and a neighbour", "container", "all dropped")
    finally:
        await asyncio.gather(evil.destroy(), prey.destroy())
