"""What kind of machine this is, as far as choosing an inference backend goes.

A machine kind is a stable string: the CPU model and the instruction-set flags that
change which backend is fastest (VNNI for int8, AVX512-BF16/AMX for bf16, ...), plus the
GPU name and compute capability when there is an NVIDIA GPU. Two machines of the same
kind get the same backend choice; a model directory records its choice per kind.

Torch-free on purpose: the serving runtime asks this on every load. The GPU is found
through `nvidia-smi` (shipped with the driver), not through torch.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

# Flags that decide between fp32, int8 and bf16 kernels (x86 and Arm spellings).
RELEVANT_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
    "asimddp", "i8mm", "bf16", "sve",
)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
BF16_MIN_COMPUTE_CAPABILITY = 8.0  # Ampere and later run bf16 natively

CPUINFO = Path("/proc/cpuinfo")


def cpu_kind(cpuinfo: str) -> str:
    """'cpu: MODEL [flags]' from the text of /proc/cpuinfo."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model Name", "Hardware") and not model:
            model = value.strip()
        elif key in ("flags", "Features"):
            flags |= set(value.split())
    model = model or platform.processor() or platform.machine()
    return f"cpu: {model} [{' '.join(f for f in RELEVANT_FLAGS if f in flags)}]"


def gpu_kind(run=subprocess.run) -> str | None:
    """'gpu: NAME sm_XY' for the first NVIDIA GPU, or None without one."""
    try:
        proc = run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no driver installed, or a hung one
        return None
    first = proc.stdout.strip().splitlines()[:1] if proc.returncode == 0 else []
    if not first or "," not in first[0]:
        return None
    name, cap = (s.strip() for s in first[0].rsplit(",", 1))
    return f"gpu: {name} sm_{cap.replace('.', '')}"


@functools.cache
def machine_kind() -> str:
    cpu = cpu_kind(CPUINFO.read_text() if CPUINFO.is_file() else "")
    gpu = gpu_kind()
    return cpu if gpu is None else f"{cpu} | {gpu}"


def bf16_hardware(kind: str) -> bool:
    """Whether a machine of this kind multiplies bf16 natively (CPU flags or GPU)."""
    cpu, _, gpu = kind.partition(" | ")
    flags = set(cpu.rpartition("[")[2].rstrip("]").split())
    if flags & set(BF16_CPU_FLAGS):
        return True
    if gpu.startswith("gpu: ") and " sm_" in gpu:
        cap = gpu.rsplit(" sm_", 1)[1]
        return cap[:-1].isdigit() and int(cap[:-1]) >= int(BF16_MIN_COMPUTE_CAPABILITY)
    return False
