"""Issue 3's launch acceptance checks across namespace hosts, over real SSH.

Each host is a network namespace with its own sshd (tests/netns.py); all of them see
this repository and this virtualenv at the same paths, like nodes on a NAS.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from launch_helpers import REPO, SCRIPTS, free_port, job_id_of, job_processes, wait_gone

pytestmark = pytest.mark.netns
PLAIN = str(SCRIPTS / "plain_ddp.py")


class Run:
    """`dtrain run ...` in the background, its output collected line by line."""

    def __init__(self, *args: str, cwd=REPO) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", *args], cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in ln for ln in self.lines):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output()}"
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.err = self.proc.stderr.read()
        time.sleep(0.2)
        return rc

    def ends_within(self, seconds: float) -> int:
        """Wait for the run to end; it must end non-zero within `seconds` from now."""
        t0 = time.monotonic()
        rc = self.finish(timeout=seconds + 60)
        elapsed = time.monotonic() - t0
        assert rc != 0 and elapsed < seconds, (rc, elapsed, self.output())
        return rc

    def output(self) -> str:
        return "\n".join(self.lines) + "\n" + self.err

    @property
    def job_id(self) -> str:
        return job_id_of("\n".join(self.lines))


def kill_workers(cluster, host: str, marker: str) -> list[int]:
    """SIGKILL the training processes (not torchrun, not the wrapper) on one host."""
    pids = [pid for pid, cmd in cluster.processes(host)
            if marker in cmd and "torch.distributed.run" not in cmd and "dtrain.launch.node" not in cmd]
    for pid in pids:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    return pids


def assert_nothing_left(cluster, job_id: str) -> None:
    assert wait_gone(job_id) == []
    for h in cluster.hosts:
        left = [c for _, c in cluster.processes(h) if "torch.distributed.run" in c or job_id in c]
        assert left == [], f"{h.name}: {left}"


@pytest.mark.slow
def test_plain_torchrun_script_static_and_elastic(netns_cluster, dtrain_home, tmp_path):
    yaml = netns_cluster.cluster_yaml(2)
    results = {}
    for mode in ("static", "elastic"):
        out = tmp_path / f"{mode}.pt"
        run = Run(str(yaml), "--rdzv", mode, "--nproc-per-node", "2", "--port", str(free_port()),
                  *(["--no-preflight"] if mode == "elastic" else []),
                  "--", "python", PLAIN, "--epochs", "1", "--out", str(out))
        assert run.finish() == 0, run.output()
        assert "[h1:r0] done world=4 steps=4" in run.lines, run.output()
        results[mode] = torch.load(out)
        assert_nothing_left(netns_cluster, run.job_id)
    for key, value in results["static"].items():
        torch.testing.assert_close(results["elastic"][key], value, rtol=0, atol=1e-6)


def _recipe_sets(synth_data, out):
    sets = {
        "data.root": synth_data, "data.image_size": 32, "data.num_workers": 0, "data.augment": False,
        "model.norm": "group", "epochs": 1, "max_steps": 3, "batch_size": 4, "precision": "fp32",
        "deterministic": True, "optim.warmup_steps": 1, "log_every": 1, "output_dir": out, "device": "cpu",
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.slow
def test_recipe_two_hosts_equals_one_host(netns_cluster, dtrain_home, synth_data, tmp_path):
    yaml = netns_cluster.cluster_yaml(2)
    params = {}
    for label, hosts, nproc in (("2x2", "h1,h2", "2"), ("1x4", "h1", "4")):
        out = tmp_path / label
        run = Run(str(yaml), "--hosts", hosts, "--nproc-per-node", nproc, "--port", str(free_port()),
                  "--no-preflight", "--", "dtrain", "train", *_recipe_sets(synth_data, out))
        assert run.finish(timeout=600) == 0, run.output()
        params[label] = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]
    assert params["2x2"].keys() == params["1x4"].keys()
    for key, value in params["1x4"].items():
        torch.testing.assert_close(params["2x2"][key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
def test_kill_on_one_host_stops_the_whole_job(netns_cluster, dtrain_home):
    yaml = netns_cluster.cluster_yaml(2)
    run = Run(str(yaml), "--no-preflight", "--nproc-per-node", "2", "--port", str(free_port()),
              "--", "python", PLAIN, "--epochs", "1000", "--sleep", "0.3")
    run.wait_for("[h1:r0] epoch 0 step 2")
    assert kill_workers(netns_cluster, "h2", "plain_ddp.py")
    run.ends_within(30)
    assert "first failure: node h2" in run.err, run.output()
    assert_nothing_left(netns_cluster, run.job_id)
    status = json.loads(subprocess.run([sys.executable, "-m", "dtrain", "status", run.job_id, "--json"],
                                       capture_output=True, text=True, timeout=60).stdout)
    assert status["state"] == "failed" and status["nodes"] == ["h1", "h2"]


# After a node's workers are killed, a restarted rank could read the previous round's gloo
# address of a peer from torch's agent store and dial a closed listener; dist.setup now
# keys each restart round's rendezvous apart (_incarnation_store). The rerun stays as a
# guard against other load-induced timeouts of this long test.
@pytest.mark.slow
@pytest.mark.flaky(reruns=1)
def test_elastic_restart_resumes_from_checkpoint(netns_cluster, dtrain_home, synth_data, tmp_path):
    yaml = netns_cluster.cluster_yaml(2)
    out = tmp_path / "elastic"
    sets = _recipe_sets(synth_data, out)
    sets[sets.index("max_steps=3")] = "max_steps=1000"
    sets[sets.index("epochs=1")] = "epochs=2"
    sets[sets.index("batch_size=4")] = "batch_size=16"  # a few steps per epoch: CI time
    run = Run(str(yaml), "--no-preflight", "--rdzv", "elastic", "--max-restarts", "1", "--nproc-per-node", "1",
              "--port", str(free_port()), "--", "dtrain", "train", *sets)
    last = out / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 400
    while not (out / "checkpoints" / "ckpt-epoch0001.pt").exists():
        assert run.proc.poll() is None, run.output()
        assert time.monotonic() < deadline, run.output()
        time.sleep(0.2)
    assert kill_workers(netns_cluster, "h2", "dtrain.train")
    assert run.finish(timeout=600) == 0, run.output()
    text = run.output()
    # Restarted once, and the restart went on from epoch 2 instead of starting over.
    assert text.count("training resnet18") == 2 and text.count("epoch 1/2: train loss") == 1, text
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(ln)["kind"] == "train"]
    assert steps.count(1) == 1 and max(steps) == 12, steps
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 2 and (out / "checkpoints" / "ckpt-epoch0002.pt").exists(), ckpt["epoch"]
    assert_nothing_left(netns_cluster, run.job_id)


def test_preflight_failure_launches_nothing(netns_cluster, dtrain_home):
    yaml = netns_cluster.cluster_yaml(2, node_extra={"h2": "    python: /nonexistent/python3"})
    res = subprocess.run([sys.executable, "-m", "dtrain", "run", str(yaml), "--port", str(free_port()),
                          "--", "python", PLAIN], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "preflight failed, nothing was launched" in res.stderr and "h2:" in res.stderr
    assert "Traceback" not in res.stderr
    listed = subprocess.run([sys.executable, "-m", "dtrain", "jobs", "--json"], capture_output=True, text=True,
                            timeout=60).stdout
    assert json.loads(listed) == []
    for h in netns_cluster.hosts:
        assert not [c for _, c in netns_cluster.processes(h) if "torch.distributed.run" in c]


@pytest.mark.slow
def test_code_sync_over_ssh_to_a_node_with_its_own_workdir(netns_cluster, dtrain_home, tmp_path):
    proj, elsewhere = tmp_path / "proj", tmp_path / "h2-workdir"
    proj.mkdir()
    (proj / "show.py").write_text(
        "import os, sys\nprint('cwd=' + os.getcwd(), 'ignored-file-there=' + str(os.path.exists('big.bin')))\n"
        "print('arg', os.fsencode(sys.argv[1]).hex())\n")
    (proj / "big.bin").write_bytes(b"x" * 100)
    (proj / ".gitignore").write_text("big.bin\n")
    with open(os.fsencode(proj) + b"/d\xe9faut.txt", "wb") as fh:  # a name that is not UTF-8 (a Windows zip's)
        fh.write(b"latin-1 name\n")
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    yaml = netns_cluster.cluster_yaml(2, node_extra={"h1": f"    workdir: {proj}", "h2": f"    workdir: {elsewhere}"})
    run = Run(str(yaml), "--no-preflight", "--no-monitor", "--port", str(free_port()), "--", "python", "show.py",
              os.fsdecode(b"lot\xff"), cwd=proj)  # an argument that is not UTF-8 either
    assert run.finish() == 0, run.output()
    assert "[h1:r0] arg 6c6f74ff" in run.lines and "[h2:r1] arg 6c6f74ff" in run.lines, run.output()
    assert f"[h2:r1] cwd={elsewhere} ignored-file-there=False" in run.lines, run.output()
    assert f"[h1:r0] cwd={proj} ignored-file-there=True" in run.lines  # h1 shares the head's directory
    assert "[dtrain] code copied to h2 (3 files)" in run.lines
    assert (elsewhere / "show.py").exists() and not list(proj.glob(".dtrain-sync-*"))
    with open(os.fsencode(elsewhere) + b"/d\xe9faut.txt", "rb") as fh:  # rsync got the name's own bytes
        assert fh.read() == b"latin-1 name\n"


@pytest.mark.slow
def test_network_partition_of_one_host_ends_the_job(netns_cluster, dtrain_home):
    yaml = netns_cluster.cluster_yaml(2)
    run = Run(str(yaml), "--no-preflight", "--no-monitor", "--nproc-per-node", "1", "--port", str(free_port()),
              "--", "python", PLAIN, "--epochs", "1000", "--sleep", "0.3")
    try:
        run.wait_for("[h1:r0] epoch 0 step 2")
        netns_cluster.set_link("h2", up=False)  # h2 drops off the network: nothing closes, all goes silent
        run.ends_within(30)
        assert "first failure: node h2: lost the connection" in run.err, run.output()
        # h2 heard nothing from the head for 20 s and stopped its part by itself.
        assert_nothing_left(netns_cluster, run.job_id)
    finally:
        netns_cluster.set_link("h2", up=True)


def _plan_of_dry_run(text: str, real_id: str, dry_id: str) -> dict[str, dict]:
    """Per node: the argv and environment a dry run printed (its job id replaced)."""
    nodes: dict[str, dict] = {}
    current = None
    plan = text.replace(dry_id, real_id).split(f"job {real_id} (", 1)[1]  # after the preflight table
    for line in plan.splitlines():
        if line.startswith("node "):
            current = nodes.setdefault(line.split()[1], {"env": {}})
        elif line.startswith("  env: "):
            key, _, value = shlex.split(line[len("  env: "):])[0].partition("=")
            current["env"][key] = value
        elif line.startswith("  run: "):
            current["argv"] = shlex.split(line[len("  run: "):])
    return nodes


@pytest.mark.slow
def test_dry_run_prints_the_plan_the_real_run_stores(netns_cluster, dtrain_home, tmp_path):
    """gpus: omitted, so the probe's findings (GPU count, interface) shape the plan: the
    dry run probes for them too and prints exactly what job.json then holds."""
    yaml = netns_cluster.cluster_yaml(2)
    args = [str(yaml), "--port", str(free_port()), "--", "python", PLAIN, "--epochs", "1"]
    dry = subprocess.run([sys.executable, "-m", "dtrain", "run", "--dry-run", *args], capture_output=True,
                         text=True, timeout=180, cwd=REPO)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    run = Run(*args)
    assert run.finish() == 0, run.output()
    saved = json.loads((dtrain_home / "jobs" / run.job_id / "job.json").read_text())["plan"]
    printed = _plan_of_dry_run(dry.stdout, run.job_id, job_id_of(dry.stdout))
    assert set(printed) == {"h1", "h2"}
    for node in saved["nodes"]:
        assert printed[node["name"]]["argv"] == node["argv"]
        assert printed[node["name"]]["env"] == node["env"]
        assert node["env"]["GLOO_SOCKET_IFNAME"] == "eth0"  # found by the probe, in both
    assert_nothing_left(netns_cluster, run.job_id)


@pytest.mark.slow
def test_hosts_given_as_ssh_config_aliases_need_no_cluster_file(netns_cluster, dtrain_home, tmp_path):
    """`--hosts gpu-1,gpu-2`: names only this machine's ssh config knows (no namespace host
    resolves them); the other nodes are told the HostName IPs `ssh -G` gives."""
    config = netns_cluster.ssh_config.read_text()
    for i, h in enumerate(netns_cluster.hosts[:2], start=1):
        config = config.replace(f"Host {h.name}\n", f"Host gpu-{i}\n")
        assert netns_cluster.exec(h, ["getent", "hosts", "gpu-1"]).returncode != 0
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(config)
    run = Run("--hosts", "gpu-1,gpu-2", "--ssh-config", str(ssh_config), "--port", str(free_port()),
              "--", "python", PLAIN, "--epochs", "1")
    assert run.finish() == 0, run.output()
    assert any(ln.startswith("[gpu-1:r0] done world=2 ") for ln in run.lines), run.output()
    plan = json.loads((dtrain_home / "jobs" / run.job_id / "job.json").read_text())["plan"]
    assert plan["master_addr"] == netns_cluster.hosts[0].address
    assert [n["address"] for n in plan["nodes"]] == [h.address for h in netns_cluster.hosts[:2]]
    assert_nothing_left(netns_cluster, run.job_id)
