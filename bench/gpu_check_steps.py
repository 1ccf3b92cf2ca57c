"""The steps of bench/gpu_check.py, one per subprocess:

    python bench/gpu_check_steps.py STEP --work DIR [--dry-run]

Each prints what it does (the step's log), writes WORK/STEP/result.json ({"result":
"pass" | "FAIL" | "no GPU", "figure": one line for the summary table, details...}) and
calls dtrain through its real entry points: `python -m dtrain ...`, `python -m
dtrain.train` under torchrun, bench/train_throughput.py's two sides, the monitor agent.
"no GPU" means the GPU part did not run; the figure then says what ran on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
PY = sys.executable

# Dependencies (pyproject.toml names) the checked paths never import: S3 data, the HTTP
# service, the dashboard. The env step lists them but does not fail without them.
NOT_CHECKED = {"s3fs", "fastapi", "uvicorn", "python-multipart", "httpx", "plotly"}
IMPORT_NAMES = {"PyYAML": "yaml", "pillow": "PIL", "nvidia-ml-py": "pynvml", "prometheus-client": "prometheus_client",
                "python-multipart": "multipart"}  # fmt: skip

# Published single-GPU ResNet-50 v1.5 training throughput, PyTorch, batch 256 per GPU:
# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance results" (pytorch-21.03 NGC container). No H100/H200 figure is
# published there; Hopper cards are compared with the A100 one (the class below them).
REFERENCE = {
    "A100": (2470, "A100 80GB, mixed precision 2470 img/s (TF32 938)"),
    "V100": (1200, "V100 16GB, mixed precision 1200 img/s (FP32 367)"),
}
REFERENCE_SOURCE = "NVIDIA DeepLearningExamples resnet50v1.5 README, 1 GPU, batch 256"


def cuda_ready() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def sh(argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None) -> tuple[int, str]:
    """Run a command, echoing its output into this step's log; (exit code, output). At
    `timeout` the command and every process it started are killed."""
    import threading

    print("$", " ".join(map(str, argv)), flush=True)
    # Wide lines: rich would wrap the figures parsed below at 80 columns.
    env = {**os.environ, "COLUMNS": "250", **(env or {})}
    proc = subprocess.Popen(list(map(str, argv)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")  # fmt: skip
    timer = threading.Timer(timeout, _kill_tree, args=(proc.pid,)) if timeout else None
    if timer:
        timer.start()
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    code = proc.wait()
    if timer:
        timer.cancel()
    return code, "".join(lines)


def _kill_tree(pid: int) -> None:
    import psutil

    print(f"(time limit: killing process {pid} and its children)", flush=True)
    try:
        parent = psutil.Process(pid)
        for p in parent.children(recursive=True) + [parent]:
            p.kill()
    except psutil.NoSuchProcess:
        pass


def settings(**kv: Any) -> list[str]:
    return [a for k, v in kv.items() for a in ("--set", f"{k.replace('__', '.')}={v}")]


def synth(root: Path, images: int, size: int) -> Path:
    """A synthetic defect set, reused when a finished one is already there."""
    if not (root / "manifest.json").is_file():
        from dtrain.data.synth import synthesize

        t0 = time.perf_counter()
        synthesize(root, images=images, size=size, seed=0)
        print(f"synthesised {images} images of {size} px in {time.perf_counter() - t0:.1f} s", flush=True)
    return root


# ---- 1. environment ------------------------------------------------------------------------


def step_env(work: Path, dry: bool) -> dict:
    import importlib
    import importlib.metadata as md
    import tomllib

    facts: dict[str, Any] = {"python": sys.executable, "python_version": sys.version.split()[0]}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    missing, versions = [], {}
    for dep in deps:
        dist = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]
        module = IMPORT_NAMES.get(dist, dist.replace("-", "_").lower())
        try:
            importlib.import_module(module)
            versions[dist] = md.version(dist) if _has_dist(dist) else "?"
        except Exception as exc:  # ImportError, or a broken install raising anything
            versions[dist] = f"MISSING ({type(exc).__name__})"
            missing.append(dist)
    facts["packages"] = versions
    needed_missing = [d for d in missing if d not in NOT_CHECKED]
    print("packages:", json.dumps(versions, indent=1))

    code, smi = sh(["nvidia-smi"], timeout=15) if _which("nvidia-smi") else (None, "nvidia-smi not on PATH")
    facts["nvidia_smi"] = smi if code == 0 else f"unavailable: {smi.strip()[-200:]}"
    import torch

    facts.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    if cuda_ready():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpus=torch.cuda.device_count(), gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                     capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                     bf16=torch.cuda.is_bf16_supported(), nccl=_dotted(torch.cuda.nccl.version()))  # fmt: skip
    try:
        import onnxruntime as ort

        facts["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        pass
    print(json.dumps({k: v for k, v in facts.items() if k not in ("packages", "nvidia_smi")}, indent=1))
    if needed_missing:
        return {"result": "FAIL", **facts,
                "figure": f"missing {', '.join(needed_missing)}: carry wheels (bench/gpu_check_wheels.sh)"}  # fmt: skip
    import dtrain.cli.app  # noqa: F401  (every command's module-level imports)

    if not cuda_ready():
        if code == 0 and not dry:  # the driver sees a GPU, this torch does not
            return {"result": "FAIL", **facts, "figure": f"nvidia-smi sees a GPU, torch {torch.__version__} "
                                                        f"(CUDA {torch.version.cuda}) does not: driver/toolkit mismatch?"}  # fmt: skip
        return {"result": "pass", **facts, "figure": f"no GPU visible; torch {torch.__version__}, dtrain imports"}
    figure = (f"{facts['gpus']}x {facts['gpu']} sm{facts['capability']} {facts['memory_gib']} GiB; torch {torch.__version__} "
              f"CUDA {facts['cuda']} NCCL {facts['nccl']}")  # fmt: skip
    return {"result": "pass", **facts, "figure": figure}


def _dotted(version: Any) -> str:
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)  # older torch: an int


def _has_dist(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def _which(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


# ---- 2. quickstart ---------------------------------------------------------------------------

QUICKSTART_TARGETS = {"miss_rate": 0.005, "accuracy": 0.97, "total_time_s": 600.0}


def step_quickstart(work: Path, dry: bool) -> dict:
    argv = [PY, "-m", "dtrain", "quickstart", "--workdir", work / "quickstart"]
    if dry or not cuda_ready():
        return {"result": "no GPU", "figure": f"would run: {' '.join(map(str, argv[1:]))}"}
    import torch

    code, output = sh(argv)
    if code != 0:
        return {"result": "FAIL", "figure": f"dtrain quickstart exit {code}: {output.strip().splitlines()[-1][:150]}"}
    report = json.loads((work / "quickstart" / "report.json").read_text())
    return judge_quickstart(report, output, "bf16" if torch.cuda.is_bf16_supported() else "fp16", torch.cuda.device_count())


def judge_quickstart(report: dict, output: str, want_precision: str, gpus: int) -> dict:
    """The quickstart's figures and what is wrong with them: precision (from the trainer's
    first line), one rank per GPU, and the recipe's targets."""
    precision = re.search(r"precision (\w+)", output)
    r = {k: report.get(k) for k in ("world_size", "train_images_per_s", "total_time_s", "train_time_s", "accuracy",
                                    "miss_rate", "miss_rate_upper95", "false_alarm_rate")}  # fmt: skip
    r["precision"] = precision.group(1) if precision else None
    problems = [f"precision {r['precision']} (want {want_precision})"] if r["precision"] != want_precision else []
    if r["world_size"] != gpus:
        problems.append(f"world size {r['world_size']} on {gpus} GPUs")
    problems += [f"{k} {r[k]:.4g} > {v}" for k, v in QUICKSTART_TARGETS.items() if k != "accuracy" and r[k] > v]
    if r["accuracy"] < QUICKSTART_TARGETS["accuracy"]:
        problems.append(f"accuracy {r['accuracy']:.4f} < {QUICKSTART_TARGETS['accuracy']}")
    figure = (f"{r['precision']}, {r['world_size']} rank(s), {r['total_time_s']:.0f} s, {r['train_images_per_s']:.0f} img/s, "
              f"acc {r['accuracy']:.2%}, miss {r['miss_rate']:.2%}")  # fmt: skip
    return {"result": "FAIL" if problems else "pass", **r, "problems": problems,
            "figure": figure + (f"; {'; '.join(problems)}" if problems else "; targets hold")}  # fmt: skip


