"""What a training run ran on: precision, device, processor, world size, seed, torch.

The same recipe scores differently in bf16 than in fp32 (and `precision: auto` picks
bf16 only on CPUs with AVX512-BF16 or AMX), so a result without these facts cannot be
compared with another. They are plain str/int/bool values: checkpoints hold them (and
are read with `torch.load(weights_only=True)`), reports print them.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The processor's marketing name ("model name" in /proc/cpuinfo), else what Python knows."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:  # no procfs (macOS): fall through
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_bf16_support() -> dict[str, bool]:
    """The CPU features torch's bf16 kernels use; without either, bf16 is emulated (slow)."""
    return {
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
    }


def run_facts(device: torch.device, precision: str, world_size: int, seed: int) -> dict[str, Any]:
    """The facts of this process's run (rank 0's machine when called there)."""
    facts: dict[str, Any] = {
        "precision": precision,
        "device": device.type,
        "world_size": int(world_size),
        "seed": int(seed),
        "torch": str(torch.__version__),  # a str subclass, which yaml and weights_only refuse
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    else:
        support = cpu_bf16_support()
        facts["cpu"] = cpu_model()
        facts.update(support)
        if precision == "bf16":
            facts["bf16_native"] = any(support.values())
    return facts


def describe(facts: dict[str, Any] | None) -> str:
    """One line for logs and reports: "bf16 on cpu (AMD EPYC, avx512_bf16), world 2, seed 0, torch 2.4"."""
    if not facts:
        return "unknown (the checkpoint predates run facts)"
    if facts.get("device") == "cuda":
        where = f"cuda ({facts.get('gpu', '?')})"
    else:
        features = [name for name in ("avx512_bf16", "amx") if facts.get(name)]
        where = f"cpu ({facts.get('cpu', '?')}{', ' + ', '.join(features) if features else ', no native bf16'})"
    emulated = ", emulated" if facts.get("bf16_native") is False else ""
    return (
        f"{facts.get('precision')}{emulated} on {where}, world {facts.get('world_size')}, "
        f"seed {facts.get('seed')}, torch {facts.get('torch')}"
    )
