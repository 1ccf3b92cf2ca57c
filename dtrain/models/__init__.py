"""Model builders: torchvision ResNets, random init, optional local weights.

`ModelConfig` (dtrain.models.config) imports no torch, so a launcher that only reads a
config (`dtrain train`, before any rank starts) does not pay torch's start-up; the
builders load torch when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtrain.models.config import ModelConfig

if TYPE_CHECKING:
    from dtrain.models.build import ARCHS, build_model

__all__ = ["ARCHS", "ModelConfig", "build_model"]


def __getattr__(name: str) -> Any:
    if name in ("ARCHS", "build_model"):
        from dtrain.models import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
