"""GPU readiness: every GPU path of dtrain in one run of at most ~9 minutes (issue 15).

    bench/gpu_check.sh [--dry-run] [--only env,ddp] [--budget 555]   # the wrapper picks the Python
    python bench/gpu_check.py [same options]

The steps (bodies in bench/gpu_check_steps.py), in this order:
  env         nvidia-smi, torch / CUDA / cuDNN / NCCL versions, GPU name, memory, compute
              capability, which of dtrain's dependencies import
  quickstart  `dtrain quickstart` on the GPU (one rank per GPU, precision auto -> bf16):
              wall time, images/s, and whether its targets hold
  ddp         the DDP-equivalence check of tests/test_train_ddp.py with CUDA tensors:
              2 ranks on the one GPU over NCCL, or gloo + CUDA where NCCL refuses
  throughput  bench/train_throughput.py: ResNet-50 at 224 px, dtrain (bf16, channels_last,
              compile off / on) vs the DDP tutorial's fp32 loop, with a published reference
  monitor     the node agent during training: GPU utilisation, memory, power, temperature
              and SM clock in /metrics and `dtrain report`; the idle-GPU rule on the idle GPU
  export      `dtrain export` + `dtrain inspect` on the GPU backends vs a naive loop

Each step runs in its own subprocess (its own process group) under its own time limit,
and the next one starts whatever happened to the last. Small results go to OUT ($OUT
when set, else --out, else a new temporary folder): summary.txt, summary.json (every
step's figures) and STEP.log; bulky work (data sets, checkpoints) to --work. The run
ends with the summary table; exit status 1 when a step failed.

--dry-run (for a machine without a GPU): the steps run only what needs no GPU (the
environment facts, the DDP-equivalence check on CPU with gloo, the agent's /metrics)
and report "no GPU" for the rest.

On a lent GPU machine of this workplace (no network, python3 without pydantic): run
bench/gpu_check_wheels.sh in the checkout that travels, then one call,
run(command="bench/gpu_check.sh", carry=[".whl"], timeout_s=600); its OUT brings back
the 8 files above and the reply's output tail ends with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS_PY = Path(__file__).with_name("gpu_check_steps.py")


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int  # the step's own limit; the whole plan's sum stays under --budget
    does: str


PLAN = (
    Step("env", 30, "nvidia-smi, torch/CUDA/NCCL versions, GPU, dtrain's dependencies"),
    Step("quickstart", 105, "dtrain quickstart on the GPU: bf16, wall time, images/s, targets"),
    Step("ddp", 80, "DDP equivalence, 2 ranks on 1 GPU (NCCL, else gloo+CUDA) vs 1 process"),
    Step("throughput", 190, "ResNet-50 224 px: dtrain bf16 (compile off/on) vs tutorial fp32 loop"),
    Step("monitor", 85, "agent during training: GPU metrics in /metrics + report; idle-GPU rule"),
    Step("export", 65, "dtrain export + inspect on GPU backends vs a naive loop"),
)
BY_NAME = {s.name: s for s in PLAN}
# A limit this short cannot finish any step: the step is reported as skipped.
MIN_STEP_S = 10
# The budgets are GPU-machine time; a dry run's CPU plumbing may share a small, loaded
# machine, so its limits are this many times longer and --budget does not apply.
DRY_RUN_SLACK = 4


def run_step(step: Step, limit_s: float, out: Path, work: Path, dry_run: bool) -> dict:
    """Run one step in its own process group; its result.json, or what went wrong."""
    step_work = work / step.name
    step_work.mkdir(parents=True, exist_ok=True)
    result_path = step_work / "result.json"
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, str(STEPS_PY), step.name, "--work", str(work)] + (["--dry-run"] if dry_run else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1", DTRAIN_HOME=str(work / "dtrain-home"))
    t0 = time.monotonic()
    with open(out / f"{step.name}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_tree(proc.pid)
            proc.wait()
    seconds = time.monotonic() - t0
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if code is None:
        result["result"] = "FAIL"
        result["figure"] = f"timed out after {limit_s:.0f} s" + (f"; so far: {result['figure']}" if result.get("figure") else "")
    elif not result or result.get("result") == "partial":
        result["result"] = "FAIL"
        result["figure"] = f"exit {code} without a result: {_last_line(out / f'{step.name}.log')}"
    result["seconds"] = round(seconds, 1)
    return result


def _kill_tree(pid: int) -> None:
    """SIGKILL a step's process group and every process below it. torchrun starts each rank
    in a session of its own, so killing the group alone leaves the ranks to notice their
    agent is gone (dtrain's within a second, a bare script's never)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in below:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(below, timeout=5)


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def table(rows: list[tuple[str, dict]]) -> str:
    """The one-screen summary: step, result, seconds, figure (cut to fit 120 columns)."""
    lines = [f"{'step':<11} {'result':<7} {'s':>5}  figure", "-" * 120]
    for name, r in rows:
        lines.append(f"{name:<11} {r['result']:<7} {r['seconds']:>5.0f}  {r.get('figure', '')}"[:120])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU here: run only what needs none")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT, else a new temp dir)")
    ap.add_argument("--work", type=Path, default=None, help="bulky work files (default: a new temp dir)")
    ap.add_argument("--only", default=None, help=f"comma-separated steps (default: all of {','.join(BY_NAME)})")
    ap.add_argument("--budget", type=float, default=555.0, help="seconds for the whole run")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; valid: {', '.join(BY_NAME)}")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="dtrain-gpu-check-")))
    work = args.work or Path(tempfile.mkdtemp(prefix="dtrain-gpu-check-work-"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (float("inf") if args.dry_run else args.budget)

    mode = "dry run (no GPU needed)" if args.dry_run else "GPU run"
    print(f"dtrain GPU check, {mode}: results in {out}, work files in {work}, budget {args.budget:.0f} s", flush=True)
    print(f"python {sys.executable}\nplan:")
    for name in names:
        print(f"  {name:<11} <= {BY_NAME[name].budget_s:>3} s  {BY_NAME[name].does}")
    rows: list[tuple[str, dict]] = []
    for name in names:
        step = BY_NAME[name]
        limit = min(step.budget_s * (DRY_RUN_SLACK if args.dry_run else 1), deadline - time.monotonic())
        if limit < MIN_STEP_S:
            rows.append((name, {"result": "skipped", "figure": "out of the run's time budget", "seconds": 0.0}))
            continue
        print(f"== {name} (limit {limit:.0f} s) ...", flush=True)
        result = run_step(step, limit, out, work, args.dry_run)
        print(f"   {result['result']}: {result.get('figure', '')}", flush=True)
        rows.append((name, result))

    text = table(rows)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"mode": mode, "work": str(work), "steps": dict(rows)}, indent=1, default=str))
    print("\n" + text)
    print(f"\n(details: {out / 'summary.json'}; logs: {out}/STEP.log)")
    return 1 if any(r["result"] == "FAIL" for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
