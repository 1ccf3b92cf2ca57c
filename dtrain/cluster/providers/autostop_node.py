"""The node side of autostop: a small daemon on every rented node that terminates its own
instance through the cloud's API when the node has been idle, or cut off from its head,
for `autostop` seconds. It never powers the operating system off: a stopped machine may
still be billed (its disk, a stopped instance), and in the tests the "node" is a network
namespace on the test machine itself.

This file is self-contained on purpose (the standard library, plus boto3 when it
terminates): `dtrain up` ships its source over SSH (dtrain.cluster.providers.autostop),
so the daemon runs before any `setup:` command installed dtrain on the node. Everything
lives in one private directory on the node (`$DTRAIN_HOME/autostop`, default
`~/.dtrain/autostop`, 0700), one set of files per instance id:

    <id>.json   what the daemon needs (0600; the provider's credentials when the head
                handed them over, never on a command line)
    <id>.beat   touched by the head whenever it arms the node
    <id>.lock   held by the running daemon: a second start exits at once
    <id>.log    why it acted, with times

The facts it decides from: a job process on this node (the dtrain node wrapper or a
torchrun, in this node's network namespace), and when the head was last heard from: the
beat file (touched each time a head arms the node: `dtrain up`, every `dtrain run` on the
cluster) or a running node wrapper, which is the head's heartbeat while a job runs (the
head writes keep-alive bytes to it, and it ends the job when they stop for its
--head-timeout).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# A process whose command line holds one of these is a job on this node; WRAPPER's
# presence also means the head is there (see the module docstring).
WRAPPER = "dtrain.launch.node"
JOB_MARKERS = (WRAPPER, "torch.distributed.run", "bin/torchrun")


def decide(now: float, job_running: bool, last_job: float, beat: float, limit: float) -> str | None:
    """Why this node should end now, or None. `last_job` is when a job was last seen
    running here (or when the daemon was armed); `beat` is when the head was last heard from."""
    if job_running and now - beat >= limit:
        return f"a job runs but its head has not been heard from for {now - beat:.0f} s (autostop {limit:.0f} s)"
    idle = now - max(last_job, beat)
    if not job_running and idle >= limit:
        return f"no job has run for {idle:.0f} s (autostop {limit:.0f} s)"
    return None


def job_processes(markers: tuple[str, ...] = JOB_MARKERS) -> list[str]:
    """The command lines of the job processes in this process's network namespace
    (another namespace is another machine: the tests' nodes share one kernel)."""
    own = os.readlink("/proc/self/ns/net")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(m in cmdline for m in markers) and os.readlink(f"/proc/{entry}/ns/net") == own:
                found.append(cmdline)
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def end_ec2(cfg: dict) -> str:
    """TerminateInstances on this instance: with the credentials the head handed over,
    else boto3's own chain (on EC2, the instance profile's role)."""
    import boto3

    creds = cfg.get("credentials") or {}
    client = boto3.client("ec2", region_name=cfg["region"], endpoint_url=cfg.get("endpoint_url"),
                          aws_access_key_id=creds.get("key"), aws_secret_access_key=creds.get("secret"),
                          aws_session_token=creds.get("token"))
    try:
        reply = client.terminate_instances(InstanceIds=[cfg["instance_id"]])
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        if code == "InvalidInstanceID.NotFound":
            return "already gone"
        raise
    return reply["TerminatingInstances"][0]["CurrentState"]["Name"]


ENDERS = {"ec2": end_ec2}


def autostop_dir() -> Path:
    home = os.environ.get("DTRAIN_HOME")
    path = (Path(home).expanduser() if home else Path.home() / ".dtrain") / "autostop"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def install(payload: dict) -> None:
    """Write this script and the instance's config, refresh the beat, and start the
    daemon detached unless it runs already (it re-reads the config every tick). Prints
    one JSON line for the head: the beat file's path."""
    cfg = payload["config"]
    if cfg["provider"] == "ec2":
        try:
            import boto3  # noqa: F401  (checked now: at the end it would be too late)
        except ImportError:
            print(json.dumps({"error": f"autostop needs boto3 in {sys.executable} on this node"}))
            return
    where = autostop_dir()
    iid = cfg["instance_id"]
    script = where / "autostop_node.py"
    _write_private(script, payload["source"])
    _write_private(where / f"{iid}.json", json.dumps(cfg))
    (where / f"{iid}.beat").touch(mode=0o600)
    os.utime(where / f"{iid}.beat")
    started = False
    if not _locked(where / f"{iid}.lock"):
        with os.fdopen(os.open(where / f"{iid}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            subprocess.Popen([sys.executable, str(script), "watch", str(where / f"{iid}.json")],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, close_fds=True, cwd=str(where))
        started = True
    print(json.dumps({"beat": str(where / f"{iid}.beat"), "started": started}))


def _locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it again if we got it
    return False


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}", flush=True)


def watch(config: Path, tick: float | None = None) -> int:
    lock = os.open(config.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another daemon watches this instance
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())
    beat_file = config.with_suffix(".beat")
    cfg = json.loads(config.read_text())
    last_job = head_seen = time.time()
    _log(f"armed on {cfg['instance_id']} ({cfg['cluster']}): ends it after {cfg['limit']:.0f} s without a job "
         "or without its head")
    while True:
        try:
            cfg = json.loads(config.read_text())  # a later `up` or `run` may change the limit
        except (OSError, ValueError):
            pass
        limit = float(cfg["limit"])
        now = time.time()
        jobs = job_processes()
        if jobs:
            last_job = now
        if any(WRAPPER in cmd for cmd in jobs):
            head_seen = now
        try:
            beat = max(head_seen, beat_file.stat().st_mtime)
        except OSError:
            beat = head_seen
        reason = decide(now, bool(jobs), last_job, beat, limit)
        if reason:
            _log(f"terminating {cfg['instance_id']}: {reason}")
            try:
                state = ENDERS[cfg["provider"]](cfg)
            except Exception as exc:  # the network or the API may be back at the next tick
                _log(f"the terminate request failed ({type(exc).__name__}: {exc}); retrying")
            else:
                _log(f"{cfg['provider']} answered: {state}")
                return 0
        time.sleep(tick or max(1.0, min(10.0, limit / 6)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "watch":
        sys.exit(watch(Path(sys.argv[2])))
    print("usage: autostop_node.py watch CONFIG (started by `dtrain up`)", file=sys.stderr)
    sys.exit(2)