# ---- 3. DDP equivalence with CUDA tensors ------------------------------------------------------

# tests/test_train_ddp.py's tolerance: only the summation order differs between the runs.
DDP_TOLERANCE = 1e-5


def step_ddp(work: Path, dry: bool) -> dict:
    """2 ranks x batch 8 == 1 process x batch 16 after 4 SGD steps (see the test's docstring
    for why), here with the model on the GPU. TF32 is switched off (NVIDIA_TF32_OVERRIDE)
    so that both runs compute in fp32 and only the summation order differs."""
    sys.path.insert(0, str(REPO / "tests"))  # the test module imports its helpers as pytest does
    from tests.test_train_ddp import _fresh_weights, final_state, max_diff, write_config

    gpu = cuda_ready() and not dry
    device = "cuda" if gpu else "cpu"
    data = synth(work / "ddp" / "data", 360, 32)
    common = dict(model={"norm": "group"}, optim={"name": "sgd", "lr": 0.05}, max_steps=4, epochs=1, device=device)
    d = work / "ddp"
    two = write_config(d / "two.yaml", data, d / "two", batch_size=8, **common)
    one = write_config(d / "one.yaml", data, d / "one", batch_size=16, **common)
    env = {"NVIDIA_TF32_OVERRIDE": "0"}
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    backend, note = "gloo", ""
    if gpu:
        # NCCL refuses two ranks on one GPU in many versions ("Duplicate GPU detected").
        code, out = sh(torchrun + ["-m", "dtrain.train", two], env=env, timeout=35)
        backend = "nccl"
        if code != 0:
            dup = "Duplicate GPU" in out
            note = "NCCL refused 2 ranks on 1 GPU" if dup else f"NCCL failed (exit {code})"
            print(f"{note}; again with gloo + CUDA tensors", flush=True)
            backend = "gloo+cuda"
            code, out = sh(torchrun + [Path(__file__), "gloo-rank", two], env=env, timeout=35)
    else:
        code, out = sh(torchrun + ["-m", "dtrain.train", two], env=env)
    if code != 0 or f"world 2 on {device}" not in out:
        return {"result": "FAIL", "figure": f"{note + '; ' if note else ''}2-rank run on {device} failed (exit {code})"}
    code, out = sh([PY, "-m", "dtrain.train", one], env=env, timeout=60 if gpu else None)
    if code != 0:
        return {"result": "FAIL", "figure": f"1-process run on {device} failed (exit {code})"}
    a, b = final_state(d / "two"), final_state(d / "one")
    diff, moved = max_diff(a["model"], b["model"]), max_diff(_fresh_weights(), b["model"])
    ok = a["step"] == b["step"] == 4 and diff <= DDP_TOLERANCE and moved > 1e-3
    figure = f"{backend}: max |w2 - w1| {diff:.1e} (<= {DDP_TOLERANCE:.0e}), weights moved {moved:.1e}"
    details = {"backend": backend, "note": note, "max_diff": diff, "moved": moved}
    if not gpu:
        return {"result": "no GPU" if ok else "FAIL", **details, "figure": f"CPU plumbing {'ok' if ok else 'FAILED'}: {figure}"}
    return {"result": "pass" if ok else "FAIL", **details, "figure": (note + "; " if note else "") + figure}


