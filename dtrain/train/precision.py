"""Mixed precision policies by name, and `auto`, which picks what the hardware does fast.

On CPUs bf16 only pays off with native support (AMX or AVX512-BF16); elsewhere torch
emulates it and it is slower than fp32, so `auto` keeps fp32 there. On GPUs `auto` takes
bf16 where supported (no loss scaling needed), fp16 with a grad scaler otherwise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype | None  # None: no autocast
    # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range.
    needs_scaler: bool

    def autocast(self, device: torch.device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # A disabled scaler is a pass-through, so the loop has one shape for all policies.
        return torch.amp.GradScaler(device.type, enabled=self.needs_scaler)


POLICIES = {
    "fp32": Precision("fp32", None, False),
    "bf16": Precision("bf16", torch.bfloat16, False),
    "fp16": Precision("fp16", torch.float16, True),
}


def cpu_has_native_bf16() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def auto_policy(device: torch.device) -> str:
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def resolve(requested: str, device: torch.device) -> Precision:
    name = auto_policy(device) if requested == "auto" else requested
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown precision {name!r}", f"valid: auto, {', '.join(POLICIES)}") from None
