"""Multi-host test harness: 3 hosts in Linux network namespaces, each with its own sshd.

Loaded as a pytest plugin from tests/conftest.py. The session fixture `netns_cluster`
builds, once per test session:

- a bridge in the root namespace with an address (the head = the test process, which
  reaches every host over it),
- one namespace per host (`dt<pid>h<i>`) joined to the bridge by a veth pair whose host
  end is called `eth0`, with loopback up and an address in a private /24,
- one `sshd` per host (key auth with a temporary keypair, root allowed by key only),
- an ssh_config so `ssh -F cfg h1` works, and per-namespace /etc/hosts files.

All hosts see the same filesystem: namespaces share the mount namespace, exactly like
nodes on a NAS. Teardown kills every process left in the namespaces, removes the
namespaces, links, bridge and temporary files; it runs from the fixture finalizer and
from atexit (Ctrl-C, SIGTERM), and the next session removes what a SIGKILLed one left.

Name resolution (measured on the CI VM, documented here because torch's rendezvous does
reverse lookups): /etc/hosts is shared, but `ip netns exec` bind-mounts the files of
/etc/netns/<ns>/ over /etc/ for the processes it starts, sshd included, so every host
gets its own hosts file naming h1..h3 and the head (and its own resolv.conf copy).
Without it a reverse lookup of a bridge address falls through to DNS; inside a
namespace the resolver is unroutable, so `getent hosts <ip>` fails at once
(ENETUNREACH) rather than stalling - but a resolver that is routable and silent stalls
every lookup for its timeout: `edit_etc` reproduces that for the preflight test.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

N_HOSTS = 3
SSHD = "/usr/sbin/sshd"
NETNS_ETC = Path("/etc/netns")
LOCK = Path("/run/dtrain-netns.lock")
_STALE = re.compile(r"^dt(\d+)(?:h\d+|br|v\d+|probe)$")


@dataclass(frozen=True)
class Host:
    name: str  # the Host entry in ssh_config and /etc/hosts of the namespaces
    netns: str
    address: str


@dataclass
class NetnsCluster:
    hosts: list[Host]
    head_address: str  # the root namespace's address on the bridge
    ssh_config: Path
    identity: Path
    tmpdir: Path
    bridge: str
    _teardown: list = field(default_factory=list, repr=False)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def exec(self, host: str | Host, argv: list[str], *, timeout: float = 30, check: bool = False,
             **kwargs) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside that host's namespace (as root, no ssh)."""
        h = host if isinstance(host, Host) else self.host(host)
        kwargs.setdefault("capture_output", True)
        return subprocess.run(["ip", "netns", "exec", h.netns, *argv], text=True, timeout=timeout,
                              check=check, **kwargs)

    def popen(self, host: str | Host, argv: list[str], **kwargs) -> subprocess.Popen:
        h = host if isinstance(host, Host) else self.host(host)
        return subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], **kwargs)

    def ssh(self, host: str, command: str, *, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a shell command on a host through its sshd, as a node would be reached."""
        return subprocess.run(["ssh", "-F", str(self.ssh_config), host, command], text=True,
                              capture_output=True, timeout=timeout)

    def processes(self, host: str | Host) -> list[tuple[int, str]]:
        """(pid, command line) of every process in the host except its sshd listener."""
        h = host if isinstance(host, Host) else self.host(host)
        return [(pid, cmd) for pid, cmd in _netns_processes(h.netns) if not _is_listener(cmd)]

    def set_link(self, host: str, up: bool) -> None:
        """Cut (or restore) a host's network, as when a node drops off the network."""
        h = self.host(host)
        _ip("-n", h.netns, "link", "set", "eth0", "up" if up else "down")

    @contextlib.contextmanager
    def edit_etc(self, host: str, name: str, text: str):
        """Temporarily replace a host's /etc/hosts or /etc/resolv.conf.

        Written in place: processes started earlier (sshd) see the bind-mounted inode,
        so the change reaches every later ssh session on that host."""
        path = NETNS_ETC / self.host(host).netns / name
        saved = path.read_text()
        with open(path, "r+") as f:
            f.write(text)
            f.truncate()
        try:
            yield path
        finally:
            with open(path, "r+") as f:
                f.write(saved)
                f.truncate()

    def cluster_yaml(self, n: int = 2, *, path: Path | None = None, extra: str = "",
                     node_extra: dict[str, str] | None = None) -> Path:
        """Write a cluster.yaml naming the first `n` hosts; returns its path.

        `extra` is appended at top level; `node_extra[name]` inside that node's entry
        (YAML lines, indented by the caller's convention of 4 spaces).
        """
        node_extra = node_extra or {}
        lines = [
            f"ssh_config: {self.ssh_config}",
            "defaults:",
            f"  python: {sys.executable}",
            f"  workdir: {Path(__file__).resolve().parents[1]}",
            "nodes:",
        ]
        for h in self.hosts[:n]:
            lines += [f"  - name: {h.name}", f"    host: {h.name}", f"    address: {h.address}"]
            if h.name in node_extra:
                lines.append(node_extra[h.name].rstrip("\n"))
        text = "\n".join(lines) + "\n" + extra
        path = path or self.tmpdir / f"cluster-{n}-{time.monotonic_ns()}.yaml"
        path.write_text(text)
        return path


# ---------------------------------------------------------------- building blocks


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_processes(netns: str) -> list[tuple[int, str]]:
    out = _ip("netns", "pids", netns, check=False).stdout.split()
    procs = []
    for pid in map(int, out):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        procs.append((pid, cmd))
    return procs


def _is_listener(cmd: str) -> bool:
    # sshd retitles its listener "sshd: /usr/sbin/sshd -D ... [listener] 0 of 64-128 startups"
    return cmd.startswith(f"sshd: {SSHD} -D ") and "[listener]" in cmd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(netns: str) -> None:
    # Deleting a namespace does not stop the processes in it; kill them first (twice:
    # sshd's session children may be forking while we look).
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in _netns_processes(netns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while _netns_processes(netns) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _netns_processes(netns):
            break
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def _clean_stale() -> None:
    """Remove namespaces and links left by earlier sessions whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _STALE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_netns(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _STALE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
    for tmp in Path(tempfile.gettempdir()).glob("dtrain-netns-*-*"):
        pid = tmp.name.split("-")[2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pick_subnet() -> str:
    """A 10.213.X.0/24 that no address or route on this machine overlaps."""
    text = _ip("-4", "addr", check=False).stdout + _ip("-4", "route", check=False).stdout
    taken = [ipaddress.ip_network(m, strict=False)
             for m in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", text)]
    start = os.getpid() % 250
    for i in range(250):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 250 + 1}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return str(net.network_address)[:-1]  # "10.213.X."
    raise RuntimeError("no free 10.213.X.0/24 subnet for the test hosts")


def _wait_port(addr: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _sshd_config(tmp: Path, h: Host) -> Path:
    cfg = tmp / f"sshd-{h.name}.conf"
    cfg.write_text(
        f"ListenAddress {h.address}\n"
        "Port 22\n"
        f"HostKey {tmp / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp / 'id_ed25519.pub'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "UseDNS no\n"
        # launch tests open several sessions per host at once
        "MaxStartups 64:30:128\n"
        "MaxSessions 64\n"
        f"PidFile {tmp / f'sshd-{h.name}.pid'}\n"
        "Subsystem sftp internal-sftp\n"
    )
    return cfg


def _ssh_config(tmp: Path, hosts: list[Host], prefix: str) -> Path:
    common = (
        "  User root\n"
        f"  IdentityFile {tmp / 'id_ed25519'}\n"
        "  IdentitiesOnly yes\n"
        "  UserKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking no\n"
        "  LogLevel ERROR\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 5\n"
    )
    text = "".join(f"Host {h.name}\n  HostName {h.address}\n{common}" for h in hosts)
    text += f"Host {prefix}*\n{common}"  # the bare addresses work too
    path = tmp / "ssh_config"
    path.write_text(text)
    return path


def _hosts_file(hosts: list[Host], head: str) -> str:
    base = Path("/etc/hosts").read_text()
    return base.rstrip("\n") + "\n" + f"{head} head\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)


def build(n_hosts: int = N_HOSTS) -> NetnsCluster:
    """Create the hosts; the caller must call `teardown(cluster)`."""
    pid = os.getpid()
    tmp = Path(tempfile.mkdtemp(prefix=f"dtrain-netns-{pid}-"))
    bridge = f"dt{pid}br"
    cluster = NetnsCluster(hosts=[], head_address="", ssh_config=tmp / "ssh_config",
                           identity=tmp / "id_ed25519", tmpdir=tmp, bridge=bridge)
    atexit.register(teardown, cluster)
    cluster._teardown.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    try:
        _populate(cluster, n_hosts, pid, tmp, bridge)
    except BaseException:
        teardown(cluster)  # a half-built cluster leaves nothing behind either
        raise
    return cluster


def _populate(cluster: NetnsCluster, n_hosts: int, pid: int, tmp: Path, bridge: str) -> None:
    for key in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dtrain-test", "-f", str(tmp / key)],
                       check=True, capture_output=True, timeout=30)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    LOCK.parent.mkdir(exist_ok=True)
    with open(LOCK, "w") as lock:
        # Concurrent sessions (several developers, CI) must not pick the same subnet.
        fcntl.flock(lock, fcntl.LOCK_EX)
        _clean_stale()
        prefix = _pick_subnet()
        cluster._teardown.append(lambda: _ip("link", "del", bridge, check=False))
        _ip("link", "add", bridge, "type", "bridge")
        cluster.head_address = prefix + "254"
        _ip("addr", "add", f"{cluster.head_address}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")

    cluster.hosts = [Host(f"h{i}", f"dt{pid}h{i}", f"{prefix}{i}") for i in range(1, n_hosts + 1)]
    hosts_text = _hosts_file(cluster.hosts, cluster.head_address)
    for i, h in enumerate(cluster.hosts, start=1):
        veth, peer = f"dt{pid}v{i}", f"dt{pid}p{i}"
        cluster._teardown.append(lambda h=h: _remove_netns(h.netns))
        cluster._teardown.append(lambda veth=veth: _ip("link", "del", veth, check=False))
        _ip("netns", "add", h.netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", h.netns)
        _ip("link", "set", veth, "master", bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", h.netns, "link", "set", peer, "name", "eth0")
        _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / h.netns / "hosts").write_text(hosts_text)
        # Its own copy, so a test can give one host a stalling resolver (edit_etc).
        resolv = Path("/etc/resolv.conf")
        (NETNS_ETC / h.netns / "resolv.conf").write_text(resolv.read_text() if resolv.exists() else "")

    _ssh_config(tmp, cluster.hosts, prefix)
    for h in cluster.hosts:
        cfg = _sshd_config(tmp, h)
        log = open(tmp / f"sshd-{h.name}.log", "w")
        subprocess.Popen(["ip", "netns", "exec", h.netns, SSHD, "-D", "-e", "-f", str(cfg)],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
        log.close()
    for h in cluster.hosts:
        if not _wait_port(h.address, 22, timeout=15):
            log = (tmp / f"sshd-{h.name}.log").read_text()
            raise RuntimeError(f"sshd on {h.name} ({h.address}) did not come up:\n{log}")


def teardown(cluster: NetnsCluster) -> None:
    """Idempotent: undo everything `build` did, newest first."""
    while cluster._teardown:
        step = cluster._teardown.pop()
        try:
            step()
        except Exception as exc:  # keep tearing down the rest
            print(f"netns teardown: {exc}", file=sys.stderr)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, sshd)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        return "openssh-server / openssh-client are not installed (apt-get install openssh-server)"
    probe = f"dt{os.getpid()}probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _sigterm_to_exit(signum, frame):  # so atexit teardown runs on SIGTERM too
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def netns_cluster():
    """3 SSH-reachable hosts in network namespaces; see the module docstring."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_to_exit)
    cluster = build()
    try:
        yield cluster
    finally:
        teardown(cluster)