def gloo_rank(argv: list[str]) -> int:
    """One torchrun rank of dtrain.train whose process group is gloo although the model
    is on a GPU: dist.setup() keeps a group that already exists."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    from dtrain.train.__main__ import main

    return main(argv)


# ---- 4. training throughput ----------------------------------------------------------------------

TP = {"images": 1200, "size": 224, "batch": 64, "steps": 15, "warmup": 5}
TP_DTRAIN = {"model.arch": "resnet50", "precision": "bf16", "channels_last": "true", "data.num_workers": 4,
             "data.cache_decoded": "true"}  # fmt: skip


def step_throughput(work: Path, dry: bool) -> dict:
    plan = (f"ResNet-50 {TP['size']} px, batch {TP['batch']}, {TP['steps']} timed steps: tutorial fp32 loop, "
            f"then dtrain {', '.join(f'{k}={v}' for k, v in TP_DTRAIN.items())}, compile false / true")  # fmt: skip
    print(plan, flush=True)
    if dry or not cuda_ready():
        return {"result": "no GPU", "figure": "would run " + plan[:90]}
    import torch

    return throughput(work / "throughput", "cuda", torch.cuda.get_device_name(0), TP, TP_DTRAIN)


def throughput(d: Path, device: str, gpu_name: str, tp: dict, tp_dtrain: dict) -> dict:
    """Both sides of bench/train_throughput.py on `device`; result.json is rewritten after
    each side so that a time-out keeps the figures measured so far."""
    sys.path.insert(0, str(BENCH))
    import train_throughput as tt

    data = synth(d / f"data-{tp['images']}-{tp['size']}", tp["images"], tp["size"])
    steps, gb, arch = tp["steps"] + tp["warmup"], tp["batch"], tp_dtrain["model.arch"]
    r: dict[str, Any] = {"result": "partial", "settings": {**tp, **tp_dtrain}, "reference_source": REFERENCE_SOURCE}
    ref_class = next((k for k in REFERENCE if k in gpu_name), "A100")
    r["reference_class"] = ref_class
    r["reference_images_per_s"], r["reference"] = REFERENCE[ref_class]

    def record(key: str, log: list[dict]) -> None:
        r[key] = round(tt.steady_rate(log, tp["warmup"], gb), 1)
        r["figure"] = _tp_figure(r)
        (d / "result.json").write_text(json.dumps(r, indent=1))
        print(f"{key}: {r[key]} images/s", flush=True)

    record("baseline_fp32", tt.run_baseline(data, tp["size"], gb, steps, d / "baseline.json", arch=arch, device=device,
                                            world=1))  # fmt: skip
    for compiled in ("false", "true"):
        extra = [f"{k}={v}" for k, v in {**tp_dtrain, "compile": compiled, "device": device}.items()]
        record(f"dtrain_compile_{compiled}", tt.run_dtrain(data, tp["size"], gb, steps, d / f"dtrain-{compiled}", extra, 1))
    best = max(r["dtrain_compile_false"], r["dtrain_compile_true"])
    r["result"] = "pass" if best > r["baseline_fp32"] else "FAIL"
    return r


def _tp_figure(r: dict) -> str:
    parts = [f"tutorial fp32 {r['baseline_fp32']:.0f}"]
    for c, label in (("false", "dtrain bf16"), ("true", "compiled")):
        if f"dtrain_compile_{c}" in r:
            v = r[f"dtrain_compile_{c}"]
            parts.append(f"{label} {v:.0f} ({v / r['baseline_fp32']:.1f}x)")
    return "img/s: " + ", ".join(parts) + f"; published {r['reference_class']} {r['reference_images_per_s']}"


# ---- 5. monitoring -----------------------------------------------------------------------------------

MON_TRAIN_S, MON_IDLE_S = 40.0, 20.0
GPU_FAMILIES = ("dtrain_gpu_utilization_ratio", "dtrain_gpu_memory_used_bytes", "dtrain_gpu_power_watts",
                "dtrain_gpu_temperature_celsius", "dtrain_gpu_sm_clock_hertz")  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    """The agent's /metrics as {family name: largest value} (gauges per GPU: GPU 0's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if m:
            values[m.group(1)] = max(values.get(m.group(1), float("-inf")), float(m.group(3)))
    return values


