"""A free TCP port for a server about to start in another process (torchrun's store, a
test's daemon), chosen so that nothing but another listener can take it before it binds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
TORCHRUN_DEFAULTS = frozenset({29400, 29500})  # c10d rendezvous and --master_port


def free_port(rng: random.Random | None = None) -> int:
    """A port free on every address, below the kernel's ephemeral range.

    A port from bind(0) is ephemeral: between the check and the server's own bind, any
    outgoing connection on the machine may be given it. Below the range only a listener
    can take it. The check binds the wildcard address because torchrun's store and
    slurmctld listen there.
    """
    rng = rng or random.Random()
    try:
        top = min(int(EPHEMERAL_RANGE.read_text().split()[0]), 32_768)
    except (OSError, ValueError, IndexError):  # not Linux: the usual IANA start
        top = 32_768
    for _ in range(200):
        port = rng.randrange(LOWEST, top)
        if port in TORCHRUN_DEFAULTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # hardly anything free down there: let the kernel choose
        s.bind(("", 0))
        return s.getsockname()[1]
