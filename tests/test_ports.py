import random
import socket

import pytest

from dtrain import ports


class Scripted(random.Random):
    """Yields the given ports first, then random ones."""

    def __init__(self, first):
        super().__init__(0)
        self.first = list(first)

    def randrange(self, *args):
        return self.first.pop(0) if self.first else super().randrange(*args)


def test_a_port_held_on_loopback_is_skipped_because_servers_listen_on_every_address():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        port = ports.free_port(Scripted([taken, 29500, 29400]))
    assert port not in (taken, 29500, 29400)
    with socket.socket() as s:  # and it is free on the wildcard address
        s.bind(("", port))


def test_the_port_is_below_the_ephemeral_range_so_no_outgoing_connection_takes_it():
    low = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    seen = {ports.free_port() for _ in range(50)}
    assert all(ports.LOWEST <= p < low for p in seen), sorted(seen)
    assert len(seen) > 40  # random, so parallel test workers rarely pick the same one


def test_a_machine_whose_ephemeral_range_starts_low_gets_a_port_above_it(tmp_path, monkeypatch):
    conf = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", conf)
    conf.write_text("1024\t60999\n")
    assert all(61_000 <= ports.free_port() < 65_536 for _ in range(20))
    conf.write_text("1024\t65535\n")  # no room outside it: the kernel's choice, still free
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("", port))


def test_a_port_held_on_the_ipv6_wildcard_alone_is_skipped():
    try:
        held = socket.socket(socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 on this machine")
    with held:
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        held.bind(("::", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as v4:  # the IPv4 wildcard is free: an IPv4-only check would hand it out
            v4.bind(("", taken))
        assert ports.free_port(Scripted([taken])) != taken