def step_monitor(work: Path, dry: bool) -> dict:
    return monitor(work, cuda_ready() and not dry, MON_TRAIN_S, MON_IDLE_S)


@contextlib.contextmanager
def _watched(directory: Path, job_id: str) -> Iterator[dict[str, str]]:
    """One node agent on loopback plus the head collector into `directory`, as `dtrain run`
    starts them on a node; yields the ranks' environment ({} when the agent did not start)."""
    from dtrain.monitor.head.startup import agent_argv, agent_env, agent_url
    from dtrain.monitor.head.collector import Collector

    directory.mkdir(parents=True, exist_ok=True)
    agent = subprocess.Popen(agent_argv(job_id, "local", "127.0.0.1", 0, PY), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    match = re.search(rb"serving http://127\.0\.0\.1:(\d+)/", agent.stdout.readline() if agent.stdout else b"")
    if match is None:
        agent.kill()
        agent.wait()
        yield {}
        return
    port = int(match.group(1))
    collector = Collector(directory, {"local": agent_url("127.0.0.1", port)}, job_id=job_id).start()
    try:
        yield agent_env(port)
    finally:
        collector.stop()
        agent.stdin.close()  # the agent ends when its stdin closes
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def monitor(work: Path, gpu: bool, train_s: float, idle_s: float) -> dict:
    """The local-run monitoring of `dtrain train` (agent + collector, `watched`) around a
    ResNet-18 training on the GPU for `train_s`, then `idle_s` with the GPU idle while the
    job is still open; /metrics scraped throughout, then `dtrain report`, then the
    idle-GPU rule over the stored series with an `idle_s` threshold (the shipped one is
    findings.IDLE_SECONDS = 300 s, longer than this check may take). Without `gpu`, only
    the agent's first /metrics."""
    from dtrain.monitor.head import findings
    from dtrain.monitor.head.metrics_db import MetricsDB
    from dtrain.paths import job_dir
    job = f"gpu-check-{int(time.time())}"
    best: dict[str, float] = {}
    idle: dict[str, float] = {}
    with _watched(job_dir(job), job) as env:
        if not env:
            return {"result": "FAIL", "figure": "the node agent did not start"}
        port = int(env["DTRAIN_AGENT_ADDR"].rsplit(":", 1)[1])
        time.sleep(2.0)
        first = scrape(port)
        if not gpu:
            ok = "dtrain_node_cpu_utilization_ratio" in first
            has_gpu = [f for f in GPU_FAMILIES if f in first]
            return {"result": "no GPU" if ok and not has_gpu else "FAIL",
                    "figure": f"CPU plumbing {'ok' if ok else 'FAILED'}: agent /metrics served {len(first)} series, "
                              f"GPU families {has_gpu or 'absent'}"}  # fmt: skip
        data = work / "quickstart" / "data"
        if not (data / "manifest.json").is_file():
            data = synth(work / "monitor" / "data", 1200, 64)
        argv = [PY, "-m", "dtrain.train", *settings(data__root=data, model__arch="resnet18", batch_size=256, epochs=1000,
                                                      val_every_epoch="false", output_dir=work / "monitor" / "train",
                                                      checkpoint_every=1000, data__cache_decoded="true",
                                                      data__num_workers=6)]  # fmt: skip
        print("$", " ".join(map(str, argv)), flush=True)
        trainer = subprocess.Popen(list(map(str, argv)), cwd=REPO, env={**os.environ, **env})
        t_end = time.monotonic() + train_s
        while time.monotonic() < t_end and trainer.poll() is None:
            time.sleep(5.0)
            now = scrape(port)
            if now.get("dtrain_gpu_utilization_ratio", -1) >= best.get("dtrain_gpu_utilization_ratio", -1):
                best = now
            print({f: now.get(f) for f in GPU_FAMILIES}, flush=True)
        trainer.terminate()
        trainer.wait(timeout=30)
        print(f"trainer stopped; GPU idle for {idle_s:.0f} s with the job open", flush=True)
        time.sleep(idle_s)
        idle = scrape(port)
    code, out = sh([PY, "-m", "dtrain", "report", job, "--out", work / "monitor" / "report"])
    summary = json.loads((work / "monitor" / "report" / "summary.json").read_text()) if code == 0 else {}
    gpus = (summary.get("nodes", {}).get("local", {}) or {}).get("gpus", {})
    g0 = gpus.get("0", {})
    store = MetricsDB.for_job(job_dir(job), readonly=True)
    try:
        fired = findings.idle_gpus(store.gpu_series(), min_idle_s=idle_s - 5.0)
    finally:
        store.close()
    missing_live = [f for f in GPU_FAMILIES if f not in best]
    missing_report = [c for c in ("util_mean", "mem_used_mean", "power_w_mean", "temp_c_mean", "sm_clock_hz_mean")
                      if g0.get(c) is None]  # fmt: skip
    busy = best.get("dtrain_gpu_utilization_ratio", 0.0)
    problems = ([f"/metrics lacks {missing_live}"] if missing_live else []) + \
               ([f"report lacks {missing_report}"] if missing_report else []) + \
               ([f"GPU utilisation never above 10 % ({busy:.0%})"] if busy <= 0.1 else []) + \
               ([] if fired else ["the idle-GPU rule did not fire"])  # fmt: skip
    figure = (f"peak util {busy:.0%}, {best.get('dtrain_gpu_memory_used_bytes', 0) / 2**30:.1f} GiB, "
              f"{best.get('dtrain_gpu_power_watts', 0):.0f} W, {best.get('dtrain_gpu_temperature_celsius', 0):.0f} C, "
              f"SM {best.get('dtrain_gpu_sm_clock_hertz', 0) / 1e6:.0f} MHz; idle util {idle.get('dtrain_gpu_utilization_ratio', -1):.0%}; "
              f"idle rule {'fired' if fired else 'silent'}")  # fmt: skip
    return {"result": "FAIL" if problems else "pass", "problems": problems, "peak": best, "idle": idle, "report_gpu0": g0,
            "idle_finding": [f.as_dict() for f in fired], "figure": figure + (f"; {'; '.join(problems)}" if problems else "")}  # fmt: skip


# ---- 6. export and inspect ---------------------------------------------------------------------------

EXPORT_BACKENDS = "ort-fp32,torch-eager,torch-bf16"


def step_export(work: Path, dry: bool) -> dict:
    if dry or not cuda_ready():
        return {"result": "no GPU", "figure": f"would export the quickstart's checkpoint, backends {EXPORT_BACKENDS}, and inspect"}
    return export_check(work, "cuda")


def export_check(work: Path, device: str) -> dict:
    """Export the quickstart's checkpoint (or a short training's), time the torch-bf16
    backend and `dtrain inspect` with it against a naive loop on `device`."""
    import numpy as np
    import torch

    d = work / "export"
    ckpt, data = work / "quickstart" / "train" / "checkpoints" / "last.pt", work / "quickstart" / "data"
    if not ckpt.is_file():  # the quickstart step failed or did not run: a short training of our own
        data = synth(d / "data", 1200, 64)
        code, _ = sh([PY, "-m", "dtrain.train", *settings(data__root=data, model__arch="small_resnet", epochs=2,
                                                           output_dir=d / "train", val_every_epoch="false")])  # fmt: skip
        ckpt = d / "train" / "checkpoints" / "last.pt"
        if code != 0:
            return {"result": "FAIL", "figure": "no quickstart checkpoint, and training one failed"}
    model_dir = d / "model"
    code, out = sh([PY, "-m", "dtrain", "export", ckpt, "--out", model_dir, "--backends", EXPORT_BACKENDS, "--data", data])
    if code != 0:
        return {"result": "FAIL", "figure": f"dtrain export exit {code}: {out.strip().splitlines()[-1][:150]}"}
    from dtrain.data.datasets import open_split
    from dtrain.evaluation.predict import normalize
    from dtrain.serve.backends import get_backend, measure
    from dtrain.serve.model_dir import load_card
    from dtrain.serve.verify import data_config
    from dtrain.train.checkpoint import load_for_inference

    card = load_card(model_dir)
    model, meta = load_for_inference(ckpt, map_location=device)
    cfg = data_config(str(data), meta)
    test = open_split(cfg, cfg.test_split, train=False)
    images = np.stack([s[0].numpy() for s in (test[i] for i in range(min(len(test), 256))) if s is not None])

    def naive(x: np.ndarray) -> np.ndarray:  # a first GPU service: one image at a time, eager fp32
        with torch.no_grad():
            return model(normalize(torch.from_numpy(x).to(device), meta["mean"], meta["std"], channels_last=False)).cpu().numpy()

    naive_ips = measure(naive, images[:1])
    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    bf16 = get_backend("torch-bf16").load(model_dir / card.backends["torch-bf16"])
    on_gpu = cuda and torch.cuda.memory_allocated() > before  # its weights went to the GPU
    bf16_ips = measure(bf16, images[:card.throughput_batch])
    code, out = sh([PY, "-m", "dtrain", "inspect", model_dir, Path(cfg.root) / cfg.test_split, "--backend", "torch-bf16",
                    "--out", d / "results.csv"])  # fmt: skip
    m = re.search(r"\((\d+) images/s, backend ([\w-]+)\)", out)
    import onnxruntime as ort

    r = {"export_images_per_s": card.throughput_images_per_s, "preferred": card.preferred_backend, "batch": card.throughput_batch,
         "naive_gpu_fp32_batch1": round(naive_ips, 1), "torch_bf16_here": round(bf16_ips, 1), "torch_on_gpu": on_gpu,
         "inspect_images_per_s": int(m.group(1)) if m else None, "ort_providers": ort.get_available_providers()}  # fmt: skip
    problems = ([] if on_gpu or not cuda else ["torch-bf16 did not run on the GPU"]) + ([] if code == 0 and m else [f"dtrain inspect exit {code}"])
    ort_note = "ORT CUDA EP" if "CUDAExecutionProvider" in r["ort_providers"] else "ORT CPU only"
    figure = (f"torch-bf16 {bf16_ips:.0f} img/s @{card.throughput_batch} vs naive GPU fp32 {naive_ips:.0f} "
              f"({bf16_ips / naive_ips:.0f}x); inspect {r['inspect_images_per_s']} img/s; {ort_note} "
              f"{card.throughput_images_per_s.get('ort-fp32', 0):.0f}")  # fmt: skip
    return {"result": "FAIL" if problems else "pass", **r, "problems": problems,
            "figure": figure + (f"; {'; '.join(problems)}" if problems else "")}  # fmt: skip


STEPS: dict[str, Callable[[Path, bool], dict]] = {
    "env": step_env, "quickstart": step_quickstart, "ddp": step_ddp, "throughput": step_throughput,
    "monitor": step_monitor, "export": step_export,
}  # fmt: skip


def main() -> int:
    # dtrain from this checkout, here and in every process a step starts.
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if len(sys.argv) > 1 and sys.argv[1] == "gloo-rank":
        return gloo_rank(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=list(STEPS))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    step_dir = args.work / args.step
    step_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = STEPS[args.step](args.work, args.dry_run)
    except Exception as exc:
        traceback.print_exc()
        # Keep what a step recorded before it broke (throughput writes as it goes).
        path = step_dir / "result.json"
        so_far = json.loads(path.read_text()) if path.is_file() else {}
        text = (str(exc).strip().splitlines() or [""])[0][:150]
        figure = f"{type(exc).__name__}: {text}" + (f"; so far: {so_far['figure']}" if so_far.get("figure") else "")
        result = {**so_far, "result": "FAIL", "figure": figure}
    (step_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"result: {result['result']}: {result.get('figure', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
