"""The data settings of a trained run, read from its checkpoint, for other photos: one rule
for `dtrain eval` and `dtrain export --data`."""

from __future__ import annotations

from typing import Any


def run_data_config(meta: dict[str, Any], root: str | None = None):
    """The run's DataConfig at the model's input size; at `root` if given, read in the layout
    that root holds (recipe.stats.relocated: a k-fold final model names its folder of links
    to train + val, and is read at the source as the recipe did, still without a val split)."""
    from dtrain.configio import validate
    from dtrain.data.config import DataConfig
    from dtrain.recipe.stats import relocated
    from dtrain.train.checkpoint import input_fields

    base = dict((meta.get("config") or {}).get("data") or {})
    if root is not None:
        base = {**relocated(base, root), "root": root}
    base.update(input_fields(meta))
    return validate(DataConfig, base, "the checkpoint's data config")
