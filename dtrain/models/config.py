"""Which network to build."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from dtrain.configio import StrictModel


# What a trained network's P(defect) is, as reports and model directories name it
# (model.score_with_mask; dtrain/models/defect_score.py).
SCORE_CLASSIFIER = "classifier"
SCORE_POOLED = "classifier + mask head (mean log-odds)"


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
    # small_resnet only: the stride of its first convolution. 2 takes a picture at twice the
    # side for about the same compute, the first convolution learning the 2x downscale that a
    # resize would otherwise do by averaging (dtrain/models/small.py). torchvision's ResNets
    # already stride their stem.
    stem_stride: Literal[1, 2] = 1
    # true: with a mask head trained beside the classifier (TrainConfig.mask_loss) and a
    # defect-free class, P(defect) at inference is the mean log-odds of the classifier's
    # and the head's most defective cell (dtrain/models/defect_score.py). Off by default: on
    # four plant-profile checkpoints it ranked defects above good parts better in all four
    # (AUROC), but at the threshold the faintest validation defect sets it flagged more good
    # parts in two of the three trained as the recipe trains (BENCHMARKS.md, session 29).
    # Training ignores it.
    score_with_mask: bool = False

    @model_validator(mode="after")
    def _stem_stride_is_small_resnets(self) -> "ModelConfig":
        if self.stem_stride != 1 and self.arch != "small_resnet":
            raise ValueError(f"model.stem_stride applies to small_resnet only ({self.arch}'s stem is its own); "
                             "leave it at 1")
        return self
