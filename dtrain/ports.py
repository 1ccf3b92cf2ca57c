"""A free TCP port for a server about to start in another process (torchrun's store, a
test's daemon), chosen so that nothing but another listener can take it before it binds."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
TORCHRUN_DEFAULTS = frozenset({29400, 29500})  # c10d rendezvous and --master_port


def free_port(rng: random.Random | None = None) -> int:
    """A port free on every address, outside the kernel's ephemeral range (below it, or
    above it where the range starts low).

    A port from bind(0) is ephemeral: between the check and the server's own bind, any
    outgoing connection on the machine may be given it. Outside the range only a listener
    can take it. The check binds the wildcard addresses because torchrun's store and
    slurmctld listen there.
    """
    rng = rng or random.Random()
    span = _outside_ephemeral()
    if span is not None:
        for _ in range(200):
            port = rng.randrange(*span)
            if port not in TORCHRUN_DEFAULTS and _free_everywhere(port):
                return port
    with socket.socket() as s:  # no room outside the range, or hardly anything free there: the kernel chooses
        s.bind(("", 0))
        return s.getsockname()[1]


def _outside_ephemeral() -> tuple[int, int] | None:
    """[start, stop) of ports outside the kernel's ephemeral range: below it from LOWEST, or
    above it where a machine's range starts lower; None where neither holds 1000 ports."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split()[:2])
    except (OSError, ValueError):  # not Linux: the IANA range
        low, high = 49_152, 65_535
    below = (LOWEST, low)
    above = (high + 1, 65_536)
    for start, stop in (below, above):
        if stop - start >= 1000:
            return start, stop
    return None


def _free_everywhere(port: int) -> bool:
    """Free on the IPv4 wildcard and, where the machine has IPv6, on its wildcard too (torch's
    store tries IPv6 first; a listener there alone leaves the IPv4 bind free)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    try:
        v6 = socket.socket(socket.AF_INET6)
    except OSError:  # no IPv6 on this machine
        return True
    with v6:
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            v6.bind(("::", port))
        except OSError as exc:
            return exc.errno == errno.EADDRNOTAVAIL  # IPv6 present but no address to bind: nothing listens there
    return True
