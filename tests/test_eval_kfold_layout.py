"""`dtrain eval CHECKPOINT DATA` on a k-fold final model: its config names the folder of
links it trained on (ImageFolder, no val split), and DATA is the source, which may be laid
out otherwise (bare class folders here). The test split read must be the one the recipe
held out of the source."""

from __future__ import annotations

from pathlib import Path

from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.evaluation.evaluate import _data_config
from dtrain.recipe.oof import run_config


def _meta(data: DataConfig) -> dict:
    return {"config": {"data": data.model_dump(mode="json")}, "image_size": 32}


def test_kfold_model_reads_the_source_layout(class_folders_data: Path, tmp_path: Path):
    source = DataConfig(root=str(class_folders_data), layout="classfolders")
    final = run_config({"data": source.model_dump(mode="json"), "output_dir": "x"}, tmp_path / "folds" / "all", 1, tmp_path)
    assert final["data"]["layout"] == "imagefolder" and final["data"]["val_split"] == ""
    cfg = _data_config(class_folders_data, _meta(DataConfig(**final["data"])))
    assert cfg.layout == "classfolders" and cfg.val_split == "" and cfg.root == str(class_folders_data)
    assert scan(cfg, cfg.test_split).paths == scan(source, "test").paths
    assert len(scan(cfg, cfg.test_split).paths) > 0


def test_a_model_with_a_val_split_reads_other_photos_in_their_layout(synth_data: Path, class_folders_data: Path):
    trained = DataConfig(root=str(synth_data), layout="imagefolder", split_seed=3)
    assert _data_config(synth_data, _meta(trained)).layout == "imagefolder"  # its own root: as trained
    # Photos laid out otherwise: their layout (read as ImageFolder, there was no split 'val'),
    # with a val split of its own and the run's other settings.
    cfg = _data_config(class_folders_data, _meta(trained))
    assert cfg.layout == "classfolders" and cfg.val_split == "val" and cfg.split_seed == 3
    assert len(scan(cfg, "val").paths) > 0


def test_kfold_model_of_a_split_source_reads_its_test_split_and_no_val(synth_data: Path, tmp_path: Path):
    """The source is ImageFolder like the folder of links: the same layout, read at the source."""
    source = DataConfig(root=str(synth_data), layout="imagefolder")
    final = run_config({"data": source.model_dump(mode="json"), "output_dir": "x"}, tmp_path / "folds" / "all", 1, tmp_path)
    cfg = _data_config(synth_data, _meta(DataConfig(**final["data"])))
    assert cfg.layout == "imagefolder" and cfg.val_split == "" and cfg.root == str(synth_data)
    assert scan(cfg, cfg.test_split).paths == scan(source, "test").paths
