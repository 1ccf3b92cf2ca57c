"""Which network to build."""

from __future__ import annotations

from typing import Literal

from dtrain.configio import StrictModel


class ModelConfig(StrictModel):
    arch: Literal["resnet18", "resnet34", "resnet50", "small_resnet"] = "resnet18"
    # A local weights file (state_dict or a dtrain checkpoint); never downloaded.
    pretrained: str | None = None
    # "group" swaps BatchNorm for GroupNorm: no batch statistics, so results do not
    # depend on how a batch is split across ranks (used by the DDP equivalence test,
    # and useful with very small per-rank batches).
    norm: Literal["batch", "group"] = "batch"
    # How the network sees an image and sums up its evidence (dtrain/models/heads.py):
    # "per_image" standardises each picture by its own level and contrast inside the
    # network; "avgmax" pools the last feature map by its mean and its maximum, so a
    # small local defect is not averaged away. Defaults keep the plain ResNet.
    input_norm: Literal["dataset", "per_image"] = "dataset"
    pool: Literal["avg", "avgmax"] = "avg"
    # At inference (evaluation, out-of-fold scores, export, inspect, serve) each image is
    # scored on this many of its symmetries and the class probabilities averaged
    # (dtrain/models/views.py); training ignores it. Views other than the image itself need
    # data.augment, which trains the network to treat them alike.
    views: Literal[1, 2, 4, 8] = 1
