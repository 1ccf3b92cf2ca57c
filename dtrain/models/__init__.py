"""Model builders: torchvision ResNets, random init, optional local weights."""

from __future__ import annotations

from dtrain.models.build import ARCHS, build_model
from dtrain.models.config import ModelConfig

__all__ = ["ARCHS", "ModelConfig", "build_model"]
