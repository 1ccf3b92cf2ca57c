"""The `ssh` runner: the OpenSSH client, so ~/.ssh/config (user, port, identity,
ProxyJump, ...) applies exactly as it does for the user's own `ssh host`.

ssh joins its command words with spaces and hands the result to the remote login shell,
so the remote command is built here as ONE shell string in which every word, every
environment value and the directory are shlex-quoted; names were validated by the spec.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from dtrain.cluster.runner import COPY_TIMEOUT, CommandRunner, register_runner
from dtrain.errors import ConfigError
from dtrain.jobs.secrets import ENV_NAME, secret_names

# Notice a dead peer (a node that lost power or network) within ~15 s instead of hanging
# on a half-open TCP connection forever.
KEEPALIVE = ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
# A job's shared master connection outlives its last session this long: enough to bridge
# the gap between the code-sync check and the launch (or a detached supervisor's start),
# short enough that a head that died without closing it leaves nothing for long.
SHARED_PERSIST_S = 30
# A unix socket path holds at most 107 bytes; ssh adds "/" + %C (40 hex) and, while
# binding, a 17-character temporary suffix.
_MAX_CONTROL_DIR = 107 - 1 - 40 - 17


@register_runner
class SshRunner(CommandRunner):
    name = "ssh"

    def __init__(self, node, cluster) -> None:
        super().__init__(node, cluster)
        self.shared_dir: str | None = None

    def open_job(self, job_id: str) -> SshRunner:
        # The user's own multiplexing (ssh_multiplex) already shares one connection.
        if not self.cluster.ssh_multiplex:
            self.shared_dir = _job_dir(job_id)
        return self

    def close_job(self) -> None:
        """`-O exit` ends the job's master connection to this node and whatever still
        rides on it; the last runner to close removes the job's socket directory."""
        if not self.shared_dir:
            return
        if os.path.isdir(self.shared_dir) and os.listdir(self.shared_dir):
            argv = self.ssh_argv()
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([*argv[:-2], "-O", "exit", *argv[-2:]], capture_output=True, timeout=15,
                               stdin=subprocess.DEVNULL)
        with contextlib.suppress(OSError):
            os.rmdir(self.shared_dir)
        self.shared_dir = None

    def reach_address(self) -> str:
        """What ssh really dials for this destination (`ssh -G`: an alias's HostName in
        ~/.ssh/config), since the other nodes know nothing of this machine's aliases."""
        if self.node.address:
            return self.node.address
        argv = self.ssh_argv()
        try:
            res = subprocess.run([argv[0], "-G", *argv[1:]], capture_output=True, text=True, errors="replace", timeout=15,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return self.node.reach_address
        for line in res.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname" and value.strip():
                return value.strip()
        return self.node.reach_address

    def copy_tree(self, root: Path, files: list[str], workdir: str) -> None:
        """rsync over this runner's ssh when both ends have it, else the tar stream."""
        if shutil.which("rsync"):
            ssh = self.ssh_argv()[:-2]  # without "--" and the destination
            cmd = ["rsync", "-a", "--from0", "--files-from=-", "-e", shlex.join(ssh),
                   "--rsync-path", f"mkdir -p {shlex.quote(workdir)} && rsync",
                   f"{root}/", f"{self.node.host}:{workdir}/"]
            listing = b"".join(os.fsencode(f) + b"\0" for f in files)
            res = subprocess.run(cmd, input=listing, capture_output=True, timeout=COPY_TIMEOUT)
            if res.returncode == 0:
                return
            # rsync missing on the node (exit 127 through ssh): the tar stream below
            if b"command not found" not in res.stderr and res.returncode != 127:
                self.copy_failed(res.stderr)
        super().copy_tree(root, files, workdir)

    def ssh_argv(self) -> list[str]:
        """`ssh` and its options, up to and including the destination."""
        out = ["ssh"]
        if self.cluster.ssh_config:
            out += ["-F", self.cluster.ssh_config]
        out += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.cluster.connect_timeout}", *KEEPALIVE]
        if self.cluster.ssh_multiplex:
            out += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control_dir()}/%C", "-o", "ControlPersist=60"]
        elif self.shared_dir:
            # The first command to the node (a preflight probe, the code-sync check or the
            # launch itself) opens the connection; every later one - the node wrapper, the
            # monitor agent, rsync - rides on it without a new TCP + key exchange + auth.
            out += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.shared_dir}/%C",
                    "-o", f"ControlPersist={SHARED_PERSIST_S}"]
        for opt in self.cluster.ssh_options:
            out += ["-o", opt]
        # "--" ends ssh's options: a destination can never be read as one.
        return out + ["--", self.node.host]

    def argv(self, remote_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None) -> list[str]:
        return self.ssh_argv() + [remote_command(remote_argv, env=self.merged_env(env), cwd=cwd)]

    def stdin_preamble(self, env: Mapping[str, str]) -> str:
        return secret_lines(env)


def remote_command(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None) -> str:
    """`cd DIR && export K=V && exec ARGV...`, every word quoted for a POSIX shell.

    Secret values (dtrain.jobs.secrets) are not in it: anyone on either machine may read
    a command line (`ps`). The remote shell reads them from stdin first, one line each, in
    the order of `secret_lines`, which the runner sends before anything else."""
    if not argv:
        raise ValueError("empty command")
    for name in env:
        if not ENV_NAME.match(name):
            raise ConfigError(f"bad environment variable name {name!r}", "use letters, digits and '_'")
    secret = secret_names(env)
    parts = [f"IFS= read -r {k}" for k in secret]
    if secret:
        parts.append("export " + " ".join(secret))
    if cwd is not None:
        parts.append(f"cd {_quote_path(cwd)}")
    plain = {k: v for k, v in env.items() if k not in secret}
    if plain:
        parts.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plain.items()))
    # exec: the remote process replaces the shell, so signals and exit codes are its own.
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)


def secret_lines(env: Mapping[str, str]) -> str:
    """The secret values of `env`, one line each, for `remote_command`'s reads."""
    values = []
    for name in secret_names(env):
        if "\n" in env[name] or "\r" in env[name]:
            raise ConfigError(f"the value of {name} holds a line break; secrets reach ssh nodes one line each",
                              "put a multi-line secret in a file on the nodes and pass its path")
        values.append(env[name] + "\n")
    return "".join(values)


def _quote_path(path: str) -> str:
    # "~/job" means the remote user's home: leave the tilde outside the quotes.
    if path == "~" or path.startswith("~/"):
        return "~" + (shlex.quote(path[1:]) if path[1:] else "")
    return shlex.quote(path)


def _job_dir(job_id: str) -> str | None:
    """A private directory for one job's shared connections, or None where its socket
    paths would be too long."""
    path = os.path.join(control_dir(), job_id)
    if len(path) > _MAX_CONTROL_DIR:
        return None
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def control_dir() -> str:
    """Where multiplexed connections keep their sockets: short (a socket path has at most
    107 bytes), private to this user."""
    path = os.path.join(tempfile.gettempdir(), f"dtrain-ssh-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
